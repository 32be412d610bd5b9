//! Bodies of the HTTP API: a request's, read whole under a size bound and a deadline and parsed
//! as a JSON object; a JSON answer; and a server-sent events stream fed by a bounded channel
//! (dropped by hyper when the client goes away, which the feeding task then sees).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::{Response, StatusCode};

use crate::http::error::{ApiError, http_codes};

/// A response body: whole, or a stream of events.
pub enum ApiBody {
    Full(Full<Bytes>),
    Events(tokio::sync::mpsc::Receiver<Bytes>),
}

impl Body for ApiBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ApiBody::Full(f) => Pin::new(f).poll_frame(cx),
            ApiBody::Events(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    /// A whole body's length, so hyper sends `content-length` rather than chunks.
    fn size_hint(&self) -> SizeHint {
        match self {
            ApiBody::Full(f) => f.size_hint(),
            ApiBody::Events(_) => SizeHint::default(),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ApiBody::Full(f) => f.is_end_stream(),
            ApiBody::Events(_) => false,
        }
    }
}

pub type ApiResponse = Response<ApiBody>;

/// Reads a request's body whole: at most `limit` bytes, within `deadline`.
pub async fn read(body: Incoming, limit: usize, deadline: Duration) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(deadline, Limited::new(body, limit).collect()).await {
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            http_codes::TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                deadline.as_secs()
            ),
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            http_codes::TOO_LARGE,
            format!("request bodies are at most {limit} bytes (llms serve --max-line)"),
        )),
        Ok(Err(e)) => Err(ApiError::bad(format!("reading the request body: {e}"))),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// A body parsed as one JSON object.
pub fn json_object(bytes: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            http_codes::INVALID_JSON,
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            http_codes::INVALID_JSON,
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

/// A JSON answer.
pub fn json(status: StatusCode, value: &serde_json::Value) -> ApiResponse {
    let mut r = Response::new(ApiBody::Full(Full::new(Bytes::from(value.to_string()))));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error answer.
pub fn error(e: &ApiError) -> ApiResponse {
    let mut r = json(e.status, &e.body());
    let retry = if e.retry { "true" } else { "false" };
    r.headers_mut()
        .insert("x-should-retry", HeaderValue::from_static(retry));
    r
}

/// A stream of server-sent events: the response, and where its events go.
pub fn events(buffer: usize) -> (ApiResponse, Events) {
    let (tx, rx) = tokio::sync::mpsc::channel(buffer.max(1));
    let mut r = Response::new(ApiBody::Events(rx));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    (r, Events { tx })
}

/// The sending end of a server-sent events stream.
pub struct Events {
    tx: tokio::sync::mpsc::Sender<Bytes>,
}

impl Events {
    /// Sends one `data:` event (with an `event:` line if `name` is given); false once the client
    /// is gone.
    pub async fn send(&self, name: Option<&str>, data: &serde_json::Value) -> bool {
        let text = match name {
            Some(n) => format!("event: {n}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        };
        self.tx.send(Bytes::from(text)).await.is_ok()
    }

    /// Sends the closing `data: [DONE]` of a chat completion stream.
    pub async fn done(&self) -> bool {
        self.tx
            .send(Bytes::from_static(b"data: [DONE]\n\n"))
            .await
            .is_ok()
    }
}
