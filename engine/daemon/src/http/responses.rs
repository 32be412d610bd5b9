//! `/v1/responses`: a response is a call on a context that persists. Without
//! `previous_response_id` or `conversation` the instructions and input make a new context; with
//! `previous_response_id` naming the latest response of its context, the input continues that
//! context (only its tokens are prefilled: the rest is cached, days later and after restarts);
//! with `conversation`, the conversation's context. `GET` and `DELETE` find a response in its
//! context's transcript (`crate::http::ids`); `input_tokens` counts.

use std::sync::Arc;

use hyper::StatusCode;
use protocol::{ErrorBody, Event, Request, Tool, Turn};
use serde_json::json;

use crate::http::answer;
use crate::http::body::{self, ApiResponse};
use crate::http::error::{ApiError, http_codes};
use crate::http::ids;
use crate::http::session::Session;
use crate::http::shapes::{
    Meta, ResponsesRequest, output, parse, read_back, response_json, tools_in_force,
};
use crate::http::stream_events::stream;
use crate::http::wire::{self, Object};
use crate::http::{Api, InUse, Who};

/// A context this request continues, held against other requests, and its turns now.
pub struct Continued {
    pub context: u64,
    pub turns: Vec<Turn>,
    pub _in_use: InUse,
}

/// The context `previous_response_id` names, held; a 409 if it moved on past that response.
async fn continue_response(
    api: &Api,
    s: &mut Session,
    who: &Who,
    id: &str,
) -> Result<Continued, ApiError> {
    let context = ids::response_context(id).ok_or_else(|| ApiError::not_found("response", id))?;
    let in_use = api.hold(context)?;
    let turns = answer::turns_of(s, &who.app, context, "response", id).await?;
    let n = ids::locate(id, &turns).ok_or_else(|| ApiError::not_found("response", id))?;
    if n != turns.len() {
        // Branching here is possible (a context made from the first `n` turns borrows their
        // chunks from this one: docs/service.md, "Forks and shared prefixes"), but the API this
        // daemon documents answers 409 for a response its context moved on from (docs/http.md).
        return Err(ApiError {
            retry: false,
            ..ApiError::new(
                StatusCode::CONFLICT,
                http_codes::MOVED_ON,
                format!(
                    "response {id} is not the latest of its conversation: it moved on by {} turns; \
                     continue from its latest response (branching from an earlier one needs forks)",
                    turns.len() - n
                ),
            )
        });
    }
    Ok(Continued {
        context,
        turns,
        _in_use: in_use,
    })
}

/// The conversation `id`'s context, held.
pub async fn continue_conversation(
    api: &Api,
    s: &mut Session,
    who: &Who,
    id: &str,
) -> Result<Continued, ApiError> {
    let context =
        ids::conversation_context(id).ok_or_else(|| ApiError::not_found("conversation", id))?;
    let in_use = api.hold(context)?;
    crate::http::conversations::check(s, who, context, id).await?;
    let turns = answer::turns_of(s, &who.app, context, "conversation", id).await?;
    Ok(Continued {
        context,
        turns,
        _in_use: in_use,
    })
}

/// The context a response is made in, and what it holds before the response's input.
struct Target {
    context: u64,
    /// Its turns before this request's.
    before: Vec<Turn>,
    /// The tools in force on it.
    in_force: Vec<Tool>,
    /// Made for this response (deleted if the call fails, or with `store: false`).
    fresh: bool,
    in_use: Option<InUse>,
}

