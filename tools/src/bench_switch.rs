//! `llms bench switch`: the paper's evaluation (§4–5, Fig. 9–11) against the real service. A
//! trace (`llms trace gen`) is replayed against a real `llms serve` started for each context
//! manager, KV budget and number of contexts, inside a cgroup v1 memory group (its peak is
//! reported) and a blkio group (the store's disk throttled to emulate slower storage, and the
//! bytes it moved counted). Each call's switch latency is the daemon's own measure (`done`'s
//! `switch_ms`). Reports a table, CSV and JSON under `--out`, and three PNG plots. docs/bench.md
//! shows a run and says how to read it.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bench::cgroup::{Device, Group};
use bench::trace::{PastCap, TraceRow};
use model::config::ModelConfig;
use model::kv::KvFormat;
use protocol::PromptFormat;
use protocol::client::{CallParams, Client};
use service::ManagerKind;

use crate::daemon_proc::{Daemon, DaemonSpec};
use crate::model_cmd::ModelsDirArg;
use crate::report::table;
use crate::serve_cmd::parse_bytes;

/// Tokens per KV chunk: the service's default, which the budget in contexts assumes.
const CHUNK_TOKENS: usize = 16;

/// The target for each switch that reads: its latency at most this many times its I/O lower
/// bound (its bytes at the disk's bandwidth).
pub const BOUND_TARGET: f64 = 1.3;

/// The latency bounds of the paper's Fig. 10, milliseconds.
const BOUNDS_MS: [f64; 2] = [10.0, 25.0];

/// Options of `llms bench switch`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    llms trace gen --past-cap restart --calls 60 trace.jsonl\n  \
    llms bench switch trace.jsonl                                  # every manager, 2 contexts' worth\n  \
    llms bench switch --managers llms,vllm-sq,lmk --budget-contexts 1,2,3 trace.jsonl\n  \
    llms bench switch --contexts 2,4,6,8 --read-bps 200M trace.jsonl\n  \
    llms bench switch --managers llms --llama-server LLAMA/build/bin/llama-server trace.jsonl\n\
    Writes <out>/switch.json, switch.csv, switch-cdf.png, switch-vs-budget.png and \
    active-vs-budget.png (docs/bench.md).")]
pub struct BenchSwitchArgs {
    /// The trace to replay, made by `llms trace gen --past-cap restart` (the service refuses a
    /// call past its --max-context, so a trace whose contexts slide past the cap is refused)
    #[arg(value_name = "TRACE", required_unless_present = "replot")]
    pub trace: Option<PathBuf>,
    /// Replay nothing: redraw the table, CSV and plots of an earlier run from its switch.json
    /// into --out (to restyle the plots of a long run)
    #[arg(long, value_name = "JSON", conflicts_with = "trace")]
    pub replot: Option<PathBuf>,
    /// A GGUF model file; the trace's token counts are this model's [default: the default
    /// model, fetched if missing]
    #[arg(long, env = "LLMS_MODEL", value_name = "FILE")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub dir: ModelsDirArg,
    #[command(flatten)]
    pub report: crate::report::ReportArgs,
    /// Context managers to compare, each run as `llms serve --manager NAME`: llms,
    /// llms-no-compression, llms-no-pipeline, llms-no-lifecycle, vllm-sq, vllm-s, swapping, lmk
    /// [default: all of them]
    #[arg(long, value_delimiter = ',', value_name = "NAMES", value_parser = parse_manager)]
    pub managers: Vec<String>,
    /// KV budgets in contexts' worth: N times the int8 slots of a context at the trace's cap
    /// (its --max-context tokens in 16-token chunks); a list gives latency against budget. A
    /// call needs its whole context resident, so under 1 a long context fails with over_budget
    /// [default: 2]
    #[arg(long, value_delimiter = ',', value_name = "N,...", value_parser = parse_contexts_worth,
          conflicts_with = "kv_budget")]
    pub budget_contexts: Vec<f64>,
    /// KV budgets in bytes instead (suffixes K, M, G: powers of 1024), a list as
    /// --budget-contexts
    #[arg(long, value_delimiter = ',', value_name = "BYTES,...", value_parser = parse_budget)]
    pub kv_budget: Vec<u64>,
    /// Replay the trace cut to its first n contexts, for each n listed: the most active
    /// contexts whose average switch latency stays under 10 ms (and 25 ms) is the largest such
    /// n (paper Fig. 10) [default: all the trace's contexts, one replay]
    #[arg(long, value_delimiter = ',', value_name = "N,...", value_parser = crate::report::positive)]
    pub contexts: Vec<usize>,
    /// Replay only the first N calls (of the contexts kept) [default: every call]
    #[arg(long, value_name = "N", value_parser = crate::report::positive)]
    pub calls: Option<usize>,
    /// Emulate slower storage: the daemon's reads of the store's disk limited to BYTES per
    /// second (cgroup v1 blkio; suffixes K, M, G) [default: the disk's full speed]
    #[arg(long, value_name = "BYTES", value_parser = parse_rate)]
    pub read_bps: Option<u64>,
    /// The daemon's writes to the store's disk limited to BYTES per second (cgroup v1 blkio
    /// throttles direct and synced writes, not the page cache's writeback) [default: full
    /// speed]
    #[arg(long, value_name = "BYTES", value_parser = parse_rate)]
    pub write_bps: Option<u64>,
    /// Send each call as soon as the previous one is answered; by default the replay waits,
    /// between calls, until the daemon's ahead-of-time writes are done, as they would be in
    /// the trace's minutes between calls (time between calls is otherwise not replayed)
    #[arg(long)]
    pub no_drain: bool,
    /// Engine threads of the daemon [default: the number of CPUs]
    #[arg(long, value_name = "N", value_parser = crate::report::positive)]
    pub threads: Option<usize>,
    /// Where each run's store, socket and mount go (a fresh directory inside, removed after
    /// the run), on the disk to measure [default: <out>]
    #[arg(long, value_name = "DIR")]
    pub scratch: Option<PathBuf>,
    /// Add the llama.cpp peer row: this llama-server (`build/bin/llama-server` of a llama.cpp
    /// build, e.g. by ../shared/tools/build-llamacpp.sh) replays the same trace with
    /// as many slots of the trace's cap as fit the budget, each context saved to
    /// --slot-save-path at its call's end and restored, from a cold page cache, when called
    /// [default: no llama.cpp row]
    #[arg(long, value_name = "PATH", value_parser = crate::bench_peer::parse_exe)]
    pub llama_server: Option<PathBuf>,
    /// llama.cpp's KV cache types, one row each: q8_0 (row llama.cpp), f16 (row llama.cpp-f16)
    #[arg(long, value_delimiter = ',', value_name = "TYPES", default_value = "q8_0",
          value_parser = crate::bench_peer::parse_kv_type, requires = "llama_server")]
    pub llama_kv: Vec<crate::bench_peer::KvType>,
}

