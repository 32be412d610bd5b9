//! The HTTP API's errors in the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`,
//! with their status codes; every error of the daemon's protocol maps here, in one place.

use hyper::StatusCode;
use protocol::{ErrorBody, codes};

/// An error answer of the HTTP API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The stable code: the daemon's protocol code where there is one (`context_full`...).
    pub code: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// Whether a client may retry as it is (OpenAI's clients read `x-should-retry`).
    pub retry: bool,
}

/// Codes of the HTTP API's own errors (beside the daemon's protocol codes).
pub mod http_codes {
    pub const UNSUPPORTED: &str = "unsupported_parameter";
    pub const INVALID_JSON: &str = "invalid_json";
    pub const NO_KEY: &str = "invalid_api_key";
    pub const NO_ROUTE: &str = "unknown_url";
    pub const NO_METHOD: &str = "method_not_allowed";
    pub const MODEL: &str = "model_not_found";
    pub const MOVED_ON: &str = "context_moved_on";
    pub const IN_USE: &str = "context_in_use";
    pub const TOO_LARGE: &str = "request_too_large";
    pub const TIMEOUT: &str = "request_timeout";
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            code: code.to_owned(),
            param: None,
            retry: status == StatusCode::TOO_MANY_REQUESTS
                || status == StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A 400 about the request.
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, codes::BAD_REQUEST, message)
    }

    /// A 400 naming the field `param`.
    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_owned()),
            ..ApiError::bad(message)
        }
    }

    /// A 400 naming fields this server does not implement.
    pub fn unsupported(fields: &[String]) -> ApiError {
        ApiError {
            code: http_codes::UNSUPPORTED.into(),
            param: fields
                .first()
                .map(|f| f.split(['=', ' ']).next().unwrap_or(f).to_owned()),
            ..ApiError::bad(format!(
                "unsupported: {}; this server implements only what the model can do \
                 (docs/http.md lists the fields)",
                fields.join(", ")
            ))
        }
    }

    /// A 404 for an id this uid does not hold (missing and another uid's alike).
    pub fn not_found(what: &str, id: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOT_FOUND,
            format!("no {what} {id:?}"),
        )
    }

    /// The OpenAI type of the error.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::CONFLICT => "conflict_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error's JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<ErrorBody> for ApiError {
    /// The daemon's error codes as HTTP statuses.
    fn from(e: ErrorBody) -> ApiError {
        let status = match e.code.as_str() {
            codes::NOT_FOUND => StatusCode::NOT_FOUND,
            codes::BUSY => StatusCode::TOO_MANY_REQUESTS,
            codes::SHUTTING_DOWN => StatusCode::SERVICE_UNAVAILABLE,
            "too_many_contexts" | "other_model" => StatusCode::CONFLICT,
            "store" | "internal" => StatusCode::INTERNAL_SERVER_ERROR,
            codes::CANCELLED => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_REQUEST,
        };
        let mut message = e.message;
        if let Some(n) = e.tokens {
            message = format!(
                "{message} (context window {}, used {}, remaining {}, needed {})",
                n.context_window, n.used, n.remaining, n.needed
            );
        }
        ApiError::new(status, &e.code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(code: &str, status: StatusCode, retry: bool) {
        let e = ApiError::from(ErrorBody::new(code, "m"));
        assert_eq!((e.status, e.retry), (status, retry), "{code}");
        assert_eq!(e.body()["error"]["code"], code);
    }

    #[test]
    fn daemon_codes_map_to_statuses() {
        check("bad_request", StatusCode::BAD_REQUEST, false);
        check("context_full", StatusCode::BAD_REQUEST, false);
        check("invalid_schema", StatusCode::BAD_REQUEST, false);
        check("not_found", StatusCode::NOT_FOUND, false);
        check("busy", StatusCode::TOO_MANY_REQUESTS, true);
        check("shutting_down", StatusCode::SERVICE_UNAVAILABLE, true);
        check("too_many_contexts", StatusCode::CONFLICT, false);
        check("internal", StatusCode::INTERNAL_SERVER_ERROR, false);
    }

    #[test]
    fn unsupported_fields_are_named() {
        let e = ApiError::unsupported(&["logprobs".into(), "n".into()]);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["param"], "logprobs");
        let e = ApiError::unsupported(&["n=2".into()]);
        assert_eq!(e.param.as_deref(), Some("n"));
        assert!(
            b["error"]["message"]
                .as_str()
                .unwrap()
                .contains("logprobs, n")
        );
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }
}
