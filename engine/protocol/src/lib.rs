//! protocol: the daemon's wire protocol, version 2 (version 1 still served), and its typed
//! client: what an app links.
//!
//! JSON lines over a Unix socket (docs/protocol.md is the contract). Requests are one typed enum
//! tagged by `op`; replies carry the request's `id` and either an `event` or an `error`. The
//! same types serve the daemon and the client ([`client`]). Version 2 adds structured output
//! (`response_format` on `call`), `count`, and token accounting (`context_window`, `used`,
//! `remaining`, `usage`); a version 1 connection neither sends nor receives any of them.
//!
//! This crate depends on serde and std only, and knows nothing of the engine: the daemon maps
//! these types to and from the service's own. The service's counters ([`ServiceStats`]) are
//! declared here, once, because they are the wire contract of `stats`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub mod client;
pub mod tools;

pub use tools::{Tool, ToolChoice};

/// The protocol version this crate speaks.
pub const VERSION: u32 = 2;

/// The oldest version the daemon still serves.
pub const MIN_VERSION: u32 = 1;

/// Longest request line the daemon reads by default (bytes, newline excluded).
pub const DEFAULT_MAX_LINE: usize = 1 << 20;

/// Most tokens one call may ask for.
pub const MAX_CALL_TOKENS: usize = 1 << 16;

/// Most stop strings in one call, and the longest one (bytes).
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;

/// Longest app name (bytes).
pub const MAX_APP: usize = 64;

/// Stable error codes. The context manager's own codes (`not_found`, `bad_request`,
/// `too_many_contexts`, `context_full`, `over_budget`, `store`, `internal`) pass through as they
/// are.
pub mod codes {
    /// The request is malformed (not JSON, unknown op or field, wrong type, out of range).
    pub const BAD_REQUEST: &str = "bad_request";
    /// The line is longer than the daemon reads; the rest of it was skipped.
    pub const TOO_LONG: &str = "too_long";
    /// `hello` has not been sent on this connection yet (or was sent twice).
    pub const NO_HELLO: &str = "no_hello";
    /// The client speaks a protocol version the daemon does not.
    pub const VERSION: &str = "unsupported_version";
    /// The queue is full: try again later.
    pub const BUSY: &str = "busy";
    /// The call was cancelled before it started.
    pub const CANCELLED: &str = "cancelled";
    /// The daemon is shutting down.
    pub const SHUTTING_DOWN: &str = "shutting_down";
    /// No such context for this uid, or no such call on this connection.
    pub const NOT_FOUND: &str = "not_found";
    /// The chat template cannot be applied with this model.
    pub const NO_TEMPLATE: &str = "no_chat_template";
    /// The prompt does not fit in the context (the error carries `tokens`).
    pub const CONTEXT_FULL: &str = "context_full";
    /// `response_format`'s schema is not a valid JSON Schema, or no value satisfies it.
    pub const INVALID_SCHEMA: &str = "invalid_schema";
    /// `response_format`'s regex does not compile, or matches nothing.
    pub const INVALID_REGEX: &str = "invalid_regex";
    /// `response_format` would make too large an automaton.
    pub const TOO_COMPLEX: &str = "too_complex";
    /// A transcript of `new` has a turn of an unknown role, or too many turns.
    pub const INVALID_TRANSCRIPT: &str = "invalid_transcript";
    /// The context has no transcript to export (it was made before transcripts were recorded).
    pub const NO_TRANSCRIPT: &str = "no_transcript";
    /// A `tool_result` for a context whose last answer is not a tool call.
    pub const NO_TOOL_CALL: &str = "no_tool_call";
}

/// The roles of a transcript's turns: `tools` declares the tools in force from there on (its
/// text is their JSON list), `tool_call` is an answer that called one (its text the call's JSON,
/// `{"name": ..., "arguments": ...}`), `tool` is a tool's result.
pub const ROLES: [&str; 7] = [
    "system",
    "user",
    "assistant",
    "raw",
    "tools",
    "tool_call",
    "tool",
];

/// Most turns in a transcript `new` rebuilds from.
pub const MAX_TURNS: usize = 1 << 16;

/// One turn of a conversation: who said it (one of [`ROLES`]) and what.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    pub role: String,
    pub text: String,
}

/// A context's turns, as `export` gives them and `new` takes them (version 2).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transcript {
    pub turns: Vec<Turn>,
}

impl Transcript {
    /// Checks every turn's role and the number of turns.
    pub fn validate(&self) -> Result<(), ErrorBody> {
        if self.turns.len() > MAX_TURNS {
            return Err(ErrorBody::new(
                codes::INVALID_TRANSCRIPT,
                format!(
                    "a transcript of {} turns; at most {MAX_TURNS}",
                    self.turns.len()
                ),
            ));
        }
        match self
            .turns
            .iter()
            .enumerate()
            .find(|(_, t)| !ROLES.contains(&t.role.as_str()))
        {
            Some((i, t)) => Err(ErrorBody::new(
                codes::INVALID_TRANSCRIPT,
                format!(
                    "turn {i} has the role {:?}; roles are {}",
                    t.role,
                    ROLES.join(", ")
                ),
            )),
            None => Ok(()),
        }
    }
}

/// What a call's answer must be (structured output, version 2): JSON that validates against a
/// JSON Schema, or text that a regular expression matches as a whole.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    JsonSchema { schema: serde_json::Value },
    Regex { pattern: String },
}

/// How a prompt's text becomes tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptFormat {
    /// A user turn in the model's chat template (the first turn of an empty context gets the
    /// template's default system prompt).
    #[default]
    Chat,
    /// The text as it is, encoded without control tokens.
    Raw,
}

