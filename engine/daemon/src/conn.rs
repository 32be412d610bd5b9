//! One client connection: a reader thread that reads bounded lines, parses and validates them
//! into typed requests and hands them to the queue (it never touches the engine), and a writer
//! thread that sends replies from a bounded channel, so a slow client never blocks the engine.
//!
//! A client that goes away cancels what it asked for: a full close seen by the reader, a failed
//! write, or a reply channel that stays full (a client that does not read) mark it gone; its
//! queued calls are then skipped and its running call stops at its next token.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Instant;

use crate::format::template_tools;
use crate::queue::{Lane, Refused};
use crate::{Job, Shared};
use parking_lot::Mutex;
use protocol::{ErrorBody, Event, HelloReply, Reply, Request, ToolChoice, codes, parse_request};
use service::Owner;

/// A connection as the engine thread and the daemon see it.
pub struct Conn {
    pub id: u64,
    pub uid: u32,
    outlet: Outlet,
    gone: AtomicBool,
    /// Cancel flags of this connection's queued and running calls, by request id.
    calls: Mutex<HashMap<u64, Arc<AtomicBool>>>,
}

/// Where a connection's replies go.
enum Outlet {
    /// A socket client: lines for the writer thread.
    Socket {
        stream: UnixStream,
        tx: SyncSender<String>,
    },
    /// An HTTP request served in this process (`crate::http`): the replies as they are, to the
    /// task that turns them into its response.
    Typed(tokio::sync::mpsc::Sender<Reply>),
}

/// Why a reply could not be queued.
enum Unsent {
    Full,
    Closed,
}

impl Conn {
    /// A connection of the HTTP API for uid `uid`: its replies go to the returned receiver,
    /// which holds at most `buffer` (a reader that falls that far behind is gone).
    pub fn typed(
        id: u64,
        uid: u32,
        buffer: usize,
    ) -> (Arc<Conn>, tokio::sync::mpsc::Receiver<Reply>) {
        let (tx, rx) = tokio::sync::mpsc::channel(buffer.max(1));
        let conn = Conn {
            id,
            uid,
            outlet: Outlet::Typed(tx),
            gone: AtomicBool::new(false),
            calls: Mutex::new(HashMap::new()),
        };
        (Arc::new(conn), rx)
    }

    /// Queues a reply for the writer; false if the client is gone (or stopped reading: a full
    /// channel makes it gone).
    pub fn send(&self, r: &Reply) -> bool {
        if self.is_gone() {
            return false;
        }
        let sent = match &self.outlet {
            Outlet::Socket { tx, .. } => tx.try_send(r.to_line()).map_err(|e| match e {
                TrySendError::Full(_) => Unsent::Full,
                TrySendError::Disconnected(_) => Unsent::Closed,
            }),
            Outlet::Typed(tx) => tx.try_send(r.clone()).map_err(|e| match e {
                tokio::sync::mpsc::error::TrySendError::Full(_) => Unsent::Full,
                tokio::sync::mpsc::error::TrySendError::Closed(_) => Unsent::Closed,
            }),
        };
        match sent {
            Ok(()) => true,
            Err(Unsent::Full) => {
                tracing::warn!(
                    conn = self.id,
                    "client does not read its replies; dropping it"
                );
                self.leave();
                false
            }
            Err(Unsent::Closed) => {
                self.leave();
                false
            }
        }
    }

