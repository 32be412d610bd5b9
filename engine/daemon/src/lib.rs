//! daemon: the socket side of the service, shaped like firecracker's API server.
//!
//! A call, top-down: [`conn`] accepts a connection, takes the peer's uid from SO_PEERCRED, reads
//! bounded lines and parses each into a typed [`Request`](protocol::Request)
//! (socket threads never touch the engine) → [`queue`] holds it, fair across apps and bounded →
//! [`run`], the one engine thread that owns the [`Manager`], encodes the prompt, runs the call
//! (Load, Run, Compress, AoT in [`service::manager`]) and streams tokens back through
//! the connection's writer thread. Errors become replies in one place each: parse and queue
//! errors in [`conn`], the manager's in [`run`]. docs/protocol.md is the contract.
//!
//! This crate owns connections, the queue and the engine thread; it holds no mechanism of the
//! context manager (the service crate) and no wire type of its own (the protocol crate).

pub mod call;
pub mod conn;
pub mod format;
pub mod http;
pub mod queue;
pub mod run;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use model::tokenizer::Tokenizer;
use parking_lot::Mutex;
use protocol::{DEFAULT_MAX_LINE, Request};
use service::{Manager, Owner};

/// The daemon's limits.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Longest request line (bytes).
    pub max_line: usize,
    /// Calls that may wait in the queue (and control requests, separately).
    pub queue: usize,
    /// Connections open at once; more are refused with `busy`.
    pub max_connections: usize,
    /// Contexts one app (uid and app name) may hold.
    pub max_contexts_per_app: usize,
    /// Replies buffered per connection before a client that does not read is dropped.
    pub reply_buffer: usize,
    /// The manager's longest context (its `max_tokens`), told to clients in `hello`.
    pub max_context_tokens: usize,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            max_line: DEFAULT_MAX_LINE,
            queue: 64,
            max_connections: 256,
            max_contexts_per_app: 8,
            reply_buffer: 8192,
            max_context_tokens: 2048,
        }
    }
}

/// What went wrong running the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("starting the daemon's threads: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("the engine thread died: {what}; contexts are as their last completed call")]
    EngineDied { what: String },
}

/// A queued request.
pub struct Job {
    pub conn: Arc<conn::Conn>,
    pub owner: Owner,
    pub request: Request,
    pub received: Instant,
    /// Set by `cancel` or when the client goes away.
    pub cancel: Arc<AtomicBool>,
    /// The protocol version the connection said in `hello`: a version 1 connection gets no
    /// field of version 2.
    pub version: u32,
    /// A call's `response_format`, compiled by the connection.
    pub format: Option<Arc<guide::Grammar>>,
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Request::Call { id, .. } | Request::ToolResult { id, .. } = self.request {
            self.conn.call_ended(id);
        }
    }
}

/// What the socket threads and the engine thread share.
pub struct Shared {
    pub cfg: DaemonConfig,
    pub queue: queue::FairQueue<(u32, String), Job>,
    pub conns: Mutex<HashMap<u64, Arc<conn::Conn>>>,
    pub model_name: String,
    /// Structured output's compiled formats.
    pub formats: format::Formats,
    started: Instant,
    stopping: AtomicBool,
    /// The running call's cancel flag.
    running: Mutex<Option<Arc<AtomicBool>>>,
    requests: AtomicU64,
    errors: AtomicU64,
    busy: AtomicU64,
}

impl Shared {
    fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }
    fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
    fn busy(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.error();
    }

    fn daemon_stats(&self) -> protocol::DaemonStats {
        protocol::DaemonStats {
            uptime_secs: self.started.elapsed().as_secs_f64(),
            connections: self.conns.lock().len(),
            queued: self.queue.len(),
            requests: self.requests.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            busy: self.busy.load(Ordering::Relaxed),
        }
    }
}

/// Asks a running daemon to drain and stop; cheap to clone, usable from a signal thread.
#[derive(Clone)]
pub struct Stopper {
    shared: Arc<Shared>,
    wake: Arc<OwnedFd>,
}

impl std::fmt::Debug for Stopper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stopper").finish_non_exhaustive()
    }
}

impl Stopper {
    /// Stops accepting; `Daemon::wait` then drains.
    pub fn stop(&self) {
        if !self.shared.stopping.swap(true, Ordering::AcqRel) {
            tracing::info!("stopping: no new connections or requests");
        }
        let _ = nix::unistd::write(self.wake.as_fd(), &[1]);
    }
}

/// A running daemon.
pub struct Daemon {
    shared: Arc<Shared>,
    stopper: Stopper,
    accept: JoinHandle<()>,
    engine: JoinHandle<Result<(), String>>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
    tokenizer: Arc<Tokenizer>,
    http: Option<http::HttpServer>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon").finish_non_exhaustive()
    }
}

