//! MarkBase's OpenAI-compatible HTTP server (axum + tokio) over the batching engine:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
//! `GET /metrics`.

pub mod auth;
pub mod error;

pub mod openai;
pub mod output;
pub mod params;
pub mod prompt;
pub mod tool_syntax;
