//! One HTTP request's way into the daemon: typed protocol requests queued as a socket
//! connection's are (`conn::submit`: the same fair queue, lanes and limits, run by the same
//! engine thread), their replies read from an in-process connection. The HTTP API never
//! touches the engine either: what it does is a few protocol operations in a row.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use protocol::{ErrorBody, Event, Reply, ReplyBody, Request, codes};
use service::Owner;
use tokio::sync::mpsc::Receiver;

use crate::Shared;
use crate::conn::{Conn, submit};

/// Ids of the HTTP API's in-process connections, apart from the socket's (for logs).
static NEXT_CONN: AtomicU64 = AtomicU64::new(1 << 40);

/// The daemon as one HTTP request sees it: a uid and an in-process connection.
pub struct Session {
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    rx: Receiver<Reply>,
    pub uid: u32,
    next: u64,
    /// When the HTTP request arrived (a call's queue and switch times count from it).
    received: Instant,
}

impl Session {
    pub fn new(shared: &Arc<Shared>, uid: u32, received: Instant) -> Session {
        let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        let (conn, rx) = Conn::typed(id, uid, shared.cfg.reply_buffer);
        shared.request();
        Session {
            shared: Arc::clone(shared),
            conn,
            rx,
            uid,
            next: 1,
            received,
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn owner(&self, app: &str) -> Owner {
        Owner {
            uid: self.uid,
            app: app.to_owned(),
        }
    }

    /// Queues the request `make` builds with its id, as app `app` of this uid.
    pub fn start(
        &mut self,
        app: &str,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<u64, ErrorBody> {
        let id = self.next;
        self.next += 1;
        let received = match self.next {
            2 => self.received,
            _ => Instant::now(),
        };
        let owner = self.owner(app);
        submit(
            &self.shared,
            &self.conn,
            owner,
            protocol::VERSION,
            make(id),
            received,
        )?;
        Ok(id)
    }

    /// The next reply to the request `id`: an event, or its error; `None` if the daemon dropped
    /// the connection (it is draining).
    pub async fn next(&mut self, id: u64) -> Option<Result<Event, ErrorBody>> {
        loop {
            let r = self.rx.recv().await?;
            if r.id != Some(id) {
                continue;
            }
            return Some(match r.body {
                ReplyBody::Event(e) => Ok(e),
                ReplyBody::Error { error } => Err(error),
            });
        }
    }

    /// Runs one request of a single reply.
    pub async fn op(
        &mut self,
        app: &str,
        make: impl FnOnce(u64) -> Request,
    ) -> Result<Event, ErrorBody> {
        let id = self.start(app, make)?;
        self.next(id).await.unwrap_or_else(|| Err(gone()))
    }

    /// Cancels the running or queued call `id` of this request (its client went away).
    pub fn cancel(&self) {
        self.conn.leave();
    }
}

impl Drop for Session {
    /// A request that ends (answered, or its client gone) cancels what it still has queued or
    /// running, as a socket client that goes away does.
    fn drop(&mut self) {
        self.conn.leave();
    }
}

/// The error of a request whose replies stopped: the daemon is draining.
pub fn gone() -> ErrorBody {
    ErrorBody::new(codes::SHUTTING_DOWN, "the daemon is shutting down")
}
