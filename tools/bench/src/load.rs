//! `llms bench load`: one context swapped out completely and brought back by the Load pipeline,
//! (a) reading every chunk, (b) recomputing every chunk, (c) as the planner splits them, with
//! (d) the delay the plan predicted; optionally under a cgroup v1 blkio read throttle, and with
//! the peak of the cgroup v1 memory group the process runs in.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::cgroup;
use model::Model;
use model::kv::KvFormat;
use service::{CallOptions, LoadMode, Manager, ManagerConfig, Owner, ServiceError};
use uffd_pager::median;

/// What to measure.
#[derive(Clone, Debug)]
pub struct LoadBenchOptions {
    /// Context lengths in tokens.
    pub lengths: Vec<usize>,
    /// Swap-out and load rounds per mode (figures are medians).
    pub runs: usize,
    /// Base format of the chunks.
    pub format: KvFormat,
    /// Compress at call end (the mix) or keep every chunk in `format`.
    pub compress: bool,
    /// Where the store lives (a fresh directory is made inside).
    pub dir: PathBuf,
    /// Read limits to emulate slow storage (bytes/s); `None` is the disk's own speed.
    pub throttles: Vec<Option<u64>>,
    /// Move chunks through a kvfs mount of the store (as `llms serve` does), or through the
    /// store's API.
    pub mount: bool,
    /// The mount's guard (see `kvfs::guard`), so an interrupted benchmark cannot hang.
    pub mount_guard: Option<kvfs::guard::GuardCommand>,
    /// Threads reading chunks when nothing is recomputed and there is no io_uring
    /// (`ManagerConfig::io_threads`).
    pub io_threads: usize,
    /// The planner's starting costs (a profile of this machine); `None`: the built-in ones.
    pub cost: Option<policy::CostModel>,
    /// Tokens per chunk; `None`: the model's (16, and 32 for Gemma 3).
    pub chunk_tokens: Option<usize>,
}

/// One row: a length, a storage speed and a load mode, medians over the runs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadRow {
    pub tokens: usize,
    pub throttle_mib_s: Option<f64>,
    pub mode: &'static str,
    pub chunks: usize,
    pub read: usize,
    pub recomputed: usize,
    pub read_bytes: u64,
    /// The whole Load, ms.
    pub load_ms: f64,
    pub io_ms: f64,
    pub recompute_ms: f64,
    /// What the plan predicted, ms.
    pub predicted_ms: f64,
    /// Recompute throughput during the Load, tokens/s.
    pub recompute_tps: f64,
    /// The memory group's peak over the row's rounds (model, store and mount included), bytes;
    /// `None` without a group.
    pub peak_memory_bytes: Option<u64>,
}

/// The report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LoadBenchReport {
    /// Whether chunks moved through a kvfs mount.
    pub mount: bool,
    /// Tokens per chunk.
    pub chunk_tokens: usize,
    pub rows: Vec<LoadRow>,
    /// Prefill throughput of each context's first call (tokens/s), for comparison with recompute.
    pub prefill_tps: Vec<(usize, f64)>,
    /// The cgroup v1 memory group the benchmark ran in, if any.
    pub memory_cgroup: Option<PathBuf>,
    /// Its peak over the whole run, the model's loading included, bytes.
    pub peak_memory_bytes: Option<u64>,
    /// The Load's read buffers at the end of the longest context's rounds, and the bytes of them
    /// the kernel backed with transparent huge pages.
    pub load_buffer_bytes: u64,
    pub load_buffer_huge_bytes: u64,
    /// Whether the Loads read through an io_uring (through the mount, where the kernel allows it).
    pub load_io_uring: bool,
}

