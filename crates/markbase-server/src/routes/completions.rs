//! `POST /v1/completions` (legacy text completions; the prompt is used as is, with BOS).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use tokio::sync::mpsc;

use super::{new_id, unix_now, ApiJson};
use crate::error::ApiError;
use crate::generate::{self, Job, Update};
use crate::openai::{Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Prompt};
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::state::AppState;

/// Default `max_tokens` of the completions API.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// The prompt ids of a completions request (one prompt per request).
fn prompt_ids(state: &AppState, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    let one = |n: usize| {
        ApiError::invalid_param(
            "prompt",
            format!("{n} prompts were given; send one prompt per request"),
        )
    };
    let ids = match prompt {
        Prompt::Text(t) => encode(state, &t)?,
        Prompt::Texts(v) if v.len() == 1 => encode(state, &v[0])?,
        Prompt::Texts(v) => return Err(one(v.len())),
        Prompt::Tokens(ids) => ids,
        Prompt::TokenLists(mut v) if v.len() == 1 => v.swap_remove(0),
        Prompt::TokenLists(v) => return Err(one(v.len())),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    let vocab = state.tokenizer.vocab_size();
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    Ok(ids)
}

fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state
        .tokenizer
        .encode(text, state.tokenizer.adds_bos())
        .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {e}")))
}

/// Handles a completions request.
pub async fn handler(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let settings = params::settings(&req.common)?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let top_logprobs = match req.logprobs {
        Some(n) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!("logprobs must be at most {MAX_TOP_LOGPROBS}"),
            ))
        }
        n => n.map(|n| n as usize),
    };
    let prompt = prompt_ids(&state, req.prompt)?;
    let max_tokens = params::max_tokens(
        Some(req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
        "max_tokens",
        state.max_tokens,
        prompt.len(),
        state.max_context,
    )?;
    let stream = settings.stream;
    let include_usage = settings.include_usage;
    let rx = generate::start(
        &state,
        Job {
            endpoint: "completions",
            prompt,
            max_tokens,
            settings,
            top_logprobs,
            parse: false,
            arrived,
        },
    )?;
    let reply = Reply {
        state,
        id: new_id("cmpl"),
        created: unix_now(),
        logprobs: top_logprobs.is_some(),
        offset: 0,
    };
    if stream {
        Ok(reply.stream(rx, include_usage))
    } else {
        reply.whole(rx).await
    }
}

struct Reply {
    state: Arc<AppState>,
    id: String,
    created: u64,
    logprobs: bool,
    /// Characters of token text so far (for `text_offset`).
    offset: usize,
}

impl Reply {
    fn object(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<crate::openai::Usage>>,
    ) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.state.model_name.clone(),
            choices,
            usage,
        }
    }

    fn logprobs_of(&mut self, tokens: &[crate::generate::TokenInfo]) -> Option<CompletionLogprobs> {
        self.logprobs
            .then(|| crate::logprobs::completion(&self.state.tokenizer, tokens, &mut self.offset))
    }

    fn stream(mut self, rx: mpsc::Receiver<Update>, include_usage: bool) -> Response {
        let json = |c: &Completion| serde_json::to_string(c).unwrap_or_default();
        let usage_slot = include_usage.then_some(None);
        crate::sse::stream(rx, move |update| match update {
            Update::Delta { delta, tokens } => {
                let choice = CompletionChoice {
                    text: delta.content,
                    index: 0,
                    logprobs: self.logprobs_of(&tokens),
                    finish_reason: None,
                };
                vec![json(&self.object(vec![choice], usage_slot))]
            }
            Update::Done {
                finish_reason,
                usage,
            } => {
                let choice = CompletionChoice {
                    text: String::new(),
                    index: 0,
                    logprobs: None,
                    finish_reason: Some(finish_reason),
                };
                let mut out = vec![json(&self.object(vec![choice], usage_slot))];
                if include_usage {
                    out.push(json(&self.object(Vec::new(), Some(Some(usage)))));
                }
                out
            }
            Update::Failed(e) => vec![serde_json::to_string(&e.body()).unwrap_or_default()],
        })
    }

    async fn whole(mut self, mut rx: mpsc::Receiver<Update>) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut logprobs = self.logprobs.then(CompletionLogprobs::default);
        while let Some(update) = rx.recv().await {
            match update {
                Update::Delta { delta, tokens } => {
                    text.push_str(&delta.content);
                    if let (Some(all), Some(part)) = (logprobs.as_mut(), self.logprobs_of(&tokens))
                    {
                        all.tokens.extend(part.tokens);
                        all.token_logprobs.extend(part.token_logprobs);
                        all.top_logprobs.extend(part.top_logprobs);
                        all.text_offset.extend(part.text_offset);
                    }
                }
                Update::Done {
                    finish_reason,
                    usage,
                } => {
                    let choice = CompletionChoice {
                        text,
                        index: 0,
                        logprobs,
                        finish_reason: Some(finish_reason),
                    };
                    return Ok(Json(self.object(vec![choice], Some(Some(usage)))).into_response());
                }
                Update::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal("the reply ended early"))
    }
}
