//! The OpenAI-compatible HTTP API (`llms serve --http`, docs/http.md): HTTP/1.1 on a Unix
//! socket (the peer's uid from SO_PEERCRED) and/or TCP (every request with a key of the key
//! file), served by hyper on one current-thread tokio runtime, the thread `llms-http`.
//!
//! A request, top-down: [`route`] authenticates it and reads its bounded body → an endpoint
//! ([`chat`], [`responses`], [`conversations`]) checks it against the OpenAI shapes ([`wire`],
//! [`shapes`]) and turns it into a few protocol requests → [`session`] queues each exactly as a
//! socket connection's (`conn::submit`: the same fair queue, the same engine thread, the same
//! limits) and reads the replies from an in-process connection → the answer, whole or as
//! server-sent events ([`body`]). The HTTP side never touches the engine, and keeps no state
//! that a restart loses beyond what it can read back: response ids are checked against the
//! contexts' transcripts ([`ids`]), the chat completions' contexts are listed again ([`cache`]).

pub mod answer;
pub mod body;
pub mod cache;
pub mod chat;
pub mod conversations;
pub mod error;
pub mod ids;
pub mod keys;
pub mod responses;
pub mod route;
pub mod session;
pub mod shapes;
pub mod stream_events;
pub mod wire;

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use hyper::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use model::tokenizer::Tokenizer;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};

use crate::Shared;
use crate::http::error::{ApiError, http_codes};
use crate::http::keys::KeyStore;

/// Where the HTTP API listens.
#[derive(Debug)]
pub enum Listen {
    /// A Unix socket: the uid is the peer's.
    Unix(std::os::unix::net::UnixListener),
    /// TCP: every request needs a key of the key file.
    Tcp(std::net::TcpListener),
}

/// The HTTP API's settings and limits.
pub struct HttpConfig {
    pub listeners: Vec<Listen>,
    /// The keys of TCP requests (required when a TCP listener is given).
    pub keys: Option<KeyStore>,
    /// The app name of requests on the Unix socket (a key names its own).
    pub unix_app: String,
    /// Longest request body (bytes).
    pub max_body: usize,
    /// Connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// A request's head must arrive within this (also an idle keep-alive connection's limit).
    pub header_timeout: Duration,
    /// A request's body must arrive within this.
    pub body_timeout: Duration,
}

impl HttpConfig {
    /// Settings with the default limits.
    pub fn new(listeners: Vec<Listen>, keys: Option<KeyStore>) -> HttpConfig {
        HttpConfig {
            listeners,
            keys,
            unix_app: "http".into(),
            max_body: protocol::DEFAULT_MAX_LINE,
            max_connections: 256,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
        }
    }
}

/// Who a request is: a uid and the app name its contexts are made under.
#[derive(Clone, Debug)]
pub struct Who {
    pub uid: u32,
    pub app: String,
}

/// How a connection was made.
#[derive(Clone, Copy, Debug)]
pub enum Peer {
    Unix { uid: u32 },
    Tcp,
}

/// What every request of the HTTP API shares.
pub struct Api {
    pub shared: Arc<Shared>,
    pub tokenizer: Arc<Tokenizer>,
    pub cache: cache::ChatCache,
    keys: Option<Mutex<KeyStore>>,
    in_use: Arc<Mutex<HashSet<u64>>>,
    unix_app: String,
    max_body: usize,
    body_timeout: Duration,
}

/// A context held by one request (continued or deleted), released when dropped.
pub struct InUse {
    set: Arc<Mutex<HashSet<u64>>>,
    context: u64,
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.set.lock().remove(&self.context);
    }
}

impl Api {
    /// Holds `context` for this request: a second request continuing it meanwhile gets 409.
    pub fn hold(&self, context: u64) -> Result<InUse, ApiError> {
        if !self.in_use.lock().insert(context) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                http_codes::IN_USE,
                "another request is continuing this conversation; wait for its answer",
            ));
        }
        Ok(InUse {
            set: Arc::clone(&self.in_use),
            context,
        })
    }
}

