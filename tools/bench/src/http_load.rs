//! `llms bench http-load`: many clients streaming chat completions over the OpenAI HTTP API's
//! TCP listener at once, for a while, against a daemon this bench starts (`daemon_proc`) with a
//! key per app. Each client holds one keep-alive connection and talks in closed loop: a
//! conversation of a few turns, each turn streamed (SSE) and read to its `[DONE]`, then a new
//! conversation, until the time is up.
//!
//! The apps are of unequal size on purpose: app 0 has half the clients, the others share the
//! rest. A first-come queue would serve each app in proportion to its clients; the daemon's queue
//! takes the apps in turn, so each should get an equal share of the streams whatever its size.
//! The report says both, with Jain's index of the shares (1 is equal), and whether every stream
//! completed, the first-token and whole-stream latencies, and the daemon's memory over the run
//! (sampled from /proc).
//!
//! The HTTP client is written by hand (HTTP/1.1, chunked bodies, server-sent events) so that
//! 64 of them are 64 threads of this process, and no client library is measured with them;
//! `tests/tests/http.rs` drives the same load with the real `openai` client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::daemon_proc::{Daemon, DaemonSpec};
use crate::switch::percentile;

/// What to run.
#[derive(Debug, Clone)]
pub struct HttpLoadSpec {
    /// The GGUF model.
    pub model: PathBuf,
    /// A scratch directory for the daemon (store, sockets, mount, key file).
    pub dir: PathBuf,
    pub clients: usize,
    pub apps: usize,
    /// How long clients start new streams.
    pub seconds: f64,
    /// Turns of each conversation before a client starts another.
    pub turns: usize,
    /// Tokens each answer streams (at most).
    pub max_tokens: usize,
    /// Engine threads of the daemon.
    pub threads: Option<usize>,
    /// The daemon's KV budget (`--kv-budget`), if not its default.
    pub kv_budget: Option<String>,
}

/// A set of durations, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Spread {
    pub median_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Spread {
        v.sort_by(f64::total_cmp);
        Spread {
            median_ms: percentile(&v, 0.5),
            p99_ms: percentile(&v, 0.99),
            max_ms: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// One app's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AppFigures {
    pub app: String,
    pub clients: usize,
    /// Streams that completed.
    pub streams: usize,
    /// Content tokens they streamed.
    pub tokens: u64,
    /// Of its streams, those that ended while every client still started new ones.
    pub streams_in_window: usize,
    /// Its share of the streams that ended then.
    pub share: f64,
    /// The share a first-come queue would give it (its share of the clients).
    pub clients_share: f64,
    pub first_token: Spread,
}

/// The daemon's resident memory over the run, in MiB.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Memory {
    /// When the clients started (after the warm-up).
    pub start_mib: f64,
    /// The most sampled while they ran (every 100 ms).
    pub peak_mib: f64,
    pub end_mib: f64,
    /// The kernel's high-water mark since the daemon started (VmHWM).
    pub hwm_mib: f64,
    /// The daemon's KV budget, and what it held resident at the end.
    pub kv_budget_mib: f64,
    pub kv_resident_mib: f64,
    /// Contexts it held at the end, and the chunks it read back and recomputed over the run.
    pub contexts: usize,
    pub chunks_read: u64,
    pub chunks_recomputed: u64,
}

/// The figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HttpLoadReport {
    pub clients: usize,
    /// How long clients started new streams, and until the last stream ended.
    pub window_s: f64,
    pub seconds: f64,
    pub max_tokens: usize,
    pub turns: usize,
    pub apps: Vec<AppFigures>,
    /// Streams completed, and those that did not (an error status, a dropped connection, a
    /// stream without its finish reason, usage or `[DONE]`).
    pub completed: usize,
    pub incomplete: usize,
    /// Of the incomplete, those refused as busy (429).
    pub busy: usize,
    /// The first few reasons streams did not complete.
    pub failures: Vec<String>,
    /// Jain's index of the apps' shares of the streams (1: equal), and what a first-come queue
    /// would give (the index of their clients' shares).
    pub fairness: f64,
    pub first_come_fairness: f64,
    pub first_token: Spread,
    pub stream: Spread,
    /// Content tokens streamed per second, over all clients.
    pub tokens_per_s: f64,
    /// Turns whose context was continued (`cached_tokens` > 0), of the turns after a first.
    pub continued: usize,
    pub later_turns: usize,
    pub memory: Memory,
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has everything.
pub fn jain(x: &[f64]) -> f64 {
    let (s, q) = x.iter().fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
    if q == 0.0 {
        1.0
    } else {
        s * s / (x.len() as f64 * q)
    }
}