impl Daemon {
    /// Serves `listener` with `manager` (the engine thread owns it) until stopped.
    pub fn start(
        listener: UnixListener,
        mut manager: Manager,
        tokenizer: Arc<Tokenizer>,
        cfg: DaemonConfig,
    ) -> Result<Daemon, DaemonError> {
        // People who mount kvfs read each context as the model's text.
        manager.show_text_with(Arc::clone(&tokenizer));
        let model_name = manager
            .model()
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let shared = Arc::new(Shared {
            queue: queue::FairQueue::new(cfg.queue.max(1)),
            cfg,
            conns: Mutex::new(HashMap::new()),
            model_name,
            formats: format::Formats::new(&tokenizer),
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            running: Mutex::new(None),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            busy: AtomicU64::new(0),
        });
        let (wake_r, wake_w) = nix::unistd::pipe().map_err(|e| DaemonError::Spawn(e.into()))?;
        let stopper = Stopper {
            shared: Arc::clone(&shared),
            wake: Arc::new(wake_w),
        };
        let engine = std::thread::Builder::new()
            .name("llms-engine".into())
            .spawn({
                let shared = Arc::clone(&shared);
                let stopper = stopper.clone();
                let tokenizer = Arc::clone(&tokenizer);
                move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run::engine_loop(manager, &tokenizer, &shared)
                    }));
                    match r {
                        Ok(()) => Ok(()),
                        Err(p) => {
                            let what = p
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                                .unwrap_or_else(|| "panic".into());
                            tracing::error!(%what, "the engine thread panicked; stopping");
                            stopper.stop();
                            Err(what)
                        }
                    }
                }
            })
            .map_err(DaemonError::Spawn)?;
        let threads = Arc::new(Mutex::new(Vec::new()));
        let accept = std::thread::Builder::new()
            .name("llms-accept".into())
            .spawn({
                let shared = Arc::clone(&shared);
                let threads = Arc::clone(&threads);
                move || accept_loop(&listener, &wake_r, &shared, &threads)
            })
            .map_err(DaemonError::Spawn)?;
        Ok(Daemon {
            shared,
            stopper,
            accept,
            engine,
            threads,
            tokenizer,
            http: None,
        })
    }

    /// Serves the OpenAI-compatible HTTP API too (`http`), from the same queue and engine
    /// thread; it stops with the daemon.
    pub fn serve_http(&mut self, cfg: http::HttpConfig) -> Result<(), DaemonError> {
        let server =
            http::HttpServer::start(Arc::clone(&self.shared), Arc::clone(&self.tokenizer), cfg)
                .map_err(DaemonError::Spawn)?;
        self.http = Some(server);
        Ok(())
    }

    /// A handle that stops the daemon.
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// Waits until the daemon is stopped, then drains: queued requests are answered
    /// `shutting_down`, the running call is cancelled (its context keeps what it said), AoT
    /// writes are flushed, replies already queued are sent, and every connection is closed.
    pub fn wait(self) -> Result<(), DaemonError> {
        let _ = self.accept.join();
        for job in self.shared.queue.close() {
            job.conn.send(&protocol::Reply::error(
                Some(job.request.id()),
                protocol::ErrorBody::new(
                    protocol::codes::SHUTTING_DOWN,
                    "the daemon is shutting down",
                ),
            ));
        }
        if let Some(c) = self.shared.running.lock().as_ref() {
            c.store(true, Ordering::Release);
        }
        let engine = self.engine.join();
        if let Some(h) = self.http {
            h.stop();
        }
        for c in self.shared.conns.lock().values() {
            c.stop_reading();
        }
        let handles = std::mem::take(&mut *self.threads.lock());
        for h in handles {
            let _ = h.join();
        }
        tracing::info!("stopped");
        match engine {
            Ok(Ok(())) => Ok(()),
            Ok(Err(what)) => Err(DaemonError::EngineDied { what }),
            Err(_) => Err(DaemonError::EngineDied {
                what: "panic".into(),
            }),
        }
    }
}

fn accept_loop(
    listener: &UnixListener,
    wake: &OwnedFd,
    shared: &Arc<Shared>,
    threads: &Mutex<Vec<JoinHandle<()>>>,
) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut next_id = 0u64;
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(wake.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "poll on the socket failed; stopping");
                return;
            }
        }
        if shared.stopping.load(Ordering::Acquire)
            || fds[1].revents().is_some_and(|r| !r.is_empty())
        {
            return;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        next_id += 1;
        let mut t = threads.lock();
        t.retain(|h| !h.is_finished());
        if shared.conns.lock().len() >= shared.cfg.max_connections {
            shared.busy();
            let line = protocol::Reply::error(
                None,
                protocol::ErrorBody::new(
                    protocol::codes::BUSY,
                    format!(
                        "the daemon serves {} connections already; try again shortly",
                        shared.cfg.max_connections
                    ),
                ),
            )
            .to_line();
            let _ = std::io::Write::write_all(&mut &stream, line.as_bytes());
            continue;
        }
        match conn::spawn(shared, next_id, stream) {
            Ok(hs) => t.extend(hs),
            Err(e) => tracing::warn!(error = %e, "cannot serve a connection"),
        }
    }
}
