//! The responses API's shapes: a request checked into turns and settings (its input items:
//! messages, function calls and their outputs), and the response object with its output items.

use protocol::{Tool, ToolChoice, Turn};
use serde_json::{Value, json};

use crate::http::answer::{Answer, Tokens};
use crate::http::error::ApiError;
use crate::http::ids;
use crate::http::wire::{self, Allowed, Generation, Object, turn};

/// A responses request, checked.
pub struct ResponsesRequest {
    pub instructions: Option<String>,
    /// The input items as turns; the last is the call.
    pub input: Vec<Turn>,
    pub previous: Option<String>,
    pub conversation: Option<String>,
    pub store: bool,
    pub stream: bool,
    pub tools: Vec<Tool>,
    pub generation: Generation,
    pub metadata: Value,
}

impl ResponsesRequest {
    /// The turns a new context for this request starts from: its instructions as a system
    /// turn, then `items`.
    pub fn opening(&self, items: &[Turn]) -> Vec<Turn> {
        let system = self.instructions.iter().map(|i| turn("system", i.clone()));
        system.chain(items.iter().cloned()).collect()
    }
}

const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "conversation",
    "store",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "metadata",
    "user",
    "seed",
    "stop",
];

/// The input (a string, or a list of messages, function calls and their outputs) as turns.
pub fn input_turns(v: &Value, at: &str) -> Result<Vec<Turn>, ApiError> {
    let items = match v {
        Value::String(s) => return Ok(vec![turn("user", s.clone())]),
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::param(
                at,
                format!("{at} must be a string or a list of items"),
            ));
        }
    };
    let mut turns = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{at}[{i}]");
        let o = wire::object(item, &at)?;
        let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
        let fields: &[&str] = match kind {
            "message" => &["type", "role", "content", "id", "status"],
            "function_call" => &["type", "call_id", "name", "arguments", "id", "status"],
            "function_call_output" => &["type", "call_id", "output", "id", "status"],
            _ => return Err(ApiError::unsupported(&[format!("{at}.type={kind:?}")])),
        };
        wire::check_fields(
            o,
            &Allowed {
                fields,
                neutral: &[],
            },
            &format!("{at}."),
        )?;
        match kind {
            "message" => {
                let content = wire::text(
                    o.get("content").unwrap_or(&Value::Null),
                    &format!("{at}.content"),
                )?;
                let role = match o.get("role").and_then(Value::as_str) {
                    Some("system" | "developer") => "system",
                    Some("user") => "user",
                    Some("assistant") => "assistant",
                    r => {
                        return Err(ApiError::param(
                            &at,
                            format!("{at}.role is user, assistant, system or developer, not {r:?}"),
                        ));
                    }
                };
                turns.push(turn(role, content));
            }
            "function_call" => {
                let name = wire::string(o, "name")?.unwrap_or_default();
                let args = wire::string(o, "arguments")?.unwrap_or_else(|| "{}".into());
                turns.push(wire::tool_call_turn(&name, &args, &at)?);
            }
            _ => {
                let output = wire::text(
                    o.get("output").unwrap_or(&Value::Null),
                    &format!("{at}.output"),
                )?;
                turns.push(turn("tool", output));
            }
        }
    }
    Ok(turns)
}

/// Parses a request's body (its `model` was checked).
pub fn parse(o: &Object) -> Result<ResponsesRequest, ApiError> {
    let neutral = [
        ("truncation", json!("disabled")),
        ("background", json!(false)),
    ];
    wire::check_fields(
        o,
        &Allowed {
            fields: FIELDS,
            neutral: &neutral,
        },
        "",
    )?;
    let input = input_turns(
        wire::get(o, "input").ok_or_else(|| ApiError::param("input", "input is missing"))?,
        "input",
    )?;
    if !matches!(input.last().map(|t| t.role.as_str()), Some("user" | "tool")) {
        return Err(ApiError::param(
            "input",
            "the last input item must be a user message or a function_call_output: it is what the model answers",
        ));
    }
    let mut generation = wire::generation(o, &["max_output_tokens"])?;
    if let Some(t) = wire::get(o, "text") {
        let t = wire::object(t, "text")?;
        wire::check_fields(
            t,
            &Allowed {
                fields: &["format"],
                neutral: &[("verbosity", json!("medium"))],
            },
            "text.",
        )?;
        if let Some(f) = wire::get(t, "format") {
            generation.response_format = wire::format(f, "text.format", true)?;
        }
    }
    let conversation = match wire::get(o, "conversation") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(c)) => c.get("id").and_then(Value::as_str).map(str::to_owned),
        Some(_) => {
            return Err(ApiError::param(
                "conversation",
                "conversation is an id or {\"id\": ...}",
            ));
        }
    };
    let previous = wire::string(o, "previous_response_id")?;
    if previous.is_some() && conversation.is_some() {
        return Err(ApiError::param(
            "conversation",
            "send previous_response_id or conversation, not both",
        ));
    }
    let tools = wire::tools(o, false)?;
    if tools.is_empty()
        && generation
            .tool_choice
            .as_ref()
            .is_some_and(|c| *c != ToolChoice::None)
    {
        return Err(ApiError::param("tool_choice", "tool_choice needs tools"));
    }
    Ok(ResponsesRequest {
        instructions: wire::string(o, "instructions")?,
        input,
        previous,
        conversation,
        store: wire::boolean(o, "store")?.unwrap_or(true),
        stream: wire::boolean(o, "stream")?.unwrap_or(false),
        tools,
        generation,
        metadata: wire::get(o, "metadata")
            .cloned()
            .unwrap_or_else(|| json!({})),
    })
}