    /// Whether the client went away.
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// Marks the client gone: its calls are cancelled and the socket shut.
    pub fn leave(&self) {
        if self.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        for c in self.calls.lock().values() {
            c.store(true, Ordering::Release);
        }
        if let Outlet::Socket { stream, .. } = &self.outlet {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Stops reading requests (the daemon is shutting down); replies already queued still go out.
    pub fn stop_reading(&self) {
        if let Outlet::Socket { stream, .. } = &self.outlet {
            let _ = stream.shutdown(std::net::Shutdown::Read);
        }
    }

    /// Registers call `id`'s cancel flag; false if a call of that id is still queued or
    /// running.
    fn register_call(&self, id: u64, cancel: &Arc<AtomicBool>) -> bool {
        let mut calls = self.calls.lock();
        if calls.contains_key(&id) {
            return false;
        }
        calls.insert(id, Arc::clone(cancel));
        true
    }

    /// The call `id` of this connection ended (answered).
    pub fn call_ended(&self, id: u64) {
        self.calls.lock().remove(&id);
    }
}

/// The peer's uid from SO_PEERCRED (never from what the client says).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    Ok(cred.uid())
}

/// Sets up a connection and starts its two threads; returns their handles.
pub fn spawn(
    shared: &Arc<Shared>,
    id: u64,
    stream: UnixStream,
) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
    let uid = peer_uid(&stream)?;
    let (tx, rx) = std::sync::mpsc::sync_channel(shared.cfg.reply_buffer);
    let conn = Arc::new(Conn {
        id,
        uid,
        outlet: Outlet::Socket {
            stream: stream.try_clone()?,
            tx,
        },
        gone: AtomicBool::new(false),
        calls: Mutex::new(HashMap::new()),
    });
    let write_half = stream.try_clone()?;
    let writer = std::thread::Builder::new()
        .name(format!("llms-conn{id}-w"))
        .spawn({
            let conn = Arc::downgrade(&conn);
            move || write_loop(write_half, rx, conn)
        })?;
    shared.conns.lock().insert(id, Arc::clone(&conn));
    let reader = std::thread::Builder::new()
        .name(format!("llms-conn{id}-r"))
        .spawn({
            let shared = Arc::clone(shared);
            move || {
                tracing::debug!(conn = id, uid, "connected");
                read_loop(&shared, &conn, stream);
                shared.conns.lock().remove(&id);
                tracing::debug!(conn = id, "reader done");
            }
        });
    match reader {
        Ok(r) => Ok(vec![writer, r]),
        Err(e) => {
            shared.conns.lock().remove(&id);
            Err(e)
        }
    }
}

fn write_loop(mut stream: UnixStream, rx: Receiver<String>, conn: std::sync::Weak<Conn>) {
    while let Ok(line) = rx.recv() {
        if stream.write_all(line.as_bytes()).is_err() {
            if let Some(c) = conn.upgrade() {
                c.leave();
            }
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// What one bounded line read gave.
enum Line {
    Text(Vec<u8>),
    TooLong(usize),
    Eof,
}

fn read_line(
    r: &mut BufReader<UnixStream>,
    max: usize,
    buf: &mut Vec<u8>,
) -> std::io::Result<Line> {
    buf.clear();
    let mut skipped = 0usize;
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            return Ok(if skipped > 0 {
                Line::TooLong(skipped)
            } else if buf.is_empty() {
                Line::Eof
            } else {
                // A last line without its newline still counts.
                Line::Text(std::mem::take(buf))
            });
        }
        let (part, found) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], Some(i + 1)),
            None => (avail, None),
        };
        if skipped > 0 || buf.len() + part.len() > max {
            skipped += buf.len() + part.len();
            buf.clear();
        } else {
            buf.extend_from_slice(part);
        }
        let used = found.unwrap_or(avail.len());
        r.consume(used);
        if found.is_some() {
            return Ok(if skipped > 0 {
                Line::TooLong(skipped)
            } else {
                Line::Text(std::mem::take(buf))
            });
        }
    }
}

/// Whether the peer closed both directions (a half-closed client still gets its replies).
fn peer_hung_up(stream: &UnixStream) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::empty())];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
}

fn read_loop(shared: &Arc<Shared>, conn: &Arc<Conn>, stream: UnixStream) {
    let mut r = BufReader::with_capacity(64 << 10, stream);
    // The app's name and protocol version, once `hello` said them.
    let mut app: Option<(String, u32)> = None;
    let mut buf = Vec::new();
    let max = shared.cfg.max_line;
    loop {
        let line = match read_line(&mut r, max, &mut buf) {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(conn = conn.id, error = %e, "read failed");
                conn.leave();
                return;
            }
        };
        let received = Instant::now();
        match line {
            Line::Eof => {
                if peer_hung_up(r.get_ref()) {
                    conn.leave();
                }
                return;
            }
            Line::TooLong(n) => {
                shared.error();
                let e = ErrorBody::new(
                    codes::TOO_LONG,
                    format!("a request line of {n} bytes; lines are at most {max} bytes"),
                );
                conn.send(&Reply::error(None, e));
            }
            Line::Text(bytes) => {
                if bytes.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                shared.request();
                match parse_request(&bytes) {
                    Ok(req) => dispatch(shared, conn, &mut app, req, received),
                    Err((id, e)) => {
                        shared.error();
                        conn.send(&Reply::error(id, e));
                    }
                }
            }
        }
        if conn.is_gone() {
            return;
        }
    }
}