impl LoadBenchReport {
    /// A text table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "chunks of {} tokens move through {}\n",
            self.chunk_tokens,
            if self.mount {
                "the kvfs mount (data files, passed through)"
            } else {
                "the store's API (no mount)"
            }
        );
        s += "tokens  disk        mode        chunks  read  recomp  load ms   io ms  recomp ms  predicted ms  recomp t/s  peak MiB\n";
        for r in &self.rows {
            let disk = r
                .throttle_mib_s
                .map_or("full".to_string(), |m| format!("{m:.0} MiB/s"));
            let peak = r
                .peak_memory_bytes
                .map_or("-".to_string(), |b| format!("{:.1}", mib(b)));
            s += &format!(
                "{:>6}  {:<10}  {:<10}  {:>6}  {:>4}  {:>6}  {:>7.2}  {:>6.2}  {:>9.2}  {:>12.2}  {:>10.0}  {:>8}\n",
                r.tokens,
                disk,
                r.mode,
                r.chunks,
                r.read,
                r.recomputed,
                r.load_ms,
                r.io_ms,
                r.recompute_ms,
                r.predicted_ms,
                r.recompute_tps,
                peak
            );
        }
        for (n, tps) in &self.prefill_tps {
            s += &format!("prefill of {n} tokens: {tps:.0} tokens/s\n");
        }
        s += &format!(
            "the Load's read buffers: {:.1} MiB, {:.1} MiB of it in huge pages; reads {}\n",
            mib(self.load_buffer_bytes),
            mib(self.load_buffer_huge_bytes),
            if self.load_io_uring {
                "in flight on an io_uring"
            } else {
                "one per I/O thread"
            }
        );
        match (&self.memory_cgroup, self.peak_memory_bytes) {
            (Some(g), Some(b)) => {
                s += &format!(
                    "peak of the memory cgroup {}: {:.1} MiB over the run (a row's peak: over its rounds)\n",
                    g.display(),
                    mib(b)
                );
            }
            _ => s += "peak memory: not measured (no cgroup v1 memory group)\n",
        }
        s
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// Runs the benchmark on `model`; `progress` is told what runs. With `memory`, the cgroup v1
/// memory group this process runs in (entered before the model was loaded,
/// [`cgroup::Joined`]), every row reports the group's peak over its rounds and the report the
/// peak over the whole run.
pub fn run(
    model: Arc<Model>,
    opts: &LoadBenchOptions,
    memory: Option<&cgroup::Group>,
    progress: impl FnMut(&str),
) -> Result<LoadBenchReport, ServiceError> {
    let mut bench = LoadBench {
        opts,
        peaks: Peaks {
            memory,
            overall: None,
        },
        progress,
        owner: Owner {
            uid: 0,
            app: "bench".into(),
        },
    };
    bench.peaks.take()?;
    let mut rows = Vec::new();
    let mut prefill_tps = Vec::new();
    let mut buffers = (0, 0);
    let mut io_uring = false;
    let mut chunk_tokens = 0;
    for &n in &opts.lengths {
        let length = bench.length(&model, n)?;
        chunk_tokens = length.chunk_tokens;
        rows.extend(length.rows);
        prefill_tps.push((n, length.prefill_tps));
        io_uring |= length.stats.load_io_uring;
        if length.stats.load_buffer_bytes >= buffers.0 {
            buffers = (
                length.stats.load_buffer_bytes,
                length.stats.load_buffer_huge_bytes,
            );
        }
    }
    bench.peaks.take()?;
    Ok(LoadBenchReport {
        mount: opts.mount,
        chunk_tokens,
        rows,
        prefill_tps,
        memory_cgroup: memory.map(|g| g.path().to_owned()),
        peak_memory_bytes: bench.peaks.overall,
        load_buffer_bytes: buffers.0,
        load_buffer_huge_bytes: buffers.1,
        load_io_uring: io_uring,
    })
}

/// The memory group's peaks: each taken since the last, and the largest over the run.
struct Peaks<'a> {
    memory: Option<&'a cgroup::Group>,
    overall: Option<u64>,
}

impl Peaks<'_> {
    /// The peak since the last reset, kept in the run's peak, and a fresh start; `None` without
    /// a group.
    fn take(&mut self) -> Result<Option<u64>, ServiceError> {
        let Some(g) = self.memory else {
            return Ok(None);
        };
        let cgroup_err = |e: cgroup::CgroupError| ServiceError::Internal {
            what: e.to_string(),
        };
        let peak = g.peak_memory().map_err(cgroup_err)?;
        g.reset_peak().map_err(cgroup_err)?;
        self.overall = Some(self.overall.unwrap_or(0).max(peak));
        Ok(Some(peak))
    }
}

