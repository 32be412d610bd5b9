//! `/v1/conversations`: a conversation is a context of the key's app's conversations
//! (`{app}.conv`), made from its items; responses with `conversation` continue it
//! (`crate::http::responses`).

use hyper::StatusCode;
use protocol::{Event, Request, Turn};
use serde_json::{Value, json};

use crate::http::Who;
use crate::http::answer::{self, unexpected};
use crate::http::body::{self, ApiResponse};
use crate::http::error::ApiError;
use crate::http::ids;
use crate::http::session::Session;
use crate::http::shapes::input_turns;
use crate::http::wire::{self, Allowed, Object};

/// The app name the key's conversations are made under.
pub fn app(who: &Who) -> String {
    let mut app = who.app.clone();
    app.truncate(protocol::MAX_APP - 5);
    app + ".conv"
}

/// Whether `context` is one of the key's conversations (a 404 if this uid does not hold it).
pub async fn is_conversation(s: &mut Session, who: &Who, context: u64) -> Result<bool, ApiError> {
    match s.op(&who.app, |id| Request::Info { id, context }).await {
        Ok(Event::Info { context: c }) => Ok(c.app == app(who)),
        Ok(e) => Err(unexpected(&e).into()),
        Err(e) if e.code == protocol::codes::NOT_FOUND => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A 404 unless `context` is one of the key's conversations.
pub async fn check(s: &mut Session, who: &Who, context: u64, id: &str) -> Result<(), ApiError> {
    match is_conversation(s, who, context).await? {
        true => Ok(()),
        false => Err(ApiError::not_found("conversation", id)),
    }
}

fn object(id: &str, created: u64, metadata: Value) -> Value {
    json!({"id": id, "object": "conversation", "created_at": created, "metadata": metadata})
}

/// Serves `POST /v1/conversations`: a context made from the items.
pub async fn create(who: &Who, o: &Object, mut s: Session) -> Result<ApiResponse, ApiError> {
    wire::check_fields(
        o,
        &Allowed {
            fields: &["items", "metadata"],
            neutral: &[],
        },
        "",
    )?;
    let turns = match wire::get(o, "items") {
        Some(v) => input_turns(v, "items")?,
        None => Vec::new(),
    };
    let context = answer::create(&mut s, &app(who), &turns, &[]).await?;
    let metadata = wire::get(o, "metadata")
        .cloned()
        .unwrap_or_else(|| json!({}));
    let v = object(&ids::conversation(context), wire::now_secs(), metadata);
    Ok(body::json(StatusCode::OK, &v))
}

/// Serves `GET /v1/conversations/{id}`.
pub async fn get(who: &Who, id: &str, mut s: Session) -> Result<ApiResponse, ApiError> {
    let context =
        ids::conversation_context(id).ok_or_else(|| ApiError::not_found("conversation", id))?;
    check(&mut s, who, context, id).await?;
    Ok(body::json(StatusCode::OK, &object(id, 0, json!({}))))
}

/// A conversation's turns as the API's items, oldest first: messages (the instructions as a
/// `system` one), function calls and their outputs; the tools declaration is not an item. Item
/// ids are the conversation's and the item's place in it (`msg_{context}_{i}`); a function
/// call's `call_id` names its place, and the output after it names the same.
pub fn items(context: u64, turns: &[Turn]) -> Vec<Value> {
    let mut out = Vec::with_capacity(turns.len());
    let mut call = String::new();
    for (i, t) in turns.iter().enumerate() {
        let id = |p: &str| format!("{p}_{context}_{i}");
        let text = |kind: &str| json!([{"type": kind, "text": t.text}]);
        out.push(match t.role.as_str() {
            "tools" => continue,
            "tool_call" => {
                let (name, arguments) = wire::call_of(&t.text);
                call = id("call");
                json!({"type": "function_call", "id": id("fc"), "call_id": call, "name": name,
                    "arguments": arguments, "status": "completed"})
            }
            "tool" => json!({"type": "function_call_output", "id": id("fco"), "call_id": call,
                "output": t.text, "status": "completed"}),
            "assistant" | "raw" => json!({"type": "message", "id": id("msg"),
                "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": t.text, "annotations": []}]}),
            role => json!({"type": "message", "id": id("msg"), "status": "completed",
                "role": if role == "system" { "system" } else { "user" },
                "content": text("input_text")}),
        });
    }
    out
}