fn parse_manager(s: &str) -> Result<String, String> {
    s.parse::<ManagerKind>()
        .map(|k| k.name().to_owned())
        .map_err(|e| e.to_string())
}

fn parse_contexts_worth(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e6 => Ok(v),
        Ok(v) => Err(format!("{v} contexts' worth: must be above 0")),
        Err(e) => Err(format!("'{s}': {e}")),
    }
}

fn parse_budget(s: &str) -> Result<u64, String> {
    match parse_bytes(s) {
        Ok(0) => Err("a KV budget must be at least 1 byte".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e:#}")),
    }
}

fn parse_rate(s: &str) -> Result<u64, String> {
    match parse_bytes(s) {
        Ok(n) if n >= 4096 => Ok(n),
        Ok(n) => Err(format!("{n} bytes/s: a disk limit must be at least 4K")),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// One KV budget of a run.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Budget {
    pub bytes: u64,
    /// The budget in contexts' worth, when given so.
    pub contexts: Option<f64>,
}

impl Budget {
    pub(crate) fn label(&self) -> String {
        match self.contexts {
            Some(c) => format!(
                "{c} ctx ({:.1} MiB)",
                self.bytes as f64 / f64::from(1 << 20)
            ),
            None => format!("{:.1} MiB", self.bytes as f64 / f64::from(1 << 20)),
        }
    }

    /// The x of the budget plots: contexts' worth, else MiB.
    pub(crate) fn x(&self) -> f64 {
        self.contexts
            .unwrap_or(self.bytes as f64 / f64::from(1 << 20))
    }
}

/// One call of a replay.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CallRecord {
    /// The trace's context number.
    pub context: u32,
    /// The call started its context (created it): nothing to switch to.
    pub start: bool,
    /// The previous call went to another context.
    pub switched: bool,
    /// The daemon's switch latency (request received to the context's chunks resident), ms.
    pub switch_ms: f64,
    /// The switch's parts (`done`'s timings): queue wait, the Load, its reads and recompute.
    pub queue_ms: f64,
    pub load_ms: f64,
    pub io_ms: f64,
    pub recompute_ms: f64,
    /// Sent to `done` received, as the app sees it, ms.
    pub e2e_ms: f64,
    pub chunks_missing: usize,
    pub chunks_read: usize,
    pub chunks_recomputed: usize,
    pub read_bytes: u64,
    /// Tokens generated.
    pub tokens: usize,
    pub context_tokens: usize,
    /// The call failed: the daemon's error code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The llama.cpp row's restores: the harness's clock around the restore request (HTTP on
    /// loopback included); `switch_ms` is llama-server's own `restore_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_wall_ms: Option<f64>,
}

impl CallRecord {
    /// A failed call's record.
    pub(crate) fn failed(row: &TraceRow, switched: bool, e2e_ms: f64, error: String) -> CallRecord {
        CallRecord {
            context: row.context,
            start: row.start,
            switched,
            switch_ms: 0.0,
            queue_ms: 0.0,
            load_ms: 0.0,
            io_ms: 0.0,
            recompute_ms: 0.0,
            e2e_ms,
            chunks_missing: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            read_bytes: 0,
            tokens: 0,
            context_tokens: 0,
            error: Some(error),
            restore_wall_ms: None,
        }
    }
}

/// One replay: a manager, a budget, a number of contexts.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Run {
    pub manager: String,
    /// The manager the daemon said it ran (its stats).
    pub daemon_manager: String,
    pub budget: Budget,
    pub contexts: usize,
    pub calls: usize,
    /// Calls answered with a `done`.
    pub answered: usize,
    pub errors: usize,
    /// Calls that started (created) their context.
    pub starts: usize,
    /// Calls to another context than the previous call's, not starts: the switch latency
    /// statistics are theirs.
    pub switches: usize,
    pub switch_avg_ms: f64,
    pub switch_p50_ms: f64,
    pub switch_p99_ms: f64,
    pub switch_max_ms: f64,
    /// Every answered call, app side.
    pub e2e_avg_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// Chunk bytes the daemon read back (its `done` events).
    pub read_bytes: u64,
    /// Bytes the daemon's processes read and wrote on the store's disk (blkio).
    pub disk_read_bytes: u64,
    pub disk_written_bytes: u64,
    pub chunks_read: u64,
    pub chunks_recomputed: u64,
    /// Chunks recomputed over chunks brought back.
    pub recompute_share: f64,
    /// The Load's read speed over the run (bytes read over the time spent reading), MiB/s.
    pub read_mib_s: f64,
    /// Switches that read chunks: the average of switch latency over its I/O lower bound (its
    /// bytes read at `read_mib_s`, or at --read-bps when that is slower); 0 when none read.
    pub io_bound_ratio: f64,
    /// The same with the bound at the disk's `O_DIRECT` read bandwidth measured in the same run
    /// (the report's `disk_mib_s`, or --read-bps when that is slower); 0 when none read.
    #[serde(default)]
    pub disk_bound_ratio: f64,
    /// The worst reading switch's latency over its bound at the disk's bandwidth; 0 when none read.
    #[serde(default)]
    pub disk_bound_ratio_max: f64,
    /// Switches that read chunks, and how many of them came within [`BOUND_TARGET`] of their
    /// bound at the disk's bandwidth (the target: every one).
    #[serde(default)]
    pub reading_switches: usize,
    #[serde(default)]
    pub within_bound_target: usize,
    /// Reclaims that waited for their victim to be written out first.
    pub sync_reclaims: u64,
    /// Reclaims of chunks given up unwritten (recomputed when needed).
    pub unwritten_reclaims: u64,
    pub reclaims: u64,
    pub faults: u64,
    pub writes: u64,
    /// Peak of the daemon's memory cgroup (memory.max_usage_in_bytes: resident memory and the
    /// page cache it charged).
    pub peak_memory_bytes: u64,
    /// The daemon's peak resident set (VmHWM).
    pub peak_rss_bytes: u64,
    /// Spawn to listening, ms.
    pub start_ms: f64,
    /// The replay's wall time, s.
    pub secs: f64,
    /// The llama.cpp row: llama-server's slots (contexts it holds at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<usize>,
    pub call_log: Vec<CallRecord>,
}