/// What one context length gave: its rows, its first call's prefill throughput (tokens/s), and
/// the manager's counters at the end.
struct Length {
    rows: Vec<LoadRow>,
    prefill_tps: f64,
    stats: service::ServiceStats,
    /// Tokens per chunk, as the manager took them.
    chunk_tokens: usize,
}

/// A run in progress: its options, the memory group's peaks, where progress is told, and the
/// owner of every context.
struct LoadBench<'a, P> {
    opts: &'a LoadBenchOptions,
    peaks: Peaks<'a>,
    progress: P,
    owner: Owner,
}

impl<P: FnMut(&str)> LoadBench<'_, P> {
    /// One context of `n` tokens in a manager of its own over a fresh store: prefilled by a
    /// first call, then swapped out and loaded in every mode at every storage speed; the store
    /// is removed at the end.
    fn length(&mut self, model: &Arc<Model>, n: usize) -> Result<Length, ServiceError> {
        let opts = self.opts;
        let store = opts.dir.join(format!("load-{n}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&store);
        let mut m = Manager::open(Arc::clone(model), manager_config(opts, &store))?;
        let tokens = pseudo_tokens(n, model.cfg.vocab as u64);
        let id = m.create(&self.owner, &[])?;
        (self.progress)(&format!("prefilling {n} tokens"));
        let opts1 = CallOptions {
            max_tokens: 1,
            ..CallOptions::default()
        };
        let r = m.call(&self.owner, id, &tokens, &opts1, Instant::now(), |_| true)?;
        let prefill_tps = r.prefill_tokens as f64 / r.prefill_secs.max(1e-9);
        m.flush();
        let mut rows = Vec::new();
        for &throttle in &opts.throttles {
            let guard = match throttle {
                Some(bps) => Some(Throttle::start(&store, bps)?),
                None => None,
            };
            for (mode, name) in [
                (LoadMode::ReadOnly, "read"),
                (LoadMode::RecomputeOnly, "recompute"),
                (LoadMode::Planned, "planned"),
            ] {
                (self.progress)(&format!(
                    "{n} tokens, {name}, disk {}",
                    throttle.map_or("full".into(), |b| format!("{} MiB/s", b >> 20))
                ));
                m.set_load_mode(mode);
                self.peaks.take()?;
                let samples = self.loads(&mut m, id, guard.is_some())?;
                let peak = self.peaks.take()?;
                rows.push(load_row(n, throttle, name, &samples, peak));
            }
            drop(guard);
        }
        let stats = m.stats();
        let chunk_tokens = m.chunk_tokens();
        drop(m);
        let _ = std::fs::remove_dir_all(&store);
        let _ = std::fs::remove_dir(store.with_extension("mnt"));
        Ok(Length {
            rows,
            prefill_tps,
            stats,
            chunk_tokens,
        })
    }

    /// --runs rounds of context `id` swapped out and brought back by a call (one token in, none
    /// out: the call is its Load plus one token of prefill); each round's Load report.
    fn loads(
        &self,
        m: &mut Manager,
        id: u64,
        throttled: bool,
    ) -> Result<Vec<service::LoadReport>, ServiceError> {
        let mut samples = Vec::new();
        for _ in 0..self.opts.runs.max(1) {
            m.flush();
            m.swap_out(&self.owner, id)?;
            if throttled {
                // Every throttled Load starts from the same state of the throttle.
                std::thread::sleep(Throttle::SETTLE);
            }
            let opts0 = CallOptions {
                max_tokens: 0,
                ..CallOptions::default()
            };
            let r = m.call(&self.owner, id, &[], &opts0, Instant::now(), |_| true)?;
            samples.push(r.load);
        }
        Ok(samples)
    }
}

/// The manager of one length's run: its store at `store` (and its mount beside it, with
/// --mount), room for the longest context, the options' format, compression, I/O threads and
/// starting costs.
fn manager_config(opts: &LoadBenchOptions, store: &Path) -> ManagerConfig {
    let max_len = opts.lengths.iter().copied().max().unwrap_or(16);
    let mut cfg = ManagerConfig::new(store, 1 << 34);
    cfg.mount = opts.mount.then(|| store.with_extension("mnt"));
    cfg.mount_guard = opts.mount_guard.clone();
    cfg.kv_format = opts.format;
    cfg.io_threads = opts.io_threads;
    cfg.max_tokens = (max_len + 64).div_ceil(16) * 16;
    if let Some(c) = opts.chunk_tokens {
        cfg.chunk_tokens = c;
    }
    if !opts.compress {
        cfg.compress_bits = None;
    }
    if let Some(cost) = opts.cost {
        cfg.cost = cost;
    }
    cfg
}

/// `n` pseudo-random token ids below `vocab`, the same for the same `n`.
fn pseudo_tokens(n: usize, vocab: u64) -> Vec<u32> {
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ n as u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab) as u32
        })
        .collect()
}