/// One request line. Every request carries an `id` chosen by the client; replies to it carry
/// the same `id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Names the app; must be the first request on a connection. The uid is the peer's.
    Hello { id: u64, version: u32, app: String },
    /// Creates a context, optionally with a system prompt, or rebuilt from a transcript
    /// (version 2; prefilled before the reply).
    New {
        id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        system: Option<String>,
        #[serde(default)]
        format: PromptFormat,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        transcript: Option<Transcript>,
        /// Tools every call of the context may use (version 2), declared at the end of its
        /// system turn.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tools: Vec<Tool>,
    },
    /// Appends a prompt to a context and streams the answer.
    Call {
        id: u64,
        context: u64,
        prompt: String,
        #[serde(default)]
        format: PromptFormat,
        #[serde(default = "default_max_tokens")]
        max_tokens: usize,
        #[serde(default)]
        temperature: f32,
        #[serde(default = "default_top_p")]
        top_p: f32,
        #[serde(default)]
        top_k: usize,
        #[serde(default)]
        seed: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stop: Vec<String>,
        /// The answer's format (version 2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_format: Option<ResponseFormat>,
        /// Tools this call and the context's later calls may use, in place of those declared
        /// before (version 2), declared at the top of the prompt's turn.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tools: Vec<Tool>,
        /// How the model chooses between a plain answer and a tool call (version 2; `auto`
        /// when tools are in force).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<ToolChoice>,
    },
    /// Answers the tool call the context's last answer made with the tool's result, and streams
    /// the model's next answer, as a call does (version 2).
    ToolResult {
        id: u64,
        context: u64,
        /// The tool's result, as text (JSON or prose).
        content: String,
        #[serde(default = "default_max_tokens")]
        max_tokens: usize,
        #[serde(default)]
        temperature: f32,
        #[serde(default = "default_top_p")]
        top_p: f32,
        #[serde(default)]
        top_k: usize,
        #[serde(default)]
        seed: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stop: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_format: Option<ResponseFormat>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_choice: Option<ToolChoice>,
    },
    /// The tokens a text would add to a context (version 2): to `context`, or to a new one.
    Count {
        id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<u64>,
        text: String,
        #[serde(default)]
        format: PromptFormat,
    },
    /// Brings a context's missing chunks back without a call (version 2): queued behind every
    /// call, so an app about to call pays its switch before the user types.
    Prewarm { id: u64, context: u64 },
    /// A context's turns (version 2).
    Export { id: u64, context: u64 },
    /// A new context of the caller's with the same tokens and turns as `context`, sharing its
    /// computed chunks (version 2); answered with `created`.
    Fork { id: u64, context: u64 },
    /// Cancels a call of this connection (queued or running).
    Cancel { id: u64, call: u64 },
    /// Deletes a context.
    Delete { id: u64, context: u64 },
    /// The caller's contexts.
    List { id: u64 },
    /// One context.
    Info { id: u64, context: u64 },
    /// Service-wide counters.
    Stats { id: u64 },
}

/// The most tokens a call generates when it does not say: the wire's default, and the typed
/// client's, the CLI's and the service's.
pub const DEFAULT_MAX_TOKENS: usize = 256;

fn default_max_tokens() -> usize {
    DEFAULT_MAX_TOKENS
}

fn default_top_p() -> f32 {
    1.0
}

impl Request {
    /// The request's id.
    pub fn id(&self) -> u64 {
        match *self {
            Request::Hello { id, .. }
            | Request::New { id, .. }
            | Request::Call { id, .. }
            | Request::ToolResult { id, .. }
            | Request::Count { id, .. }
            | Request::Prewarm { id, .. }
            | Request::Export { id, .. }
            | Request::Fork { id, .. }
            | Request::Cancel { id, .. }
            | Request::Delete { id, .. }
            | Request::List { id }
            | Request::Info { id, .. }
            | Request::Stats { id } => id,
        }
    }

    /// The op's name, for logs.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::New { .. } => "new",
            Request::Call { .. } => "call",
            Request::ToolResult { .. } => "tool_result",
            Request::Count { .. } => "count",
            Request::Prewarm { .. } => "prewarm",
            Request::Export { .. } => "export",
            Request::Fork { .. } => "fork",
            Request::Cancel { .. } => "cancel",
            Request::Delete { .. } => "delete",
            Request::List { .. } => "list",
            Request::Info { .. } => "info",
            Request::Stats { .. } => "stats",
        }
    }

    /// Whether the request uses what only version 2 has (a version 1 connection may not).
    pub fn needs_v2(&self) -> bool {
        match self {
            Request::Count { .. }
            | Request::Prewarm { .. }
            | Request::Export { .. }
            | Request::Fork { .. }
            | Request::ToolResult { .. } => true,
            Request::New {
                transcript, tools, ..
            } => transcript.is_some() || !tools.is_empty(),
            Request::Call {
                response_format,
                tools,
                tool_choice,
                ..
            } => response_format.is_some() || !tools.is_empty() || tool_choice.is_some(),
            _ => false,
        }
    }

    /// Checks every value's range (what serde's types do not).
    pub fn validate(&self) -> Result<(), ErrorBody> {
        let bad = |m: String| Err(ErrorBody::new(codes::BAD_REQUEST, m));
        match self {
            Request::Hello { version, app, .. } => {
                if !(MIN_VERSION..=VERSION).contains(version) {
                    return Err(ErrorBody::new(
                        codes::VERSION,
                        format!(
                            "this daemon speaks protocol versions {MIN_VERSION} to {VERSION}, \
                             not {version}"
                        ),
                    ));
                }
                if app.is_empty()
                    || app.len() > MAX_APP
                    || !app
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                {
                    return bad(format!(
                        "app names are 1 to {MAX_APP} characters of A-Z a-z 0-9 . _ -"
                    ));
                }
            }
            Request::New {
                system,
                format,
                transcript,
                tools,
                ..
            } => check_new(system.as_deref(), *format, transcript.as_ref(), tools)?,
            Request::Call {
                prompt,
                format,
                max_tokens,
                temperature,
                top_p,
                stop,
                response_format,
                tools,
                tool_choice,
                ..
            } => {
                if *format == PromptFormat::Raw && prompt.is_empty() {
                    return bad("a raw prompt must not be empty".into());
                }
                if *format == PromptFormat::Raw && (!tools.is_empty() || tool_choice.is_some()) {
                    return bad(
                        "tools live in the chat template; a raw prompt cannot use them".into(),
                    );
                }
                if !tools.is_empty() {
                    tools::validate_tools(tools)?;
                    if let Some(c) = tool_choice {
                        tools::validate_choice(c, tools)?;
                    }
                }
                check_generation(
                    *max_tokens,
                    *temperature,
                    *top_p,
                    stop,
                    response_format.as_ref(),
                    tool_choice.as_ref(),
                )?;
            }
            Request::ToolResult {
                max_tokens,
                temperature,
                top_p,
                stop,
                response_format,
                tool_choice,
                ..
            } => check_generation(
                *max_tokens,
                *temperature,
                *top_p,
                stop,
                response_format.as_ref(),
                tool_choice.as_ref(),
            )?,
            _ => {}
        }
        Ok(())
    }
}

