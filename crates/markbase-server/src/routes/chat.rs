//! `POST /v1/chat/completions`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use tokio::sync::mpsc;

use super::{new_id, unix_now, ApiJson};
use crate::error::ApiError;
use crate::generate::{self, Job, TokenInfo, Update};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatRequest, ChunkChoice, Delta,
    FunctionCall, ToolCallOut,
};
use crate::output::ParsedCall;
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::prompt::{self, PromptModel};
use crate::state::AppState;

/// Handles a chat completion request.
pub async fn handler(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let settings = params::settings(&req.common)?;
    let top_logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, _) => None,
        (true, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
            ))
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
    };
    let model = PromptModel {
        tokenizer: &state.tokenizer,
        template: &state.template,
        has_tools: state.markers.has_tools(),
    };
    let prompt = prompt::chat_prompt(&model, &req)?;
    let (requested, param) = match req.max_completion_tokens {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (req.max_tokens, "max_tokens"),
    };
    let max_tokens = params::max_tokens(
        requested,
        param,
        state.max_tokens,
        prompt.len(),
        state.max_context,
    )?;
    let stream = settings.stream;
    let include_usage = settings.include_usage;
    let rx = generate::start(
        &state,
        Job {
            endpoint: "chat",
            prompt,
            max_tokens,
            settings,
            top_logprobs,
            parse: true,
            arrived,
        },
    )?;
    let reply = Reply {
        state,
        id: new_id("chatcmpl"),
        created: unix_now(),
        logprobs: top_logprobs.is_some(),
        calls: 0,
        role_sent: false,
    };
    if stream {
        Ok(reply.stream(rx, include_usage))
    } else {
        reply.whole(rx).await
    }
}

/// What the chunks or the whole reply of one request share.
struct Reply {
    state: Arc<AppState>,
    id: String,
    created: u64,
    logprobs: bool,
    /// Tool calls so far.
    calls: usize,
    /// Whether a chunk with the role went out.
    role_sent: bool,
}

impl Reply {
    /// Numbers and names the calls of one delta.
    fn tool_calls(&mut self, calls: Vec<ParsedCall>, streaming: bool) -> Vec<ToolCallOut> {
        calls
            .into_iter()
            .map(|c| {
                let index = self.calls;
                self.calls += 1;
                ToolCallOut {
                    index: streaming.then_some(index),
                    id: format!("call_{}_{index}", self.id),
                    kind: "function",
                    function: FunctionCall {
                        name: c.name,
                        arguments: c.arguments,
                    },
                }
            })
            .collect()
    }

