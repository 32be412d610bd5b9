//! A typed client of the daemon: one connection, requests one at a time, a call's answer as a
//! streaming iterator. `llms chat`, `llms ctx` and `llms stats` use it.
//!
//! ```no_run
//! use protocol::client::{CallParams, Client};
//! let mut c = Client::connect("/run/llms/llms.sock".as_ref(), "notes")?;
//! let ctx = c.new_context(None, Default::default())?;
//! for ev in c.call(ctx, "What is the capital of France?", &CallParams::default())? {
//!     if let protocol::client::CallEvent::Token { text, .. } = ev? {
//!         print!("{text}");
//!     }
//! }
//! # Ok::<(), protocol::client::ClientError>(())
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use crate::{
    ContextInfo, Done, ErrorBody, Event, HelloReply, Prewarmed, PromptFormat, Reply, ReplyBody,
    Request, ResponseFormat, Stats, TokenCount, Tool, ToolChoice, Transcript, VERSION,
};

/// Longest reply line the client reads (a `list` of many contexts is the longest).
const MAX_REPLY_LINE: usize = 16 << 20;

/// What went wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}: {source}; is `llms serve` running?")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("talking to the daemon: {0}")]
    Io(#[from] std::io::Error),
    #[error("the daemon closed the connection")]
    Closed,
    #[error("the daemon sent something this client does not understand: {what}")]
    Protocol { what: String },
    /// The daemon answered the request with an error.
    #[error("{} ({})", .error.message, .error.code)]
    Server { error: ErrorBody },
}

impl ClientError {
    /// The daemon's error code, if the daemon answered with an error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Server { error } => Some(&error.code),
            _ => None,
        }
    }
}

/// A call's options; the defaults are the protocol's.
#[derive(Clone, Debug, PartialEq)]
pub struct CallParams {
    pub format: PromptFormat,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
    pub stop: Vec<String>,
    /// The answer's format: JSON under a schema, or text a regex matches (structured output).
    pub response_format: Option<ResponseFormat>,
    /// Tools this call and the context's later calls may use (a `tool_result` takes the
    /// context's).
    pub tools: Vec<Tool>,
    /// How the model chooses between a plain answer and a tool call (`auto` by default).
    pub tool_choice: Option<ToolChoice>,
}

impl Default for CallParams {
    fn default() -> Self {
        Self {
            format: PromptFormat::Chat,
            max_tokens: crate::DEFAULT_MAX_TOKENS,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: Vec::new(),
            response_format: None,
            tools: Vec::new(),
            tool_choice: None,
        }
    }
}

/// One event of a call's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum CallEvent {
    Token {
        token: u32,
        text: String,
    },
    /// The answer is a call of this tool; answer it with [`Client::tool_result`].
    ToolCall(ToolCall),
    Done(Box<Done>),
}

/// A tool call the model made: the tool's name and arguments that validate against its schema.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

/// A whole answer, collected.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The answer's text (empty for a tool call, whose tokens are not streamed as text).
    pub text: String,
    pub tokens: Vec<u32>,
    /// The tool call, if the answer is one.
    pub tool_call: Option<ToolCall>,
    pub done: Done,
}

/// A connection to the daemon, after `hello`.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
    hello: HelloReply,
    line: Vec<u8>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("hello", &self.hello)
            .finish()
    }
}