/// Checks a `new`: a transcript alone, tools with the chat format.
fn check_new(
    system: Option<&str>,
    format: PromptFormat,
    transcript: Option<&Transcript>,
    tools: &[Tool],
) -> Result<(), ErrorBody> {
    let bad = |m: String| Err(ErrorBody::new(codes::BAD_REQUEST, m));
    if let Some(t) = transcript {
        if system.is_some() {
            return bad("a transcript carries its own system turn; send system or \
                                    transcript"
                .into());
        }
        if !tools.is_empty() {
            return bad(
                "a transcript declares its tools in a tools turn; send tools \
                                    or transcript"
                    .into(),
            );
        }
        t.validate()?;
    }
    if !tools.is_empty() {
        tools::validate_tools(tools)?;
        if format == PromptFormat::Raw {
            return bad("tools are declared in the chat template; send them with \
                                    the chat format"
                .into());
        }
    }
    Ok(())
}

/// Checks a call's generation settings: the ranges, and formats that go together.
fn check_generation(
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    stop: &[String],
    response_format: Option<&ResponseFormat>,
    tool_choice: Option<&ToolChoice>,
) -> Result<(), ErrorBody> {
    let bad = |m: &str| Err(ErrorBody::new(codes::BAD_REQUEST, m));
    if response_format.is_some() && !stop.is_empty() {
        return bad(
            "stop strings would cut a structured answer; send response_format without stop",
        );
    }
    if let Some(ResponseFormat::Regex { pattern }) = response_format
        && pattern.is_empty()
    {
        return bad("response_format's regex pattern must not be empty");
    }
    if response_format.is_some()
        && matches!(
            tool_choice,
            Some(ToolChoice::Required | ToolChoice::Tool(_))
        )
    {
        return bad(
            "a tool call is the whole answer: response_format goes with tool_choice auto or none",
        );
    }
    if max_tokens == 0 || max_tokens > MAX_CALL_TOKENS {
        return bad(&format!("max_tokens must be 1 to {MAX_CALL_TOKENS}"));
    }
    if !(temperature.is_finite() && (0.0..=100.0).contains(&temperature)) {
        return bad("temperature must be a number from 0 (greedy) to 100");
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad("top_p must be in (0, 1]");
    }
    if stop.len() > MAX_STOPS
        || stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return bad(&format!(
            "at most {MAX_STOPS} stop strings of 1 to {MAX_STOP_BYTES} bytes"
        ));
    }
    Ok(())
}

/// An error reply's body: a stable code and a message that says what to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
    /// `context_full`'s numbers (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<FullNumbers>,
    /// `over_budget`'s numbers (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Box<BudgetNumbers>>,
}

impl ErrorBody {
    pub fn new(code: &str, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            code: code.to_owned(),
            message: message.into(),
            tokens: None,
            memory: None,
        }
    }
}

/// Why a call does not fit in the KV memory budget, in bytes: what the context's chunks and the
/// call's new ones take, and the whole budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetNumbers {
    pub needed: u64,
    pub budget: u64,
}

/// Why a context is full, in tokens: its window, what it holds, what is left, and what the
/// prompt needed (its tokens and one for the answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FullNumbers {
    pub context_window: usize,
    pub used: usize,
    pub remaining: usize,
    pub needed: usize,
}

/// Parses one request line (without its newline) and validates it. On failure the error comes
/// with the request's id when the line has a readable one.
pub fn parse_request(line: &[u8]) -> Result<Request, (Option<u64>, ErrorBody)> {
    let text = std::str::from_utf8(line).map_err(|e| {
        (
            None,
            ErrorBody::new(
                codes::BAD_REQUEST,
                format!(
                    "the line is not UTF-8 (bad byte at {}); send one JSON object per line",
                    e.valid_up_to()
                ),
            ),
        )
    })?;
    match serde_json::from_str::<Request>(text) {
        Ok(r) => {
            r.validate().map_err(|e| (Some(r.id()), e))?;
            Ok(r)
        }
        Err(e) => {
            #[derive(Deserialize)]
            struct IdProbe {
                id: Option<u64>,
            }
            let id = serde_json::from_str::<IdProbe>(text)
                .ok()
                .and_then(|p| p.id);
            Err((
                id,
                ErrorBody::new(
                    codes::BAD_REQUEST,
                    format!("{e}; see docs/protocol.md for the requests"),
                ),
            ))
        }
    }
}

/// One reply line: the request's id (null when the request had none readable) and an event or
/// an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub id: Option<u64>,
    #[serde(flatten)]
    pub body: ReplyBody,
}

/// An event or an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ReplyBody {
    Error { error: ErrorBody },
    Event(Event),
}

impl Reply {
    pub fn event(id: u64, e: Event) -> Reply {
        Reply {
            id: Some(id),
            body: ReplyBody::Event(e),
        }
    }

    pub fn error(id: Option<u64>, e: ErrorBody) -> Reply {
        Reply {
            id,
            body: ReplyBody::Error { error: e },
        }
    }

    /// The reply as one line, newline included.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|e| {
            format!(
                r#"{{"id":null,"error":{{"code":"internal","message":"encoding a reply: {e}"}}}}"#
            )
        });
        s.push('\n');
        s
    }
}

/// What the daemon says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The answer to `hello`.
    Hello(HelloReply),
    /// A context was created.
    Created { context: u64 },
    /// One generated token and the text it completes (empty while a character is incomplete).
    Token { token: u32, text: String },
    /// The call ended.
    Done(Box<Done>),
    /// `cancel` or `delete` succeeded.
    Ok,
    /// The answer to `list`.
    Contexts { contexts: Vec<ContextInfo> },
    /// The answer to `info`.
    Info { context: ContextInfo },
    /// The answer to `stats`.
    Stats(Box<Stats>),
    /// The answer to `count` (version 2).
    Count(TokenCount),
    /// The answer to `prewarm` (version 2): every chunk of the context is resident.
    Prewarmed(Prewarmed),
    /// The answer to `export` (version 2).
    Transcript {
        context: u64,
        transcript: Transcript,
    },
    /// The call's answer is a call of this tool (version 2): its arguments validate against the
    /// tool's schema. The call's `done` follows, with `stop` `tool_call`; answer it with
    /// `tool_result`.
    ToolCall {
        name: String,
        arguments: serde_json::Value,
    },
}

