//! HTTP handlers, one module per endpoint family, and the JSON body extractor they share.

pub mod chat;
pub mod completions;
pub mod info;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::state::AppState;

/// A JSON request body whose errors are OpenAI-shaped (400 naming the bad field, 413 when the
/// body is over the limit).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<Arc<AppState>> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(state.max_body_bytes)
            } else {
                ApiError::invalid(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// Parses a JSON body; the error names the field at fault.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let msg = format!("invalid JSON body: {}", e.inner());
        if path.is_empty() || path == "." || path == "?" {
            ApiError::invalid(msg)
        } else {
            ApiError::invalid_param(&path, msg)
        }
    })?;
    de.end()
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
    Ok(value)
}

/// Unix time now, in seconds.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A new id with `prefix` (unique within the process, different across restarts).
pub fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    format!("{prefix}-{t:x}{n:06x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatRequest;

    #[test]
    fn json_errors_are_400_and_name_the_field() {
        let e = parse::<ChatRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param, None);
        let e = parse::<ChatRequest>(br#"{"messages": [{"role": 5}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse::<ChatRequest>(br#"{"messages": []} x"#).unwrap_err();
        assert!(e.message.contains("trailing"), "{}", e.message);
        assert!(parse::<ChatRequest>(br#"{"messages": []}"#).is_ok());
        assert_ne!(new_id("a"), new_id("a"));
    }
}
