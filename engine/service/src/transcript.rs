//! A context's transcript: its turns (who said what, as text), recorded at every call beside the
//! tokens, so a conversation can be exported, rebuilt from text on another device, or rebuilt
//! under another model (its tokens mean nothing to another tokenizer).
//!
//! kvfs keeps the transcript as opaque bytes (`Store::write_transcript`, replaced by write,
//! fsync, rename), and the tokens in their own file, so the two cannot change in one step. The
//! file therefore holds two versions: the turns that go with the tokens as they were when it was
//! written (durable then), and the turns that go with the tokens the call is about to make
//! durable, named by their count and hash. Reading it against the store's tokens ([`resolve`])
//! picks the version those tokens match, so after a crash between the two writes the transcript
//! is, like the tokens, the last completed call.
//!
//! Tools are turns too: a `tools` turn declares the tools in force from there on (its text is
//! their JSON list), a `tool_call` turn is an answer that called one (its text the call's JSON,
//! `{"name": ..., "arguments": ...}`), and a `tool` turn is the app's result for it. The chat
//! template renders them ([`messages`]): declarations that open the transcript (as `new` records
//! them, before its system turn) at the end of the system turn, any others at the top of the
//! next user turn; a call as the assistant's answer between the template's markers; a result as
//! a user turn.

use serde::{Deserialize, Serialize};

use model::tokenizer::{
    Message, Tokenizer, TokenizerError, Tool, tool_call_text, tool_response_text, tools_text,
};

/// Who said a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The chat template's system turn.
    System,
    /// A chat prompt.
    User,
    /// The model's answer to a chat prompt.
    Assistant,
    /// Text without a template: a raw prompt, or the model's continuation of one.
    Raw,
    /// The tools in force from here on: their JSON list ([`tools_turn`]).
    Tools,
    /// An answer that is a tool call: its JSON, `{"name": ..., "arguments": ...}`.
    ToolCall,
    /// A tool's result, the app's answer to the tool call before it.
    Tool,
}

impl Role {
    /// The role named `name` (as the wire and the file spell it).
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "raw" => Some(Role::Raw),
            "tools" => Some(Role::Tools),
            "tool_call" => Some(Role::ToolCall),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }

    /// The role's name.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Raw => "raw",
            Role::Tools => "tools",
            Role::ToolCall => "tool_call",
            Role::Tool => "tool",
        }
    }
}

/// One turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    pub role: Role,
    pub text: String,
}

impl Turn {
    pub fn new(role: Role, text: impl Into<String>) -> Turn {
        Turn {
            role,
            text: text.into(),
        }
    }
}

/// What went wrong reading a transcript file.
#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    #[error("the transcript file does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("the transcript file has version {found}; this service reads version {FILE_VERSION}")]
    Version { found: u32 },
}

/// The file's version.
const FILE_VERSION: u32 = 1;

/// The file: the turns of the tokens as they were, and those of the tokens to come.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    turns: Vec<Turn>,
    next: Next,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Next {
    /// The count and hash of the tokens these turns go with.
    tokens: usize,
    hash: u64,
    turns: Vec<Turn>,
}