    fn chunk(&self, choices: Vec<ChunkChoice>, include_usage: bool) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.state.model_name.clone(),
            choices,
            usage: include_usage.then_some(None),
        }
    }

    /// The reply as server-sent events.
    fn stream(mut self, rx: mpsc::Receiver<Update>, include_usage: bool) -> Response {
        crate::sse::stream(rx, move |update| self.events(update, include_usage))
    }

    /// The JSON texts of the events one update becomes.
    fn events(&mut self, update: Update, include_usage: bool) -> Vec<String> {
        let json = |c: &ChatChunk| serde_json::to_string(c).unwrap_or_default();
        let role = (!std::mem::replace(&mut self.role_sent, true)).then_some("assistant");
        match update {
            Update::Delta { delta, tokens } => {
                let logprobs = self
                    .logprobs
                    .then(|| crate::logprobs::chat(&self.state.tokenizer, &tokens));
                let d = Delta {
                    role,
                    content: Some(delta.content).filter(|c| !c.is_empty()),
                    reasoning_content: Some(delta.reasoning).filter(|c| !c.is_empty()),
                    tool_calls: self.tool_calls(delta.tool_calls, true),
                };
                let choice = ChunkChoice {
                    index: 0,
                    delta: d,
                    logprobs,
                    finish_reason: None,
                };
                vec![json(&self.chunk(vec![choice], include_usage))]
            }
            Update::Done {
                finish_reason,
                usage,
            } => {
                let choice = ChunkChoice {
                    index: 0,
                    delta: Delta {
                        role,
                        ..Delta::default()
                    },
                    logprobs: None,
                    finish_reason: Some(finish_reason),
                };
                let mut out = vec![json(&self.chunk(vec![choice], include_usage))];
                if include_usage {
                    let mut last = self.chunk(Vec::new(), true);
                    last.usage = Some(Some(usage));
                    out.push(json(&last));
                }
                out
            }
            Update::Failed(e) => vec![serde_json::to_string(&e.body()).unwrap_or_default()],
        }
    }

    /// The reply as one JSON object.
    async fn whole(mut self, mut rx: mpsc::Receiver<Update>) -> Result<Response, ApiError> {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        let mut tokens: Vec<TokenInfo> = Vec::new();
        while let Some(update) = rx.recv().await {
            match update {
                Update::Delta { delta, tokens: t } => {
                    content.push_str(&delta.content);
                    reasoning.push_str(&delta.reasoning);
                    calls.extend(self.tool_calls(delta.tool_calls, false));
                    tokens.extend(t);
                }
                Update::Done {
                    finish_reason,
                    usage,
                } => {
                    let logprobs = self
                        .logprobs
                        .then(|| crate::logprobs::chat(&self.state.tokenizer, &tokens));
                    let body = ChatCompletion {
                        id: self.id,
                        object: "chat.completion",
                        created: self.created,
                        model: self.state.model_name.clone(),
                        choices: vec![ChatChoice {
                            index: 0,
                            message: AssistantMessage {
                                role: "assistant",
                                content: (!content.is_empty() || calls.is_empty())
                                    .then_some(content),
                                reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
                                tool_calls: calls,
                            },
                            logprobs,
                            finish_reason,
                        }],
                        usage,
                    };
                    return Ok(Json(body).into_response());
                }
                Update::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal("the reply ended early"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::Usage;
    use crate::output::Delta as Parts;
    use serde_json::{json, Value};

    fn reply() -> Reply {
        Reply {
            state: crate::state::tests::fixture_state(),
            id: "chatcmpl-t".into(),
            created: 1,
            logprobs: false,
            calls: 0,
            role_sent: false,
        }
    }

    /// Reasoning, text with a call, a second call, the end.
    fn updates() -> Vec<Update> {
        let call = |name: &str, arguments: &str| ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        };
        let parts = |content: &str, reasoning: &str, calls| Update::Delta {
            delta: Parts {
                content: content.into(),
                reasoning: reasoning.into(),
                tool_calls: calls,
            },
            tokens: Vec::new(),
        };
        vec![
            parts("", "Think.", vec![]),
            parts("Checking.", "", vec![call("w", r#"{"city":"Oslo"}"#)]),
            parts("", "", vec![call("t", "{}")]),
            Update::Done {
                finish_reason: "tool_calls",
                usage: Usage {
                    prompt_tokens: 5,
                    completion_tokens: 9,
                    total_tokens: 14,
                },
            },
        ]
    }

    #[test]
    fn streamed_chunks_carry_reasoning_and_numbered_tool_calls() {
        let mut r = reply();
        let chunks: Vec<Value> = updates()
            .into_iter()
            .flat_map(|u| r.events(u, true))
            .map(|s| serde_json::from_str(&s).unwrap())
            .collect();
        assert_eq!(chunks.len(), 5);
        let delta = |i: usize| chunks[i]["choices"][0]["delta"].clone();
        assert_eq!(
            delta(0),
            json!({"role": "assistant", "reasoning_content": "Think."})
        );
        assert_eq!(
            delta(1),
            json!({"content": "Checking.", "tool_calls": [{"index": 0, "id": "call_chatcmpl-t_0",
                "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}}]})
        );
        assert_eq!(delta(2)["tool_calls"][0]["index"], 1);
        assert_eq!(delta(2)["tool_calls"][0]["function"]["name"], "t");
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(delta(3), json!({}));
        assert!(chunks[..4].iter().all(|c| c["usage"].is_null()));
        assert_eq!(chunks[4]["choices"], json!([]));
        assert_eq!(chunks[4]["usage"]["total_tokens"], 14);
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == "chatcmpl-t"));
    }

    #[test]
    fn whole_reply_matches_the_stream() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let body: Value = rt.block_on(async {
            let (tx, rx) = mpsc::channel(8);
            for u in updates() {
                tx.send(u).await.unwrap();
            }
            drop(tx);
            let resp = reply().whole(rx).await.unwrap();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            serde_json::from_slice(&bytes).unwrap()
        });
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(
            choice["message"],
            json!({"role": "assistant", "content": "Checking.", "reasoning_content": "Think.",
                "tool_calls": [
                    {"id": "call_chatcmpl-t_0", "type": "function",
                     "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}},
                    {"id": "call_chatcmpl-t_1", "type": "function",
                     "function": {"name": "t", "arguments": "{}"}}]})
        );
        assert_eq!(body["usage"]["completion_tokens"], 9);
    }
}
