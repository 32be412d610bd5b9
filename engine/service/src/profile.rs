//! The cost profile the Load planner starts from (paper §3.3 "Profiling"): the linear models
//! `T_re(x)` (seconds to recompute x chunks) and `T_IO(m)` (seconds to read m bytes of chunks),
//! measured on this machine by `llms profile` and saved as JSON; `llms serve --profile FILE` and
//! `llms bench load --profile FILE` seed the manager's cost model with it
//! ([`ManagerConfig::cost`](crate::ManagerConfig::cost)), which every Load then refits.
//!
//! [`measure_io`] times chunk reads the way the service reads them: one chunk at a time through
//! the `data` file of a kvfs mount of a real store ([`ChunkIo`], [`kvfs::MountReader`]), cold (the
//! data file is read with `O_DIRECT`, so no page cache answers).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kvfs::{NewContext, Store, StoreOptions};
use policy::{CostModel, LinearCost};
use uffd_pager::median;

use crate::ServiceError;
use crate::chunk_io::ChunkIo;
use crate::source::model_fingerprint;
use model::Model;
use model::kv::{KvCache, KvFormat, codec};

/// Why a profile file cannot seed the cost model.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read the profile {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a profile written by `llms profile`: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(
        "the profile {path} has no I/O model (it predates `llms profile` measuring reads); run `llms profile` again"
    )]
    NoIo { path: PathBuf },
    #[error("the profile {path} has a bad {model} model: {source}; run `llms profile` again")]
    Bad {
        path: PathBuf,
        model: &'static str,
        source: policy::CostError,
    },
}

/// A fitted linear model `T(x) = fixed + per_unit * x` seconds, as the file holds it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinearFit {
    pub fixed_secs: f64,
    pub per_unit_secs: f64,
    /// How well the line fits the measured points.
    pub r_squared: f64,
}

impl From<policy::Fit> for LinearFit {
    fn from(f: policy::Fit) -> LinearFit {
        LinearFit {
            fixed_secs: f.cost.fixed(),
            per_unit_secs: f.cost.per_unit(),
            r_squared: f.r_squared,
        }
    }
}

impl LinearFit {
    fn cost(&self) -> Result<LinearCost, policy::CostError> {
        LinearCost::new(self.fixed_secs, self.per_unit_secs)
    }
}

/// One recompute measurement: the last `chunks` chunks of a `context`-token context.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RecomputePoint {
    pub context: usize,
    pub chunks: usize,
    pub seconds: f64,
}

/// One read measurement: the first `chunks` chunks of a context stored in `format`, read one
/// after another through the mount (`bytes` of chunk data, as a Load counts them).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct IoPoint {
    pub format: String,
    pub chunks: usize,
    pub bytes: u64,
    pub seconds: f64,
}

/// The file `llms profile` writes (`<out>/profile.json`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostProfile {
    /// The model file it was measured with.
    pub model: String,
    pub chunk_tokens: usize,
    /// Engine threads during the recompute measurements.
    pub threads: usize,
    /// `T_re(x)`: seconds to recompute x chunks, over every context length measured.
    pub recompute: LinearFit,
    /// The same fit at each context length (later chunks attend to more keys).
    pub recompute_by_context: Vec<(usize, LinearFit)>,
    /// `T_IO(m)`: seconds to read m bytes of chunks in one stream, over every format measured
    /// (absent in profiles written before reads were measured).
    pub io: Option<LinearFit>,
    pub points: Vec<RecomputePoint>,
    #[serde(default)]
    pub io_points: Vec<IoPoint>,
}

