//! The llama.cpp peer row of `llms bench switch`: the same trace replayed against
//! `llama-server` (a binary the user built, never part of this project's build or CI) doing the
//! best a llama.cpp user can do today to keep many contexts under a KV budget: one slot per
//! context that fits the budget's bytes, the least recently used slot's context saved to a file
//! (`--slot-save-path`) at the end of each call, and the called context's file restored into
//! the slot when it is not in one. The switch latency is the restore (`timings.restore_ms`),
//! read from a cold page cache, as the daemon's chunks are. docs/bench.md says how to read it.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use crate::trace::TraceRow;
use anyhow::{Context, bail, ensure};
use model::config::ModelConfig;
use strum::VariantArray;

use crate::switch::{Budget, CallRecord, Run, Sandbox, Setup};

/// llama.cpp's KV cache types compared: q8_0 (about the bytes of the service's int8 chunks) and
/// f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
pub enum KvType {
    #[strum(serialize = "q8_0")]
    Q8_0,
    #[strum(serialize = "f16")]
    F16,
}

impl KvType {
    /// The name `llama-server --cache-type-k` takes.
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The row's name in the report.
    pub fn row(self) -> &'static str {
        match self {
            KvType::Q8_0 => "llama.cpp",
            KvType::F16 => "llama.cpp-f16",
        }
    }

    /// Bytes of `values` K or V values in llama.cpp's cache: q8_0 blocks are 32 int8 values
    /// and one f16 scale (34 bytes).
    fn bytes(self, values: usize) -> u64 {
        match self {
            KvType::Q8_0 => values.div_ceil(32) as u64 * 34,
            KvType::F16 => values as u64 * 2,
        }
    }

    /// KV bytes of one token, all layers, keys and values.
    pub fn token_bytes(self, cfg: &ModelConfig) -> u64 {
        cfg.n_layers as u64 * 2 * self.bytes(cfg.n_kv_heads * cfg.head_dim)
    }
}

impl std::str::FromStr for KvType {
    type Err = String;

    fn from_str(s: &str) -> Result<KvType, String> {
        let s = s.trim();
        KvType::VARIANTS
            .iter()
            .copied()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = KvType::VARIANTS.iter().map(|t| t.name()).collect();
                format!(
                    "no llama.cpp KV type {s:?}: the types compared are {}",
                    names.join(", ")
                )
            })
    }
}

/// How many slots of `cap` tokens fit `budget` bytes of KV at `token_bytes` a token: the
/// contexts llama.cpp holds at once under the same budget as the service (0: not one).
pub fn slots_for(budget: u64, cap: u32, token_bytes: u64) -> usize {
    let slot = u64::from(cap) * token_bytes;
    if slot == 0 {
        return 0;
    }
    usize::try_from(budget / slot).unwrap_or(usize::MAX)
}

/// Where a call runs: the slot, whether its context was already there, and the context that
/// held the slot before (now evicted: it was saved at the end of its last call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub slot: usize,
    pub hit: bool,
    pub evicted: Option<u32>,
}

/// The slots' contexts, least recently used evicted first (an empty slot before any).
#[derive(Debug)]
pub struct SlotLru {
    /// Per slot: its context and the tick of its last use.
    slots: Vec<Option<(u32, u64)>>,
    tick: u64,
}

impl SlotLru {
    pub fn new(n: usize) -> SlotLru {
        SlotLru {
            slots: vec![None; n],
            tick: 0,
        }
    }

    /// The slot for a call to `context`, marked as its most recent use.
    pub fn place(&mut self, context: u32) -> Placement {
        self.tick += 1;
        let found = self
            .slots
            .iter()
            .position(|s| s.is_some_and(|(c, _)| c == context));
        let (slot, hit) = match found {
            Some(i) => (i, true),
            None => {
                let i = self
                    .slots
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, s)| s.map_or(0, |(_, t)| t))
                    .map_or(0, |(i, _)| i);
                (i, false)
            }
        };
        let evicted = if hit {
            None
        } else {
            self.slots[slot].map(|(c, _)| c)
        };
        self.slots[slot] = Some((context, self.tick));
        Placement { slot, hit, evicted }
    }

    /// Forgets `context`'s slot (its call failed: what the slot holds is unknown).
    pub fn forget(&mut self, context: u32) {
        for s in &mut self.slots {
            if s.is_some_and(|(c, _)| c == context) {
                *s = None;
            }
        }
    }
}