/// How `clients` are spread over `apps`: app 0 has half (rounded up), the rest share the rest.
pub fn clients_per_app(clients: usize, apps: usize) -> Vec<usize> {
    if apps == 1 {
        return vec![clients];
    }
    let first = clients.div_ceil(2);
    let rest = clients - first;
    let mut v = vec![first];
    v.extend((0..apps - 1).map(|i| rest / (apps - 1) + usize::from(i < rest % (apps - 1))));
    v
}

/// One stream as a client saw it.
#[derive(Debug, Clone)]
struct Stream {
    app: usize,
    /// Why it did not complete, if it did not.
    failed: Option<String>,
    busy: bool,
    tokens: u64,
    first_token_ms: f64,
    whole_ms: f64,
    /// Prompt tokens the daemon reported as cached (continued).
    cached: u64,
    turn: usize,
    /// When it ended.
    ended: Instant,
}

impl Stream {
    /// A stream of `app` started at `at`, nothing received yet.
    fn started(app: usize, at: Instant) -> Stream {
        Stream {
            app,
            failed: None,
            busy: false,
            tokens: 0,
            first_token_ms: 0.0,
            whole_ms: 0.0,
            cached: 0,
            turn: 0,
            ended: at,
        }
    }
}

/// One keep-alive connection to the TCP listener, with one app's key.
struct Conn {
    out: TcpStream,
    input: BufReader<TcpStream>,
    key: String,
}

impl Conn {
    fn connect(port: u16, key: &str) -> anyhow::Result<Conn> {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(600)))?;
        Ok(Conn {
            out: s.try_clone()?,
            input: BufReader::new(s),
            key: key.to_owned(),
        })
    }

    /// Sends a POST; returns the status and whether the body is chunked, or its length.
    fn post(&mut self, path: &str, body: &Value) -> anyhow::Result<(u16, Option<usize>)> {
        let body = body.to_string();
        write!(
            self.out,
            "POST {path} HTTP/1.1\r\nhost: llms\r\nauthorization: Bearer {}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            self.key,
            body.len()
        )?;
        let mut line = String::new();
        self.input.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("not an HTTP status line: {line:?}"))?;
        let mut length = None;
        loop {
            line.clear();
            self.input.read_line(&mut line)?;
            if line.trim_end().is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = Some(v.trim().parse()?);
            }
        }
        Ok((status, length))
    }

    /// The next piece of a chunked body; empty at its end.
    fn chunk(&mut self) -> anyhow::Result<Vec<u8>> {
        let mut line = String::new();
        self.input.read_line(&mut line)?;
        let size = usize::from_str_radix(line.trim(), 16)
            .with_context(|| format!("not a chunk size: {line:?}"))?;
        let mut data = vec![0; size + 2];
        self.input.read_exact(&mut data)?;
        data.truncate(size);
        Ok(data)
    }

    /// A whole body: by its length, or every chunk.
    fn body(&mut self, length: Option<usize>) -> anyhow::Result<Vec<u8>> {
        if let Some(n) = length {
            let mut b = vec![0; n];
            self.input.read_exact(&mut b)?;
            return Ok(b);
        }
        let mut b = Vec::new();
        loop {
            let c = self.chunk()?;
            if c.is_empty() {
                return Ok(b);
            }
            b.extend(c);
        }
    }
}

/// What a streamed answer said.
#[derive(Default)]
struct Streamed {
    text: String,
    tokens: u64,
    first_token: Option<Instant>,
    finish: bool,
    usage: Option<Value>,
    done: bool,
}

