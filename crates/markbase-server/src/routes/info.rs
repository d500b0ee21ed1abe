//! `GET /v1/models`, `GET /health`, `GET /metrics`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Json, Response};
use serde_json::json;

use crate::openai::{ModelCard, ModelList};
use crate::state::AppState;

/// `GET /v1/models`: the one served model.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.model_name.clone(),
            object: "model",
            created: state.created,
            owned_by: "markbase",
        }],
    })
}

/// `GET /health`: 200 with the engine's state and its step counters since start.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let s = state.engine.stats();
    Json(json!({
        "status": "ok",
        "model": state.model_name,
        "waiting": s.waiting,
        "running": s.running,
        "kv_blocks_used": s.kv_blocks_used,
        "kv_blocks_total": s.kv_blocks_total,
        "steps": s.steps,
        "decode_rows": s.decode_rows,
        "prefill_rows": s.prefill_rows,
        "step_seconds": s.step_seconds,
        "device_wait_seconds": s.device_wait_seconds,
        "device_waits": s.device_waits,
        "graph_replays": s.graph_replays,
        "f16_copy_bytes": s.f16_copy_bytes,
    }))
    .into_response()
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    crate::metrics::engine(&state.engine.stats());
    state.metrics.run_upkeep();
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