/// What `prewarm` did: the context's chunks that were missing and how they came back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prewarmed {
    /// Sealed chunks the context holds.
    pub chunks: usize,
    /// Of those, not resident when the prewarm ran.
    pub missing: usize,
    /// Read from the store.
    pub read: usize,
    /// Recomputed from their tokens (including failed reads).
    pub recomputed: usize,
    pub read_bytes: u64,
    /// The Load, measured and as the planner predicted it, milliseconds.
    pub load_ms: f64,
    pub load_predicted_ms: f64,
    /// Request received to the prewarm starting (the time it yielded to calls), milliseconds.
    pub queue_ms: f64,
}

/// What `count` says: the tokens the text would add, and the context's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCount {
    /// Tokens the text would add to the context, as a call's prompt in that format (the chat
    /// template's tokens included).
    pub tokens: usize,
    pub context_window: usize,
    /// Tokens the context holds (0 without a context).
    pub used: usize,
    /// `context_window - used`; a call fits without sliding the window when `tokens <
    /// remaining` (one token is left for the answer).
    pub remaining: usize,
}

/// Where a call's tokens came from (version 2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// The prompt's tokens (the chat template's included), prefilled.
    pub prompt: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Tokens of the context the call started from whose K/V was used as it was: resident, or
    /// read from the store.
    pub reused: usize,
    /// Tokens of the context the call started from whose K/V was computed again: chunks the
    /// Load recomputed, the open tail of the last call, the tokens a sliding window kept.
    pub recomputed: usize,
    /// Of `reused`, the tokens whose chunks were read from the store.
    pub read: usize,
}

/// The answer to `hello`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HelloReply {
    pub version: u32,
    /// The uid the daemon saw on the socket (SO_PEERCRED).
    pub uid: u32,
    pub app: String,
    /// The model's file name.
    pub model: String,
    /// The most tokens a context holds.
    pub max_context_tokens: usize,
    /// The longest request line the daemon reads.
    pub max_line: usize,
    /// Contexts one app may hold.
    pub max_contexts_per_app: usize,
}

/// The end of a call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Done {
    /// `stop` (an end-of-turn token), `max_tokens`, `stop_string`, `cancelled` or
    /// `context_full`.
    pub stop: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Tokens the context holds after the call.
    pub context_tokens: usize,
    /// Tokens the sliding window dropped from the full context before this call (the rest was
    /// prefilled again with the prompt: see `timings.prefill_tokens`).
    #[serde(default)]
    pub window_dropped: usize,
    pub timings: Timings,
    pub chunks: ChunkCounts,
    /// The context's window, what it holds after the call (`context_tokens`) and what is left
    /// (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<usize>,
    /// Where the call's tokens came from (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A call's timings, milliseconds unless named otherwise.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Request received to every chunk of the context resident (queue wait + load).
    pub switch_ms: f64,
    /// Time in the daemon's queue.
    pub queue_ms: f64,
    /// The Load: measured and as the planner predicted it, and its parts.
    pub load_ms: f64,
    pub load_predicted_ms: f64,
    pub plan_ms: f64,
    pub io_ms: f64,
    pub recompute_ms: f64,
    /// Prompt tokens prefilled (with what the previous call left open) and their speed.
    pub prefill_tokens: usize,
    pub prefill_ms: f64,
    pub prefill_tps: f64,
    pub decode_ms: f64,
    pub decode_tps: f64,
    /// Request received to `done`: the call's end included.
    pub total_ms: f64,
    /// Time the answer's format took, masks and steps, over every token (version 2, calls with
    /// `response_format` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guide_ms: Option<f64>,
    /// The call's end after its last token (version 2): the attention merged into the chunks'
    /// densities, chunks recompressed, the tokens made durable and the write-out queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ms: Option<f64>,
}

/// What a call did to the context's chunks.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkCounts {
    /// Missing when the call arrived.
    pub missing: usize,
    /// Read from the store.
    pub read: usize,
    /// Recomputed from their tokens (including failed reads).
    pub recomputed: usize,
    /// Reads that failed their checks.
    pub failed_reads: usize,
    pub read_bytes: u64,
    /// Moved down a compression level at the end of the call.
    pub recompressed: usize,
    /// Queued for ahead-of-time write-out.
    pub queued_writes: usize,
}

/// A context as `list` and `info` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextInfo {
    pub id: u64,
    pub app: String,
    pub tokens: usize,
    pub chunks: usize,
    pub resident_chunks: usize,
    pub resident_bytes: u64,
    /// Sealed chunks per format.
    pub formats: BTreeMap<String, usize>,
    /// Completed calls since the daemon started.
    pub calls: u64,
    /// The context's window, what it holds (`tokens`) and what is left (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<usize>,
    /// How many of its first chunks it borrows from a shared prefix (version 2): a fork's
    /// parent's, or another context's of the caller with the same first tokens. They are held
    /// once, whatever the number of contexts that borrow them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_chunks: Option<usize>,
}

/// The answer to `stats`: the context manager's counters ([`ServiceStats`], its fields at the
/// top level of the reply, as docs/protocol.md lists them) and the daemon's own.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    #[serde(flatten)]
    pub service: ServiceStats,
    pub daemon: DaemonStats,
}

/// The daemon's own counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DaemonStats {
    pub uptime_secs: f64,
    pub connections: usize,
    pub queued: usize,
    pub requests: u64,
    pub errors: u64,
    pub busy: u64,
}