impl Client {
    /// Connects to the daemon's socket and names the app.
    pub fn connect(path: &Path, app: &str) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_owned(),
            source,
        })?;
        Client::with_stream(stream, app)
    }

    /// Names the app over an already connected stream.
    pub fn with_stream(stream: UnixStream, app: &str) -> Result<Client, ClientError> {
        let writer = stream.try_clone()?;
        let mut c = Client {
            reader: BufReader::new(stream),
            writer,
            next_id: 1,
            hello: HelloReply {
                version: VERSION,
                uid: 0,
                app: String::new(),
                model: String::new(),
                max_context_tokens: 0,
                max_line: 0,
                max_contexts_per_app: 0,
            },
            line: Vec::new(),
        };
        let id = c.next_id();
        match c.request(Request::Hello {
            id,
            version: VERSION,
            app: app.to_owned(),
        })? {
            Event::Hello(h) => c.hello = h,
            e => return Err(unexpected(&e)),
        }
        Ok(c)
    }

    /// What the daemon said to `hello`.
    pub fn hello(&self) -> &HelloReply {
        &self.hello
    }

    /// A fresh request id.
    pub fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Sends one request line.
    pub fn send(&mut self, r: &Request) -> Result<(), ClientError> {
        let mut line = serde_json::to_vec(r).map_err(|e| ClientError::Protocol {
            what: e.to_string(),
        })?;
        line.push(b'\n');
        self.writer.write_all(&line)?;
        Ok(())
    }

    /// Reads the next reply line, whatever its id.
    pub fn read_reply(&mut self) -> Result<Reply, ClientError> {
        self.line.clear();
        let n = Read::take(&mut self.reader, MAX_REPLY_LINE as u64 + 1)
            .read_until(b'\n', &mut self.line)?;
        if n == 0 {
            return Err(ClientError::Closed);
        }
        if n > MAX_REPLY_LINE {
            return Err(ClientError::Protocol {
                what: format!("a reply line longer than {MAX_REPLY_LINE} bytes"),
            });
        }
        serde_json::from_slice(&self.line).map_err(|e| ClientError::Protocol {
            what: format!("{e}: {}", String::from_utf8_lossy(&self.line).trim_end()),
        })
    }

    /// Reads replies until the one for `id`; replies for other ids (a cancel's
    /// acknowledgement) are skipped, errors without an id are returned.
    fn reply_for(&mut self, id: u64) -> Result<Event, ClientError> {
        loop {
            let r = self.read_reply()?;
            match (r.id, r.body) {
                (Some(i), ReplyBody::Event(e)) if i == id => return Ok(e),
                (Some(i), ReplyBody::Error { error }) if i == id => {
                    return Err(ClientError::Server { error });
                }
                (None, ReplyBody::Error { error }) => return Err(ClientError::Server { error }),
                _ => {}
            }
        }
    }

    /// Sends a request and waits for its one reply.
    pub fn request(&mut self, r: Request) -> Result<Event, ClientError> {
        let id = r.id();
        self.send(&r)?;
        self.reply_for(id)
    }

    /// Creates a context; `system` is its system prompt.
    pub fn new_context(
        &mut self,
        system: Option<&str>,
        format: PromptFormat,
    ) -> Result<u64, ClientError> {
        let id = self.next_id();
        match self.request(Request::New {
            id,
            system: system.map(str::to_owned),
            format,
            transcript: None,
            tools: Vec::new(),
        })? {
            Event::Created { context } => Ok(context),
            e => Err(unexpected(&e)),
        }
    }

    /// Creates a chat context whose calls may use `tools` (declared at the end of its system
    /// turn, after `system` or the template's default).
    pub fn new_with_tools(
        &mut self,
        system: Option<&str>,
        tools: &[Tool],
    ) -> Result<u64, ClientError> {
        let id = self.next_id();
        match self.request(Request::New {
            id,
            system: system.map(str::to_owned),
            format: PromptFormat::Chat,
            transcript: None,
            tools: tools.to_vec(),
        })? {
            Event::Created { context } => Ok(context),
            e => Err(unexpected(&e)),
        }
    }

    /// Creates a context rebuilt from `transcript` (its turns rendered in the model's chat
    /// template and prefilled before the daemon answers).
    pub fn new_from_transcript(&mut self, transcript: &Transcript) -> Result<u64, ClientError> {
        let id = self.next_id();
        match self.request(Request::New {
            id,
            system: None,
            format: PromptFormat::Chat,
            transcript: Some(transcript.clone()),
            tools: Vec::new(),
        })? {
            Event::Created { context } => Ok(context),
            e => Err(unexpected(&e)),
        }
    }

    /// A context's turns, as recorded at each call.
    pub fn export(&mut self, context: u64) -> Result<Transcript, ClientError> {
        let id = self.next_id();
        match self.request(Request::Export { id, context })? {
            Event::Transcript { transcript, .. } => Ok(transcript),
            e => Err(unexpected(&e)),
        }
    }

    /// Starts a call; the stream yields its tokens, then its `done`.
    pub fn call(
        &mut self,
        context: u64,
        prompt: &str,
        p: &CallParams,
    ) -> Result<CallStream<'_>, ClientError> {
        let id = self.next_id();
        self.send(&Request::Call {
            id,
            context,
            prompt: prompt.to_owned(),
            format: p.format,
            max_tokens: p.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            seed: p.seed,
            stop: p.stop.clone(),
            response_format: p.response_format.clone(),
            tools: p.tools.clone(),
            tool_choice: p.tool_choice.clone(),
        })?;
        Ok(CallStream {
            client: self,
            id,
            finished: false,
        })
    }

    /// Answers the tool call of `context`'s last answer with the tool's result, `content`; the
    /// stream yields the model's next answer (text, or another tool call). `p.format` and
    /// `p.tools` do not apply: the context's tools stay in force.
    pub fn tool_result(
        &mut self,
        context: u64,
        content: &str,
        p: &CallParams,
    ) -> Result<CallStream<'_>, ClientError> {
        let id = self.next_id();
        self.send(&Request::ToolResult {
            id,
            context,
            content: content.to_owned(),
            max_tokens: p.max_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            seed: p.seed,
            stop: p.stop.clone(),
            response_format: p.response_format.clone(),
            tool_choice: p.tool_choice.clone(),
        })?;
        Ok(CallStream {
            client: self,
            id,
            finished: false,
        })
    }

    /// The tokens `text` would add to `context` (or to a new context) as a call's prompt in
    /// `format`, and the context's window, used and remaining tokens.
    pub fn count(
        &mut self,
        context: Option<u64>,
        text: &str,
        format: PromptFormat,
    ) -> Result<TokenCount, ClientError> {
        let id = self.next_id();
        match self.request(Request::Count {
            id,
            context,
            text: text.to_owned(),
            format,
        })? {
            Event::Count(c) => Ok(c),
            e => Err(unexpected(&e)),
        }
    }

    /// Brings `context`'s missing chunks back before a call (the daemon runs it once no call
    /// waits): the next call's switch then loads nothing.
    pub fn prewarm(&mut self, context: u64) -> Result<Prewarmed, ClientError> {
        let id = self.next_id();
        match self.request(Request::Prewarm { id, context })? {
            Event::Prewarmed(p) => Ok(p),
            e => Err(unexpected(&e)),
        }
    }

    /// Forks `context`: a new context with its tokens and turns that shares its computed chunks
    /// (version 2). Returns the new context's id.
    pub fn fork(&mut self, context: u64) -> Result<u64, ClientError> {
        let id = self.next_id();
        match self.request(Request::Fork { id, context })? {
            Event::Created { context } => Ok(context),
            e => Err(unexpected(&e)),
        }
    }

    /// Deletes a context.
    pub fn delete(&mut self, context: u64) -> Result<(), ClientError> {
        let id = self.next_id();
        match self.request(Request::Delete { id, context })? {
            Event::Ok => Ok(()),
            e => Err(unexpected(&e)),
        }
    }

    /// This uid's contexts.
    pub fn list(&mut self) -> Result<Vec<ContextInfo>, ClientError> {
        let id = self.next_id();
        match self.request(Request::List { id })? {
            Event::Contexts { contexts } => Ok(contexts),
            e => Err(unexpected(&e)),
        }
    }

    /// One context.
    pub fn info(&mut self, context: u64) -> Result<ContextInfo, ClientError> {
        let id = self.next_id();
        match self.request(Request::Info { id, context })? {
            Event::Info { context } => Ok(context),
            e => Err(unexpected(&e)),
        }
    }

    /// Service-wide counters.
    pub fn stats(&mut self) -> Result<Stats, ClientError> {
        let id = self.next_id();
        match self.request(Request::Stats { id })? {
            Event::Stats(s) => Ok(*s),
            e => Err(unexpected(&e)),
        }
    }
}

