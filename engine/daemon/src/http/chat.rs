//! `POST /v1/chat/completions`: the messages become the daemon's turns; a conversation this uid
//! already holds is continued (`crate::http::cache`), any other gets a context made from its
//! turns before the last; the last message (the user's, or a tool's result) is the call. The
//! answer comes whole or as server-sent chunks, with OpenAI's usage (cached tokens: those of the
//! continued context whose K/V was reused).

use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use protocol::{ErrorBody, Event, Request, Tool, Turn, codes};
use serde_json::{Value, json};

use crate::http::answer::{self, Answer, Piece, Tokens, finish_reason};
use crate::http::body::{self, ApiResponse, Events};
use crate::http::cache::Held;
use crate::http::error::ApiError;
use crate::http::session::Session;
use crate::http::wire::{self, Allowed, Generation, Object, turn};
use crate::http::{Api, Who};

/// A chat completion request, checked.
pub struct ChatRequest {
    /// The messages as turns; the last is the call.
    pub turns: Vec<Turn>,
    pub tools: Vec<Tool>,
    pub generation: Generation,
    pub stream: bool,
    pub include_usage: bool,
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
];

/// Parses a request's body (its `model` was checked).
pub fn parse(o: &Object) -> Result<ChatRequest, ApiError> {
    let neutral = [
        ("n", json!(1)),
        ("presence_penalty", json!(0)),
        ("frequency_penalty", json!(0)),
        ("logprobs", json!(false)),
        ("store", json!(false)),
    ];
    wire::check_fields(
        o,
        &Allowed {
            fields: FIELDS,
            neutral: &neutral,
        },
        "",
    )?;
    let messages = wire::get(o, "messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::param("messages", "messages must be a non-empty list"))?;
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        message(m, i, &mut turns)?;
    }
    if !matches!(turns.last().map(|t| t.role.as_str()), Some("user" | "tool")) {
        return Err(ApiError::param(
            "messages",
            "the last message must be the user's or a tool's: it is what the model answers",
        ));
    }
    let mut generation = wire::generation(o, &["max_completion_tokens", "max_tokens"])?;
    if let Some(f) = wire::get(o, "response_format") {
        generation.response_format = wire::format(f, "response_format", false)?;
    }
    let tools = wire::tools(o, true)?;
    if tools.is_empty()
        && generation
            .tool_choice
            .as_ref()
            .is_some_and(|c| *c != protocol::ToolChoice::None)
    {
        return Err(ApiError::param("tool_choice", "tool_choice needs tools"));
    }
    let stream = wire::boolean(o, "stream")?.unwrap_or(false);
    let include_usage = match wire::get(o, "stream_options") {
        None => false,
        Some(v) => {
            let so = wire::object(v, "stream_options")?;
            wire::check_fields(
                so,
                &Allowed {
                    fields: &["include_usage"],
                    neutral: &[],
                },
                "stream_options.",
            )?;
            wire::boolean(so, "include_usage")?.unwrap_or(false)
        }
    };
    Ok(ChatRequest {
        turns,
        tools,
        generation,
        stream,
        include_usage,
    })
}

/// One message as turns (an assistant's tool calls are a turn each).
fn message(m: &Value, i: usize, turns: &mut Vec<Turn>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let o = wire::object(m, &at)?;
    let role = o.get("role").and_then(Value::as_str).unwrap_or("");
    let fields: &[&str] = match role {
        "system" | "developer" | "user" => &["role", "content"],
        "assistant" => &["role", "content", "tool_calls"],
        "tool" => &["role", "content", "tool_call_id"],
        _ => {
            return Err(ApiError::param(
                &at,
                format!("{at}.role is system, developer, user, assistant or tool, not {role:?}"),
            ));
        }
    };
    wire::check_fields(
        o,
        &Allowed {
            fields,
            neutral: &[],
        },
        &format!("{at}."),
    )?;
    let content = match wire::get(o, "content") {
        Some(c) => wire::text(c, &format!("{at}.content"))?,
        None => String::new(),
    };
    match role {
        "system" | "developer" => turns.push(turn("system", content)),
        "user" => turns.push(turn("user", content)),
        "tool" => turns.push(turn("tool", content)),
        _ => match wire::get(o, "tool_calls").and_then(Value::as_array) {
            Some(calls) if !calls.is_empty() => {
                if !content.is_empty() {
                    return Err(ApiError::param(
                        &at,
                        format!("{at}: an answer is text or tool calls, not both"),
                    ));
                }
                for (j, c) in calls.iter().enumerate() {
                    let cat = format!("{at}.tool_calls[{j}]");
                    let f = c
                        .get("function")
                        .and_then(Value::as_object)
                        .ok_or_else(|| {
                            ApiError::param(&cat, format!("{cat}.function is missing"))
                        })?;
                    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
                    let args = f.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                    turns.push(wire::tool_call_turn(name, args, &cat)?);
                }
            }
            _ => turns.push(turn("assistant", content)),
        },
    }
    Ok(())
}