impl CostProfile {
    /// Reads a profile file.
    pub fn read(path: &Path) -> Result<CostProfile, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: path.to_owned(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| ProfileError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// The cost model the planner starts from; `path` names the file in errors.
    pub fn cost_model(&self, path: &Path) -> Result<CostModel, ProfileError> {
        let bad = |model| {
            move |source| ProfileError::Bad {
                path: path.to_owned(),
                model,
                source,
            }
        };
        let io = self.io.as_ref().ok_or_else(|| ProfileError::NoIo {
            path: path.to_owned(),
        })?;
        Ok(CostModel::new(
            self.recompute.cost().map_err(bad("recompute"))?,
            io.cost().map_err(bad("I/O"))?,
        ))
    }
}

/// The cost model in the profile file at `path`: what `--profile FILE` seeds the manager with.
pub fn read_cost_model(path: &Path) -> Result<CostModel, ProfileError> {
    CostProfile::read(path)?.cost_model(path)
}

/// What [`measure_io`] reads.
#[derive(Clone, Debug)]
pub struct IoOptions {
    /// Where the scratch store and its mount go (removed afterwards): on the disk the service's
    /// store lives on.
    pub dir: PathBuf,
    /// The formats the chunks are stored in; each at most as heavy as the cache's format.
    pub formats: Vec<KvFormat>,
    /// How many chunks each measurement reads (capped at the cache's sealed chunks).
    pub counts: Vec<usize>,
    /// Repetitions per point (the median is kept).
    pub reps: usize,
    /// The mount's guard (see `kvfs::guard`), so an interrupted profile cannot hang.
    pub mount_guard: Option<kvfs::guard::GuardCommand>,
}

/// Writes the sealed chunks of `cache` (prefilled by `model`) to a fresh store in every format
/// of `opts`, mounts it, and times reading the first x chunks of each, one `preadv` of the
/// context's `data` file per chunk as a Load's I/O thread does; `progress` is told each point.
pub fn measure_io(
    model: &Model,
    cache: &KvCache,
    opts: &IoOptions,
    mut progress: impl FnMut(&IoPoint),
) -> Result<Vec<IoPoint>, ServiceError> {
    let internal = |what: String| ServiceError::Internal { what };
    let shape = *cache.shape();
    let sealed = cache.chunk_formats().len();
    if sealed == 0 {
        return Err(internal(
            "the context holds no sealed chunk to store".into(),
        ));
    }
    let fingerprint = model_fingerprint(model.path()).map_err(|e| {
        internal(format!(
            "reading {} to fingerprint it: {e}",
            model.path().display()
        ))
    })?;
    let root = opts.dir.join(format!("profile-io-{}", std::process::id()));
    let mountpoint = root.with_extension("mnt");
    let _ = std::fs::remove_dir_all(&root);
    let result = (|| {
        let store = Arc::new(Store::open(&root, StoreOptions::default())?);
        let io = ChunkIo::mounted(
            Arc::clone(&store),
            fingerprint,
            &mountpoint,
            opts.mount_guard.as_ref(),
        )?;
        let mut contexts = Vec::new();
        let mut scratch = Vec::new();
        for &format in &opts.formats {
            let ctx = store.create_context(NewContext {
                owner_uid: 0,
                app: "profile".into(),
                fingerprint,
                chunk_tokens: shape.tokens as u32,
            })?;
            store.append_tokens(ctx, &cache.tokens()[..sealed * shape.tokens])?;
            for i in 0..sealed {
                let have = cache.chunk_formats()[i];
                let bytes = cache
                    .chunk_bytes(i)
                    .ok_or_else(|| internal(format!("chunk {i} of the cache is not resident")))?;
                let data = if have == format {
                    bytes
                } else if codec::moves_down(&shape, have, format) {
                    codec::recompress(&shape, have, format, bytes, &mut scratch)
                        .map_err(|e| internal(format!("chunk {i} to {}: {e}", format.name())))?;
                    &scratch[..]
                } else {
                    return Err(internal(format!(
                        "cannot store {} chunks from a {} cache",
                        format.name(),
                        have.name()
                    )));
                };
                io.write(ctx.0, i as u32, format, 0.0, data)?;
            }
            contexts.push((format, ctx.0));
        }
        let mut buf = vec![0u8; shape.chunk_bytes(KvFormat::F16)];
        let mut points = Vec::new();
        for &(format, ctx) in &contexts {
            // The first read opens the context's mount files, which a Load finds open.
            io.read_into(ctx, 0, &mut buf)?;
            let mut counts: Vec<usize> = opts.counts.iter().map(|&x| x.clamp(1, sealed)).collect();
            counts.sort_unstable();
            counts.dedup();
            for x in counts {
                let mut secs = Vec::with_capacity(opts.reps);
                let mut bytes = 0;
                for _ in 0..opts.reps.max(1) {
                    bytes = 0;
                    let t = Instant::now();
                    for i in 0..x {
                        bytes += u64::from(io.read_into(ctx, i as u32, &mut buf)?.raw_len);
                    }
                    secs.push(t.elapsed().as_secs_f64());
                }
                let p = IoPoint {
                    format: format.name().to_owned(),
                    chunks: x,
                    bytes,
                    seconds: median(secs),
                };
                progress(&p);
                points.push(p);
            }
        }
        Ok(points)
    })();
    let _ = std::fs::remove_dir_all(&root);
    let _ = std::fs::remove_dir(&mountpoint);
    result
}

/// The least-squares line through the read points: `T_IO(bytes)`.
pub fn fit_io(points: &[IoPoint]) -> Result<LinearFit, policy::CostError> {
    let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.bytes as f64, p.seconds)).collect();
    Ok(LinearCost::fit(&xy)?.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Manager, ManagerConfig};
    use model::tiny::{TinySpec, write_tiny_gguf};

    fn profile() -> CostProfile {
        // Figures as a measurement gives them: seventeen significant digits.
        let recompute = LinearFit {
            fixed_secs: 0.1 / 7.0,
            per_unit_secs: 0.3 / 7.0,
            r_squared: 0.998_765_432_1,
        };
        CostProfile {
            model: "tiny.gguf".into(),
            chunk_tokens: 16,
            threads: 2,
            recompute,
            recompute_by_context: vec![(256, recompute)],
            io: Some(LinearFit {
                fixed_secs: 1e-3 / 11.0,
                per_unit_secs: 1e-8 / 9.0,
                r_squared: 0.999_1,
            }),
            points: vec![RecomputePoint {
                context: 256,
                chunks: 1,
                seconds: 0.05,
            }],
            io_points: vec![IoPoint {
                format: "int8".into(),
                chunks: 1,
                bytes: 217_088,
                seconds: 3.1e-4,
            }],
        }
    }

    fn close(a: LinearCost, b: LinearCost) -> bool {
        let near = |x: f64, y: f64| (x - y).abs() <= 1e-15 * x.abs().max(y.abs());
        near(a.fixed(), b.fixed()) && near(a.per_unit(), b.per_unit())
    }

    #[test]
    fn a_written_profile_is_the_cost_model_a_manager_starts_from() {
        let dir = tempfile::tempdir().unwrap();
        let written = profile();
        let path = dir.path().join("profile.json");
        // As `llms profile` writes it (tools/src/report.rs).
        std::fs::write(&path, serde_json::to_string_pretty(&written).unwrap()).unwrap();
        let read = CostProfile::read(&path).unwrap();
        let cost = read_cost_model(&path).unwrap();
        let want = written.cost_model(&path).unwrap();
        // JSON keeps the figures to within a rounding of the last digit.
        assert!(
            close(cost.recompute, want.recompute),
            "{cost:?} != {want:?}"
        );
        assert!(close(cost.io, want.io), "{cost:?} != {want:?}");
        assert_eq!(read.io_points, written.io_points);

        let gguf = dir.path().join("tiny.gguf");
        write_tiny_gguf(&gguf, &TinySpec::default()).unwrap();
        let model = Arc::new(Model::load(&gguf).unwrap());
        let mut cfg = ManagerConfig::new(dir.path().join("store"), 16 << 20);
        cfg.cost = cost;
        let m = Manager::open(model, cfg).unwrap();
        assert_eq!(m.cost(), cost);
        assert_ne!(m.cost(), crate::config::default_cost());
    }

    #[test]
    fn a_bad_profile_says_what_is_wrong_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let check = |body: Option<&str>, says: &str| {
            let path = dir.path().join("p.json");
            let _ = std::fs::remove_file(&path);
            if let Some(b) = body {
                std::fs::write(&path, b).unwrap();
            }
            let e = read_cost_model(&path).unwrap_err().to_string();
            assert!(e.contains(says), "{body:?}: {e}");
            assert!(e.contains("p.json"), "{body:?}: {e}");
        };
        check(None, "cannot read the profile");
        check(
            Some("not json"),
            "is not a profile written by `llms profile`",
        );
        check(Some("{}"), "missing field");
        let mut p = profile();
        p.io = None;
        check(Some(&serde_json::to_string(&p).unwrap()), "no I/O model");
        let mut p = profile();
        p.recompute.per_unit_secs = -1.0;
        check(
            Some(&serde_json::to_string(&p).unwrap()),
            "bad recompute model",
        );
    }
}