fn unexpected(e: &Event) -> ClientError {
    ClientError::Protocol {
        what: format!("unexpected reply {e:?}"),
    }
}

/// A call's answer as it streams: `Token`s, then one `Done`, then the end.
pub struct CallStream<'a> {
    client: &'a mut Client,
    id: u64,
    finished: bool,
}

impl std::fmt::Debug for CallStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallStream").field("id", &self.id).finish()
    }
}

impl CallStream<'_> {
    /// The call's request id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Asks the daemon to stop the call; the stream then ends with a `Done` whose stop is
    /// `cancelled` (or the error `cancelled` if the call had not started).
    pub fn cancel(&mut self) -> Result<(), ClientError> {
        let id = self.client.next_id();
        self.client.send(&Request::Cancel { id, call: self.id })
    }

    /// Reads the whole answer.
    pub fn collect_answer(self) -> Result<Answer, ClientError> {
        let (mut text, mut tokens, mut tool_call) = (String::new(), Vec::new(), None);
        for ev in self {
            match ev? {
                CallEvent::Token { token, text: t } => {
                    tokens.push(token);
                    text.push_str(&t);
                }
                CallEvent::ToolCall(c) => tool_call = Some(c),
                CallEvent::Done(done) => {
                    return Ok(Answer {
                        text,
                        tokens,
                        tool_call,
                        done: *done,
                    });
                }
            }
        }
        Err(ClientError::Closed)
    }
}

impl Iterator for CallStream<'_> {
    type Item = Result<CallEvent, ClientError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        let r = self.client.reply_for(self.id);
        let ev = match r {
            Ok(Event::Token { token, text }) => return Some(Ok(CallEvent::Token { token, text })),
            Ok(Event::ToolCall { name, arguments }) => {
                return Some(Ok(CallEvent::ToolCall(ToolCall { name, arguments })));
            }
            Ok(Event::Done(d)) => Ok(CallEvent::Done(d)),
            Ok(e) => Err(unexpected(&e)),
            Err(e) => Err(e),
        };
        self.finished = true;
        Some(ev)
    }
}