/// The context `req` continues (`previous_response_id`, `conversation`), held, or a new one
/// made from its instructions and input before the last item.
async fn target(
    api: &Api,
    s: &mut Session,
    who: &Who,
    req: &ResponsesRequest,
) -> Result<Target, ApiError> {
    let continued = match (&req.previous, &req.conversation) {
        (Some(p), _) if !req.store => {
            return Err(ApiError::param(
                "store",
                format!(
                    "store=false cannot continue {p} yet: the context it names would move on (this needs forks)"
                ),
            ));
        }
        (Some(p), _) => Some(continue_response(api, s, who, p).await?),
        (None, Some(c)) => Some(continue_conversation(api, s, who, c).await?),
        (None, None) => None,
    };
    let prefix = &req.input[..req.input.len() - 1];
    Ok(match continued {
        Some(c) => {
            if !prefix.is_empty() {
                return Err(ApiError::param(
                    "input",
                    "continuing a conversation takes one input item: a user message or a function_call_output",
                ));
            }
            if let Some(i) = &req.instructions
                && c.turns
                    .iter()
                    .find(|t| t.role == "system")
                    .is_none_or(|t| t.text != *i)
            {
                return Err(ApiError::param(
                    "instructions",
                    "the conversation keeps the instructions it started with; send none, or the same",
                ));
            }
            Target {
                context: c.context,
                in_force: tools_in_force(&c.turns),
                before: c.turns,
                fresh: false,
                in_use: Some(c._in_use),
            }
        }
        None => {
            let turns = req.opening(prefix);
            Target {
                context: answer::create(s, &who.app, &turns, &req.tools).await?,
                before: answer::created_turns(&turns, &req.tools),
                in_force: req.tools.clone(),
                fresh: true,
                in_use: None,
            }
        }
    })
}

/// Serves `POST /v1/responses`.
pub async fn create(
    api: &Arc<Api>,
    who: &Who,
    o: &Object,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let req = parse(o)?;
    let last = req.input[req.input.len() - 1].clone();
    let Target {
        context,
        before,
        in_force,
        fresh,
        in_use: _in_use,
    } = target(api, &mut s, who, &req).await?;
    let mut g = req.generation.clone();
    let declare = answer::tools_for_call(&req.tools, &in_force, &mut g);
    let mut before = before;
    if let Some(t) = &declare {
        before.push(answer::tools_turn(t));
    }
    before.push(last.clone());
    let rid = ids::response(context, &before);
    let meta = Meta {
        id: rid,
        model: api.shared.model_name.clone(),
        created: wire::now_secs(),
        previous: req.previous.clone(),
        conversation: req.conversation.clone(),
        store: req.store,
        continued: !fresh,
    };
    let call = answer::start(&mut s, &who.app, context, &last, &g, declare);
    let id = match call {
        Ok(id) => id,
        Err(e) => {
            drop_fresh(&mut s, who, context, fresh).await;
            return Err(e.into());
        }
    };
    let first = match answer::next(&mut s, id).await {
        Ok(p) => p,
        Err(e) => {
            drop_fresh(&mut s, who, context, fresh).await;
            return Err(e.into());
        }
    };
    let delete_after = fresh && !req.store;
    if req.stream {
        let (response, events) = body::events(64);
        let (app, api) = (who.app.clone(), Arc::clone(api));
        tokio::spawn(async move {
            let _held = (_in_use, api);
            let r = stream(&mut s, id, first, &meta, &req, &events).await;
            if delete_after || r.is_err() && fresh {
                let _ = s.op(&app, |i| Request::Delete { id: i, context }).await;
            }
        });
        return Ok(response);
    }
    let r = answer::rest(&mut s, id, first).await;
    if delete_after {
        drop_fresh(&mut s, who, context, true).await;
    }
    let a = r?;
    Ok(body::json(
        StatusCode::OK,
        &response_json(&meta, &req, Some(&a), "completed"),
    ))
}

/// Deletes a context made for a response that failed, or that is not to be stored.
async fn drop_fresh(s: &mut Session, who: &Who, context: u64, fresh: bool) {
    if fresh {
        let _ = s.op(&who.app, |id| Request::Delete { id, context }).await;
    }
}