/// The running HTTP API.
pub struct HttpServer {
    thread: Option<JoinHandle<()>>,
    stop: Arc<Notify>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer").finish_non_exhaustive()
    }
}

impl HttpServer {
    /// Serves `cfg.listeners` on the thread `llms-http` until stopped.
    pub fn start(
        shared: Arc<Shared>,
        tokenizer: Arc<Tokenizer>,
        cfg: HttpConfig,
    ) -> std::io::Result<HttpServer> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let api = Arc::new(Api {
            shared,
            tokenizer,
            cache: cache::ChatCache::default(),
            keys: cfg.keys.map(Mutex::new),
            in_use: Arc::new(Mutex::new(HashSet::new())),
            unix_app: cfg.unix_app,
            max_body: cfg.max_body,
            body_timeout: cfg.body_timeout,
        });
        let stop = Arc::new(Notify::new());
        let limits = Limits {
            connections: Arc::new(Semaphore::new(cfg.max_connections)),
            header_timeout: cfg.header_timeout,
        };
        for l in &cfg.listeners {
            match l {
                Listen::Unix(l) => l.set_nonblocking(true)?,
                Listen::Tcp(l) => l.set_nonblocking(true)?,
            }
        }
        let thread = std::thread::Builder::new()
            .name("llms-http".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    rt.block_on(async move {
                        for l in cfg.listeners {
                            let (api, limits) = (Arc::clone(&api), limits.clone());
                            tokio::spawn(async move { accept(l, api, limits).await });
                        }
                        stop.notified().await;
                    });
                }
            })?;
        Ok(HttpServer {
            thread: Some(thread),
            stop,
        })
    }

    /// Stops serving: open connections are closed, their calls cancelled.
    pub fn stop(mut self) {
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Clone)]
struct Limits {
    connections: Arc<Semaphore>,
    header_timeout: Duration,
}

/// Accepts connections on one listener.
async fn accept(l: Listen, api: Arc<Api>, limits: Limits) {
    match l {
        Listen::Unix(l) => {
            let l = match tokio::net::UnixListener::from_std(l) {
                Ok(l) => l,
                Err(e) => return tracing::error!(error = %e, "cannot serve HTTP on a Unix socket"),
            };
            loop {
                match l.accept().await {
                    Ok((s, _)) => match s.peer_cred() {
                        Ok(c) => serve(s, Peer::Unix { uid: c.uid() }, &api, &limits),
                        Err(e) => {
                            tracing::warn!(error = %e, "no peer credentials; connection closed")
                        }
                    },
                    Err(e) => pause(e).await,
                }
            }
        }
        Listen::Tcp(l) => {
            let l = match tokio::net::TcpListener::from_std(l) {
                Ok(l) => l,
                Err(e) => return tracing::error!(error = %e, "cannot serve HTTP on TCP"),
            };
            loop {
                match l.accept().await {
                    Ok((s, _)) => {
                        let _ = s.set_nodelay(true);
                        serve(s, Peer::Tcp, &api, &limits);
                    }
                    Err(e) => pause(e).await,
                }
            }
        }
    }
}

/// After a failed accept (out of descriptors, mostly): wait a little rather than spin.
async fn pause(e: std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Serves one connection in a task of its own, if the connection limit allows.
fn serve<S>(mut stream: S, peer: Peer, api: &Arc<Api>, limits: &Limits)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(permit) = Arc::clone(&limits.connections).try_acquire_owned() else {
        api.shared.busy();
        tokio::spawn(async move {
            let body = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                protocol::codes::BUSY,
                "too many connections; try again shortly",
            )
            .body()
            .to_string();
            let head = format!(
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(format!("{head}{body}").as_bytes()).await;
        });
        return;
    };
    let api = Arc::clone(api);
    let header_timeout = limits.header_timeout;
    tokio::spawn(async move {
        let _permit = permit;
        let svc = hyper::service::service_fn(move |req| {
            let api = Arc::clone(&api);
            async move { Ok::<_, std::convert::Infallible>(route::handle(api, peer, req).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .max_buf_size(64 << 10)
            .max_headers(64)
            .serve_connection(TokioIo::new(stream), svc);
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "HTTP connection ended");
        }
    });
}
