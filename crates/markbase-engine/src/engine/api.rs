//! The public types of the serving engine: configuration, requests, events, errors, stats.

use std::fmt;

use crate::generate::FinishReason;
use crate::sampling::SamplingParams;

/// Largest `top_logprobs` a request may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How the engine runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// Token budget of one step: decode tokens plus prefill chunks.
    pub max_step_tokens: usize,
    /// KV blocks in the pool; `None` sizes it for `max_seqs` sequences of `max_context` tokens,
    /// within `kv_memory`.
    pub kv_blocks: Option<usize>,
    /// Most bytes the KV pools take where `kv_blocks` is `None` (fewer full-attention blocks
    /// than `max_seqs` sequences of `max_context` tokens then: sequences that would outgrow
    /// the pool are preempted and recomputed later); `None`: no limit.
    pub kv_memory: Option<usize>,
    /// Waiting requests before [`crate::Engine::submit`] answers [`SubmitError::QueueFull`].
    pub max_queue: usize,
    /// Per-sequence limit on prompt + output tokens (at most the model's context).
    pub max_context: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_seqs: 64,
            max_step_tokens: 512,
            kv_blocks: None,
            kv_memory: None,
            max_queue: 256,
            max_context: 4096,
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids, BOS included by the caller.
    pub prompt: Vec<u32>,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// How tokens are drawn, seed included.
    pub sampling: SamplingParams,
    /// Ids that finish the sequence; they are not emitted as [`Event::Token`].
    pub stop_tokens: Vec<u32>,
    /// `Some(n)`: each token event carries its log-probability and the `n` (≤ 20) most likely.
    pub top_logprobs: Option<usize>,
}

/// Why [`crate::Engine::submit`] refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full; try again later.
    QueueFull,
    /// The prompt leaves no room for output within the context limit.
    TooLong {
        /// Prompt tokens.
        tokens: usize,
        /// The per-sequence limit on prompt + output tokens.
        limit: usize,
    },
    /// The request is malformed (the text says how).
    Invalid(String),
    /// The engine is stopping or stopped.
    ShuttingDown,
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::QueueFull => write!(f, "the request queue is full"),
            SubmitError::TooLong { tokens, limit } => write!(
                f,
                "the prompt has {tokens} tokens; with at least one output token it must fit in {limit}"
            ),
            SubmitError::Invalid(why) => write!(f, "invalid request: {why}"),
            SubmitError::ShuttingDown => write!(f, "the engine is shutting down"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// What the engine tells a request's owner.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One generated token.
    Token {
        /// The token id.
        id: u32,
        /// Its natural log-probability under the model (raw logits, before sampling filters),
        /// when `top_logprobs` was asked for.
        logprob: Option<f32>,
        /// The most likely tokens with their log-probabilities, most likely first.
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The request finished; always the last event.
    Done {
        /// Stop token or limit.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Tokens generated (the stop token excluded).
        completion_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache (at the last admission).
        cached_prompt_tokens: usize,
    },
    /// The request failed; always the last event.
    Error(String),
}

/// A request in flight: its id and the stream of its events. Dropping it (or its receiver)
/// cancels the request; the engine notices before its next step and frees its KV blocks.
#[derive(Debug)]
pub struct RequestHandle {
    /// Engine-wide unique id.
    pub id: u64,
    /// Token events, then one `Done` or `Error`.
    pub events: tokio::sync::mpsc::UnboundedReceiver<Event>,
}

/// A snapshot of the engine's state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests queued, not yet running.
    pub waiting: usize,
    /// Sequences running.
    pub running: usize,
    /// Blocks in the KV pool.
    pub kv_blocks_total: usize,
    /// Blocks held by running sequences.
    pub kv_blocks_used: usize,
    /// Steps run.
    pub steps: u64,
    /// Sequences preempted (their KV dropped, to be recomputed) for lack of blocks.
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_cache_hit_tokens: u64,
    /// Token rows the steps ran as decode rows (a sequence's one new token).
    pub decode_rows: u64,
    /// Token rows the steps ran as prefill rows (prompts, and tokens recomputed after a
    /// preemption).
    pub prefill_rows: u64,
    /// Seconds the steps took, from the model call to the last token handed out.
    pub step_seconds: f64,
    /// Seconds of those the host spent waiting for the model's device (0 on the CPU).
    pub device_wait_seconds: f64,
    /// Times the host waited for the model's device (a decode step waits once; 0 on the CPU).
    pub device_waits: u64,
    /// Steps that ran as one CUDA graph replay (0 on the CPU).
    pub graph_replays: u64,
    /// Device bytes held by f16 copies of the model's quantized weights (0 on the CPU).
    pub f16_copy_bytes: u64,
}