impl Streamed {
    /// Takes one server-sent event (`data: ...`).
    fn event(&mut self, e: &str) -> anyhow::Result<()> {
        let data = e
            .strip_prefix("data: ")
            .with_context(|| format!("not an SSE data line: {e:?}"))?;
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data)?;
        if let Some(c) = v["choices"].get(0) {
            if let Some(t) = c["delta"]["content"].as_str()
                && !t.is_empty()
            {
                self.text.push_str(t);
                self.tokens += 1;
                self.first_token.get_or_insert_with(Instant::now);
            }
            self.finish |= c["finish_reason"].is_string();
        }
        if v["usage"].is_object() {
            self.usage = Some(v["usage"].clone());
        }
        Ok(())
    }
}

/// One streamed turn on `conn`: how it went, and the answer's text if it completed.
fn turn(
    conn: &mut Conn,
    model: &str,
    messages: &[Value],
    max_tokens: usize,
) -> (Stream, Option<String>) {
    let t = Instant::now();
    let mut s = Stream::started(0, t);
    let body = json!({"model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let r = (|| -> anyhow::Result<Streamed> {
        let (status, length) = conn.post("/v1/chat/completions", &body)?;
        if status != 200 {
            let b = conn.body(length)?;
            s.busy = status == 429;
            bail!("{status}: {}", String::from_utf8_lossy(&b));
        }
        let (mut a, mut pending) = (Streamed::default(), String::new());
        loop {
            let c = conn.chunk()?;
            if c.is_empty() {
                break;
            }
            pending.push_str(std::str::from_utf8(&c)?);
            while let Some(end) = pending.find("\n\n") {
                a.event(&pending[..end])?;
                pending.drain(..end + 2);
            }
        }
        ensure!(
            pending.is_empty(),
            "a partial event at the end: {pending:?}"
        );
        ensure!(a.done, "no [DONE]");
        ensure!(a.finish, "no finish reason");
        ensure!(a.usage.is_some(), "no usage chunk");
        Ok(a)
    })();
    s.ended = Instant::now();
    s.whole_ms = (s.ended - t).as_secs_f64() * 1e3;
    let mut text = None;
    match r {
        Ok(a) => {
            s.tokens = a.tokens;
            s.first_token_ms = a
                .first_token
                .map_or(s.whole_ms, |f| (f - t).as_secs_f64() * 1e3);
            s.cached = a.usage.as_ref().map_or(0, |u| {
                u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0)
            });
            text = Some(a.text);
        }
        Err(e) => s.failed = Some(format!("{e:#}")),
    }
    (s, text)
}

/// One client: conversations of `turns` turns, in closed loop, until `stop`.
fn client(
    port: u16,
    key: &str,
    model: &str,
    (app, n): (usize, usize),
    spec: &HttpLoadSpec,
    stop: &AtomicBool,
) -> Vec<Stream> {
    let mut out = Vec::new();
    let mut conn = None;
    let mut conversation = 0;
    while !stop.load(Ordering::Relaxed) {
        let mut messages = Vec::new();
        for t in 0..spec.turns {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let c = match &mut conn {
                Some(c) => c,
                None => match Conn::connect(port, key) {
                    Ok(c) => conn.insert(c),
                    Err(e) => {
                        out.push(failed(app, format!("cannot connect: {e:#}")));
                        std::thread::sleep(Duration::from_millis(100));
                        break;
                    }
                },
            };
            messages.push(json!({"role": "user",
                "content": format!("App {app}, client {n}, conversation {conversation}, \
                                    turn {t}: name a colour and say why.")}));
            let (mut s, text) = turn(c, model, &messages, spec.max_tokens);
            s.app = app;
            s.turn = t;
            out.push(s);
            let Some(text) = text else {
                // The connection may be mid-answer: start over on a new one.
                conn = None;
                break;
            };
            messages.push(json!({"role": "assistant", "content": text}));
        }
        conversation += 1;
    }
    out
}

