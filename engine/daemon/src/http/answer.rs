//! What both generating endpoints do with the daemon: make a context from a conversation's
//! turns (`new`, with a transcript when there is more than a system prompt), run its last turn as
//! a `call` (a user's message) or a `tool_result` (a tool's output), and read the answer's
//! events: text as it streams, a tool call whole, then `done` with the accounting.

use protocol::{Done, ErrorBody, Event, PromptFormat, Request, Tool, ToolChoice, Transcript, Turn};

use crate::http::error::ApiError;
use crate::http::session::{Session, gone};
use crate::http::wire::{Generation, turn};

/// The turn that declares `tools`, as the daemon's transcripts write it.
pub fn tools_turn(tools: &[Tool]) -> Turn {
    turn("tools", serde_json::to_string(tools).unwrap_or_default())
}

/// Makes a context of app `app` holding `turns` (system, user, assistant, tool call and tool
/// turns), `tools` declared with its system turn. A system prompt alone is only recorded (it is
/// prefilled with the first call); anything more is rebuilt as a transcript and prefilled now.
pub async fn create(
    s: &mut Session,
    app: &str,
    turns: &[Turn],
    tools: &[Tool],
) -> Result<u64, ErrorBody> {
    let only_system = match turns {
        [] => true,
        [t] => t.role == "system",
        _ => false,
    };
    let ev = if only_system {
        let system = turns.first().map(|t| t.text.clone());
        let tools = tools.to_vec();
        s.op(app, |id| Request::New {
            id,
            system,
            format: PromptFormat::Chat,
            transcript: None,
            tools,
        })
        .await?
    } else {
        let mut all = Vec::with_capacity(turns.len() + 1);
        if !tools.is_empty() {
            all.push(tools_turn(tools));
        }
        all.extend_from_slice(turns);
        s.op(app, |id| Request::New {
            id,
            system: None,
            format: PromptFormat::Chat,
            transcript: Some(Transcript { turns: all }),
            tools: Vec::new(),
        })
        .await?
    };
    match ev {
        Event::Created { context } => Ok(context),
        other => Err(unexpected(&other)),
    }
}

/// The turns a context made by [`create`] records (what `export` will give back).
pub fn created_turns(turns: &[Turn], tools: &[Tool]) -> Vec<Turn> {
    let mut all = Vec::with_capacity(turns.len() + 1);
    if !tools.is_empty() {
        all.push(tools_turn(tools));
    }
    all.extend_from_slice(turns);
    all
}

pub fn unexpected(e: &Event) -> ErrorBody {
    ErrorBody::new(
        "internal",
        format!("the daemon answered {e:?} unexpectedly"),
    )
}

/// Queues the call that answers `last` (a `user` turn: `call`; a `tool` turn: `tool_result`) on
/// `context`; `declare` tools on the call (those in force differ). Returns the call's id.
pub fn start(
    s: &mut Session,
    app: &str,
    context: u64,
    last: &Turn,
    g: &Generation,
    declare: Option<Vec<Tool>>,
) -> Result<u64, ErrorBody> {
    let g = g.clone();
    let text = last.text.clone();
    if last.role == "tool" {
        return s.start(app, |id| Request::ToolResult {
            id,
            context,
            content: text,
            max_tokens: g.max_tokens,
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: 0,
            seed: g.seed,
            stop: g.stop,
            response_format: g.response_format,
            tool_choice: g.tool_choice,
        });
    }
    s.start(app, |id| Request::Call {
        id,
        context,
        prompt: text,
        format: PromptFormat::Chat,
        max_tokens: g.max_tokens,
        temperature: g.temperature,
        top_p: g.top_p,
        top_k: 0,
        seed: g.seed,
        stop: g.stop,
        response_format: g.response_format,
        tools: declare.unwrap_or_default(),
        tool_choice: g.tool_choice,
    })
}

/// The tools to declare on a call whose request offers `wanted` on a context where `in_force`
/// are, and the choice to send: new tools are declared; a request without tools on a context
/// that has some answers in plain text (`none`).
pub fn tools_for_call(wanted: &[Tool], in_force: &[Tool], g: &mut Generation) -> Option<Vec<Tool>> {
    if wanted.is_empty() {
        if !in_force.is_empty() {
            g.tool_choice = Some(ToolChoice::None);
        }
        return None;
    }
    (wanted != in_force).then(|| wanted.to_vec())
}

/// One piece of an answer as it streams.
#[derive(Debug)]
pub enum Piece {
    Text(String),
    ToolCall {
        name: String,
        arguments: serde_json::Value,
    },
    Done(Box<Done>),
}

/// The next piece of call `id`'s answer; an error ends it.
pub async fn next(s: &mut Session, id: u64) -> Result<Piece, ErrorBody> {
    loop {
        match s.next(id).await.unwrap_or_else(|| Err(gone()))? {
            Event::Token { text, .. } if text.is_empty() => continue,
            Event::Token { text, .. } => return Ok(Piece::Text(text)),
            Event::ToolCall { name, arguments } => return Ok(Piece::ToolCall { name, arguments }),
            Event::Done(d) => return Ok(Piece::Done(d)),
            other => return Err(unexpected(&other)),
        }
    }
}

