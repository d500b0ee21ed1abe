//! The API key check: `Authorization: Bearer KEY` on every `/v1` route when a key is set.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// Whether `given` equals `want`, in time that does not depend on where they differ.
fn same_key(given: &[u8], want: &[u8]) -> bool {
    let mut diff = given.len() ^ want.len();
    for (i, &w) in want.iter().enumerate() {
        diff |= usize::from(given.get(i).copied().unwrap_or(!w) ^ w);
    }
    diff == 0
}

/// Checks the bearer token of a request against the server's key.
pub fn check(key: Option<&str>, header: Option<&[u8]>) -> Result<(), ApiError> {
    let Some(key) = key else { return Ok(()) };
    let Some(value) = header else {
        return Err(ApiError::unauthorized(
            "missing API key: send it as 'Authorization: Bearer KEY'",
        ));
    };
    let token = value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))
        .unwrap_or(b"");
    if same_key(token, key.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized("incorrect API key"))
    }
}

/// Middleware: answers 401 unless the request carries the key.
pub async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let header = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
    match check(state.api_key.as_deref(), header) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(check(None, None).is_ok());
        assert!(check(Some("k1"), Some(b"Bearer k1")).is_ok());
        for bad in [
            None,
            Some(&b"Bearer k2"[..]),
            Some(b"Bearer k1x"),
            Some(b"Bearer k"),
            Some(b"k1"),
            Some(b"Bearer "),
        ] {
            let e = check(Some("k1"), bad).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::UNAUTHORIZED, "{bad:?}");
        }
        assert!(same_key(b"", b""));
        assert!(!same_key(b"a", b""));
    }
}