/// The chat cache's app name for the key's app: its own, so stored responses are never evicted.
fn cache_app(who: &Who) -> String {
    let mut app = who.app.clone();
    app.truncate(protocol::MAX_APP - 5);
    app + ".chat"
}

/// Reads this uid's chat contexts from the daemon once after a start.
async fn load_cache(api: &Api, s: &mut Session, owner: &(u32, String)) -> Result<(), ErrorBody> {
    if api.cache.loaded(owner) {
        return Ok(());
    }
    let Event::Contexts { contexts } = s.op(&owner.1, |id| Request::List { id }).await? else {
        return Err(ErrorBody::new("internal", "list answered unexpectedly"));
    };
    let mut held = Vec::new();
    for c in contexts.into_iter().filter(|c| c.app == owner.1) {
        if let Ok(Event::Transcript { transcript, .. }) = s
            .op(&owner.1, |id| Request::Export { id, context: c.id })
            .await
        {
            held.push(Held::new(c.id, &transcript.turns));
        }
    }
    api.cache.load(owner.clone(), held);
    Ok(())
}

/// How long a new conversation waits for one of the app's chat contexts to come back when
/// every one is in use, before it is answered 429.
const ROOM_WAIT: Duration = Duration::from_secs(60);

/// A context for `prefix` with `tools`. When the app holds its most contexts, the least
/// recently used idle one is deleted for room; when every one is in use by another request,
/// this one waits until one comes back, the conversations waiting longest first (a stateless
/// API should not fail because others run).
async fn fresh(
    api: &Api,
    s: &mut Session,
    owner: &(u32, String),
    prefix: &[Turn],
    tools: &[Tool],
) -> Result<u64, ErrorBody> {
    loop {
        let back = api.cache.returned(owner);
        let returned = back.notified();
        tokio::pin!(returned);
        returned.as_mut().enable();
        match answer::create(s, &owner.1, prefix, tools).await {
            Err(e) if e.code == "too_many_contexts" => match api.cache.take_oldest(owner) {
                Some(old) => {
                    tracing::debug!(context = old.context, "chat cache: making room");
                    s.op(&owner.1, |id| Request::Delete {
                        id,
                        context: old.context,
                    })
                    .await?;
                }
                None => {
                    tracing::debug!("chat cache: every context in use; waiting for one");
                    if tokio::time::timeout(ROOM_WAIT, returned).await.is_err() {
                        return Err(ErrorBody::new(
                            codes::BUSY,
                            format!(
                                "every chat context of this app is in use ({}); try again shortly",
                                e.message
                            ),
                        ));
                    }
                }
            },
            r => return r,
        }
    }
}

/// Serves one chat completion.
pub async fn completions(
    api: &Arc<Api>,
    who: &Who,
    o: &Object,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let req = parse(o)?;
    let owner = (who.uid, cache_app(who));
    load_cache(api, &mut s, &owner).await?;
    let (prefix, last) = req.turns.split_at(req.turns.len() - 1);
    let last = &last[0];
    let taken = api.cache.take(&owner, prefix, &req.tools);
    let continued = taken.is_some();
    let (context, in_force) = match taken {
        Some(h) => (h.context, h.tools),
        None => (
            fresh(api, &mut s, &owner, prefix, &req.tools).await?,
            req.tools.clone(),
        ),
    };
    let mut g = req.generation.clone();
    let declare = answer::tools_for_call(&req.tools, &in_force, &mut g);
    let tools_after = if declare.is_some() {
        req.tools.clone()
    } else {
        in_force.clone()
    };
    let put_back =
        |turns: Vec<Turn>, tools: Vec<Tool>| api.cache.put(owner.clone(), context, turns, tools);
    let call = answer::start(&mut s, &owner.1, context, last, &g, declare);
    let id = match call {
        Ok(id) => id,
        Err(e) => {
            put_back(prefix.to_vec(), in_force);
            return Err(e.into());
        }
    };
    // The first piece decides the status: an error before any token is an HTTP error.
    let first = match answer::next(&mut s, id).await {
        Ok(p) => p,
        Err(e) => {
            put_back(prefix.to_vec(), in_force);
            return Err(e.into());
        }
    };
    let meta = Meta {
        id: format!("chatcmpl-{}", wire::unique()),
        model: api.shared.model_name.clone(),
        created: wire::now_secs(),
        continued,
    };
    if req.stream {
        let (response, events) = body::events(64);
        let api = Arc::clone(api);
        tokio::spawn(async move {
            let r = stream(&mut s, id, first, &meta, &req, &events).await;
            finish(&api, s.uid, &owner, context, &req, r, tools_after).await;
        });
        return Ok(response);
    }
    let r = answer::rest(&mut s, id, first).await;
    let out = match &r {
        Ok(a) => Ok(body::json(StatusCode::OK, &whole(&meta, a, &req))),
        Err(e) => Err(ApiError::from(e.clone())),
    };
    finish(api, s.uid, &owner, context, &req, r, tools_after).await;
    out
}