/// Service-wide counters. The protocol's `stats` reply carries them field by field as they are
/// here, beside the daemon's own counters ([`Stats`]), so these names and units are
/// the wire contract of docs/protocol.md; the `serde(default)`s let a client read a daemon
/// that predates a field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServiceStats {
    /// The context manager (`llms serve --manager`).
    #[serde(default)]
    pub manager: String,
    pub budget_bytes: u64,
    pub resident_bytes: u64,
    pub contexts: usize,
    /// Shared prefixes that contexts borrow chunks from, and the bytes of theirs resident
    /// (counted once in `resident_bytes`).
    #[serde(default)]
    pub shared_prefixes: usize,
    #[serde(default)]
    pub shared_resident_bytes: u64,
    pub calls: u64,
    pub chunks_read: u64,
    pub chunks_recomputed: u64,
    pub faults: u64,
    pub reclaims: u64,
    /// Victims given up before they were written out (they are recomputed when needed).
    pub unwritten_reclaims: u64,
    /// Victims written out while the reclaim waited (never written ahead of time, or not yet).
    #[serde(default)]
    pub sync_reclaims: u64,
    /// Calls that slid their context's window (it was full).
    #[serde(default)]
    pub window_slides: u64,
    pub writes: u64,
    pub write_failures: u64,
    pub writes_queued: u64,
    /// The Load's read buffers (the io_uring's, or one part per I/O thread, sized to the largest
    /// chunks loaded).
    #[serde(default)]
    pub load_buffer_bytes: u64,
    /// Of those, the bytes the kernel backs with transparent huge pages, into which direct reads
    /// run about twice as fast (`load_buffer_bytes` when it gave them all).
    #[serde(default)]
    pub load_buffer_huge_bytes: u64,
    /// Whether the Load reads through an io_uring (through the mount, where the kernel allows
    /// it), or with one thread per read in flight.
    #[serde(default)]
    pub load_io_uring: bool,
    /// Switch latency (request received to chunks resident), all calls.
    pub switch: Latency,
    /// The model's weights: what they hold and what they read (`--weight-budget`).
    #[serde(default)]
    pub weights: ServiceWeights,
}