/// One row from a mode's Load reports: the medians of their times, the last one's chunk
/// counts, and the memory group's `peak` over them.
fn load_row(
    n: usize,
    throttle: Option<u64>,
    mode: &'static str,
    samples: &[service::LoadReport],
    peak: Option<u64>,
) -> LoadRow {
    let med = |f: &dyn Fn(&service::LoadReport) -> f64| median(samples.iter().map(f));
    let last = samples.last().cloned().unwrap_or_default();
    let re_tokens = last.recomputed.len() * 16;
    let re_ms = med(&|l| l.recompute_secs * 1e3);
    LoadRow {
        tokens: n,
        throttle_mib_s: throttle.map(|b| b as f64 / f64::from(1 << 20)),
        mode,
        chunks: last.missing,
        read: last.read.len(),
        recomputed: last.recomputed.len(),
        read_bytes: last.read_bytes,
        load_ms: med(&|l| l.total_secs * 1e3),
        io_ms: med(&|l| l.io_secs * 1e3),
        recompute_ms: re_ms,
        predicted_ms: med(&|l| l.predicted_secs * 1e3),
        recompute_tps: if re_ms > 0.0 {
            re_tokens as f64 / (re_ms / 1e3)
        } else {
            0.0
        },
        peak_memory_bytes: peak,
    }
}

/// This process in a cgroup v1 blkio group that limits reads from the store's disk; dropping it
/// moves the process back and removes the group.
///
/// The kernel's throttle is not a slow disk: it counts bytes in slices (100 ms on a disk that
/// says it is rotational, as this project's virtio disk does, 20 ms otherwise), and a group that
/// starts a slice after an idle one may read a whole slice's bytes at once (at 50 MiB/s, `dd` of
/// 5 MiB with `O_DIRECT` after a second's idle took 7 ms, 8 MiB 126 ms, 16 MiB 323 ms). A Load
/// that followed idle time (a recompute-only Load, say) would then read its first bytes
/// unthrottled and one that followed reads would not, so the benchmark lets the throttle settle
/// ([`Throttle::SETTLE`]) before every throttled Load, in every mode: each starts with the same
/// first slice.
#[derive(Debug)]
pub struct Throttle {
    _joined: cgroup::Joined,
}

impl Throttle {
    /// Idle time that ends any slice of the throttle (two of the longest).
    pub const SETTLE: std::time::Duration = std::time::Duration::from_millis(200);

    /// Limits reads from the disk holding `path` to `bps` bytes/s for this process.
    pub fn start(path: &Path, bps: u64) -> Result<Throttle, ServiceError> {
        let err = |e: cgroup::CgroupError| ServiceError::Internal {
            what: e.to_string(),
        };
        let dev = cgroup::Device::of(path).map_err(err)?;
        let joined = cgroup::Joined::enter("blkio", &format!("llms-bench-{}", std::process::id()))
            .map_err(err)?;
        joined.group().throttle(dev, Some(bps), None).map_err(err)?;
        Ok(Throttle { _joined: joined })
    }
}