/// What version 2 adds to a request, checked: nothing of it on a version 1 connection, a call's
/// `response_format` compiled, and tools declared (on `new`, on a call, in a transcript's tools
/// turns) compiled, so a bad schema is refused before anything is queued (the engine thread
/// then finds the call's grammar in the cache).
fn version_2(
    shared: &Shared,
    req: &Request,
    version: u32,
) -> Result<Option<Arc<guide::Grammar>>, ErrorBody> {
    if version < 2 && req.needs_v2() {
        return Err(ErrorBody::new(
            codes::BAD_REQUEST,
            format!(
                "{} with these fields needs protocol version 2; say \"version\":2 in hello",
                req.op()
            ),
        ));
    }
    let f = &shared.formats;
    match req {
        Request::New {
            tools, transcript, ..
        } => {
            if !tools.is_empty() {
                f.tools(&template_tools(tools), &ToolChoice::Auto, None)?;
            }
            for t in transcript.iter().flat_map(|t| &t.turns) {
                if t.role == "tools" {
                    declared_in_transcript(shared, &t.text)?;
                }
            }
            Ok(None)
        }
        Request::Call {
            response_format,
            max_tokens,
            tools,
            tool_choice,
            ..
        } => {
            let format = match response_format {
                Some(r) => Some(f.grammar(r, *max_tokens)?),
                None => None,
            };
            if !tools.is_empty() {
                let tools = template_tools(tools);
                f.tools(&tools, &ToolChoice::Auto, None)?;
                match tool_choice.as_ref().unwrap_or(&ToolChoice::Auto) {
                    ToolChoice::None => {}
                    c => {
                        f.tools(&tools, c, format.as_deref())?;
                    }
                }
            }
            Ok(format)
        }
        Request::ToolResult {
            response_format: Some(r),
            max_tokens,
            ..
        } => f.grammar(r, *max_tokens).map(Some),
        _ => Ok(None),
    }
}

/// Checks the tools a transcript's `tools` turn declares: their JSON list, names, schemas.
fn declared_in_transcript(shared: &Shared, text: &str) -> Result<(), ErrorBody> {
    let tools: Vec<protocol::Tool> = serde_json::from_str(text).map_err(|e| {
        ErrorBody::new(
            codes::INVALID_TRANSCRIPT,
            format!("a tools turn's text is not a JSON list of tools: {e}"),
        )
    })?;
    protocol::tools::validate_tools(&tools).map_err(|e| {
        ErrorBody::new(
            codes::INVALID_TRANSCRIPT,
            format!("a tools turn: {}", e.message),
        )
    })?;
    shared
        .formats
        .tools(&template_tools(&tools), &ToolChoice::Auto, None)?;
    Ok(())
}

/// Answers `hello`: the app is named, the version said.
fn hello(shared: &Shared, conn: &Conn, id: u64, name: &str, version: u32) {
    tracing::info!(conn = conn.id, uid = conn.uid, app = %name, version, "hello");
    conn.send(&Reply::event(
        id,
        Event::Hello(HelloReply {
            version,
            uid: conn.uid,
            app: name.to_owned(),
            model: shared.model_name.clone(),
            max_context_tokens: shared.cfg.max_context_tokens,
            max_line: shared.cfg.max_line,
            max_contexts_per_app: shared.cfg.max_contexts_per_app,
        }),
    ));
}

