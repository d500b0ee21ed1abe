//! `markbase serve`: the OpenAI-compatible HTTP server.

use anyhow::{Context, Result};
use markbase_engine::EngineConfig;
use markbase_server::{AppState, ServerOptions};

use crate::Global;

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long = "api-key", env = "MARKBASE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name in replies and /v1/models (default: the model file's name).
    #[arg(long = "model-name")]
    pub model_name: Option<String>,
    /// Sequences the engine runs at once (default: 256 on a GPU, 16 on the CPU; at most
    /// max-step-tokens).
    #[arg(long = "max-seqs")]
    pub max_seqs: Option<usize>,
    /// Requests that may wait for the engine; more are answered 429.
    #[arg(long = "max-queue", default_value_t = 256)]
    pub max_queue: usize,
    /// Token budget of one engine step (decode tokens + prompt chunks).
    #[arg(long = "max-step-tokens", default_value_t = 512)]
    pub max_step_tokens: usize,
    /// KV-cache blocks (default: enough for max-seqs sequences of ctx tokens; on a GPU no more
    /// than half of its memory free after loading holds, the rest left to the f16 copies of
    /// quantized weights and to scratch).
    #[arg(long = "kv-blocks")]
    pub kv_blocks: Option<usize>,
    /// Per-request limit on prompt + output tokens (default: 4096, at most the model's context).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Largest max_tokens a request may ask for.
    #[arg(long = "max-tokens", default_value_t = 2048)]
    pub max_tokens: usize,
    /// Largest request body in bytes.
    #[arg(long = "max-body-bytes", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
}

/// Default per-request context.
const DEFAULT_CTX: usize = 4096;
/// Default `--max-seqs` on a GPU (or `--max-step-tokens` if fewer): steps of up to 256
/// sequences run as one CUDA graph with one host wait (E4B Q4_K_M with f16 copies on an H100:
/// 11 116 / 18 229 / 28 125 t/s at 64 / 128 / 256 sequences, docs/perf.md session 54).
const GPU_MAX_SEQS: usize = 256;
/// Default `--max-seqs` on the CPU, whose steps grow in time with their rows.
const CPU_MAX_SEQS: usize = 16;

/// Runs `serve`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let path = crate::model::model_path(global)?;
    let loaded = crate::model::load_model(global)?;
    let limit = loaded.model.info().context_length;
    let memory = loaded
        .model
        .device_memory()
        .context("cannot read the GPU's free memory")?;
    let default_seqs = if memory.is_some() {
        GPU_MAX_SEQS
    } else {
        CPU_MAX_SEQS
    }
    .min(args.max_step_tokens);
    let max_seqs = args.max_seqs.unwrap_or(default_seqs);
    let device = loaded.model.info().device.clone();
    let model_name = args.model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .or(path.file_name())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "markbase".into())
    });
    let opts = ServerOptions {
        model_name: model_name.clone(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_tokens: args.max_tokens,
        max_body_bytes: args.max_body_bytes,
        engine: EngineConfig {
            max_seqs,
            max_step_tokens: args.max_step_tokens,
            kv_blocks: args.kv_blocks,
            kv_memory: memory.map(|(free, _)| free / 2),
            max_queue: args.max_queue,
            max_context: args.ctx.unwrap_or(DEFAULT_CTX.min(limit)),
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let warm = loaded.model.warm_up_rows();
        let started = std::time::Instant::now();
        if !warm.is_empty() {
            eprintln!(
                "markbase: planning the device's products for {} batch sizes (once per start)…",
                warm.len()
            );
        }
        let state = AppState::new(loaded, opts).map_err(anyhow::Error::msg)?;
        if !warm.is_empty() {
            eprintln!(
                "markbase: planned in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        let stats = state.engine.stats();
        eprintln!(
            "markbase: up to {max_seqs} sequences at once; KV cache of {} blocks of {} tokens",
            stats.kv_blocks_total,
            markbase_engine::KV_BLOCK_TOKENS
        );
        let copies = stats.f16_copy_bytes;
        if copies > 0 {
            eprintln!(
                "markbase: f16 copies of quantized weights for steps of 65+ token rows: {:.2} GiB (--no-f16-copies keeps only the stored weights)",
                copies as f64 / (1u64 << 30) as f64
            );
        }
        let addr = listener.local_addr()?;
        eprintln!(
            "markbase: serving {model_name} ({device}) on http://{addr} (OpenAI API under /v1{})",
            if state.api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        markbase_server::serve(listener, state, shutdown_signal())
            .await
            .context("the server failed")
    })
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("markbase: shutting down");
}