/// The body of a `/completion` request: the context's whole text as the prompt, run in `slot`
/// reusing what the slot holds, greedy, at most `n_predict` tokens.
pub fn completion_body(text: &str, slot: usize, n_predict: u32) -> String {
    serde_json::json!({
        "prompt": text,
        "id_slot": slot,
        "cache_prompt": true,
        "n_predict": n_predict,
        "temperature": 0.0,
        "stream": false,
    })
    .to_string()
}

/// The body of a slot save or restore.
pub fn slot_body(filename: &str) -> String {
    serde_json::json!({ "filename": filename }).to_string()
}

/// A context's slot file under --slot-save-path.
fn slot_file(context: u32) -> String {
    format!("context-{context}.bin")
}

/// One HTTP/1.1 request to llama-server on a fresh connection (`Connection: close`), and its
/// status and body. Plain `std` TCP rather than an HTTP crate: the workspace has none, the
/// server is on loopback, and the three requests used need no more than a Content-Length body
/// (or a chunked one, decoded by [`parse_response`]).
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .with_context(|| format!("cannot connect to llama-server at {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    s.set_nodelay(true)?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading llama-server's answer to {method} {path}"))?;
    parse_response(&raw)
}

/// An HTTP/1.1 response's status and body (Content-Length, chunked, or to the end).
pub fn parse_response(raw: &[u8]) -> anyhow::Result<(u16, String)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("an HTTP response without the end of its headers")?;
    let head = std::str::from_utf8(&raw[..end]).context("HTTP headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .with_context(|| format!("not an HTTP status line: {:?}", head.lines().next()))?;
    let mut length = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let v = v.trim();
        if k.eq_ignore_ascii_case("content-length") {
            length = Some(v.parse::<usize>().context("a bad Content-Length")?);
        } else if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        let mut out = Vec::new();
        let mut at = rest;
        loop {
            let eol = at
                .windows(2)
                .position(|w| w == b"\r\n")
                .context("a chunk without its size line")?;
            let size = std::str::from_utf8(&at[..eol])?
                .split(';')
                .next()
                .map(str::trim)
                .and_then(|h| usize::from_str_radix(h, 16).ok())
                .context("a bad chunk size")?;
            at = &at[eol + 2..];
            if size == 0 {
                break;
            }
            ensure!(at.len() >= size + 2, "a chunked body cut short");
            out.extend_from_slice(&at[..size]);
            at = &at[size + 2..];
        }
        out
    } else if let Some(n) = length {
        ensure!(
            rest.len() >= n,
            "a body cut short: {} of {n} bytes",
            rest.len()
        );
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok((
        status,
        String::from_utf8(body).context("a body that is not UTF-8")?,
    ))
}

/// A JSON answer of llama-server, or its error.
fn call_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<Result<serde_json::Value, String>> {
    let (status, text) = request(addr, method, path, body)?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("llama-server answered {method} {path} with no JSON: {text:?}"))?;
    if status == 200 {
        Ok(Ok(v))
    } else {
        let msg = v
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .map_or_else(|| text.clone(), str::to_owned);
        Ok(Err(format!("HTTP {status}: {msg}")))
    }
}

/// Writes `path`'s dirty pages and drops its pages from the page cache, so that the next read
/// of it comes from the disk (the service reads its chunks with O_DIRECT).
fn drop_cached(path: &Path) -> anyhow::Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    f.sync_data()?;
    nix::fcntl::posix_fadvise(
        f.as_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .with_context(|| format!("cannot drop {} from the page cache", path.display()))?;
    Ok(())
}

