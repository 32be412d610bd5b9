//! Where a swapped-out chunk comes from: the kvfs store, for the pager's fault path and for Load;
//! and the one place the engine's, kvfs's and the policy's names for a chunk's format meet.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use kvfs::{Fingerprint, StoreError};
use policy::{Level, LevelSet};
use sha2::Digest;
use uffd_pager::{ChunkKey, ChunkSource, SourceError};

use crate::chunk_io::ChunkIo;
use crate::chunks::ChunkBook;
use model::kv::{ChunkShape, KvFormat};

/// Why compression levels were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LevelsError {
    /// The formats do not shrink strictly from one level to the next (or are too many).
    #[error("compression levels {formats:?} must get strictly smaller, heaviest first: {source}")]
    Order {
        formats: Vec<KvFormat>,
        source: policy::LevelError,
    },
    /// The bit budget is below what the lightest level stores.
    #[error(
        "a budget of {bits} stored bits per value is below the lightest level {lightest}'s {need:.3}"
    )]
    Budget {
        bits: f64,
        lightest: KvFormat,
        need: f64,
    },
}

/// The compression levels as engine formats, heaviest first, and the policy's level set over
/// their stored bytes per chunk (each level's cost is what kvfs stores for a chunk in it, so a
/// budget in all-in stored bits per value is a global ratio of the policy, Eq. 3).
#[derive(Clone, Debug, PartialEq)]
pub struct FormatLevels {
    formats: Vec<KvFormat>,
    set: LevelSet,
    shape: ChunkShape,
}

impl FormatLevels {
    /// The levels `formats` (heaviest first) for chunks of `shape`.
    pub fn new(shape: &ChunkShape, formats: &[KvFormat]) -> Result<Self, LevelsError> {
        let costs: Vec<u32> = formats
            .iter()
            .map(|&f| u32::try_from(shape.stored_bytes(f)).unwrap_or(u32::MAX))
            .collect();
        let set = LevelSet::weighted(&costs).map_err(|source| LevelsError::Order {
            formats: formats.to_vec(),
            source,
        })?;
        Ok(Self {
            formats: formats.to_vec(),
            set,
            shape: *shape,
        })
    }

    /// The policy's level set.
    pub fn set(&self) -> &LevelSet {
        &self.set
    }

    /// The format of a policy level.
    pub fn format(&self, level: Level) -> Option<KvFormat> {
        self.formats.get(usize::from(level.0)).copied()
    }

    /// The policy level of a format, if it is one of the levels.
    pub fn level(&self, f: KvFormat) -> Option<Level> {
        self.formats
            .iter()
            .position(|&x| x == f)
            .map(|i| Level(i as u8))
    }

    /// The level a chunk in `f` starts from: its own, or the heaviest when `f` is no level but
    /// moves down to it (int8 to k8v8); `None` when chunks in `f` cannot take these levels.
    pub fn floor(&self, f: KvFormat) -> Option<Level> {
        self.level(f).or_else(|| {
            model::kv::codec::moves_down(&self.shape, f, self.formats[0]).then_some(Level(0))
        })
    }

    /// The policy's global ratio (Eq. 3) for a mean of `bits` all-in stored bits per value.
    pub fn ratio_for_bits(&self, bits: f64) -> Result<f64, LevelsError> {
        let lightest = self.formats[self.formats.len() - 1];
        let need = self.shape.stored_bits(lightest);
        if bits.is_nan() || bits < need {
            return Err(LevelsError::Budget {
                bits,
                lightest,
                need,
            });
        }
        let bytes = bits * self.shape.chunk_values() as f64 / 8.0;
        Ok((bytes / f64::from(self.set.base_cost())).min(1.0))
    }
}

/// The model's fingerprint as kvfs checks it: sha256 of the GGUF file, read in 1 MiB pieces,
/// followed by the layout of its chunks where that differs from the first one's: a model whose
/// coded values are in groups narrower than a head (Gemma 3) hashes `kv-value-group=<n>` after
/// its bytes, so contexts stored before that layout are refused as another model's, not misread.
pub fn model_fingerprint(path: &Path) -> std::io::Result<Fingerprint> {
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    // A file the engine cannot configure fingerprints as its bytes alone.
    if let Ok(cfg) = model::config::ModelConfig::from_gguf_file(path) {
        let group = cfg.chunk_shape(1).value_group;
        if group > 0 {
            h.update(format!("kv-value-group={group}").as_bytes());
        }
    }
    Ok(Fingerprint(h.finalize().into()))
}