/// The `limit`, `order` and `after` of a list request's query string.
fn list_query(query: Option<&str>) -> Result<(usize, bool, Option<String>), ApiError> {
    let (mut limit, mut desc, mut after) = (20, true, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| ApiError::param("limit", "limit is 1 to 100"))?;
            }
            "order" => {
                desc = match v {
                    "desc" => true,
                    "asc" => false,
                    _ => return Err(ApiError::param("order", "order is asc or desc")),
                };
            }
            "after" => after = Some(v.to_owned()),
            "include" | "include[]" => {}
            _ => return Err(ApiError::unsupported(&[k.to_owned()])),
        }
    }
    Ok((limit, desc, after))
}

/// Serves `GET /v1/conversations/{id}/items`: the conversation's items, newest first unless
/// `order=asc`, `limit` (20) at a time after the item `after`.
pub async fn list_items(
    who: &Who,
    id: &str,
    query: Option<&str>,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let (limit, desc, after) = list_query(query)?;
    let context =
        ids::conversation_context(id).ok_or_else(|| ApiError::not_found("conversation", id))?;
    check(&mut s, who, context, id).await?;
    let turns = answer::turns_of(&mut s, &who.app, context, "conversation", id).await?;
    let mut all = items(context, &turns);
    if desc {
        all.reverse();
    }
    let start = match after {
        Some(a) => {
            1 + all
                .iter()
                .position(|i| i["id"] == a)
                .ok_or_else(|| ApiError::not_found("item", &a))?
        }
        None => 0,
    };
    let page: Vec<Value> = all.iter().skip(start).take(limit).cloned().collect();
    let v = json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": start + page.len() < all.len(),
    });
    Ok(body::json(StatusCode::OK, &v))
}

/// Serves `DELETE /v1/conversations/{id}`: its context goes.
pub async fn delete(
    api: &crate::http::Api,
    who: &Who,
    id: &str,
    mut s: Session,
) -> Result<ApiResponse, ApiError> {
    let context =
        ids::conversation_context(id).ok_or_else(|| ApiError::not_found("conversation", id))?;
    let _in_use = api.hold(context)?;
    check(&mut s, who, context, id).await?;
    s.op(&who.app, |rid| Request::Delete { id: rid, context })
        .await?;
    let v = json!({"id": id, "object": "conversation.deleted", "deleted": true});
    Ok(body::json(StatusCode::OK, &v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::wire::turn;

    #[test]
    fn turns_become_items_with_calls_and_their_outputs_paired() {
        let turns = [
            turn("tools", "[]"),
            turn("system", "Be brief."),
            turn("user", "Weather in Oslo?"),
            turn(
                "tool_call",
                r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#,
            ),
            turn("tool", "rain"),
            turn("assistant", "It rains."),
        ];
        let items = items(7, &turns);
        let kinds: Vec<_> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "message",
                "message",
                "function_call",
                "function_call_output",
                "message"
            ]
        );
        assert_eq!(items[0]["role"], "system");
        assert_eq!(items[1]["content"][0]["type"], "input_text");
        assert_eq!(items[2]["name"], "get_weather");
        assert_eq!(items[2]["call_id"], items[3]["call_id"]);
        assert_eq!(items[4]["content"][0]["type"], "output_text");
        assert_eq!(items[4]["id"], "msg_7_5");
    }

    #[test]
    fn the_list_query_is_checked() {
        assert_eq!(list_query(None).unwrap(), (20, true, None));
        assert_eq!(
            list_query(Some("limit=5&order=asc&after=msg_1_2")).unwrap(),
            (5, false, Some("msg_1_2".into()))
        );
        assert!(list_query(Some("limit=0")).is_err());
        assert!(list_query(Some("order=up")).is_err());
        assert!(list_query(Some("colour=red")).is_err());
    }
}
