//! One request through the engine: submit, then a task that turns the engine's token events
//! into reply updates (text, reasoning, tool calls, log-probabilities, the end) on a channel.
//! Streaming and non-streaming replies both read this channel. When the reader goes away (the
//! client disconnected), the task drops the engine handle at once, which frees the sequence.

use std::sync::Arc;
use std::time::Instant;

use markbase_engine::{Event, FinishReason, Request, SubmitError};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::openai::Usage;
use crate::output::{Delta, Markers, OutputParser};
use crate::params::Settings;
use crate::state::AppState;

/// A request ready for the engine.
pub struct Job {
    /// `chat` or `completions` (metrics label).
    pub endpoint: &'static str,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling, stop strings, streaming.
    pub settings: Settings,
    /// `Some(n)`: log-probabilities with `n` alternatives.
    pub top_logprobs: Option<usize>,
    /// Split reasoning and tool calls out of the text (chat on Gemma 4).
    pub parse: bool,
    /// When the HTTP request arrived.
    pub arrived: Instant,
}

/// A generated token with its log-probabilities (when asked for).
#[derive(Clone, Debug)]
pub struct TokenInfo {
    /// The id.
    pub id: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely alternatives.
    pub top: Vec<(u32, f32)>,
}

/// What the reader of a request receives.
#[derive(Debug)]
pub enum Update {
    /// New reply parts and the tokens behind them (tokens only when log-probabilities were
    /// asked for).
    Delta {
        /// The new text, reasoning and tool calls.
        delta: Delta,
        /// The tokens since the previous update.
        tokens: Vec<TokenInfo>,
    },
    /// The end.
    Done {
        /// `stop`, `length` or `tool_calls`.
        finish_reason: &'static str,
        /// Token counts.
        usage: Usage,
    },
    /// The request failed (always last).
    Failed(ApiError),
}

/// Submits `job`; the updates arrive on the returned channel.
pub fn start(state: &Arc<AppState>, job: Job) -> Result<mpsc::Receiver<Update>, ApiError> {
    let request = Request {
        prompt: job.prompt.clone(),
        max_tokens: job.max_tokens,
        sampling: job.settings.sampling.clone(),
        stop_tokens: if job.settings.ignore_eos {
            Vec::new()
        } else {
            state.stop_tokens.clone()
        },
        top_logprobs: job.top_logprobs,
    };
    let handle = state.engine.submit(request).map_err(|e| match e {
        SubmitError::QueueFull => ApiError::queue_full(),
        SubmitError::TooLong { .. } => {
            ApiError::invalid_param("messages", e.to_string()).with_code("context_length_exceeded")
        }
        SubmitError::Invalid(why) => ApiError::invalid(why),
        SubmitError::ShuttingDown => ApiError::unavailable("the server is shutting down"),
    })?;
    crate::metrics::submitted(job.prompt.len());
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(run(state.clone(), handle, job, tx));
    Ok(rx)
}

/// Reads the engine's events until the end, a stop string, or the reader leaving.
async fn run(
    state: Arc<AppState>,
    mut handle: markbase_engine::RequestHandle,
    job: Job,
    tx: mpsc::Sender<Update>,
) {
    let markers = if job.parse {
        state.markers
    } else {
        Markers::default()
    };
    let mut parser = OutputParser::new(&state.tokenizer, markers, &job.settings.stop_strings);
    let mut pending = Delta::default();
    let mut tokens: Vec<TokenInfo> = Vec::new();
    let mut generated = 0usize;
    let mut called = false;
    let mut last = job.arrived;
    let usage = |completion_tokens: usize| Usage {
        prompt_tokens: job.prompt.len(),
        completion_tokens,
        total_tokens: job.prompt.len() + completion_tokens,
    };
    loop {
        let event = tokio::select! {
            _ = tx.closed() => return, // the client left: dropping `handle` cancels
            e = handle.events.recv() => e,
        };
        let end = match event {
            Some(Event::Token {
                id,
                logprob,
                top_logprobs,
            }) => {
                let now = Instant::now();
                crate::metrics::token(generated == 0, now - last);
                last = now;
                generated += 1;
                if job.top_logprobs.is_some() {
                    tokens.push(TokenInfo {
                        id,
                        logprob: logprob.unwrap_or(f32::NAN),
                        top: top_logprobs,
                    });
                }
                pending.append(parser.push(id));
                parser.stopped().then_some(FinishReason::Stop)
            }
            Some(Event::Done { reason, .. }) => Some(reason),
            Some(Event::Error(msg)) => {
                let _ = tx
                    .send(Update::Failed(ApiError::internal(format!(
                        "generation failed: {msg}"
                    ))))
                    .await;
                return;
            }
            None => {
                let _ = tx
                    .send(Update::Failed(ApiError::internal("the engine stopped")))
                    .await;
                return;
            }
        };
        if let Some(reason) = end {
            drop(handle); // a stop string: the engine frees the sequence now
            pending.append(parser.finish());
            called |= !pending.tool_calls.is_empty();
            let finish_reason = match reason {
                FinishReason::Length => "length",
                FinishReason::Stop if called => "tool_calls",
                FinishReason::Stop => "stop",
            };
            if !pending.is_empty() || !tokens.is_empty() {
                let delta = std::mem::take(&mut pending);
                let tokens = std::mem::take(&mut tokens);
                if tx.send(Update::Delta { delta, tokens }).await.is_err() {
                    return;
                }
            }
            crate::metrics::finished(job.endpoint, finish_reason, job.arrived.elapsed());
            let _ = tx
                .send(Update::Done {
                    finish_reason,
                    usage: usage(generated),
                })
                .await;
            return;
        }
        if !pending.is_empty() {
            called |= !pending.tool_calls.is_empty();
            let delta = std::mem::take(&mut pending);
            let tokens = std::mem::take(&mut tokens);
            if tx.send(Update::Delta { delta, tokens }).await.is_err() {
                return;
            }
        }
    }
}