/// Reads chunks from kvfs (through the mount when there is one): the pager's source for faults.
/// A chunk is read straight into the pager's buffer, with no allocation. Unless built not to,
/// it also writes a victim that was never written out before the pager reclaims it.
pub struct StoreSource {
    io: Arc<ChunkIo>,
    book: Arc<ChunkBook>,
    shape: ChunkShape,
    write_back: bool,
}

impl StoreSource {
    /// A source over `io`; `write_back` lets it write victims out on reclaim.
    pub fn new(
        io: Arc<ChunkIo>,
        book: Arc<ChunkBook>,
        shape: ChunkShape,
        write_back: bool,
    ) -> Self {
        Self {
            io,
            book,
            shape,
            write_back,
        }
    }
}

/// A store error, classified for the pager.
pub fn classify(key: ChunkKey, e: &StoreError) -> SourceError {
    match e {
        StoreError::ChunkMissing { .. } | StoreError::NoSuchContext { .. } => {
            SourceError::Missing { key }
        }
        e if e.needs_recompute() => SourceError::Corrupt {
            key,
            detail: e.to_string(),
        },
        e => SourceError::Io {
            key,
            detail: e.to_string(),
        },
    }
}

impl ChunkSource for StoreSource {
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError> {
        let want = self
            .book
            .get(key)
            .format
            .ok_or(SourceError::Missing { key })?;
        match self.io.store().chunk_state(key.ctx, key.index) {
            Ok(kvfs::StoreState::Stored(s)) if s.format == want => {}
            Ok(kvfs::StoreState::Stored(s)) => {
                return Err(SourceError::Corrupt {
                    key,
                    detail: format!("stored as {}, expected {}", s.format, want.name()),
                });
            }
            Ok(_) => return Err(SourceError::Missing { key }),
            Err(e) => return Err(classify(key, &e)),
        }
        let meta = match self.io.read_into(key.ctx.0, key.index, dst) {
            Ok(meta) => meta,
            Err(StoreError::BufferTooSmall { need, have, .. }) => {
                return Err(SourceError::Corrupt {
                    key,
                    detail: format!("{need} bytes for a {have}-byte slot"),
                });
            }
            Err(e) => return Err(classify(key, &e)),
        };
        dst[meta.raw_len as usize..].fill(0);
        Ok(())
    }

    fn write_back(&self, key: ChunkKey, data: &[u8]) -> Result<bool, SourceError> {
        if !self.write_back {
            return Ok(false);
        }
        let facts = self.book.get(key);
        let Some(format) = facts.format else {
            return Ok(false);
        };
        let shape = if facts.trimmed {
            self.shape.trimmed()
        } else {
            self.shape
        };
        let len = shape.chunk_bytes(format);
        let Some(bytes) = data.get(..len) else {
            return Err(SourceError::Corrupt {
                key,
                detail: format!(
                    "a {}-byte slot for a {len}-byte {} chunk",
                    data.len(),
                    format.name()
                ),
            });
        };
        self.io
            .write(key.ctx.0, key.index, format, facts.density, bytes)
            .map_err(|e| classify(key, &e))?;
        self.book.set_stored(key, self.io.stored_copy(key));
        Ok(true)
    }