/// The most active contexts under each latency bound, for one manager and budget.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Active {
    pub manager: String,
    pub budget: Budget,
    /// The largest n of --contexts whose average switch latency is under 10 ms (0: none).
    pub under_10ms: usize,
    pub under_25ms: usize,
}

/// The whole report.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SwitchReport {
    pub trace: String,
    pub model: String,
    /// Bytes of one context's worth: int8 slots of a context at the trace's cap.
    pub context_bytes: u64,
    pub max_context: u32,
    pub read_bps: Option<u64>,
    pub write_bps: Option<u64>,
    /// The scratch disk's `O_DIRECT` read bandwidth measured at the start of the run (64 MiB of
    /// the model file when it is on that disk, else of a file written there, in 1 MiB reads, 4
    /// at a time: the Load's I/O threads), MiB/s; 0 in reports from before it.
    #[serde(default)]
    pub disk_mib_s: f64,
    pub device: String,
    pub drained: bool,
    pub runs: Vec<Run>,
    pub active: Vec<Active>,
    pub plots: Vec<String>,
    /// The plots' colour of each manager (the plots carry no text).
    pub colours: BTreeMap<String, String>,
}

/// What one replay needs besides its manager, budget and rows.
pub(crate) struct Setup<'a> {
    pub(crate) model: &'a Path,
    pub(crate) scratch: &'a Path,
    pub(crate) device: Device,
    pub(crate) read_bps: Option<u64>,
    pub(crate) write_bps: Option<u64>,
    /// The scratch disk's `O_DIRECT` read bandwidth, bytes/s (the I/O lower bound's).
    pub(crate) disk_bps: f64,
    pub(crate) max_context: u32,
    pub(crate) apps_contexts: usize,
    pub(crate) threads: Option<usize>,
    pub(crate) drain: bool,
}

/// The `n`-th percentile (nearest rank) of sorted `v`.
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let k = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[k - 1]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The daemon's peak resident set, from /proc/PID/status.
pub(crate) fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb << 10)
}