/// A running llama-server; killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(
        exe: &Path,
        args: &[String],
        cgroups: &[PathBuf],
        log: &Path,
    ) -> anyhow::Result<(Server, f64)> {
        let t = Instant::now();
        // A free port: bound by the kernel, released for the server to take.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let out = std::fs::File::create(log)?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // Its libraries are beside it in a llama.cpp build tree.
        if let Some(dir) = exe.parent() {
            let mut path = std::ffi::OsString::from(dir);
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                path.push(":");
                path.push(old);
            }
            cmd.env("LD_LIBRARY_PATH", path);
        }
        let child = crate::daemon_proc::spawn_in(&mut cmd, cgroups)
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let mut server = Server { child, addr };
        loop {
            if let Some(status) = server.child.try_wait()? {
                let tail = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                bail!(
                    "llama-server exited ({status}) before it was ready; its log ends: {:?}",
                    tail.into_iter().rev().collect::<Vec<_>>()
                );
            }
            if let Ok((200, _)) = request(addr, "GET", "/health", "") {
                break;
            }
            ensure!(
                t.elapsed() < Duration::from_secs(120),
                "llama-server not ready after 2 minutes (its log: {})",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok((server, t.elapsed().as_secs_f64() * 1e3))
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        if self.child.try_wait()?.is_none() {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            )?;
            let t = Instant::now();
            while self.child.try_wait()?.is_none() {
                if t.elapsed() > Duration::from_secs(10) {
                    self.child.kill()?;
                    self.child.wait()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The llama.cpp row: which llama-server, the model's shape (a token's KV bytes) and the KV
/// type.
pub struct Peer<'a> {
    pub exe: &'a Path,
    pub cfg: &'a ModelConfig,
    pub kv: KvType,
}

/// Replays `rows` against a fresh llama-server with the peer's KV type, as many slots of the
/// trace's cap as fit `budget`.
pub fn replay(
    s: &Setup<'_>,
    peer: &Peer<'_>,
    budget: Budget,
    contexts: usize,
    rows: &[TraceRow],
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<Run> {
    let kv = peer.kv;
    let n = slots_for(budget.bytes, s.max_context, kv.token_bytes(peer.cfg));
    ensure!(
        n > 0,
        "{}: not one slot of {} tokens ({} bytes of {} KV) fits the budget of {}",
        kv.row(),
        s.max_context,
        u64::from(s.max_context) * kv.token_bytes(peer.cfg),
        kv.name(),
        budget.label()
    );
    static REPLAYS: AtomicUsize = AtomicUsize::new(0);
    let sandbox = Sandbox::create(s, "llms-peer", &REPLAYS)?;
    let slots_dir = sandbox.dir.join("slots");
    std::fs::create_dir_all(&slots_dir)
        .with_context(|| format!("cannot create {}", slots_dir.display()))?;
    let t0 = Instant::now();
    let (mut server, start_ms) = Server::start(
        peer.exe,
        &server_args(s, kv, n, &slots_dir),
        &sandbox.cgroups(),
        &sandbox.dir.join("llama-server.log"),
    )?;
    let mut calls = PeerCalls {
        addr: server.addr,
        kv,
        slots_dir,
        lru: SlotLru::new(n),
        texts: vec![String::new(); contexts],
        saved: vec![false; contexts],
        previous: None,
        evictions: 0,
        saves: 0,
    };
    let mut log = Vec::with_capacity(rows.len());
    for row in rows {
        log.push(calls.call(row)?);
        progress.inc(1);
    }
    let secs = t0.elapsed().as_secs_f64();
    let (disk_read_bytes, disk_written_bytes) = sandbox.blkio.io_bytes(s.device)?;
    let peak_rss_bytes = crate::switch::peak_rss(server.child.id());
    server.stop()?;
    drop(server);
    let peak_memory_bytes = sandbox.remove()?;
    let mut run = crate::switch::summarize(kv.row(), budget, contexts, log, s.read_bps, s.disk_bps);
    run.daemon_manager = kv.row().to_owned();
    run.disk_read_bytes = disk_read_bytes;
    run.disk_written_bytes = disk_written_bytes;
    run.reclaims = calls.evictions;
    run.writes = calls.saves;
    run.peak_memory_bytes = peak_memory_bytes;
    run.peak_rss_bytes = peak_rss_bytes;
    run.start_ms = start_ms;
    run.secs = secs;
    run.slots = Some(n);
    Ok(run)
}

/// llama-server's arguments: the model, `slots` slots of the trace's cap each, KV of type
/// `kv`, slot files under `slots_dir`, nothing kept outside the slots.
fn server_args(s: &Setup<'_>, kv: KvType, slots: usize, slots_dir: &Path) -> Vec<String> {
    let threads = s.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    [
        "--model",
        &s.model.display().to_string(),
        "--threads",
        &threads.to_string(),
        "--threads-batch",
        &threads.to_string(),
        "--parallel",
        &slots.to_string(),
        "--ctx-size",
        &(slots * s.max_context as usize).to_string(),
        // One slot per context: each slot holds --ctx-size / --parallel tokens, no more.
        "--no-kv-unified",
        "--cache-type-k",
        kv.name(),
        "--cache-type-v",
        kv.name(),
        "--flash-attn",
        "on",
        // No host-memory prompt cache: it would keep contexts outside the KV budget.
        "--cache-ram",
        "0",
        "--slot-save-path",
        &slots_dir.display().to_string(),
        "--no-webui",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

/// A restore's figures: llama-server's own `restore_ms`, the harness's clock around the
/// request, and the bytes it read.
#[derive(Clone, Copy, Debug)]
struct Restore {
    ms: f64,
    wall_ms: f64,
    bytes: u64,
}

/// The calls of one llama.cpp replay: which context each slot holds, each context's text so
/// far, and which contexts' last state is in their slot file.
struct PeerCalls {
    addr: SocketAddr,
    kv: KvType,
    slots_dir: PathBuf,
    lru: SlotLru,
    texts: Vec<String>,
    /// Contexts whose last call's state is in their slot file.
    saved: Vec<bool>,
    /// The previous call's context.
    previous: Option<u32>,
    /// Contexts evicted from their slot, and slots saved.
    evictions: u64,
    saves: u64,
}

impl PeerCalls {
    /// One call: its context brought into a slot (restored from its file, or the slot erased
    /// for a start), the completion, and the slot saved. A request llama-server refused is a
    /// failed call's record; a server gone, or a save refused, is an error.
    fn call(&mut self, row: &TraceRow) -> anyhow::Result<CallRecord> {
        let k = row.context as usize;
        let switched = self.previous.is_some_and(|p| p != row.context);
        self.previous = Some(row.context);
        if row.start {
            self.texts[k].clear();
            self.saved[k] = false;
        }
        let place = self.lru.place(row.context);
        self.evictions += u64::from(place.evicted.is_some());
        let t = Instant::now();
        let restore = if place.hit {
            None
        } else {
            match self.switch_in(row.context, place.slot)? {
                Ok(restore) => restore,
                Err(e) => {
                    self.lru.forget(row.context);
                    let e2e = t.elapsed().as_secs_f64() * 1e3;
                    return Ok(CallRecord::failed(row, switched, e2e, e));
                }
            }
        };
        self.texts[k].push_str(&row.prompt);
        let body = completion_body(&self.texts[k], place.slot, row.max_tokens);
        let answer = call_json(self.addr, "POST", "/completion", &body)?;
        let e2e_ms = t.elapsed().as_secs_f64() * 1e3;
        let v = match answer {
            Ok(v) => v,
            Err(e) => {
                self.lru.forget(row.context);
                self.saved[k] = false;
                tracing::warn!(context = row.context, error = %e, "a completion failed");
                return Ok(CallRecord::failed(row, switched, e2e_ms, e));
            }
        };
        tracing::debug!(
            context = row.context,
            slot = place.slot,
            timings = %v.get("timings").unwrap_or(&serde_json::Value::Null),
            "completion"
        );
        let content = v.get("content").and_then(|c| c.as_str()).unwrap_or("");
        self.texts[k].push_str(content);
        self.save(row.context, place.slot)?;
        Ok(answered(row, switched, e2e_ms, restore, &v))
    }

    /// Brings `context` into `slot`: its file restored, from a cold page cache, when its last
    /// call was saved, else the slot erased (a start reuses nothing of the evicted context).
    /// The restore's figures, or why llama-server refused.
    fn switch_in(
        &self,
        context: u32,
        slot: usize,
    ) -> anyhow::Result<Result<Option<Restore>, String>> {
        let file = slot_file(context);
        let action = if self.saved[context as usize] {
            // Cold: the page cache was dropped after the save; again in case anything read it.
            drop_cached(&self.slots_dir.join(&file))?;
            "restore"
        } else {
            "erase"
        };
        let t = Instant::now();
        let path = format!("/slots/{slot}?action={action}");
        let answer = call_json(self.addr, "POST", &path, &slot_body(&file))?;
        let wall_ms = t.elapsed().as_secs_f64() * 1e3;
        match answer {
            Ok(v) if action == "restore" => {
                let ms = v
                    .pointer("/timings/restore_ms")
                    .and_then(serde_json::Value::as_f64)
                    .context("a restore without timings.restore_ms")?;
                let bytes = v.get("n_read").and_then(serde_json::Value::as_u64);
                Ok(Ok(Some(Restore {
                    ms,
                    wall_ms,
                    bytes: bytes.unwrap_or(0),
                })))
            }
            Ok(_) => Ok(Ok(None)),
            Err(e) => {
                tracing::warn!(context, error = %e, "a slot {action} failed");
                Ok(Err(format!("{action}: {e}")))
            }
        }
    }

    /// At the call's end, off the switch's path (as the service's ahead-of-time write-out): the
    /// slot is saved to `context`'s file, and the file leaves the page cache.
    fn save(&mut self, context: u32, slot: usize) -> anyhow::Result<()> {
        let file = slot_file(context);
        let path = format!("/slots/{slot}?action=save");
        match call_json(self.addr, "POST", &path, &slot_body(&file))? {
            Ok(_) => {
                drop_cached(&self.slots_dir.join(&file))?;
                self.saved[context as usize] = true;
                self.saves += 1;
                Ok(())
            }
            Err(e) => bail!("{}: saving slot {slot} failed: {e}", self.kv.row()),
        }
    }
}

/// An answered call's record: the restore as its switch (none when the context was in its
/// slot), the tokens from the completion's answer `v`.
fn answered(
    row: &TraceRow,
    switched: bool,
    e2e_ms: f64,
    restore: Option<Restore>,
    v: &serde_json::Value,
) -> CallRecord {
    let count = |key: &str| v.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
    let tokens = count("tokens_predicted");
    let evaluated = count("tokens_evaluated");
    let (switch_ms, bytes) = restore.map_or((0.0, 0), |r| (r.ms, r.bytes));
    CallRecord {
        context: row.context,
        start: row.start,
        switched,
        switch_ms,
        queue_ms: 0.0,
        load_ms: switch_ms,
        io_ms: switch_ms,
        recompute_ms: 0.0,
        e2e_ms,
        prefill_ms: 0.0,
        decode_ms: 0.0,
        end_ms: 0.0,
        chunks_missing: 0,
        chunks_read: 0,
        chunks_recomputed: 0,
        read_bytes: bytes,
        tokens,
        context_tokens: evaluated + tokens,
        error: None,
        restore_wall_ms: restore.map(|r| r.wall_ms),
    }
}

/// Which llama.cpp rows to run.
pub fn parse_kv_type(s: &str) -> Result<KvType, String> {
    s.parse()
}

/// `--llama-server PATH`: an executable file.
pub fn parse_exe(s: &str) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;
    let p = PathBuf::from(s);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {
            std::path::absolute(&p).map_err(|e| format!("{s}: {e}"))
        }
        Ok(_) => Err(format!("{s} is not an executable file")),
        Err(e) => Err(format!(
            "{s}: {e} (build llama.cpp with ../shared/tools/build-llamacpp.sh and give its \
             build/bin/llama-server)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm() -> ModelConfig {
        ModelConfig {
            arch: "llama".into(),
            n_layers: 30,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            hidden: 576,
            ffn: 1536,
            vocab: 49152,
            rope_base: 100_000.0,
            rope_dim: 64,
            rms_eps: 1e-5,
            max_ctx: 8192,
            family: model::config::Family::LLAMA,
            window: None,
            swa_pattern: 0,
            rope_base_local: 10_000.0,
            rope_freq_scale: 1.0,
        }
    }

    #[test]
    fn token_bytes_are_llama_cpp_cache_bytes() {
        // 30 layers, K and V, 192 values each: q8_0 is 6 blocks of 34 bytes, f16 2 bytes a value.
        assert_eq!(KvType::Q8_0.token_bytes(&smollm()), 30 * 2 * 6 * 34);
        assert_eq!(KvType::F16.token_bytes(&smollm()), 30 * 2 * 192 * 2);
    }

    #[test]
    fn slots_are_the_contexts_at_the_cap_that_fit_the_budget() {
        let check = |budget: u64, cap: u32, token: u64, expected: usize| {
            assert_eq!(
                slots_for(budget, cap, token),
                expected,
                "{budget} {cap} {token}"
            );
        };
        // The standard run: 2 contexts' worth of int8 slots (2 x 128 x 212 KiB) at a 2k cap.
        let two = 2 * 128 * 212 * 1024;
        check(two, 2048, KvType::Q8_0.token_bytes(&smollm()), 2);
        check(two, 2048, KvType::F16.token_bytes(&smollm()), 1);
        check(two / 2, 2048, KvType::Q8_0.token_bytes(&smollm()), 1);
        check(two / 2, 2048, KvType::F16.token_bytes(&smollm()), 0);
        check(100, 10, 10, 1);
        check(99, 10, 10, 0);
        check(1000, 10, 10, 10);
        check(1000, 0, 10, 0);
    }

    #[test]
    fn slots_go_to_the_least_recently_used() {
        let mut lru = SlotLru::new(2);
        let p = |slot, hit, evicted| Placement { slot, hit, evicted };
        assert_eq!(lru.place(0), p(0, false, None));
        assert_eq!(lru.place(1), p(1, false, None));
        assert_eq!(lru.place(0), p(0, true, None));
        assert_eq!(lru.place(2), p(1, false, Some(1)));
        assert_eq!(lru.place(0), p(0, true, None));
        assert_eq!(lru.place(1), p(1, false, Some(2)));
        assert_eq!(lru.place(3), p(0, false, Some(0)));
        lru.forget(1);
        assert_eq!(lru.place(4), p(1, false, None));
        let mut one = SlotLru::new(1);
        assert_eq!(one.place(5), p(0, false, None));
        assert_eq!(one.place(5), p(0, true, None));
        assert_eq!(one.place(6), p(0, false, Some(5)));
    }

    #[test]
    fn slot_lru_matches_an_oracle() {
        // The oracle: a list of contexts, most recent last, at most n long.
        let mut state = 7u64;
        for n in 1..4 {
            let mut lru = SlotLru::new(n);
            let mut order: Vec<u32> = Vec::new();
            for _ in 0..500 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let c = (state >> 33) as u32 % 6;
                let p = lru.place(c);
                let hit = order.contains(&c);
                assert_eq!(p.hit, hit);
                let evicted = if !hit && order.len() == n {
                    Some(order.remove(0))
                } else {
                    None
                };
                assert_eq!(p.evicted, evicted);
                order.retain(|&x| x != c);
                order.push(c);
            }
        }
    }

    #[test]
    fn request_bodies() {
        let v: serde_json::Value =
            serde_json::from_str(&completion_body("a \"b\"\n", 3, 16)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"prompt": "a \"b\"\n", "id_slot": 3, "cache_prompt": true,
                               "n_predict": 16, "temperature": 0.0, "stream": false})
        );
        assert_eq!(
            slot_body("context-2.bin"),
            r#"{"filename":"context-2.bin"}"#
        );
        assert_eq!(slot_file(7), "context-7.bin");
    }

    #[test]
    fn responses_are_parsed() {
        let check = |raw: &str, status: u16, body: &str| {
            assert_eq!(
                parse_response(raw.as_bytes()).unwrap(),
                (status, body.to_owned())
            );
        };
        check("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 200, "{}");
        check(
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\nX: y\r\n\r\nabcdef",
            400,
            "abc",
        );
        check(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
            200,
            "abcde",
        );
        check("HTTP/1.1 200 OK\r\n\r\nto the end", 200, "to the end");
        let err = |raw: &str, says: &str| {
            let e = parse_response(raw.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(says), "{raw:?}: {e}");
        };
        err("HTTP/1.1 200 OK\r\n", "end of its headers");
        err(
            "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc",
            "cut short",
        );
        err("garbage\r\n\r\n", "status line");
        err(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "chunk size",
        );
    }

    #[test]
    fn kv_types_parse() {
        assert_eq!(parse_kv_type("q8_0"), Ok(KvType::Q8_0));
        assert_eq!(parse_kv_type("f16"), Ok(KvType::F16));
        assert!(parse_kv_type("q4_0").unwrap_err().contains("q8_0, f16"));
    }
}