/// After a call: its context goes back to the cache holding the conversation and its answer;
/// one left in an unknown state (the call failed or its client went away midway) is deleted.
async fn finish(
    api: &Api,
    uid: u32,
    owner: &(u32, String),
    context: u64,
    req: &ChatRequest,
    r: Result<Answer, ErrorBody>,
    tools: Vec<Tool>,
) {
    match r {
        Ok(a) => {
            let mut turns = req.turns.clone();
            turns.push(a.turn());
            api.cache.put(owner.clone(), context, turns, tools);
        }
        Err(e) => {
            tracing::debug!(context, error = %e.message, "chat cache: dropping a context");
            let mut s = Session::new(&api.shared, uid, std::time::Instant::now());
            let _ = s.op(&owner.1, |id| Request::Delete { id, context }).await;
            api.cache.freed(owner);
        }
    }
}

/// What every chunk and the whole answer name.
struct Meta {
    id: String,
    model: String,
    created: u64,
    /// Whether the call continued a context this uid held (its reused tokens are cached).
    continued: bool,
}

fn usage(t: Tokens) -> Value {
    json!({
        "prompt_tokens": t.input,
        "completion_tokens": t.output,
        "total_tokens": t.input + t.output,
        "prompt_tokens_details": {"cached_tokens": t.cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
    })
}

fn tool_calls(meta: &Meta, name: &str, arguments: &Value) -> Value {
    json!([{
        "index": 0,
        "id": format!("call_{}", &meta.id["chatcmpl-".len()..]),
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()},
    }])
}

/// A whole (non-streamed) completion.
fn whole(meta: &Meta, a: &Answer, req: &ChatRequest) -> Value {
    let message = match &a.tool_call {
        Some((name, args)) => {
            json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": tool_calls(meta, name, args)})
        }
        None => {
            json!({"role": "assistant", "content": a.visible(&req.generation.stop), "refusal": null})
        }
    };
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": null,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason(&a.done.stop)}],
        "usage": usage(Tokens::of(&a.done, meta.continued)),
    })
}

fn chunk(meta: &Meta, delta: Value, finish: Option<&str>, include_usage: bool) -> Value {
    let mut c = json!({
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": null,
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
    });
    if include_usage {
        c["usage"] = Value::Null;
    }
    c
}

/// Streams an answer as chat completion chunks; the text of a stop string is held back until
/// it is known not to be one. Returns the answer (an error if the client went away midway).
async fn stream(
    s: &mut Session,
    id: u64,
    first: Piece,
    meta: &Meta,
    req: &ChatRequest,
    ev: &Events,
) -> Result<Answer, ErrorBody> {
    let gone = || ErrorBody::new("cancelled", "the client went away");
    let iu = req.include_usage;
    let stop = &req.generation.stop;
    let hold = stop.iter().map(String::len).max().unwrap_or(0);
    if !ev
        .send(
            None,
            &chunk(meta, json!({"role": "assistant", "content": ""}), None, iu),
        )
        .await
    {
        return Err(gone());
    }
    let (mut text, mut sent, mut tool_call) = (String::new(), 0usize, None);
    let mut piece = first;
    let done = loop {
        match piece {
            Piece::Text(t) => {
                text.push_str(&t);
                // Send what can no longer be the start of a stop string.
                let mut upto = text.len().saturating_sub(hold.saturating_sub(1));
                while !text.is_char_boundary(upto) {
                    upto -= 1;
                }
                if hold == 0 || !stop.iter().any(|s| text.contains(s.as_str())) {
                    if upto > sent
                        && !ev
                            .send(
                                None,
                                &chunk(meta, json!({"content": &text[sent..upto]}), None, iu),
                            )
                            .await
                    {
                        s.cancel();
                        return Err(gone());
                    }
                    sent = sent.max(upto);
                }
            }
            Piece::ToolCall { name, arguments } => {
                let delta = json!({"tool_calls": tool_calls(meta, &name, &arguments)});
                if !ev.send(None, &chunk(meta, delta, None, iu)).await {
                    return Err(gone());
                }
                tool_call = Some((name, arguments));
            }
            Piece::Done(d) => break d,
        }
        piece = answer::next(s, id).await?;
    };
    let a = Answer {
        text,
        tool_call,
        done,
    };
    let shown = a.visible(stop);
    if shown.len() > sent
        && !ev
            .send(
                None,
                &chunk(meta, json!({"content": &shown[sent..]}), None, iu),
            )
            .await
    {
        return Err(gone());
    }
    let end = chunk(meta, json!({}), Some(finish_reason(&a.done.stop)), iu);
    let mut ok = ev.send(None, &end).await;
    if iu {
        let mut u = chunk(meta, json!({}), None, false);
        u["choices"] = json!([]);
        u["usage"] = usage(Tokens::of(&a.done, meta.continued));
        ok = ok && ev.send(None, &u).await;
    }
    ok = ok && ev.done().await;
    if !ok {
        tracing::debug!("a chat stream's client left before its end");
    }
    Ok(a)
}