/// Routes one parsed request of a socket connection: `hello` and `cancel` answered here, the
/// rest (after a `hello`) checked and queued in its lane by [`submit`].
fn dispatch(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    app: &mut Option<(String, u32)>,
    req: Request,
    received: Instant,
) {
    let id = req.id();
    let fail = |code: &str, message: String| {
        shared.error();
        conn.send(&Reply::error(Some(id), ErrorBody::new(code, message)));
    };
    if let Request::Hello {
        app: name, version, ..
    } = &req
    {
        if app.is_some() {
            return fail(
                codes::NO_HELLO,
                "hello was already sent on this connection".into(),
            );
        }
        *app = Some((name.clone(), *version));
        return hello(shared, conn, id, name, *version);
    }
    let Some((name, version)) = app.as_ref() else {
        return fail(
            codes::NO_HELLO,
            "send {\"op\":\"hello\",\"id\":..,\"version\":2,\"app\":\"NAME\"} first".into(),
        );
    };
    let owner = Owner {
        uid: conn.uid,
        app: name.clone(),
    };
    if let Request::Cancel { call, .. } = &req {
        match conn.calls.lock().get(call) {
            Some(flag) => {
                flag.store(true, Ordering::Release);
                conn.send(&Reply::event(id, Event::Ok));
            }
            None => fail(
                codes::NOT_FOUND,
                format!("no call {call} is queued or running on this connection"),
            ),
        }
        return;
    }
    if let Err(e) = submit(shared, conn, owner, *version, req, received) {
        fail(&e.code, e.message);
    }
}

/// Checks a request (what version 2 adds, a call's id free on its connection) and queues it in
/// its lane, fair across apps: the one way into the queue, for a socket connection's requests
/// and the HTTP API's alike. An error says why it was not queued (`busy`, `shutting_down`, or
/// what is wrong with it); the caller answers it.
pub fn submit(
    shared: &Shared,
    conn: &Arc<Conn>,
    owner: Owner,
    version: u32,
    req: Request,
    received: Instant,
) -> Result<(), ErrorBody> {
    let id = req.id();
    let format = version_2(shared, &req, version)?;
    let cancel = Arc::new(AtomicBool::new(false));
    let lane = match &req {
        Request::Call { .. } | Request::ToolResult { .. } => {
            if !conn.register_call(id, &cancel) {
                return Err(ErrorBody::new(
                    codes::BAD_REQUEST,
                    format!("call {id} is still running on this connection; use a new id"),
                ));
            }
            Lane::Call((owner.uid, owner.app.clone()))
        }
        // A context rebuilt from a transcript is prefilled, a fork loads its parent's chunks and
        // writes them to a shared prefix: each waits its turn as a call does.
        Request::New {
            transcript: Some(_),
            ..
        }
        | Request::Fork { .. } => Lane::Call((owner.uid, owner.app.clone())),
        // A prewarm yields to calls: it waits until none is queued.
        Request::Prewarm { .. } => Lane::Idle((owner.uid, owner.app.clone())),
        _ => Lane::Control,
    };
    let job = Job {
        conn: Arc::clone(conn),
        owner,
        request: req,
        received,
        cancel,
        version,
        format,
    };
    match shared.queue.push(lane, job) {
        Ok(()) => Ok(()),
        Err((job, why)) => {
            conn.call_ended(id);
            drop(job);
            Err(match why {
                Refused::Busy => {
                    shared.busy();
                    ErrorBody::new(codes::BUSY, "the daemon's queue is full; try again shortly")
                }
                Refused::Closed => {
                    ErrorBody::new(codes::SHUTTING_DOWN, "the daemon is shutting down")
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<String> {
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(input).unwrap();
        drop(b);
        let mut r = BufReader::with_capacity(4, a);
        let mut buf = Vec::new();
        let mut out = Vec::new();
        loop {
            match read_line(&mut r, max, &mut buf).unwrap() {
                Line::Eof => return out,
                Line::TooLong(n) => out.push(format!("too long {n}")),
                Line::Text(t) => out.push(String::from_utf8(t).unwrap()),
            }
        }
    }

    #[test]
    fn bounded_lines() {
        assert_eq!(lines(b"ab\ncd\n", 8), ["ab", "cd"]);
        assert_eq!(lines(b"ab\n0123456789\ncd", 8), ["ab", "too long 10", "cd"]);
        assert_eq!(
            lines(b"01234567\n012345678\n", 8),
            ["01234567", "too long 9"]
        );
        assert_eq!(lines(b"\n\n", 8), ["", ""]);
        assert!(lines(b"", 8).is_empty());
    }

    #[test]
    fn hung_up_only_on_full_close() {
        let (a, b) = UnixStream::pair().unwrap();
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!peer_hung_up(&a));
        drop(b);
        assert!(peer_hung_up(&a));
    }
}
