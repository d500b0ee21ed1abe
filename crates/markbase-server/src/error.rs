//! Errors as OpenAI-shaped JSON bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered to an HTTP client.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// The OpenAI error type (`invalid_request_error`, `authentication_error`, …).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A short machine-readable code, if one applies.
    pub code: Option<&'static str>,
}

/// The JSON body of an error.
#[derive(Serialize)]
pub struct ErrorBody<'a> {
    /// The error itself.
    pub error: ErrorDetail<'a>,
}

/// The fields of an error body.
#[derive(Serialize)]
pub struct ErrorDetail<'a> {
    /// What went wrong.
    pub message: &'a str,
    /// The error type.
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The request field at fault.
    pub param: Option<&'a str>,
    /// A short code.
    pub code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400: the request is malformed or asks for something out of range.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    /// 404: no such route or model.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    /// 413: the request body is larger than the server accepts.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the limit of {limit} bytes"),
            )
        }
    }

    /// 429: the queue of waiting requests is full.
    pub fn queue_full() -> Self {
        ApiError {
            code: Some("queue_full"),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "the server is busy: its queue of waiting requests is full; retry later",
            )
        }
    }

    /// 503: the server cannot take requests (shutting down or too many connections).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// Sets the error code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid_param("temperature", "temperature must be ≥ 0");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {
                "message": "temperature must be ≥ 0",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": null
            }})
        );
        let v = serde_json::to_value(ApiError::unauthorized("no key").body()).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(ApiError::queue_full().status, StatusCode::TOO_MANY_REQUESTS);
    }
}
