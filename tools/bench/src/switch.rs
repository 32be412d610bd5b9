//! The switch benchmark's mechanism: replay a trace against a real `llms serve` under a KV
//! budget inside cgroup v1 memory and blkio groups, and sum each replay up (switches, latency,
//! bytes read against the disk's bound, the daemon's and the cgroups' figures). `llms bench
//! switch` (tools) parses its arguments, runs the replays and prints; docs/bench.md shows a run.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use anyhow::Context;
use protocol::PromptFormat;
use protocol::client::{CallParams, Client};

use crate::cgroup::{Device, Group};
use crate::daemon_proc::{Daemon, DaemonSpec};
use crate::trace::TraceRow;

/// Tokens per KV chunk: the service's default, which the budget in contexts assumes.
pub const CHUNK_TOKENS: usize = 16;

/// The target for each switch that reads: its latency at most this many times its I/O lower
/// bound (its bytes at the disk's bandwidth).
pub const BOUND_TARGET: f64 = 1.3;

/// The latency bounds of the paper's Fig. 10, milliseconds.
pub const BOUNDS_MS: [f64; 2] = [10.0, 25.0];

/// One KV budget of a run.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Budget {
    pub bytes: u64,
    /// The budget in contexts' worth, when given so.
    pub contexts: Option<f64>,
}

impl Budget {
    pub fn label(&self) -> String {
        match self.contexts {
            Some(c) => format!(
                "{c} ctx ({:.1} MiB)",
                self.bytes as f64 / f64::from(1 << 20)
            ),
            None => format!("{:.1} MiB", self.bytes as f64 / f64::from(1 << 20)),
        }
    }