/// The tools in force after `turns`.
pub fn tools_in_force(turns: &[Turn]) -> Vec<Tool> {
    turns
        .iter()
        .rev()
        .find(|t| t.role == "tools")
        .and_then(|t| serde_json::from_str(&t.text).ok())
        .unwrap_or_default()
}

/// What a response object says beside its output.
pub struct Meta {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub previous: Option<String>,
    pub conversation: Option<String>,
    pub store: bool,
    /// Whether the call continued a context (its reused tokens are cached).
    pub continued: bool,
}

/// The output items of an answer (a message, or a function call).
pub fn output(meta: &Meta, a_turn: &Turn, status: &str) -> Value {
    match a_turn.role.as_str() {
        "tool_call" => {
            let (name, arguments) = wire::call_of(&a_turn.text);
            json!([{
                "type": "function_call",
                "id": ids::item("fc", &meta.id),
                "call_id": ids::item("call", &meta.id),
                "name": name,
                "arguments": arguments,
                "status": status,
            }])
        }
        _ => json!([{
            "type": "message",
            "id": ids::item("msg", &meta.id),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": a_turn.text, "annotations": [], "logprobs": []}],
        }]),
    }
}

/// A response object; `a` the answer when it is known (not for one read back by `GET`).
pub fn response_json(
    meta: &Meta,
    req: &ResponsesRequest,
    a: Option<&Answer>,
    status: &str,
) -> Value {
    let out = a.map(|a| {
        let mut t = a.turn();
        if t.role == "assistant" {
            t.text = a.visible(&req.generation.stop);
        }
        output(meta, &t, status)
    });
    let usage = a.map(|a| {
        let t = Tokens::of(&a.done, meta.continued);
        json!({
            "input_tokens": t.input,
            "input_tokens_details": {"cached_tokens": t.cached},
            "output_tokens": t.output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": t.input + t.output,
        })
    });
    let incomplete = a
        .filter(|a| matches!(a.done.stop.as_str(), "max_tokens" | "context_full"))
        .map(|_| json!({"reason": "max_output_tokens"}));
    let g = &req.generation;
    json!({
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": if incomplete.is_some() { "incomplete" } else { status },
        "model": meta.model,
        "output": out.unwrap_or_else(|| json!([])),
        "usage": usage,
        "previous_response_id": meta.previous,
        "conversation": meta.conversation.as_ref().map(|c| json!({"id": c})),
        "instructions": req.instructions,
        "store": meta.store,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "max_output_tokens": g.max_tokens,
        "tools": req.tools.iter().map(|t| json!({"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": true})).collect::<Vec<_>>(),
        "tool_choice": serde_json::to_value(g.tool_choice.clone().unwrap_or_default()).unwrap_or(json!("auto")),
        "parallel_tool_calls": false,
        "text": {"format": match &g.response_format { Some(protocol::ResponseFormat::JsonSchema { schema }) => json!({"type": "json_schema", "name": "answer", "schema": schema, "strict": true}), _ => json!({"type": "text"}) }},
        "error": null,
        "incomplete_details": incomplete,
        "metadata": req.metadata,
    })
}

/// The request a stored response was read back for (`GET`): its settings are not kept.
pub fn read_back() -> ResponsesRequest {
    ResponsesRequest {
        instructions: None,
        input: Vec::new(),
        previous: None,
        conversation: None,
        store: true,
        stream: false,
        tools: Vec::new(),
        generation: Generation::default(),
        metadata: json!({}),
    }
}