/// Serves `GET /v1/responses/{id}`: the response as its context's transcript keeps it.
pub async fn get(who: &Who, id: &str, mut s: Session) -> Result<ApiResponse, ApiError> {
    let context = ids::response_context(id).ok_or_else(|| ApiError::not_found("response", id))?;
    let turns = answer::turns_of(&mut s, &who.app, context, "response", id).await?;
    let n = ids::locate(id, &turns).ok_or_else(|| ApiError::not_found("response", id))?;
    let meta = Meta {
        id: id.to_owned(),
        model: s.shared().model_name.clone(),
        created: 0,
        previous: None,
        conversation: None,
        store: true,
        continued: false,
    };
    let mut v = response_json(&meta, &read_back(), None, "completed");
    v["output"] = output(&meta, &turns[n - 1], "completed");
    for unknown in [
        "created_at",
        "temperature",
        "top_p",
        "max_output_tokens",
        "tool_choice",
    ] {
        v[unknown] = serde_json::Value::Null;
    }
    Ok(body::json(StatusCode::OK, &v))
}

/// Serves `DELETE /v1/responses/{id}`: the latest response of a context deletes it (an earlier
/// one is part of the later ones: 409); a conversation's responses go with the conversation.
pub async fn delete(
    api: &Api,
    who: &Who,
    id: &str,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let context = ids::response_context(id).ok_or_else(|| ApiError::not_found("response", id))?;
    let _in_use = api.hold(context)?;
    let turns = answer::turns_of(&mut s, &who.app, context, "response", id).await?;
    let n = ids::locate(id, &turns).ok_or_else(|| ApiError::not_found("response", id))?;
    let conflict = |m: String| ApiError {
        retry: false,
        ..ApiError::new(StatusCode::CONFLICT, http_codes::MOVED_ON, m)
    };
    if crate::http::conversations::is_conversation(&mut s, who, context).await? {
        return Err(conflict(format!(
            "response {id} belongs to conversation {}; delete the conversation",
            ids::conversation(context)
        )));
    }
    if n != turns.len() {
        return Err(conflict(format!(
            "response {id} is followed by later responses of its conversation; delete the latest"
        )));
    }
    s.op(&who.app, |rid| Request::Delete { id: rid, context })
        .await?;
    Ok(body::json(
        StatusCode::OK,
        &json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}

/// Serves `POST /v1/responses/input_tokens`: the tokens the input would add, counted as a call
/// would encode it.
pub async fn input_tokens(
    api: &Arc<Api>,
    who: &Who,
    o: &Object,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let mut o = o.clone();
    o.remove("stream");
    let req = parse(&o)?;
    let context = match (&req.previous, &req.conversation) {
        (Some(p), _) => Some(continue_response(api, &mut s, who, p).await?),
        (None, Some(c)) => Some(continue_conversation(api, &mut s, who, c).await?),
        _ => None,
    };
    let tokens = match context {
        Some(c) => {
            let last = req.input.last().map(|t| match t.role.as_str() {
                "tool" => model::tokenizer::tool_response_text(&t.text),
                _ => t.text.clone(),
            });
            let text = last.unwrap_or_default();
            match s
                .op(&who.app, |id| Request::Count {
                    id,
                    context: Some(c.context),
                    text,
                    format: protocol::PromptFormat::Chat,
                })
                .await?
            {
                Event::Count(c) => c.tokens,
                e => return Err(answer::unexpected(&e).into()),
            }
        }
        None => {
            let turns = req.opening(&req.input);
            count_new(api, &answer::created_turns(&turns, &req.tools))?
        }
    };
    Ok(body::json(
        StatusCode::OK,
        &json!({"object": "response.input_tokens", "input_tokens": tokens}),
    ))
}

/// The tokens of a new context's `turns` and the answer's opening, as a call encodes them.
fn count_new(api: &Api, turns: &[Turn]) -> Result<usize, ApiError> {
    use service::transcript::{Role, Turn as ServiceTurn, messages};
    let turns: Vec<ServiceTurn> = turns
        .iter()
        .filter_map(|t| Role::parse(&t.role).map(|r| ServiceTurn::new(r, t.text.as_str())))
        .collect();
    let tok = &api.tokenizer;
    tok.encode_chat(&messages(tok, &turns, true), true)
        .map(|t| t.len())
        .map_err(|e| ApiError::from(ErrorBody::new(protocol::codes::NO_TEMPLATE, e.to_string())))
}