    /// The x of the budget plots: contexts' worth, else MiB.
    pub fn x(&self) -> f64 {
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
    /// The rest of the call in the daemon (`done`'s timings; 0 for the llama.cpp row): its
    /// prefill, its decode, and its end after the last token (densities, recompression, the
    /// write-out queued), ms.
    #[serde(default)]
    pub prefill_ms: f64,
    #[serde(default)]
    pub decode_ms: f64,
    #[serde(default)]
    pub end_ms: f64,
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
    pub fn failed(row: &TraceRow, switched: bool, e2e_ms: f64, error: String) -> CallRecord {
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
            prefill_ms: 0.0,
            decode_ms: 0.0,
            end_ms: 0.0,
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
    /// The daemons' tokens per chunk (`--chunk-tokens`); `None`: the model's.
    #[serde(default)]
    pub chunk_tokens: Option<usize>,
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
pub struct Setup<'a> {
    pub model: &'a Path,
    pub scratch: &'a Path,
    pub device: Device,
    pub read_bps: Option<u64>,
    pub write_bps: Option<u64>,
    /// The scratch disk's `O_DIRECT` read bandwidth, bytes/s (the I/O lower bound's).
    pub disk_bps: f64,
    pub max_context: u32,
    pub apps_contexts: usize,
    pub threads: Option<usize>,
    /// `None`: the model's.
    pub chunk_tokens: Option<usize>,
    pub drain: bool,
}

/// The `n`-th percentile (nearest rank) of sorted `v`.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let k = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[k - 1]
}

pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The daemon's peak resident set, from /proc/PID/status.
pub fn peak_rss(pid: u32) -> u64 {
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
pub fn drain(c: &mut Client) -> anyhow::Result<()> {
    let t = Instant::now();
    while c.stats()?.service.writes_queued > 0 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A replay's own scratch directory and cgroup v1 memory and blkio groups (the blkio group
/// throttled as the setup says), under a name no earlier replay of this process used: a group
/// left behind (its removal failed) never lends its peak or its byte counts to the next replay.
pub struct Sandbox {
    pub dir: PathBuf,
    pub memory: Group,
    pub blkio: Group,
}

impl Sandbox {
    /// Makes `<scratch>/<prefix>-<pid>-<nth>` afresh and the groups of that name, `nth` counted
    /// by `replays`.
    pub fn create(s: &Setup<'_>, prefix: &str, replays: &AtomicUsize) -> anyhow::Result<Sandbox> {
        let nth = replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{prefix}-{}-{nth}", std::process::id());
        let dir = s.scratch.join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let memory = Group::create("memory", &name)?;
        let blkio = Group::create("blkio", &name)?;
        blkio.throttle(s.device, s.read_bps, s.write_bps)?;
        Ok(Sandbox { dir, memory, blkio })
    }

    /// The groups' directories, for the replayed server to start in.
    pub fn cgroups(&self) -> Vec<PathBuf> {
        vec![self.memory.path().to_owned(), self.blkio.path().to_owned()]
    }

    /// Once the server has stopped: the memory group's peak, then the groups and the directory
    /// removed.
    pub fn remove(self) -> anyhow::Result<u64> {
        let peak = self.memory.peak_memory()?;
        let Sandbox { dir, memory, blkio } = self;
        drop((memory, blkio));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(peak)
    }
}

/// The daemon of one replay: `manager` under `budget`, in the sandbox's directory and groups.
fn daemon_spec(s: &Setup<'_>, manager: &str, budget: Budget, sandbox: &Sandbox) -> DaemonSpec {
    let mut spec = DaemonSpec::new(s.model, &sandbox.dir);
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
    if let Some(c) = s.chunk_tokens {
        spec.args.extend(["--chunk-tokens".into(), c.to_string()]);
    }
    spec.cgroups = sandbox.cgroups();
    spec
}

/// Replays `rows` against a fresh daemon running `manager` under `budget`.
pub fn replay(
    s: &Setup<'_>,
    manager: &str,
    budget: Budget,
    contexts: usize,
    rows: &[TraceRow],
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Run> {
    static REPLAYS: AtomicUsize = AtomicUsize::new(0);
    let sandbox = Sandbox::create(s, "llms-switch", &REPLAYS)?;
    let spec = daemon_spec(s, manager, budget, &sandbox);
    let t0 = Instant::now();
    let (mut daemon, start_ms) =
        Daemon::start(&spec).with_context(|| format!("starting llms serve --manager {manager}"))?;
    let socket = spec.socket();
    let mut calls = Calls {
        socket: &socket,
        manager,
        clients: BTreeMap::new(),
        ids: vec![None; contexts],
        previous: None,
    };
    let mut log = Vec::with_capacity(rows.len());
    for row in rows {
        log.push(calls.call(row, s.drain)?);
        progress.inc(1);
    }
    let secs = t0.elapsed().as_secs_f64();
    let stats = calls.stats()?;
    let (disk_read_bytes, disk_written_bytes) = sandbox.blkio.io_bytes(s.device)?;
    let peak_rss_bytes = peak_rss(daemon.pid());
    drop(calls);
    daemon.term()?;
    let peak_memory_bytes = sandbox.remove()?;

    let mut run = summarize(manager, budget, contexts, log, s.read_bps, s.disk_bps);
    add_daemon_stats(&mut run, &stats);
    run.disk_read_bytes = disk_read_bytes;
    run.disk_written_bytes = disk_written_bytes;
    run.peak_memory_bytes = peak_memory_bytes;
    run.peak_rss_bytes = peak_rss_bytes;
    run.start_ms = start_ms;
    run.secs = secs;
    Ok(run)
}

/// The calls of one replay: a connection per app, made at its first call, and the daemon's id
/// of each of the trace's contexts.
struct Calls<'a> {
    socket: &'a Path,
    manager: &'a str,
    clients: BTreeMap<String, Client>,
    ids: Vec<Option<u64>>,
    /// The previous call's context.
    previous: Option<u32>,
}

impl Calls<'_> {
    /// Sends `row`'s call on its app's connection (its context made first, or deleted and made
    /// again when the row restarts it) and records what came back; with `drain`, then waits for
    /// the daemon's ahead-of-time writes. A call the daemon refused is a record; a connection
    /// or daemon gone is an error.
    fn call(&mut self, row: &TraceRow, drain_after: bool) -> anyhow::Result<CallRecord> {
        let c = client(&mut self.clients, self.socket, &row.app)?;
        let id = context_id(c, &mut self.ids[row.context as usize], row)?;
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
        let switched = self.previous.is_some_and(|p| p != row.context);
        self.previous = Some(row.context);
        let manager = self.manager;
        let record = match answer {
            Ok(a) => answered(row, switched, e2e_ms, &a.done),
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
        if drain_after {
            drain(c)?;
        }
        Ok(record)
    }

    /// The daemon's figures at the replay's end, asked on any connection (a new one when no
    /// call was made).
    fn stats(&mut self) -> anyhow::Result<protocol::ServiceStats> {
        Ok(match self.clients.values_mut().next() {
            Some(c) => c.stats()?.service,
            None => Client::connect(self.socket, "bench")?.stats()?.service,
        })
    }
}

/// `app`'s connection, made at its first call.
fn client<'c>(
    clients: &'c mut BTreeMap<String, Client>,
    socket: &Path,
    app: &str,
) -> anyhow::Result<&'c mut Client> {
    Ok(match clients.entry(app.to_owned()) {
        std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::btree_map::Entry::Vacant(e) => {
            e.insert(Client::connect(socket, app).with_context(|| format!("connecting as {app}"))?)
        }
    })
}

/// The daemon's id of `row`'s context: made at its first call, deleted and made again when the
/// row starts its conversation over.
fn context_id(c: &mut Client, id: &mut Option<u64>, row: &TraceRow) -> anyhow::Result<u64> {
    if row.start || id.is_none() {
        if let Some(old) = id.take() {
            c.delete(old)
                .with_context(|| format!("deleting context {} to restart it", row.context))?;
        }
        *id = Some(c.new_context(None, PromptFormat::Raw)?);
    }
    id.context("a context without an id")
}

/// An answered call's record, from its `done`.
fn answered(row: &TraceRow, switched: bool, e2e_ms: f64, done: &protocol::Done) -> CallRecord {
    CallRecord {
        context: row.context,
        start: row.start,
        switched,
        switch_ms: done.timings.switch_ms,
        queue_ms: done.timings.queue_ms,
        load_ms: done.timings.load_ms,
        io_ms: done.timings.io_ms,
        recompute_ms: done.timings.recompute_ms,
        e2e_ms,
        prefill_ms: done.timings.prefill_ms,
        decode_ms: done.timings.decode_ms,
        end_ms: done.timings.end_ms.unwrap_or(0.0),
        chunks_missing: done.chunks.missing,
        chunks_read: done.chunks.read,
        chunks_recomputed: done.chunks.recomputed,
        read_bytes: done.chunks.read_bytes,
        tokens: done.tokens,
        context_tokens: done.context_tokens,
        error: None,
        restore_wall_ms: None,
    }
}

/// The daemon's own counters into `run`: the manager it ran, chunks read and recomputed, and
/// its reclaims, faults and writes.
fn add_daemon_stats(run: &mut Run, stats: &protocol::ServiceStats) {
    let brought = stats.chunks_read + stats.chunks_recomputed;
    run.daemon_manager = stats.manager.clone();
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
}

/// A replay's figures from its calls: switches (calls to another context than the previous
/// call's, not starts) and their latency, every answered call's end-to-end latency, bytes read
/// and the I/O bound; the daemon's and the cgroups' figures are left at zero for the caller.
pub fn summarize(
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

/// The rows of the first `n` contexts, at most `calls` of them.
pub fn cut(rows: &[TraceRow], n: usize, calls: Option<usize>) -> Vec<TraceRow> {
    rows.iter()
        .filter(|r| (r.context as usize) < n)
        .take(calls.unwrap_or(usize::MAX))
        .cloned()
        .collect()
}

/// The largest n of `runs` (one manager, one budget) whose average switch latency is under
/// `bound_ms` with every call answered; 0 when none.
pub fn max_active(runs: &[&Run], bound_ms: f64) -> usize {
    runs.iter()
        .filter(|r| r.errors == 0 && r.switch_avg_ms < bound_ms)
        .map(|r| r.contexts)
        .max()
        .unwrap_or(0)
}

pub fn write_csv(path: &Path, runs: &[Run]) -> anyhow::Result<()> {
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