/// A whole answer.
#[derive(Debug)]
pub struct Answer {
    /// The text as streamed (a stop string included, as the context holds it).
    pub text: String,
    pub tool_call: Option<(String, serde_json::Value)>,
    pub done: Box<Done>,
}

impl Answer {
    /// The text a client sees: cut before the first stop string that ended it.
    pub fn visible(&self, stop: &[String]) -> String {
        visible(&self.text, &self.done.stop, stop)
    }

    /// The turn the daemon records for this answer.
    pub fn turn(&self) -> Turn {
        match &self.tool_call {
            Some((name, arguments)) => turn(
                "tool_call",
                serde_json::json!({"name": name, "arguments": arguments}).to_string(),
            ),
            None => turn("assistant", self.text.clone()),
        }
    }
}

/// `text` cut before the stop string that ended it (`stop_string`), as OpenAI's APIs return it.
pub fn visible(text: &str, why: &str, stop: &[String]) -> String {
    if why != "stop_string" {
        return text.to_owned();
    }
    let cut = stop.iter().filter_map(|s| text.find(s.as_str())).min();
    text[..cut.unwrap_or(text.len())].to_owned()
}

/// Reads call `id`'s answer whole.
pub async fn collect(s: &mut Session, id: u64) -> Result<Answer, ErrorBody> {
    let mut text = String::new();
    let mut tool_call = None;
    loop {
        match next(s, id).await? {
            Piece::Text(t) => text.push_str(&t),
            Piece::ToolCall { name, arguments } => tool_call = Some((name, arguments)),
            Piece::Done(done) => {
                return Ok(Answer {
                    text,
                    tool_call,
                    done,
                });
            }
        }
    }
}

/// The rest of an answer after its first piece.
pub async fn rest(s: &mut Session, id: u64, first: Piece) -> Result<Answer, ErrorBody> {
    let mut text = String::new();
    let mut tool_call = None;
    let mut piece = first;
    loop {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            Piece::ToolCall { name, arguments } => tool_call = Some((name, arguments)),
            Piece::Done(done) => {
                return Ok(Answer {
                    text,
                    tool_call,
                    done,
                });
            }
        }
        piece = next(s, id).await?;
    }
}

/// OpenAI's `finish_reason` for the daemon's stop.
pub fn finish_reason(stop: &str) -> &'static str {
    match stop {
        "max_tokens" | "context_full" => "length",
        "tool_call" => "tool_calls",
        _ => "stop",
    }
}

/// Token accounting as OpenAI's: the input the answer was computed from (the context before the
/// answer), of it the tokens whose K/V was reused from a context this uid already held
/// (`cached`: only when the call continued one), and the answer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokens {
    pub input: usize,
    pub cached: usize,
    pub output: usize,
}

impl Tokens {
    pub fn of(done: &Done, continued: bool) -> Tokens {
        let reused = done.usage.map_or(0, |u| u.reused);
        Tokens {
            input: done.context_tokens.saturating_sub(done.tokens),
            cached: if continued { reused } else { 0 },
            output: done.tokens,
        }
    }
}

/// The context `id`'s turns (`export`), a 404 if this uid holds no such context.
pub async fn turns_of(
    s: &mut Session,
    app: &str,
    context: u64,
    what: &str,
    id: &str,
) -> Result<Vec<Turn>, ApiError> {
    match s.op(app, |rid| Request::Export { id: rid, context }).await {
        Ok(Event::Transcript { transcript, .. }) => Ok(transcript.turns),
        Ok(e) => Err(unexpected(&e).into()),
        Err(e) if e.code == protocol::codes::NOT_FOUND => Err(ApiError::not_found(what, id)),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_is_cut_from_what_the_client_sees() {
        let stop = vec!["END".to_owned(), "\n\n".to_owned()];
        assert_eq!(visible("abc\n\nEND", "stop_string", &stop), "abc");
        assert_eq!(visible("abcEND", "stop", &stop), "abcEND");
        assert_eq!(visible("abc", "stop_string", &stop), "abc");
    }

    #[test]
    fn tools_declared_only_when_they_change() {
        let t = |n: &str| Tool {
            name: n.into(),
            description: String::new(),
            parameters: serde_json::json!({}),
        };
        let mut g = Generation::default();
        assert_eq!(tools_for_call(&[t("a")], &[t("a")], &mut g), None);
        assert_eq!(
            tools_for_call(&[t("b")], &[t("a")], &mut g),
            Some(vec![t("b")])
        );
        assert_eq!(tools_for_call(&[], &[t("a")], &mut g), None);
        assert_eq!(g.tool_choice, Some(ToolChoice::None));
    }
}