    fn writes_back(&self) -> bool {
        self.write_back
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn smollm2() -> ChunkShape {
        ChunkShape {
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            tokens: 16,
            ..ChunkShape::DENSE
        }
    }

    /// A model whose values are grouped (Gemma 3's family, heads of 64 here) fingerprints as its
    /// bytes and its group, so contexts of the old layout are another model's; a model whose
    /// values keep one group per token (llama) fingerprints as its bytes alone, as before.
    #[test]
    fn the_fingerprint_names_the_value_groups() {
        use model::config::Family;
        use model::tiny::{TinySpec, write_tiny_gguf};
        let dir = tempfile::tempdir().unwrap();
        let sha = |path: &Path, tail: &[u8]| {
            let mut h = sha2::Sha256::new();
            h.update(std::fs::read(path).unwrap());
            h.update(tail);
            Fingerprint(h.finalize().into())
        };
        let llama = dir.path().join("llama.gguf");
        write_tiny_gguf(&llama, &TinySpec::default()).unwrap();
        assert_eq!(model_fingerprint(&llama).unwrap(), sha(&llama, b""));
        let gemma = dir.path().join("gemma3.gguf");
        let spec = TinySpec {
            family: Family::GEMMA3,
            n_layers: 2,
            head_dim: Some(64),
            n_kv_heads: 1,
            window: Some((8, 2)),
            ..TinySpec::default()
        };
        write_tiny_gguf(&gemma, &spec).unwrap();
        let cfg = model::config::ModelConfig::from_gguf_file(&gemma).unwrap();
        assert_eq!(cfg.chunk_shape(16).value_group, 32);
        assert_eq!(
            model_fingerprint(&gemma).unwrap(),
            sha(&gemma, b"kv-value-group=32")
        );
    }

    #[test]
    fn the_coded_levels_map_both_ways() {
        let s = smollm2();
        let l = FormatLevels::new(&s, &KvFormat::CODED).unwrap();
        for (i, f) in KvFormat::CODED.into_iter().enumerate() {
            assert_eq!(l.level(f), Some(Level(i as u8)));
            assert_eq!(l.format(Level(i as u8)), Some(f));
            assert_eq!(l.set().cost(Level(i as u8)), Some(s.stored_bytes(f) as u32));
        }
        // int8 and f16 chunks start from the heaviest level; int4 cannot take these levels.
        assert_eq!(l.floor(KvFormat::Int8), Some(Level(0)));
        assert_eq!(l.floor(KvFormat::F16), Some(Level(0)));
        assert_eq!(l.floor(KvFormat::Int4), None);
        // 4.5 bits is a ratio of about 0.52 of k8v8's bytes; below k4v3's bits is refused.
        let r = l.ratio_for_bits(4.5).unwrap();
        assert!(
            (r - 4.5 / s.stored_bits(KvFormat::K8v8)).abs() < 1e-12,
            "{r}"
        );
        assert!(matches!(
            l.ratio_for_bits(4.0),
            Err(LevelsError::Budget {
                lightest: KvFormat::K4v3,
                ..
            })
        ));
        assert!(matches!(
            FormatLevels::new(&s, &[KvFormat::K4v4, KvFormat::K8v8]),
            Err(LevelsError::Order { .. })
        ));
        // The paper's levels still map, by their stored bytes.
        let paper = [KvFormat::Int8, KvFormat::Int4, KvFormat::Int2];
        let l = FormatLevels::new(&s, &paper).unwrap();
        assert_eq!(l.format(Level(2)), Some(KvFormat::Int2));
    }

    proptest! {
        /// The service's assignment (the policy over the levels' stored bytes) keeps the mean
        /// all-in stored bits of a context's chunks within the budget, for any densities and
        /// any levels the chunks already hold.
        #[test]
        fn the_mix_keeps_its_bit_budget_for_any_densities(
            densities in prop::collection::vec(0.0f64..10.0, 0..200),
            floors in prop::collection::vec(0u8..3, 200),
            bits in 4.15f64..9.0,
        ) {
            let s = smollm2();
            let l = FormatLevels::new(&s, &KvFormat::CODED).unwrap();
            let ratio = l.ratio_for_bits(bits).unwrap();
            let floors: Vec<Level> = floors[..densities.len()].iter().map(|&f| Level(f)).collect();
            let a = policy::assign_levels(&densities, Some(&floors), l.set(), ratio).unwrap();
            let mut total = 0.0;
            for (i, lv) in a.levels.iter().enumerate() {
                prop_assert!(*lv >= floors[i]);
                total += s.stored_bits(l.format(*lv).unwrap());
            }
            // Floors only make chunks lighter, so the budget is always met.
            if !densities.is_empty() {
                prop_assert!(total / densities.len() as f64 <= bits + 1e-9, "{total} > {bits}");
            }
        }

        /// `llms eval ppl --kv-mix llms` picks the levels with `eval::levels_for_budget` over
        /// all-in bits; the service with the policy over stored bytes: the same information kept.
        #[test]
        fn the_eval_and_the_service_keep_the_same_information(
            densities in prop::collection::vec(0.0f64..10.0, 1..120),
            bits in 4.15f64..9.0,
        ) {
            let s = smollm2();
            let l = FormatLevels::new(&s, &KvFormat::CODED).unwrap();
            let a = policy::assign_levels(&densities, None, l.set(), l.ratio_for_bits(bits).unwrap())
                .unwrap();
            let stored: Vec<f64> = KvFormat::CODED.iter().map(|&f| s.stored_bits(f)).collect();
            let e = model::kv::eval::levels_for_budget(&densities, &stored, bits).unwrap();
            let info = |levels: &mut dyn Iterator<Item = usize>| -> f64 {
                levels.zip(&densities).map(|(w, d)| stored[w] / stored[0] * d).sum()
            };
            let service = info(&mut a.levels.iter().map(|l| usize::from(l.0)));
            let eval = info(&mut e.iter().copied());
            prop_assert!((service - eval).abs() <= 1e-9 * (1.0 + eval), "{service} vs {eval}");
        }
    }
}
