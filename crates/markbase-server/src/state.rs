//! What every handler shares: the engine, the tokenizer and template, limits and the key.

use std::sync::Arc;

use markbase_core::tokenizer::{ChatTemplate, Tokenizer};
use markbase_engine::{Engine, EngineConfig, LoadedModel};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::output::Markers;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The name `/v1/models` reports and replies carry.
    pub model_name: String,
    /// Requests to `/v1/*` must carry `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Largest `max_tokens` a request may ask for (also the default, within the context).
    pub max_tokens: usize,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// The engine's settings.
    pub engine: EngineConfig,
}

/// The shared state of a running server.
pub struct AppState {
    /// The batching engine.
    pub engine: Engine,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// Ids that end a reply (EOS and end-of-turn tokens).
    pub stop_tokens: Vec<u32>,
    /// Gemma 4 reasoning / tool-call markers the vocabulary has.
    pub markers: Markers,
    /// Served model name.
    pub model_name: String,
    /// Unix time the server started.
    pub created: u64,
    /// Largest `max_tokens`.
    pub max_tokens: usize,
    /// Per-request limit on prompt + output tokens.
    pub max_context: usize,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// The API key, if one is required.
    pub api_key: Option<String>,
    /// The metrics recorder.
    pub metrics: PrometheusHandle,
}

impl AppState {
    /// Starts the engine on `loaded`'s model.
    pub fn new(loaded: LoadedModel, opts: ServerOptions) -> Result<Arc<AppState>, String> {
        let stop_tokens = loaded
            .stop_tokens()
            .map_err(|e| format!("cannot read the stop tokens: {e}"))?;
        let LoadedModel {
            model,
            tokenizer,
            template,
            ..
        } = loaded;
        let limit = model.info().context_length;
        if opts.engine.max_context > limit {
            return Err(format!(
                "a context of {} tokens is larger than the model's {limit}",
                opts.engine.max_context
            ));
        }
        let metrics = crate::metrics::handle()?;
        let max_context = opts.engine.max_context;
        let engine = Engine::start(Arc::new(model), opts.engine)
            .map_err(|e| format!("cannot start the engine: {e}"))?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Arc::new(AppState {
            engine,
            markers: Markers::of(&tokenizer),
            tokenizer,
            template,
            stop_tokens,
            model_name: opts.model_name,
            created,
            max_tokens: opts.max_tokens,
            max_context,
            max_body_bytes: opts.max_body_bytes,
            api_key: opts.api_key,
            metrics,
        }))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A server state on the tiny Gemma 4 fixture model (random weights, real tokenizer).
    pub fn fixture_state() -> Arc<AppState> {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gemma4/e4b_like");
        let loaded = markbase_engine::load(&dir, &markbase_models::LoadOptions::default()).unwrap();
        let opts = ServerOptions {
            model_name: "fixture".into(),
            api_key: None,
            max_tokens: 64,
            max_body_bytes: 1 << 16,
            engine: EngineConfig {
                max_seqs: 4,
                max_context: 256,
                ..EngineConfig::default()
            },
        };
        AppState::new(loaded, opts).unwrap()
    }

    #[test]
    fn fixture_state_has_gemma4_markers() {
        let s = fixture_state();
        assert!(s.markers.has_tools() && s.markers.channel.is_some());
        assert_eq!(s.stop_tokens, [1, 106, 50]);
    }
}