/// Waits until the daemon has written out every chunk queued ahead of time (at most a minute).
fn drain(c: &mut Client) -> anyhow::Result<()> {
    let t = Instant::now();
    while c.stats()?.service.writes_queued > 0 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Replays `rows` against a fresh daemon running `manager` under `budget`.
fn replay(
    s: &Setup<'_>,
    manager: &str,
    budget: Budget,
    contexts: usize,
    rows: &[TraceRow],
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Run> {
    // A fresh name per replay: a group left behind (its removal failed) never lends its peak
    // or its byte counts to the next replay.
    static REPLAYS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let nth = REPLAYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("llms-switch-{}-{nth}", std::process::id());
    let dir = s.scratch.join(&name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let memory = Group::create("memory", &name)?;
    let blkio = Group::create("blkio", &name)?;
    blkio.throttle(s.device, s.read_bps, s.write_bps)?;
    let mut spec = DaemonSpec::new(s.model, &dir);
    spec.args = vec![
        "--manager".into(),
        manager.into(),
        "--kv-budget".into(),
        budget.bytes.to_string(),
        "--max-context".into(),
        s.max_context.to_string(),
        "--max-contexts-per-app".into(),
        s.apps_contexts.max(1).to_string(),
    ];
    if let Some(t) = s.threads {
        spec.args.extend(["--threads".into(), t.to_string()]);
    }
    spec.cgroups = vec![memory.path().to_owned(), blkio.path().to_owned()];
    let t0 = Instant::now();
    let (mut daemon, start_ms) =
        Daemon::start(&spec).with_context(|| format!("starting llms serve --manager {manager}"))?;
    let socket = spec.socket();
    let mut clients: BTreeMap<String, Client> = BTreeMap::new();
    let mut ids: Vec<Option<u64>> = vec![None; contexts];
    let mut log = Vec::with_capacity(rows.len());
    let mut previous: Option<u32> = None;
    for row in rows {
        let c = match clients.entry(row.app.clone()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(
                Client::connect(&socket, &row.app)
                    .with_context(|| format!("connecting as {}", row.app))?,
            ),
        };
        let k = row.context as usize;
        if row.start || ids[k].is_none() {
            if let Some(id) = ids[k].take() {
                c.delete(id)
                    .with_context(|| format!("deleting context {k} to restart it"))?;
            }
            ids[k] = Some(c.new_context(None, PromptFormat::Raw)?);
        }
        let id = ids[k].context("a context without an id")?;
        let params = CallParams {
            format: PromptFormat::Raw,
            max_tokens: row.max_tokens as usize,
            ..CallParams::default()
        };
        let t = Instant::now();
        let answer = c
            .call(id, &row.prompt, &params)
            .and_then(|s| s.collect_answer());
        let e2e_ms = t.elapsed().as_secs_f64() * 1e3;
        let switched = previous.is_some_and(|p| p != row.context);
        previous = Some(row.context);
        let record = match answer {
            Ok(a) => CallRecord {
                context: row.context,
                start: row.start,
                switched,
                switch_ms: a.done.timings.switch_ms,
                queue_ms: a.done.timings.queue_ms,
                load_ms: a.done.timings.load_ms,
                io_ms: a.done.timings.io_ms,
                recompute_ms: a.done.timings.recompute_ms,
                e2e_ms,
                chunks_missing: a.done.chunks.missing,
                chunks_read: a.done.chunks.read,
                chunks_recomputed: a.done.chunks.recomputed,
                read_bytes: a.done.chunks.read_bytes,
                tokens: a.done.tokens,
                context_tokens: a.done.context_tokens,
                error: None,
                restore_wall_ms: None,
            },
            Err(e) => {
                let code = e.code().map_or_else(|| e.to_string(), str::to_owned);
                if e.code().is_none() {
                    // Not an answer of the daemon: the connection or the daemon is gone.
                    return Err(e).with_context(|| format!("{manager}: a call failed"));
                }
                tracing::warn!(manager, context = row.context, error = %e, "a call failed");
                CallRecord::failed(row, switched, e2e_ms, code)
            }
        };
        log.push(record);
        if s.drain {
            drain(c)?;
        }
        progress.inc(1);
    }
    let secs = t0.elapsed().as_secs_f64();
    let stats = match clients.values_mut().next() {
        Some(c) => c.stats()?.service,
        None => Client::connect(&socket, "bench")?.stats()?.service,
    };
    let daemon_manager = stats.manager.clone();
    let (disk_read_bytes, disk_written_bytes) = blkio.io_bytes(s.device)?;
    let peak_rss_bytes = peak_rss(daemon.pid());
    drop(clients);
    daemon.term()?;
    let peak_memory_bytes = memory.peak_memory()?;
    drop((memory, blkio));
    let _ = std::fs::remove_dir_all(&dir);

    let mut run = summarize(manager, budget, contexts, log, s.read_bps, s.disk_bps);
    let brought = stats.chunks_read + stats.chunks_recomputed;
    run.daemon_manager = daemon_manager;
    run.disk_read_bytes = disk_read_bytes;
    run.disk_written_bytes = disk_written_bytes;
    run.chunks_read = stats.chunks_read;
    run.chunks_recomputed = stats.chunks_recomputed;
    run.recompute_share = if brought > 0 {
        stats.chunks_recomputed as f64 / brought as f64
    } else {
        0.0
    };
    run.sync_reclaims = stats.sync_reclaims;
    run.unwritten_reclaims = stats.unwritten_reclaims;
    run.reclaims = stats.reclaims;
    run.faults = stats.faults;
    run.writes = stats.writes;
    run.peak_memory_bytes = peak_memory_bytes;
    run.peak_rss_bytes = peak_rss_bytes;
    run.start_ms = start_ms;
    run.secs = secs;
    Ok(run)
}

/// A replay's figures from its calls: switches (calls to another context than the previous
/// call's, not starts) and their latency, every answered call's end-to-end latency, bytes read
/// and the I/O bound; the daemon's and the cgroups' figures are left at zero for the caller.
pub(crate) fn summarize(
    manager: &str,
    budget: Budget,
    contexts: usize,
    log: Vec<CallRecord>,
    read_limit: Option<u64>,
    disk_bps: f64,
) -> Run {
    let ok: Vec<&CallRecord> = log.iter().filter(|r| r.error.is_none()).collect();
    let mut sw: Vec<f64> = ok
        .iter()
        .filter(|r| r.switched && !r.start)
        .map(|r| r.switch_ms)
        .collect();
    sw.sort_by(f64::total_cmp);
    let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
    e2e.sort_by(f64::total_cmp);
    let (bytes, io_s) = ok.iter().fold((0u64, 0.0f64), |(b, t), r| {
        (b + r.read_bytes, t + r.io_ms / 1e3)
    });
    let read_bps = if io_s > 0.0 { bytes as f64 / io_s } else { 0.0 };
    // Each reading switch's latency over its bytes at `bps`, the throttle capping it (none when
    // nothing was read, or no speed is known).
    let bound_ratios = |bps: f64| {
        let bps = match read_limit {
            Some(limit) if bps > 0.0 => bps.min(limit as f64),
            _ => bps,
        };
        ok.iter()
            .filter(|r| r.switched && !r.start && r.read_bytes > 0 && bps > 0.0)
            .map(|r| r.switch_ms / (r.read_bytes as f64 / bps * 1e3))
            .collect::<Vec<f64>>()
    };
    let disk_ratios = bound_ratios(disk_bps);
    Run {
        manager: manager.to_owned(),
        daemon_manager: String::new(),
        budget,
        contexts,
        calls: log.len(),
        answered: ok.len(),
        errors: log.len() - ok.len(),
        starts: log.iter().filter(|r| r.start).count(),
        switches: sw.len(),
        switch_avg_ms: mean(&sw),
        switch_p50_ms: percentile(&sw, 0.5),
        switch_p99_ms: percentile(&sw, 0.99),
        switch_max_ms: sw.last().copied().unwrap_or(0.0),
        e2e_avg_ms: mean(&e2e),
        e2e_p50_ms: percentile(&e2e, 0.5),
        e2e_p99_ms: percentile(&e2e, 0.99),
        read_bytes: ok.iter().map(|r| r.read_bytes).sum(),
        disk_read_bytes: 0,
        disk_written_bytes: 0,
        chunks_read: 0,
        chunks_recomputed: 0,
        recompute_share: 0.0,
        read_mib_s: read_bps / f64::from(1 << 20),
        io_bound_ratio: mean(&bound_ratios(read_bps)),
        disk_bound_ratio: mean(&disk_ratios),
        disk_bound_ratio_max: disk_ratios.iter().copied().fold(0.0, f64::max),
        reading_switches: disk_ratios.len(),
        within_bound_target: disk_ratios.iter().filter(|&&r| r <= BOUND_TARGET).count(),
        sync_reclaims: 0,
        unwritten_reclaims: 0,
        reclaims: 0,
        faults: 0,
        writes: 0,
        peak_memory_bytes: 0,
        peak_rss_bytes: 0,
        start_ms: 0.0,
        secs: 0.0,
        slots: None,
        call_log: log,
    }
}

/// A replay's line above the progress bar.
fn report_line(progress: &indicatif::ProgressBar, r: &Run) {
    let slots = r.slots.map_or(String::new(), |n| format!(" ({n} slots)"));
    print_line(
        progress,
        format!(
            "{}{slots}, {}, {} contexts: {} switches, avg {:.2} ms, p99 {:.2} ms, {} errors",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.switches,
            r.switch_avg_ms,
            r.switch_p99_ms,
            r.errors
        ),
    );
}

fn print_line(progress: &indicatif::ProgressBar, line: String) {
    // A hidden bar (stderr is not a terminal) prints nothing, not even its lines.
    if progress.is_hidden() {
        eprintln!("{line}");
    } else {
        progress.println(line);
    }
}

/// The rows of the first `n` contexts, at most `calls` of them.
fn cut(rows: &[TraceRow], n: usize, calls: Option<usize>) -> Vec<TraceRow> {
    rows.iter()
        .filter(|r| (r.context as usize) < n)
        .take(calls.unwrap_or(usize::MAX))
        .cloned()
        .collect()
}

/// The largest n of `runs` (one manager, one budget) whose average switch latency is under
/// `bound_ms` with every call answered; 0 when none.
fn max_active(runs: &[&Run], bound_ms: f64) -> usize {
    runs.iter()
        .filter(|r| r.errors == 0 && r.switch_avg_ms < bound_ms)
        .map(|r| r.contexts)
        .max()
        .unwrap_or(0)
}

/// Runs the benchmark.
pub fn run(args: &BenchSwitchArgs) -> anyhow::Result<()> {
    args.report.begin();
    if let Some(json) = &args.replot {
        return replot(args, json);
    }
    let trace_path = args.trace.as_deref().context("no trace to replay")?;
    let trace = bench::trace::read(trace_path)?;
    let h = &trace.header;
    let model = match &args.model {
        Some(p) => p.clone(),
        None => model::fetch::default_model_path(&args.dir.fetch_options())
            .context("cannot get the default model (try `llms model fetch`)")?,
    };
    let model = std::path::absolute(&model)?;
    let cfg = ModelConfig::from_gguf_file(&model)?;
    let model_name = model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if model_name != h.model {
        tracing::warn!(
            trace = h.model,
            model = model_name,
            "the trace's token counts are another model's"
        );
    }
    ensure!(
        h.max_context as usize <= cfg.max_ctx,
        "the trace's contexts reach {} tokens, more than the model's context of {}",
        h.max_context,
        cfg.max_ctx
    );
    let past = trace
        .rows
        .iter()
        .filter(|r| r.context_tokens > u64::from(h.max_context))
        .count();
    if h.past_cap == PastCap::Slide && past > 0 {
        bail!(
            "{} slides contexts past its cap of {} tokens ({past} calls): the service refuses a \
             call past its --max-context (context_full), so replay a trace made with `llms trace \
             gen --past-cap restart` (docs/bench.md)",
            trace_path.display(),
            h.max_context
        );
    }
    let all = h.contexts.len();
    let mut ns = if args.contexts.is_empty() {
        vec![all]
    } else {
        args.contexts.clone()
    };
    ns.sort_unstable();
    ns.dedup();
    if let Some(&n) = ns.iter().find(|&&n| n > all) {
        bail!("--contexts {n}: the trace has {all} contexts");
    }
    let managers: Vec<String> = if args.managers.is_empty() {
        ManagerKind::ALL
            .iter()
            .map(|m| m.name().to_owned())
            .collect()
    } else {
        args.managers.clone()
    };
    let shape = cfg.chunk_shape(CHUNK_TOKENS);
    let context_bytes = (h.max_context as usize).div_ceil(CHUNK_TOKENS) as u64
        * shape.slot_bytes(KvFormat::Int8) as u64;
    let budgets: Vec<Budget> = if !args.kv_budget.is_empty() {
        args.kv_budget
            .iter()
            .map(|&bytes| Budget {
                bytes,
                contexts: None,
            })
            .collect()
    } else {
        let worth = if args.budget_contexts.is_empty() {
            vec![2.0]
        } else {
            args.budget_contexts.clone()
        };
        worth
            .iter()
            .map(|&c| Budget {
                bytes: ((c * context_bytes as f64) as u64).max(1),
                contexts: Some(c),
            })
            .collect()
    };
    let scratch = args.report.scratch_dir(args.scratch.as_deref())?;
    let device = Device::of(&scratch)?;
    let per_app = h
        .contexts
        .iter()
        .fold(BTreeMap::<&str, usize>::new(), |mut m, c| {
            *m.entry(&c.app).or_default() += 1;
            m
        })
        .into_values()
        .max()
        .unwrap_or(1);
    // The I/O lower bound's bandwidth: what the disk gives O_DIRECT reads, 4 at a time (the
    // Load's I/O threads), measured now, before the replays. The model file is read when it is
    // on that disk and large enough: a file written just before reads back faster than the disk
    // (3.3 GB/s against 1.2 here: the virtual disk's host keeps what was just written).
    let probe_bytes = 64 << 20;
    let model_bytes = std::fs::metadata(&model).map_or(0, |m| m.len());
    let disk_bps = if Device::of(&model)? == device && model_bytes >= probe_bytes as u64 {
        crate::disk::direct_read_bps(&model, probe_bytes, 4)?
    } else {
        crate::disk::probe_dir(&scratch, probe_bytes, 4)?
    };
    print_line(
        &indicatif::ProgressBar::hidden(),
        format!(
            "bench switch: the scratch disk reads {:.0} MiB/s with O_DIRECT (the I/O lower bound's)",
            disk_bps / f64::from(1 << 20)
        ),
    );
    let setup = Setup {
        model: &model,
        scratch: &scratch,
        device,
        read_bps: args.read_bps,
        write_bps: args.write_bps,
        disk_bps,
        max_context: h.max_context,
        apps_contexts: per_app,
        threads: args.threads,
        drain: !args.no_drain,
    };
    let plan: Vec<(Budget, usize, Vec<TraceRow>)> = budgets
        .iter()
        .flat_map(|&b| ns.iter().map(move |&n| (b, n)).collect::<Vec<_>>())
        .map(|(b, n)| (b, n, cut(&trace.rows, n, args.calls)))
        .collect();
    let peers: Vec<crate::bench_peer::KvType> = if args.llama_server.is_some() {
        let mut v = args.llama_kv.clone();
        v.dedup();
        v
    } else {
        Vec::new()
    };
    // Every row's name: the managers, then the llama.cpp rows.
    let names: Vec<String> = managers
        .iter()
        .cloned()
        .chain(peers.iter().map(|k| k.row().to_owned()))
        .collect();
    let total: u64 = plan.iter().map(|p| p.2.len() as u64).sum::<u64>() * names.len() as u64;
    let progress = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} calls {elapsed_precise} (eta {eta})",
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .progress_chars("=> "),
    );
    let mut runs = Vec::new();
    for (budget, n, rows) in &plan {
        for m in &managers {
            progress.set_prefix(format!("{m}, {}, {n} contexts", budget.label()));
            let r = replay(&setup, m, *budget, *n, rows, &progress)?;
            ensure!(
                &r.daemon_manager == m,
                "asked the daemon for --manager {m}; its stats say it ran {}",
                r.daemon_manager
            );
            report_line(&progress, &r);
            runs.push(r);
        }
        let Some(exe) = &args.llama_server else {
            continue;
        };
        for kv in &peers {
            let m = kv.row();
            let slots =
                crate::bench_peer::slots_for(budget.bytes, h.max_context, kv.token_bytes(&cfg));
            if slots == 0 {
                progress.inc(rows.len() as u64);
                print_line(
                    &progress,
                    format!(
                        "{m}, {}, {n} contexts: skipped, not one slot of {} tokens of {} KV fits \
                         the budget",
                        budget.label(),
                        h.max_context,
                        kv.name()
                    ),
                );
                continue;
            }
            progress.set_prefix(format!("{m}, {}, {n} contexts", budget.label()));
            let r = crate::bench_peer::replay(&setup, exe, &cfg, *kv, *budget, *n, rows, &progress)
                .with_context(|| format!("the {m} row"))?;
            report_line(&progress, &r);
            runs.push(r);
        }
    }
    progress.finish_and_clear();
    let managers = names;
    let mut active = Vec::new();

    for b in &budgets {
        for m in &managers {
            let rs: Vec<&Run> = runs
                .iter()
                .filter(|r| &r.manager == m && r.budget.bytes == b.bytes)
                .collect();
            active.push(Active {
                manager: m.clone(),
                budget: *b,
                under_10ms: max_active(&rs, BOUNDS_MS[0]),
                under_25ms: max_active(&rs, BOUNDS_MS[1]),
            });
        }
    }
    print_tables(&runs, &active, ns.len() > 1);
    std::fs::create_dir_all(&args.report.out)
        .with_context(|| format!("cannot create {}", args.report.out.display()))?;
    let csv = args.report.out.join("switch.csv");
    write_csv(&csv, &runs)?;
    let plots = crate::bench_switch_plot::draw(&args.report.out, &runs, &active, &managers)?;
    let report = SwitchReport {
        trace: trace_path.display().to_string(),
        model: model_name,
        context_bytes,
        max_context: h.max_context,
        read_bps: args.read_bps,
        write_bps: args.write_bps,
        disk_mib_s: disk_bps / f64::from(1 << 20),
        device: device.to_string(),
        drained: !args.no_drain,
        runs,
        active,
        plots: plots.iter().map(|p| p.display().to_string()).collect(),
        colours: managers
            .iter()
            .map(|m| {
                (
                    m.clone(),
                    crate::bench_switch_plot::colour_name(m).to_owned(),
                )
            })
            .collect(),
    };
    args.report.write("switch", &report)?;
    eprintln!("wrote {}", csv.display());
    for p in &plots {
        eprintln!("wrote {}", p.display());
    }
    // Failed calls are a result (an f16 context larger than the budget cannot run): the table
    // shows them, the JSON has their codes, and their replays count for no latency bound.
    for r in report.runs.iter().filter(|r| r.errors > 0) {
        let mut codes: BTreeMap<&str, usize> = BTreeMap::new();
        for c in &r.call_log {
            if let Some(e) = &c.error {
                *codes.entry(e).or_default() += 1;
            }
        }
        eprintln!(
            "{}, {}, {} contexts: {} of {} calls failed: {codes:?}",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.errors,
            r.calls
        );
    }
    Ok(())
}

/// `--replot`: the table, CSV and plots of an earlier report, and the report again with its new
/// plots' paths.
fn replot(args: &BenchSwitchArgs, json: &Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("cannot read {}", json.display()))?;
    let mut report: SwitchReport = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench switch report", json.display()))?;
    let mut managers: Vec<String> = Vec::new();
    for r in &report.runs {
        if !managers.contains(&r.manager) {
            managers.push(r.manager.clone());
        }
    }
    let several_n = report.runs.iter().any(|r| {
        report
            .runs
            .first()
            .is_some_and(|f| f.contexts != r.contexts)
    });
    print_tables(&report.runs, &report.active, several_n);
    std::fs::create_dir_all(&args.report.out)
        .with_context(|| format!("cannot create {}", args.report.out.display()))?;
    let csv = args.report.out.join("switch.csv");
    write_csv(&csv, &report.runs)?;
    let plots =
        crate::bench_switch_plot::draw(&args.report.out, &report.runs, &report.active, &managers)?;
    report.plots = plots.iter().map(|p| p.display().to_string()).collect();
    args.report.write("switch", &report)?;
    eprintln!("wrote {}", csv.display());
    for p in &plots {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / f64::from(1 << 20)
}

fn print_tables(runs: &[Run], active: &[Active], several_n: bool) {
    table!(
        "| manager | budget | contexts | calls | switches | switch avg ms | p50 | p99 | e2e avg ms | e2e p99 | read MiB | disk read MiB | disk written MiB | chunks read | recomputed | recompute share | sync reclaims | peak MiB |"
    );
    table!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        table!(
            "| {} | {} | {} | {}{} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {} | {} | {:.0}% | {} | {:.0} |",
            r.manager,
            r.budget.label(),
            r.contexts,
            r.answered,
            if r.errors > 0 {
                format!(" ({} failed)", r.errors)
            } else {
                String::new()
            },
            r.switches,
            r.switch_avg_ms,
            r.switch_p50_ms,
            r.switch_p99_ms,
            r.e2e_avg_ms,
            r.e2e_p99_ms,
            mib(r.read_bytes),
            mib(r.disk_read_bytes),
            mib(r.disk_written_bytes),
            r.chunks_read,
            r.chunks_recomputed,
            r.recompute_share * 100.0,
            r.sync_reclaims,
            mib(r.peak_memory_bytes)
        );
    }
    if several_n {
        table!();
        table!("| manager | budget | max active contexts, avg switch < 10 ms | < 25 ms |");
        table!("|---|---|---|---|");
        for a in active {
            table!(
                "| {} | {} | {} | {} |",
                a.manager,
                a.budget.label(),
                a.under_10ms,
                a.under_25ms
            );
        }
    }
    let reading: Vec<&Run> = runs.iter().filter(|r| r.io_bound_ratio > 0.0).collect();
    if !reading.is_empty() {
        table!();
        table!(
            "| manager | budget | contexts | Load reads MiB/s | switch / I/O bound at that speed | switch / I/O bound at the disk's | worst switch / its bound at the disk's | switches within {BOUND_TARGET}x of it |"
        );
        table!("|---|---|---|---|---|---|---|---|");
        for r in reading {
            table!(
                "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {} of {} |",
                r.manager,
                r.budget.label(),
                r.contexts,
                r.read_mib_s,
                r.io_bound_ratio,
                r.disk_bound_ratio,
                r.disk_bound_ratio_max,
                r.within_bound_target,
                r.reading_switches
            );
        }
    }
}