fn failed(app: usize, why: String) -> Stream {
    Stream {
        failed: Some(why),
        ..Stream::started(app, Instant::now())
    }
}

/// The resident memory of `pid` now (`VmRSS`) or at its peak (`VmHWM`), in MiB.
fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// A key for `app` of this uid, by `llms keys add` (this very executable).
fn add_key(keys: &std::path::Path, app: &str) -> anyhow::Result<String> {
    let uid = nix::unistd::getuid().as_raw();
    let out = Command::new(std::env::current_exe()?)
        .args([
            "keys",
            "add",
            "--uid",
            &uid.to_string(),
            "--app",
            app,
            "--file",
        ])
        .arg(keys)
        .output()?;
    ensure!(out.status.success(), "llms keys add: {out:?}");
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// The daemon with a key per app, listening on a free loopback port: it, its spec, the keys and
/// the port.
fn start(
    spec: &HttpLoadSpec,
    sizes: &[usize],
) -> anyhow::Result<(Daemon, DaemonSpec, Vec<String>, u16)> {
    let keys_file = spec.dir.join("http-keys");
    let keys: Vec<String> = (0..spec.apps)
        .map(|a| add_key(&keys_file, &format!("app{a}")))
        .collect::<anyhow::Result<_>>()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut d = DaemonSpec::new(&spec.model, &spec.dir);
    d.args = vec![
        "--http".into(),
        format!("127.0.0.1:{port}"),
        "--http-keys".into(),
        keys_file.display().to_string(),
        // Every client of an app may hold a context, and every client may wait in the queue:
        // what is measured is the queue's order, not these limits.
        "--max-contexts-per-app".into(),
        (sizes[0] + 1).to_string(),
        "--queue".into(),
        spec.clients.max(64).to_string(),
    ];
    if let Some(t) = spec.threads {
        d.args.extend(["--threads".into(), t.to_string()]);
    }
    if let Some(b) = &spec.kv_budget {
        d.args.extend(["--kv-budget".into(), b.clone()]);
    }
    let (daemon, _) = Daemon::start(&d)?;
    Ok((daemon, d, keys, port))
}

/// Runs the load: starts the daemon, warms each app (its first request reads the app's chat
/// contexts), runs the clients for `spec.seconds`, and sums up what they saw.
pub fn run(spec: &HttpLoadSpec) -> anyhow::Result<HttpLoadReport> {
    let sizes = clients_per_app(spec.clients, spec.apps);
    ensure!(
        sizes.iter().all(|&n| n > 0),
        "{} clients leave an app without any: give at least {} for {} apps (app 0 has half)",
        spec.clients,
        2 * spec.apps - 2,
        spec.apps
    );
    let (mut daemon, d, keys, port) = start(spec, &sizes)?;
    let model = spec
        .model
        .file_name()
        .and_then(|n| n.to_str())
        .context("the model's file name")?
        .to_owned();
    for key in &keys {
        let mut c = Conn::connect(port, key)?;
        let (s, _) = turn(
            &mut c,
            &model,
            &[json!({"role": "user", "content": "Hi"})],
            1,
        );
        if let Some(why) = s.failed {
            bail!("the warm-up stream failed: {why}");
        }
    }

    let pid = daemon.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let start_mib = status_mib(pid, "VmRSS:");
    let sampler = {
        let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                samples.lock().push(status_mib(pid, "VmRSS:"));
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let t0 = Instant::now();
    let mut stopped = t0;
    let streams: Vec<Stream> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (app, &n) in sizes.iter().enumerate() {
            for i in 0..n {
                let (key, model, stop) = (&keys[app], &model, &*stop);
                handles.push(s.spawn(move || client(port, key, model, (app, i), spec, stop)));
            }
        }
        std::thread::sleep(Duration::from_secs_f64(spec.seconds));
        stop.store(true, Ordering::Relaxed);
        stopped = Instant::now();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a client thread panicked"))
            .collect()
    });
    let seconds = t0.elapsed().as_secs_f64();
    sampler.join().expect("the sampler panicked");
    let stats = protocol::client::Client::connect(&d.socket(), "bench-http-load")
        .and_then(|mut c| c.stats())
        .context("the daemon's stats")?
        .service;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let memory = Memory {
        start_mib,
        peak_mib: samples.lock().iter().copied().fold(start_mib, f64::max),
        end_mib: status_mib(pid, "VmRSS:"),
        hwm_mib: status_mib(pid, "VmHWM:"),
        kv_budget_mib: mib(stats.budget_bytes),
        kv_resident_mib: mib(stats.resident_bytes),
        contexts: stats.contexts,
        chunks_read: stats.chunks_read,
        chunks_recomputed: stats.chunks_recomputed,
    };
    daemon.term()?;
    let window = (stopped - t0).as_secs_f64();
    Ok(report(
        spec,
        &sizes,
        &streams,
        (window, seconds),
        stopped,
        memory,
    ))
}

