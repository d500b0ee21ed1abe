//! MarkBase's OpenAI-compatible HTTP server (axum + tokio) over the batching engine:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
//! `GET /metrics`.

pub mod auth;
pub mod error;
pub mod generate;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod params;
pub mod prompt;
pub mod routes;
pub mod sse;
pub mod state;
pub mod tool_syntax;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

pub use state::{AppState, ServerOptions};

/// The server's routes. `/v1/*` need the API key (when one is set); `/health` and `/metrics`
/// do not.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(routes::chat::handler))
        .route("/v1/completions", post(routes::completions::handler))
        .route("/v1/models", get(routes::info::models))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ))
        .route("/health", get(routes::info::health))
        .route("/metrics", get(routes::info::metrics))
        .fallback(|| async { error::ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(middleware::from_fn(count_requests))
        .with_state(state)
}

/// Middleware: counts answered requests by route and status.
async fn count_requests(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".to_string());
    let response = next.run(req).await;
    metrics::http_request(&route, response.status().as_u16());
    response
}

/// Serves on `listener` until `shutdown` completes; then stops the engine (requests still
/// running end with an error) and waits for open connections to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let engine_state = state.clone();
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            shutdown.await;
            // Waits for the step loop to end: off the async threads.
            let _ = tokio::task::spawn_blocking(move || engine_state.engine.shutdown()).await;
        })
        .await
}