fn write_csv(path: &Path, runs: &[Run]) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("cannot write {}", path.display()))?,
    );
    writeln!(
        f,
        "manager,budget_bytes,budget_contexts,contexts,calls,answered,errors,starts,switches,\
         switch_avg_ms,switch_p50_ms,switch_p99_ms,switch_max_ms,e2e_avg_ms,e2e_p50_ms,e2e_p99_ms,\
         read_bytes,disk_read_bytes,disk_written_bytes,chunks_read,chunks_recomputed,\
         recompute_share,sync_reclaims,unwritten_reclaims,reclaims,faults,writes,peak_memory_bytes,peak_rss_bytes,\
         start_ms,secs"
    )?;
    for r in runs {
        writeln!(
            f,
            "{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{},{:.4},{},{},{},{},{},{},{},{:.1},{:.1}",
            r.manager,
            r.budget.bytes,
            r.budget.contexts.map_or(String::new(), |c| c.to_string()),
            r.contexts,
            r.calls,
            r.answered,
            r.errors,
            r.starts,
            r.switches,
            r.switch_avg_ms,
            r.switch_p50_ms,
            r.switch_p99_ms,
            r.switch_max_ms,
            r.e2e_avg_ms,
            r.e2e_p50_ms,
            r.e2e_p99_ms,
            r.read_bytes,
            r.disk_read_bytes,
            r.disk_written_bytes,
            r.chunks_read,
            r.chunks_recomputed,
            r.recompute_share,
            r.sync_reclaims,
            r.unwritten_reclaims,
            r.reclaims,
            r.faults,
            r.writes,
            r.peak_memory_bytes,
            r.peak_rss_bytes,
            r.start_ms,
            r.secs
        )?;
    }
    f.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reading_switch_is_held_against_its_own_bound() {
        // The disk reads 1 MiB a millisecond.
        let disk_bps = f64::from(1 << 20) * 1e3;
        let call = |start, switched, switch_ms, mib: u64| CallRecord {
            context: 0,
            start,
            switched,
            switch_ms,
            queue_ms: 0.0,
            load_ms: switch_ms,
            io_ms: switch_ms,
            recompute_ms: 0.0,
            e2e_ms: switch_ms,
            chunks_missing: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            read_bytes: mib << 20,
            tokens: 1,
            context_tokens: 1,
            error: None,
            restore_wall_ms: None,
        };
        let log = vec![
            call(false, true, 1.2, 1),
            call(false, true, 3.0, 2),
            call(false, true, 1.0, 1),
            // Not counted: a switch that read nothing, a start, a call to the same context.
            call(false, true, 0.2, 0),
            call(true, true, 9.0, 1),
            call(false, false, 9.0, 1),
        ];
        let budget = Budget {
            bytes: 1,
            contexts: None,
        };
        let r = summarize("llms", budget, 8, log, None, disk_bps);
        assert_eq!(r.reading_switches, 3);
        assert_eq!(r.within_bound_target, 2);
        assert!(
            (r.disk_bound_ratio_max - 1.5).abs() < 1e-9,
            "{}",
            r.disk_bound_ratio_max
        );
        assert!(
            (r.disk_bound_ratio - 3.7 / 3.0).abs() < 1e-9,
            "{}",
            r.disk_bound_ratio
        );
        // A throttle slower than the disk is the bound's speed.
        let log = vec![call(false, true, 1.2, 1)];
        let r = summarize("llms", budget, 8, log, Some(1 << 19), disk_bps);
        assert!((r.disk_bound_ratio_max - 1.2 / 2000.0).abs() < 1e-9);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    fn run_of(contexts: usize, avg: f64, errors: usize) -> Run {
        Run {
            manager: "llms".into(),
            daemon_manager: "llms".into(),
            budget: Budget {
                bytes: 1,
                contexts: None,
            },
            contexts,
            calls: 1,
            answered: 1,
            errors,
            starts: 0,
            switches: 1,
            switch_avg_ms: avg,
            switch_p50_ms: avg,
            switch_p99_ms: avg,
            switch_max_ms: avg,
            e2e_avg_ms: 0.0,
            e2e_p50_ms: 0.0,
            e2e_p99_ms: 0.0,
            read_bytes: 0,
            disk_read_bytes: 0,
            disk_written_bytes: 0,
            chunks_read: 0,
            chunks_recomputed: 0,
            recompute_share: 0.0,
            read_mib_s: 0.0,
            io_bound_ratio: 0.0,
            disk_bound_ratio: 0.0,
            disk_bound_ratio_max: 0.0,
            reading_switches: 0,
            within_bound_target: 0,
            sync_reclaims: 0,
            unwritten_reclaims: 0,
            reclaims: 0,
            faults: 0,
            writes: 0,
            peak_memory_bytes: 0,
            peak_rss_bytes: 0,
            start_ms: 0.0,
            secs: 0.0,
            slots: None,
            call_log: Vec::new(),
        }
    }

    #[test]
    fn max_active_is_the_largest_n_under_the_bound() {
        let runs = [
            run_of(2, 1.0, 0),
            run_of(4, 8.0, 0),
            run_of(6, 20.0, 0),
            run_of(8, 40.0, 0),
        ];
        let rs: Vec<&Run> = runs.iter().collect();
        assert_eq!(max_active(&rs, 10.0), 4);
        assert_eq!(max_active(&rs, 25.0), 6);
        assert_eq!(max_active(&rs, 0.5), 0);
        // A run with failed calls does not count, however fast.
        let runs = [run_of(2, 1.0, 0), run_of(4, 1.0, 3)];
        let rs: Vec<&Run> = runs.iter().collect();
        assert_eq!(max_active(&rs, 10.0), 2);
    }

    #[test]
    fn cut_keeps_the_first_contexts_rows() {
        let row = |context: u32| TraceRow {
            time: 0.0,
            app: "a".into(),
            context,
            source: bench::trace::Source::Sst2,
            start: false,
            tokens: 1,
            max_tokens: 1,
            context_tokens: 1,
            prompt: "x".into(),
        };
        let rows: Vec<TraceRow> = [0, 3, 1, 2, 0, 1].into_iter().map(row).collect();
        let ctx = |v: Vec<TraceRow>| v.iter().map(|r| r.context).collect::<Vec<_>>();
        assert_eq!(ctx(cut(&rows, 2, None)), [0, 1, 0, 1]);
        assert_eq!(ctx(cut(&rows, 2, Some(3))), [0, 1, 0]);
        assert_eq!(ctx(cut(&rows, 4, None)), [0, 3, 1, 2, 0, 1]);
    }
}