/// Sums up the streams. The apps' shares count the streams that ended while every client was
/// still starting new ones (before `stopped`): after it, the apps with more clients have more
/// streams left to finish, and the queue has nothing else to give turns to.
fn report(
    spec: &HttpLoadSpec,
    sizes: &[usize],
    streams: &[Stream],
    (window, seconds): (f64, f64),
    stopped: Instant,
    memory: Memory,
) -> HttpLoadReport {
    let ok: Vec<&Stream> = streams.iter().filter(|s| s.failed.is_none()).collect();
    let completed = ok.len();
    let in_window_all = ok.iter().filter(|s| s.ended <= stopped).count();
    let apps: Vec<AppFigures> = sizes
        .iter()
        .enumerate()
        .map(|(a, &clients)| {
            let mine: Vec<&&Stream> = ok.iter().filter(|s| s.app == a).collect();
            let in_window = mine.iter().filter(|s| s.ended <= stopped).count();
            AppFigures {
                app: format!("app{a}"),
                clients,
                streams: mine.len(),
                tokens: mine.iter().map(|s| s.tokens).sum(),
                streams_in_window: in_window,
                share: in_window as f64 / in_window_all.max(1) as f64,
                clients_share: clients as f64 / spec.clients as f64,
                first_token: Spread::of(mine.iter().map(|s| s.first_token_ms).collect()),
            }
        })
        .collect();
    let later: Vec<&&Stream> = ok.iter().filter(|s| s.turn > 0).collect();
    HttpLoadReport {
        clients: spec.clients,
        window_s: window,
        seconds,
        max_tokens: spec.max_tokens,
        turns: spec.turns,
        fairness: jain(&apps.iter().map(|a| a.share).collect::<Vec<_>>()),
        first_come_fairness: jain(&apps.iter().map(|a| a.clients_share).collect::<Vec<_>>()),
        apps,
        completed,
        incomplete: streams.len() - completed,
        busy: streams.iter().filter(|s| s.busy).count(),
        failures: streams
            .iter()
            .filter_map(|s| s.failed.clone())
            .take(5)
            .collect(),
        first_token: Spread::of(ok.iter().map(|s| s.first_token_ms).collect()),
        stream: Spread::of(ok.iter().map(|s| s.whole_ms).collect()),
        tokens_per_s: ok.iter().map(|s| s.tokens).sum::<u64>() as f64 / seconds,
        continued: later.iter().filter(|s| s.cached > 0).count(),
        later_turns: later.len(),
        memory,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apps_are_of_unequal_size_and_take_every_client() {
        assert_eq!(clients_per_app(64, 4), vec![32, 11, 11, 10]);
        assert_eq!(clients_per_app(5, 1), vec![5]);
        assert_eq!(clients_per_app(3, 3), vec![2, 1, 0]);
        assert_eq!(clients_per_app(4, 3), vec![2, 1, 1]);
        assert_eq!(clients_per_app(7, 2), vec![4, 3]);
    }

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_one_taking_all() {
        assert!((jain(&[0.25; 4]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        let first_come = jain(&[0.5, 0.5 / 3.0, 0.5 / 3.0, 0.5 / 3.0]);
        assert!(first_come < 0.8, "{first_come}");
    }
}