/// Latencies, milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub count: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The model's weights under their budget: the same accounting as the KV side's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServiceWeights {
    /// The weight budget (`--weight-budget`); `None` (absent on the wire): every weight resident.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
    /// How the resident matrices were chosen: `all` without a budget, else the planner's
    /// residency (`stream`, `inorder`, `balanced`, `preserve`).
    pub residency: String,
    /// Bytes held in memory for the weights, what the budget counts: resident matrices, norms,
    /// tables and the stream's buffers.
    pub resident_bytes: u64,
    /// Of `resident_bytes`, the stream's buffers (ring and staging).
    pub buffer_bytes: u64,
    /// Bytes of the matrices that are not resident: what every decode token reads.
    pub streamed_bytes: u64,
    /// Bytes read from the model file for streamed matrices since start (every pass: prefill,
    /// decode and recompute).
    pub bytes_read: u64,
    /// Decode tokens measured: each one a forward pass of one token between two streamed tokens.
    pub decode_tokens: u64,
    /// Bytes those decode tokens read, over their count (0 with nothing streamed or measured).
    pub read_bytes_per_token: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(line: &str, expected: Result<Request, (Option<u64>, &str)>) {
        let got = parse_request(line.as_bytes()).map_err(|(id, e)| (id, e.code));
        match (&got, &expected) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{line}"),
            (Err((ia, ca)), Err((ib, cb))) => {
                assert_eq!((ia, ca.as_str()), (ib, *cb), "{line}")
            }
            _ => panic!("{line}: got {got:?}, expected {expected:?}"),
        }
    }

    fn call(id: u64, context: u64, prompt: &str) -> Request {
        Request::Call {
            id,
            context,
            prompt: prompt.into(),
            format: PromptFormat::Chat,
            max_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            stop: vec![],
            response_format: None,
            tools: Vec::new(),
            tool_choice: None,
        }
    }

    #[test]
    fn requests() {
        let hello = Request::Hello {
            id: 1,
            version: 1,
            app: "notes".into(),
        };
        check(
            r#"{"op":"hello","id":1,"version":1,"app":"notes"}"#,
            Ok(hello),
        );
        check(
            r#"{"op":"call","id":3,"context":7,"prompt":"Hi"}"#,
            Ok(call(3, 7, "Hi")),
        );
        check(r#"{"op":"list","id":9}"#, Ok(Request::List { id: 9 }));
        let new = Request::New {
            id: 2,
            system: Some("terse".into()),
            format: PromptFormat::Raw,
            transcript: None,
            tools: Vec::new(),
        };
        check(
            r#"{"op":"new","id":2,"system":"terse","format":"raw"}"#,
            Ok(new),
        );
        check(
            r#"{"op":"frobnicate","id":4}"#,
            Err((Some(4), codes::BAD_REQUEST)),
        );
        check(
            r#"{"op":"list","id":5,"extra":1}"#,
            Err((Some(5), codes::BAD_REQUEST)),
        );
        check(
            r#"{"op":"info","id":6,"context":"x"}"#,
            Err((Some(6), codes::BAD_REQUEST)),
        );
        check(r#"{"op":"list"}"#, Err((None, codes::BAD_REQUEST)));
        check(r#"{"op":"list","id":-1}"#, Err((None, codes::BAD_REQUEST)));
        check("not json", Err((None, codes::BAD_REQUEST)));
        check("", Err((None, codes::BAD_REQUEST)));
        check("[1,2]", Err((None, codes::BAD_REQUEST)));
        check(
            r#"{"op":"hello","id":1,"version":0,"app":"a"}"#,
            Err((Some(1), codes::VERSION)),
        );
        check(
            r#"{"op":"hello","id":1,"version":1,"app":"../etc"}"#,
            Err((Some(1), codes::BAD_REQUEST)),
        );
        for bad in [
            r#""max_tokens":0"#,
            r#""temperature":-1"#,
            r#""top_p":0"#,
            r#""top_p":1.5"#,
            r#""stop":[""]"#,
            r#""format":"yaml""#,
            r#""max_tokens":100000000"#,
        ] {
            let line = format!(r#"{{"op":"call","id":8,"context":1,"prompt":"x",{bad}}}"#);
            check(&line, Err((Some(8), codes::BAD_REQUEST)));
        }
        check(
            r#"{"op":"call","id":8,"context":1,"prompt":"","format":"raw"}"#,
            Err((Some(8), codes::BAD_REQUEST)),
        );
        let err = parse_request(&[b'{', 0xff, b'}']).unwrap_err();
        assert_eq!((err.0, err.1.code.as_str()), (None, codes::BAD_REQUEST));
    }

    proptest::proptest! {
        /// Any bytes get a request or an error, never a panic; an error's id is one the line
        /// really holds.
        #[test]
        fn any_bytes_parse_or_fail(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            if let Err((Some(id), _)) = parse_request(&bytes) {
                let text = String::from_utf8_lossy(&bytes);
                proptest::prop_assert!(text.contains(&id.to_string()));
            }
        }

        /// Every valid call survives the wire: serialized by the client, parsed by the daemon.
        #[test]
        fn calls_round_trip(
            id in 0u64..u64::MAX,
            context in 0u64..1000,
            prompt in ".{0,40}",
            max_tokens in 1usize..=MAX_CALL_TOKENS,
            temperature in 0.0f32..=100.0,
            top_p in 0.001f32..=1.0,
            top_k in 0usize..100,
            seed in proptest::prelude::any::<u64>(),
            stop in proptest::collection::vec(".{1,8}", 0..4),
        ) {
            let r = Request::Call {
                id, context, prompt, format: PromptFormat::Chat, max_tokens, temperature, top_p,
                top_k, seed, stop, response_format: None, tools: Vec::new(), tool_choice: None,
            };
            let line = serde_json::to_vec(&r).unwrap();
            proptest::prop_assert_eq!(parse_request(&line).unwrap(), r);
        }
    }

    #[test]
    fn version_2_requests() {
        check(
            r#"{"op":"hello","id":1,"version":2,"app":"a"}"#,
            Ok(Request::Hello {
                id: 1,
                version: 2,
                app: "a".into(),
            }),
        );
        check(
            r#"{"op":"hello","id":1,"version":3,"app":"a"}"#,
            Err((Some(1), codes::VERSION)),
        );
        let schema =
            serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let mut with_schema = call(3, 7, "Hi");
        if let Request::Call {
            response_format, ..
        } = &mut with_schema
        {
            *response_format = Some(ResponseFormat::JsonSchema {
                schema: schema.clone(),
            });
        }
        check(
            &format!(
                r#"{{"op":"call","id":3,"context":7,"prompt":"Hi","response_format":{{"type":"json_schema","schema":{schema}}}}}"#
            ),
            Ok(with_schema.clone()),
        );
        assert!(with_schema.needs_v2());
        assert!(!call(3, 7, "Hi").needs_v2());
        check(
            r#"{"op":"call","id":3,"context":7,"prompt":"Hi","response_format":{"type":"regex","pattern":"(yes|no)"}}"#,
            Ok({
                let mut c = call(3, 7, "Hi");
                if let Request::Call {
                    response_format, ..
                } = &mut c
                {
                    *response_format = Some(ResponseFormat::Regex {
                        pattern: "(yes|no)".into(),
                    });
                }
                c
            }),
        );
        for bad in [
            r#"{"type":"grammar","pattern":"x"}"#,
            r#"{"type":"regex"}"#,
            r#"{"type":"regex","pattern":""}"#,
            r#"{"type":"regex","pattern":"x","flags":"i"}"#,
            r#"{"type":"json_schema"}"#,
            r#""json""#,
        ] {
            let line = format!(
                r#"{{"op":"call","id":8,"context":1,"prompt":"x","response_format":{bad}}}"#
            );
            check(&line, Err((Some(8), codes::BAD_REQUEST)));
        }
        check(
            r#"{"op":"call","id":8,"context":1,"prompt":"x","stop":["}"],"response_format":{"type":"regex","pattern":"x"}}"#,
            Err((Some(8), codes::BAD_REQUEST)),
        );
        check(
            r#"{"op":"count","id":4,"text":"hello"}"#,
            Ok(Request::Count {
                id: 4,
                context: None,
                text: "hello".into(),
                format: PromptFormat::Chat,
            }),
        );
        check(
            r#"{"op":"count","id":4,"context":2,"text":"hello","format":"raw"}"#,
            Ok(Request::Count {
                id: 4,
                context: Some(2),
                text: "hello".into(),
                format: PromptFormat::Raw,
            }),
        );
        check(
            r#"{"op":"count","id":4}"#,
            Err((Some(4), codes::BAD_REQUEST)),
        );
        check(
            r#"{"op":"export","id":6,"context":3}"#,
            Ok(Request::Export { id: 6, context: 3 }),
        );
        let turns = |roles: &[&str]| Transcript {
            turns: roles
                .iter()
                .map(|r| Turn {
                    role: (*r).into(),
                    text: "x".into(),
                })
                .collect(),
        };
        let rebuilt = Request::New {
            id: 7,
            system: None,
            format: PromptFormat::Chat,
            transcript: Some(turns(&["system", "user", "assistant", "raw"])),
            tools: Vec::new(),
        };
        check(
            r#"{"op":"new","id":7,"transcript":{"turns":[{"role":"system","text":"x"},{"role":"user","text":"x"},{"role":"assistant","text":"x"},{"role":"raw","text":"x"}]}}"#,
            Ok(rebuilt.clone()),
        );
        assert!(rebuilt.needs_v2() && Request::Export { id: 6, context: 3 }.needs_v2());
        let fork = Request::Fork { id: 7, context: 3 };
        assert_eq!(
            parse_request(br#"{"op":"fork","id":7,"context":3}"#),
            Ok(fork.clone())
        );
        assert!(fork.needs_v2());
        assert_eq!(fork.op(), "fork");
        for (line, code) in [
            (
                r#"{"op":"new","id":7,"transcript":{"turns":[{"role":"robot","text":"x"}]}}"#,
                codes::INVALID_TRANSCRIPT,
            ),
            (
                r#"{"op":"new","id":7,"system":"s","transcript":{"turns":[]}}"#,
                codes::BAD_REQUEST,
            ),
            (
                r#"{"op":"new","id":7,"transcript":{"turns":[{"role":"user"}]}}"#,
                codes::BAD_REQUEST,
            ),
            (
                r#"{"op":"new","id":7,"transcript":[{"role":"user","text":"x"}]}"#,
                codes::BAD_REQUEST,
            ),
        ] {
            check(line, Err((Some(7), code)));
        }
        let prewarm = Request::Prewarm { id: 5, context: 3 };
        check(
            r#"{"op":"prewarm","id":5,"context":3}"#,
            Ok(prewarm.clone()),
        );
        assert!(prewarm.needs_v2());
        assert_eq!(prewarm.op(), "prewarm");
        for bad in [
            r#"{"op":"prewarm","id":5}"#,
            r#"{"op":"prewarm","id":5,"context":-1}"#,
            r#"{"op":"prewarm","id":5,"context":3,"prompt":"x"}"#,
        ] {
            check(bad, Err((Some(5), codes::BAD_REQUEST)));
        }
    }

    #[test]
    fn tool_requests() {
        let tool =
            r#"{"name":"get_weather","description":"Weather now","parameters":{"type":"object"}}"#;
        let Ok(Request::Call {
            tools, tool_choice, ..
        }) = parse_request(
            format!(
                r#"{{"op":"call","id":3,"context":7,"prompt":"Hi","tools":[{tool}],"tool_choice":{{"name":"get_weather"}}}}"#
            )
            .as_bytes(),
        )
        else {
            panic!("a call with tools does not parse")
        };
        assert_eq!(tools[0].name, "get_weather");
        assert_eq!(tool_choice, Some(ToolChoice::Tool("get_weather".into())));
        let result =
            parse_request(br#"{"op":"tool_result","id":4,"context":7,"content":"18 C"}"#).unwrap();
        assert!(result.needs_v2() && result.op() == "tool_result" && result.id() == 4);
        let with_tools =
            parse_request(format!(r#"{{"op":"new","id":2,"tools":[{tool}]}}"#).as_bytes()).unwrap();
        assert!(with_tools.needs_v2());
        let choice = parse_request(
            br#"{"op":"call","id":3,"context":7,"prompt":"Hi","tool_choice":"none"}"#,
        )
        .unwrap();
        assert!(choice.needs_v2());
        for (line, names) in [
            (format!(r#"{{"op":"call","id":8,"context":1,"prompt":"x","tools":[{tool},{tool}]}}"#), "\"get_weather\""),
            (format!(r#"{{"op":"call","id":8,"context":1,"prompt":"x","tools":[{tool}],"tool_choice":{{"name":"other"}}}}"#), "\"other\""),
            (format!(r#"{{"op":"call","id":8,"context":1,"prompt":"x","tools":[{tool}],"format":"raw"}}"#), "raw"),
            (format!(r#"{{"op":"new","id":8,"tools":[{tool}],"format":"raw"}}"#), "chat"),
            (format!(r#"{{"op":"new","id":8,"tools":[{tool}],"transcript":{{"turns":[]}}}}"#), "tools turn"),
            (r#"{"op":"call","id":8,"context":1,"prompt":"x","tool_choice":"maybe"}"#.into(), "maybe"),
            (r#"{"op":"call","id":8,"context":1,"prompt":"x","tools":[{"name":"f"}]}"#.into(), "parameters"),
            (r#"{"op":"tool_result","id":8,"context":1}"#.into(), "content"),
            (r#"{"op":"tool_result","id":8,"context":1,"content":"x","prompt":"y"}"#.into(), "prompt"),
            (r#"{"op":"tool_result","id":8,"context":1,"content":"x","tool_choice":"required","response_format":{"type":"regex","pattern":"x"}}"#.into(), "whole answer"),
        ] {
            let (id, e) = parse_request(line.as_bytes()).unwrap_err();
            assert_eq!((id, e.code.as_str()), (Some(8), codes::BAD_REQUEST), "{line}");
            assert!(e.message.contains(names), "{line}: {}", e.message);
        }
    }

    /// A version 1 reply (no v2 field set) is the line version 1 always sent; the v2 fields
    /// round trip.
    #[test]
    fn version_1_replies_carry_no_version_2_field() {
        let done = Done {
            stop: "stop".into(),
            tokens: 1,
            context_tokens: 2,
            window_dropped: 0,
            timings: Timings::default(),
            chunks: ChunkCounts::default(),
            context_window: None,
            used: None,
            remaining: None,
            usage: None,
        };
        let line = Reply::event(1, Event::Done(Box::new(done))).to_line();
        for v2 in [
            "context_window",
            "used",
            "remaining",
            "usage",
            "guide_ms",
            "end_ms",
        ] {
            assert!(!line.contains(v2), "{line}");
        }
        let full = ErrorBody {
            tokens: Some(FullNumbers {
                context_window: 8,
                used: 6,
                remaining: 2,
                needed: 5,
            }),
            ..ErrorBody::new(codes::CONTEXT_FULL, "full")
        };
        let line = Reply::error(Some(2), full.clone()).to_line();
        assert_eq!(
            line,
            concat!(
                r#"{"id":2,"error":{"code":"context_full","message":"full","#,
                r#""tokens":{"context_window":8,"used":6,"remaining":2,"needed":5}}}"#,
                "\n"
            )
        );
        let back: Reply = serde_json::from_str(&line).unwrap();
        assert_eq!(back, Reply::error(Some(2), full));
        let count = Reply::event(
            3,
            Event::Count(TokenCount {
                tokens: 4,
                context_window: 8,
                used: 1,
                remaining: 7,
            }),
        );
        let line = count.to_line();
        assert_eq!(
            line,
            "{\"id\":3,\"event\":\"count\",\"tokens\":4,\"context_window\":8,\"used\":1,\"remaining\":7}\n"
        );
        assert_eq!(serde_json::from_str::<Reply>(&line).unwrap(), count);
    }

    #[test]
    fn replies_round_trip() {
        let replies = [
            Reply::event(
                1,
                Event::Token {
                    token: 5,
                    text: "hi".into(),
                },
            ),
            Reply::event(2, Event::Ok),
            Reply::event(3, Event::Created { context: 9 }),
            Reply::error(None, ErrorBody::new(codes::BUSY, "later")),
            Reply::event(
                4,
                Event::Done(Box::new(Done {
                    stop: "max_tokens".into(),
                    tokens: 3,
                    context_tokens: 40,
                    window_dropped: 0,
                    timings: Timings::default(),
                    chunks: ChunkCounts::default(),
                    context_window: Some(1024),
                    used: Some(40),
                    remaining: Some(984),
                    usage: Some(Usage {
                        prompt: 30,
                        generated: 3,
                        reused: 7,
                        recomputed: 0,
                        read: 0,
                    }),
                })),
            ),
            Reply::event(5, Event::Stats(Box::default())),
            Reply::event(
                7,
                Event::Prewarmed(Prewarmed {
                    chunks: 12,
                    missing: 10,
                    read: 9,
                    recomputed: 1,
                    read_bytes: 1 << 20,
                    load_ms: 1.5,
                    load_predicted_ms: 1.25,
                    queue_ms: 0.5,
                }),
            ),
            Reply::event(
                6,
                Event::Contexts {
                    contexts: vec![ContextInfo {
                        id: 1,
                        app: "a".into(),
                        tokens: 3,
                        chunks: 0,
                        resident_chunks: 0,
                        resident_bytes: 0,
                        formats: BTreeMap::new(),
                        calls: 1,
                        context_window: None,
                        used: None,
                        remaining: None,
                        shared_chunks: None,
                    }],
                },
            ),
        ];
        for r in replies {
            let line = r.to_line();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            let back: Reply = serde_json::from_str(&line).unwrap();
            assert_eq!(back, r, "{line}");
        }
        assert_eq!(
            Reply::error(Some(3), ErrorBody::new("not_found", "no context 3")).to_line(),
            "{\"id\":3,\"error\":{\"code\":\"not_found\",\"message\":\"no context 3\"}}\n"
        );
        assert_eq!(
            Reply::event(3, Event::Created { context: 9 }).to_line(),
            "{\"id\":3,\"event\":\"created\",\"context\":9}\n"
        );
    }

    /// The `stats` reply exactly as docs/protocol.md lists it: the manager's counters at the top
    /// level beside `daemon`, `weights.budget_bytes` absent without a budget, and a reply of a
    /// daemon that predates `manager`, `sync_reclaims`, `window_slides`, the load buffers and
    /// `weights` still read.
    #[test]
    fn a_stats_reply_keeps_the_documented_fields() {
        use crate::{Latency, ServiceStats, ServiceWeights};
        let stats = Stats {
            service: ServiceStats {
                manager: "llms".into(),
                budget_bytes: 1,
                resident_bytes: 2,
                contexts: 3,
                shared_prefixes: 0,
                shared_resident_bytes: 0,
                calls: 4,
                chunks_read: 5,
                chunks_recomputed: 6,
                faults: 7,
                reclaims: 8,
                unwritten_reclaims: 9,
                sync_reclaims: 10,
                window_slides: 11,
                writes: 12,
                write_failures: 13,
                writes_queued: 14,
                load_buffer_bytes: 29,
                load_buffer_huge_bytes: 30,
                load_io_uring: true,
                switch: Latency {
                    count: 15,
                    mean_ms: 1.5,
                    p50_ms: 1.25,
                    p99_ms: 2.5,
                    max_ms: 3.0,
                },
                weights: ServiceWeights {
                    budget_bytes: Some(16),
                    residency: "balanced".into(),
                    resident_bytes: 17,
                    buffer_bytes: 18,
                    streamed_bytes: 19,
                    bytes_read: 20,
                    decode_tokens: 21,
                    read_bytes_per_token: 22.5,
                },
            },
            daemon: DaemonStats {
                uptime_secs: 23.5,
                connections: 24,
                queued: 25,
                requests: 26,
                errors: 27,
                busy: 28,
            },
        };
        let reply = Reply::event(7, Event::Stats(Box::new(stats.clone())));
        let line = reply.to_line();
        assert_eq!(
            line,
            concat!(
                r#"{"id":7,"event":"stats","manager":"llms","budget_bytes":1,"resident_bytes":2,"#,
                r#""contexts":3,"shared_prefixes":0,"shared_resident_bytes":0,"#,
                r#""calls":4,"chunks_read":5,"chunks_recomputed":6,"faults":7,"#,
                r#""reclaims":8,"unwritten_reclaims":9,"sync_reclaims":10,"window_slides":11,"#,
                r#""writes":12,"write_failures":13,"writes_queued":14,"#,
                r#""load_buffer_bytes":29,"load_buffer_huge_bytes":30,"load_io_uring":true,"#,
                r#""switch":{"count":15,"mean_ms":1.5,"p50_ms":1.25,"p99_ms":2.5,"max_ms":3.0},"#,
                r#""weights":{"budget_bytes":16,"residency":"balanced","resident_bytes":17,"#,
                r#""buffer_bytes":18,"streamed_bytes":19,"bytes_read":20,"decode_tokens":21,"#,
                r#""read_bytes_per_token":22.5},"#,
                r#""daemon":{"uptime_secs":23.5,"connections":24,"queued":25,"requests":26,"#,
                r#""errors":27,"busy":28}}"#,
                "\n"
            )
        );
        let back: Reply = serde_json::from_str(&line).unwrap();
        assert_eq!(back, reply);

        let mut unbudgeted = stats.clone();
        unbudgeted.service.weights.budget_bytes = None;
        let line = Reply::event(8, Event::Stats(Box::new(unbudgeted.clone()))).to_line();
        assert!(!line.contains("budget_bytes\":16"), "{line}");
        assert!(
            line.contains(r#""weights":{"residency":"balanced","#),
            "{line}"
        );
        let back: Reply = serde_json::from_str(&line).unwrap();
        assert_eq!(back, Reply::event(8, Event::Stats(Box::new(unbudgeted))));

        let old = concat!(
            r#"{"id":9,"event":"stats","budget_bytes":1,"resident_bytes":2,"contexts":3,"#,
            r#""calls":4,"chunks_read":5,"chunks_recomputed":6,"faults":7,"reclaims":8,"#,
            r#""unwritten_reclaims":9,"writes":12,"write_failures":13,"writes_queued":14,"#,
            r#""switch":{"count":15,"mean_ms":1.5,"p50_ms":1.25,"p99_ms":2.5,"max_ms":3.0},"#,
            r#""daemon":{"uptime_secs":23.5,"connections":24,"queued":25,"requests":26,"#,
            r#""errors":27,"busy":28}}"#
        );
        let Reply {
            body: ReplyBody::Event(Event::Stats(old)),
            ..
        } = serde_json::from_str(old).unwrap()
        else {
            panic!("not a stats reply: {old}")
        };
        let mut expected = stats;
        expected.service.manager = String::new();
        expected.service.sync_reclaims = 0;
        expected.service.window_slides = 0;
        expected.service.load_buffer_bytes = 0;
        expected.service.load_buffer_huge_bytes = 0;
        expected.service.load_io_uring = false;
        expected.service.weights = ServiceWeights::default();
        assert_eq!(*old, expected);
    }
}
