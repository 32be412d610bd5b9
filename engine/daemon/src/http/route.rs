//! Every HTTP request's first steps: who it is (the Unix peer's uid, or the uid of a TCP
//! request's key), refused while the daemon drains, its bounded body read, then the endpoint its
//! method and path name; an error from any of them is answered here in OpenAI's shape.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use hyper::body::Incoming;
use hyper::header::AUTHORIZATION;
use hyper::{Method, Request, StatusCode};
use serde_json::json;

use crate::http::body::{self, ApiResponse};
use crate::http::error::{ApiError, http_codes};
use crate::http::session::Session;
use crate::http::wire::Object;
use crate::http::{Api, Peer, Who, chat, conversations, responses};

/// Answers one request.
pub async fn handle(api: Arc<Api>, peer: Peer, req: Request<Incoming>) -> ApiResponse {
    let received = Instant::now();
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    match serve(&api, peer, req, received).await {
        Ok(r) => r,
        Err(e) => {
            api.shared.error();
            tracing::debug!(%method, %path, status = e.status.as_u16(), error = %e.message, "HTTP error");
            body::error(&e)
        }
    }
}

/// Who a request is: the Unix peer, or the owner of its bearer key.
fn who(api: &Api, peer: Peer, req: &Request<Incoming>) -> Result<Who, ApiError> {
    if let Peer::Unix { uid } = peer {
        return Ok(Who {
            uid,
            app: api.unix_app.clone(),
        });
    }
    let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, http_codes::NO_KEY, m);
    let key = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or_else(|| {
            unauthorized("send Authorization: Bearer KEY with a key of `llms keys add`")
        })?;
    let found = api.keys.as_ref().and_then(|k| k.lock().lookup(key));
    found
        .map(|i| Who {
            uid: i.uid,
            app: i.app,
        })
        .ok_or_else(|| unauthorized("the key is not in the daemon's key file"))
}

/// The body as a JSON object whose `model`, if `need_model` or present, is the daemon's.
async fn object(api: &Api, req: Request<Incoming>, need_model: bool) -> Result<Object, ApiError> {
    let bytes = body::read(req.into_body(), api.max_body, api.body_timeout).await?;
    let o = body::json_object(&bytes)?;
    match o.get("model").and_then(|m| m.as_str()) {
        Some(m) if m == api.shared.model_name => Ok(o),
        None if !need_model && o.get("model").is_none_or(|m| m.is_null()) => Ok(o),
        None => Err(ApiError::param(
            "model",
            "model is missing; GET /v1/models names it",
        )),
        Some(m) => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                http_codes::MODEL,
                format!("this daemon serves {:?}, not {m:?}", api.shared.model_name),
            )
        }),
    }
}

fn models(api: &Api) -> serde_json::Value {
    json!({"id": api.shared.model_name, "object": "model", "created": 0, "owned_by": "llms"})
}

async fn serve(
    api: &Arc<Api>,
    peer: Peer,
    req: Request<Incoming>,
    received: Instant,
) -> Result<ApiResponse, ApiError> {
    let who = who(api, peer, &req)?;
    if api.shared.stopping.load(Ordering::Acquire) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            protocol::codes::SHUTTING_DOWN,
            "the daemon is shutting down",
        ));
    }
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let query = req.uri().query().map(str::to_owned);
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let method = req.method().clone();
    let s = Session::new(&api.shared, who.uid, received);
    let ok = |v| Ok(body::json(StatusCode::OK, &v));
    match (&method, parts.as_slice()) {
        (&Method::GET, ["v1", "models"]) => ok(json!({"object": "list", "data": [models(api)]})),
        (&Method::GET, ["v1", "models", m]) if *m == api.shared.model_name => ok(models(api)),
        (&Method::GET, ["v1", "models", m]) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            http_codes::MODEL,
            format!("no model {m:?}"),
        )),
        (&Method::POST, ["v1", "chat", "completions"]) => {
            let o = object(api, req, true).await?;
            chat::completions(api, &who, &o, s).await
        }
        (&Method::POST, ["v1", "responses"]) => {
            let o = object(api, req, true).await?;
            responses::create(api, &who, &o, s).await
        }
        (&Method::POST, ["v1", "responses", "input_tokens"]) => {
            let o = object(api, req, false).await?;
            responses::input_tokens(api, &who, &o, s).await
        }
        (&Method::GET, ["v1", "responses", id]) => responses::get(&who, id, s).await,
        (&Method::DELETE, ["v1", "responses", id]) => responses::delete(api, &who, id, s).await,
        (&Method::POST, ["v1", "conversations"]) => {
            let o = object(api, req, false).await?;
            conversations::create(&who, &o, s).await
        }
        (&Method::GET, ["v1", "conversations", id]) => conversations::get(&who, id, s).await,
        (&Method::GET, ["v1", "conversations", id, "items"]) => {
            conversations::list_items(&who, id, query.as_deref(), s).await
        }
        (&Method::DELETE, ["v1", "conversations", id]) => {
            conversations::delete(api, &who, id, s).await
        }
        (
            _,
            ["v1", "models" | "responses" | "conversations", ..] | ["v1", "chat", "completions"],
        ) => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            http_codes::NO_METHOD,
            format!("{method} is not served on {path}"),
        )),
        _ => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            http_codes::NO_ROUTE,
            format!("no endpoint {path}; docs/http.md lists them"),
        )),
    }
}
