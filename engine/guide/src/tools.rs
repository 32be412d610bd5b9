//! Tool calls: an answer that is a call of one of the declared tools, `{"name": N, "arguments":
//! A}` with `A` valid under that tool's JSON Schema, between the chat template's markers; or,
//! beside it, a plain answer (any text that does not start with the opening marker, or the text
//! of a response format), so the model chooses at its first tokens.
//!
//! The call's JSON is written as the schema module writes objects (at most one space where JSON
//! allows whitespace, `name` before `arguments`); each tool's arguments are its own schema
//! compiled on its own (its `$ref`s resolve inside it), and an error names the tool.

use serde_json::Value;

use crate::schema::{WS, schema_regex};
use crate::{Grammar, GuideError, Vocab};
use std::sync::Arc;

/// A tool the model may call: its name and the JSON Schema of its arguments.
#[derive(Clone, Copy, Debug)]
pub struct ToolSchema<'a> {
    pub name: &'a str,
    pub parameters: &'a Value,
}

/// What an answer may be beside a tool call.
#[derive(Clone, Copy, Debug)]
pub enum Besides<'a> {
    /// Nothing: the answer is a tool call.
    Nothing,
    /// Any text that does not start with the opening marker (it may be empty).
    Text,
    /// Text of this regular expression (a response format's, [`Grammar::regex`]).
    Regex(&'a str),
}

/// An answer under tools: a call of one of `tools` between `open` and `close`, or what
/// `besides` allows.
#[derive(Clone, Copy, Debug)]
pub struct ToolCalls<'a> {
    pub tools: &'a [ToolSchema<'a>],
    /// The text before a call's JSON (`<tool_call>\n`).
    pub open: &'a str,
    /// The text after it (`\n</tool_call>`).
    pub close: &'a str,
    pub besides: Besides<'a>,
}

/// The expression of `{"name": "NAME", "arguments": ARGS}` for one tool.
fn call_regex(tool: &ToolSchema) -> Result<String, GuideError> {
    let args = schema_regex(tool.parameters).map_err(|e| of_tool(e, tool.name))?;
    let name = regex_syntax::escape(&Value::String(tool.name.to_owned()).to_string());
    Ok(format!(
        r#"\{{{WS}"name"{WS}:{WS}{name}{WS},{WS}"arguments"{WS}:{WS}(?:{args}){WS}\}}"#
    ))
}

/// An error of a tool's schema, with the tool named where it is.
fn of_tool(e: GuideError, name: &str) -> GuideError {
    let at = |at: String| format!("{at} of tool {name:?}'s parameters");
    match e {
        GuideError::Unsupported {
            keyword,
            at: a,
            why,
        } => GuideError::Unsupported {
            keyword,
            at: at(a),
            why,
        },
        GuideError::InvalidSchema { at: a, what } => GuideError::InvalidSchema { at: at(a), what },
        e => e,
    }
}

/// Every text that does not start with `open`: a strict prefix of it, or its first `k` bytes
/// and then any character but its next.
fn not_starting_with(open: &str) -> String {
    let mut alts = Vec::new();
    for (k, c) in open.char_indices() {
        let prefix = regex_syntax::escape(&open[..k]);
        alts.push(format!(r"{prefix}(?:[^\x{{{:x}}}].*)?", c as u32));
    }
    if alts.is_empty() {
        return "(?s:.*)".into();
    }
    format!("(?s:{})", alts.join("|"))
}

/// The expression of every answer `calls` allows.
pub(crate) fn tools_regex(calls: &ToolCalls) -> Result<String, GuideError> {
    let mut names: Vec<&str> = Vec::new();
    let mut alts = Vec::with_capacity(calls.tools.len());
    for t in calls.tools {
        if names.contains(&t.name) {
            return Err(GuideError::InvalidSchema {
                at: format!("tool {:?}", t.name),
                what: "two tools have this name".into(),
            });
        }
        names.push(t.name);
        alts.push(call_regex(t)?);
    }
    let call = match alts.is_empty() {
        true => None,
        false => Some(format!(
            "{}(?:{}){}",
            regex_syntax::escape(calls.open),
            alts.join("|"),
            regex_syntax::escape(calls.close)
        )),
    };
    let besides = match calls.besides {
        Besides::Nothing => None,
        Besides::Text => Some(not_starting_with(calls.open)),
        Besides::Regex(r) => Some(r.to_owned()),
    };
    match (call, besides) {
        (Some(c), Some(b)) => Ok(format!("(?:{c})|(?:{b})")),
        (Some(c), None) => Ok(c),
        (None, Some(b)) => Ok(b),
        (None, None) => Err(GuideError::InvalidSchema {
            at: "tools".into(),
            what: "no tool to call and nothing else allowed".into(),
        }),
    }
}

impl Grammar {
    /// Compiles an answer under tools: every answer is a whole tool call whose arguments
    /// validate against the tool's schema, or what [`ToolCalls::besides`] allows.
    pub fn from_tools(calls: &ToolCalls, vocab: Arc<Vocab>) -> Result<Grammar, GuideError> {
        let regex = tools_regex(calls)?;
        Grammar::from_built(&regex, vocab, "tools")
    }
}
