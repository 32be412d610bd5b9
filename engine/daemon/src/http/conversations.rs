//! `/v1/conversations`: a conversation is a context of the key's app's conversations
//! (`{app}.conv`), made from its items; responses with `conversation` continue it
//! (`crate::http::responses`).

use hyper::StatusCode;
use protocol::{Event, Request};
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