/// FNV-1a over the tokens' little-endian bytes: fixed across builds and machines, unlike std's
/// hasher.
pub fn tokens_hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tokens.iter().flat_map(|t| t.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The file that says: `now` while the store's tokens are what they are, `next` once they are
/// `tokens`.
pub fn encode(now: &[Turn], next: &[Turn], tokens: &[u32]) -> Vec<u8> {
    let file = File {
        version: FILE_VERSION,
        turns: now.to_vec(),
        next: Next {
            tokens: tokens.len(),
            hash: tokens_hash(tokens),
            turns: next.to_vec(),
        },
    };
    serde_json::to_vec(&file).expect("turns always serialize")
}

/// The turns a transcript file gives for the store's `tokens`.
pub fn resolve(bytes: &[u8], tokens: &[u32]) -> Result<Vec<Turn>, TranscriptError> {
    let file: File = serde_json::from_slice(bytes)?;
    if file.version != FILE_VERSION {
        return Err(TranscriptError::Version {
            found: file.version,
        });
    }
    let next = file.next;
    Ok(
        if next.tokens == tokens.len() && next.hash == tokens_hash(tokens) {
            next.turns
        } else {
            file.turns
        },
    )
}

/// The tokens a context rebuilt from `turns` holds, as calls would have made them: chat turns in
/// the model's chat template (each closed, so the next call opens its own), raw turns as their
/// text; the first text of a context starts with BOS when the model wants it.
pub fn render(tok: &Tokenizer, turns: &[Turn]) -> Result<Vec<u32>, TokenizerError> {
    let mut out: Vec<u32> = Vec::new();
    let mut at = 0;
    while at < turns.len() {
        if turns[at].role == Role::Raw {
            let t = &turns[at].text;
            out.extend(match out.is_empty() {
                true => tok.encode_start(t),
                false => tok.encode(t),
            });
            at += 1;
            continue;
        }
        let run = turns[at..]
            .iter()
            .take_while(|t| t.role != Role::Raw)
            .count();
        let chat = &turns[at..at + run];
        if out.is_empty() {
            out = tok.encode_chat(&messages(tok, chat, true), false)?;
        } else {
            // After raw text: each turn as a call would add it, no default system prompt.
            let marks = tok.chat_turns()?;
            for m in messages(tok, chat, false) {
                let role = match m.role.as_str() {
                    "assistant" => marks.assistant,
                    r => r,
                };
                out.push(marks.start);
                out.extend(tok.encode(&format!("{role}\n{}", m.content)));
                out.push(marks.end);
                out.extend(tok.encode("\n"));
            }
        }
        at += run;
    }
    Ok(out)
}

/// The turn that declares `tools`.
pub fn tools_turn(tools: &[Tool]) -> Turn {
    Turn::new(
        Role::Tools,
        serde_json::to_string(tools).expect("tools always serialize"),
    )
}

/// The tools a `tools` turn declares.
pub fn tools_of(turn: &Turn) -> Result<Vec<Tool>, serde_json::Error> {
    serde_json::from_str(&turn.text)
}

/// The tools in force after `turns`: those of the last `tools` turn (none without one).
pub fn tools_in_force(turns: &[Turn]) -> Vec<Tool> {
    turns
        .iter()
        .rev()
        .find(|t| t.role == Role::Tools)
        .and_then(|t| tools_of(t).ok())
        .unwrap_or_default()
}

/// The tool call waiting for its result: the last turn, if it is a call.
pub fn pending_tool_call(turns: &[Turn]) -> Option<&Turn> {
    turns.last().filter(|t| t.role == Role::ToolCall)
}

/// A `tools` turn's declarations as text (its text as it is, if it does not parse).
fn declared(turn: &Turn) -> String {
    tools_of(turn).map_or_else(|_| turn.text.clone(), |t| tools_text(&t))
}

/// `a`, a blank line and `b`; `b` alone when `a` is empty.
fn join(a: &str, b: &str) -> String {
    match a.is_empty() {
        true => b.to_owned(),
        false => format!("{a}\n\n{b}"),
    }
}

/// The chat turns `turns` (no raw turn) as the template's messages. At the `start` of a
/// conversation, a tools turn first declares its tools at the end of the system turn (the next
/// turn if it is one, else the template's default system prompt); any other tools turn starts
/// the next user turn (or is a user turn of its own). A tool call is the assistant's answer
/// between the template's markers; a tool's result is a user turn.
pub fn messages(tok: &Tokenizer, turns: &[Turn], start: bool) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(turns.len());
    let mut at = 0;
    if start && let Some(first) = turns.first().filter(|t| t.role == Role::Tools) {
        let system = match turns.get(1) {
            Some(t) if t.role == Role::System => {
                at += 1;
                t.text.as_str()
            }
            _ => tok.default_system().unwrap_or(""),
        };
        out.push(Message::system(join(system, &declared(first))));
        at += 1;
    }
    let mut tools: Option<String> = None;
    let user = |tools: &mut Option<String>, text: &str| match tools.take() {
        Some(block) => Message::user(join(&block, text)),
        None => Message::user(text),
    };
    for t in &turns[at..] {
        match t.role {
            Role::System => out.push(Message::system(t.text.as_str())),
            Role::Tools => tools = Some(declared(t)),
            Role::User | Role::Raw => out.push(user(&mut tools, &t.text)),
            Role::Tool => out.push(user(&mut tools, &tool_response_text(&t.text))),
            Role::Assistant => out.push(Message::assistant(t.text.as_str())),
            Role::ToolCall => out.push(Message::assistant(tool_call_text(&t.text))),
        }
    }
    if let Some(block) = tools {
        out.push(Message::user(block));
    }
    out
}

/// The longest tail of `turns` that fits in `max` tokens once rendered, the leading system turn
/// kept: how a context of another model is rebuilt when its whole transcript no longer fits (as
/// a sliding window keeps the start and the most recent tokens). Returns the turns kept and their
/// tokens.
pub fn fit(
    tok: &Tokenizer,
    turns: &[Turn],
    max: usize,
) -> Result<(Vec<Turn>, Vec<u32>), TokenizerError> {
    // The system turn and the tools declared with it (before it).
    let head = match turns {
        [a, b, ..] if a.role == Role::Tools && b.role == Role::System => 2,
        [a, ..] if matches!(a.role, Role::System | Role::Tools) => 1,
        _ => 0,
    };
    let mut from = head;
    loop {
        let mut kept = turns[..head].to_vec();
        kept.extend_from_slice(&turns[from..]);
        let tokens = render(tok, &kept)?;
        if tokens.len() < max || from >= turns.len() {
            return Ok((kept, tokens));
        }
        from += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns(n: usize) -> Vec<Turn> {
        (0..n)
            .map(|i| Turn::new(Role::User, format!("turn {i}")))
            .collect()
    }

    #[test]
    fn the_file_gives_the_turns_of_the_tokens_the_store_holds() {
        let (old, new) = (vec![1, 2, 3], vec![1, 2, 3, 4, 5]);
        let file = encode(&turns(1), &turns(3), &new);
        // The tokens were made durable: the new turns.
        assert_eq!(resolve(&file, &new).unwrap(), turns(3));
        // A crash before they were: the old ones.
        assert_eq!(resolve(&file, &old).unwrap(), turns(1));
        // The same count, other tokens (a slid window): the hash tells them apart.
        assert_eq!(resolve(&file, &[1, 2, 3, 4, 6]).unwrap(), turns(1));
        assert!(matches!(
            resolve(b"{\"version\":1}", &old),
            Err(TranscriptError::Parse(_))
        ));
        let v2 = String::from_utf8(file)
            .unwrap()
            .replace("\"version\":1", "\"version\":2");
        assert!(matches!(
            resolve(v2.as_bytes(), &old),
            Err(TranscriptError::Version { found: 2 })
        ));
    }

    #[test]
    fn roles_round_trip_by_name() {
        for r in [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Raw,
            Role::Tools,
            Role::ToolCall,
            Role::Tool,
        ] {
            assert_eq!(Role::parse(r.name()), Some(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.name())
            );
        }
        assert_eq!(Role::parse("robot"), None);
        assert_ne!(tokens_hash(&[1, 2]), tokens_hash(&[2, 1]));
        assert_ne!(tokens_hash(&[]), tokens_hash(&[0]));
    }
}
