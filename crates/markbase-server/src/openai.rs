//! The OpenAI API's JSON shapes (the subset MarkBase serves), as serde types.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Settings shared by `/v1/chat/completions` and `/v1/completions`.
#[derive(Debug, Default, Deserialize)]
pub struct CommonFields {
    /// The model name (any value is accepted when one model is served).
    pub model: Option<String>,
    /// Softmax temperature (default 1; 0 = greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling mass (default 1 = off).
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens (extension; default 0 = off).
    pub top_k: Option<usize>,
    /// Drop tokens below this fraction of the top probability (extension; default 0 = off).
    pub min_p: Option<f32>,
    /// Repetition penalty over the last 64 tokens (extension; default 1 = off).
    pub repetition_penalty: Option<f32>,
    /// Stop strings (one or a list of up to 4).
    pub stop: Option<Stop>,
    /// Seed of the sampler (default: a fresh one per request).
    pub seed: Option<i64>,
    /// Stream the reply as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is served.
    pub n: Option<u32>,
    /// Not supported beyond 0.
    pub frequency_penalty: Option<f32>,
    /// Not supported beyond 0.
    pub presence_penalty: Option<f32>,
    /// Keep generating past end-of-turn tokens until max_tokens (extension, for benchmarks).
    pub ignore_eos: Option<bool>,
    /// Only `{"type": "text"}` is served (no constrained decoding).
    pub response_format: Option<Value>,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token usage (and `usage: null` before it).
    pub include_usage: Option<bool>,
}

/// A `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Most tokens to generate (deprecated name).
    pub max_tokens: Option<u64>,
    /// Most tokens to generate.
    pub max_completion_tokens: Option<u64>,
    /// Return the log-probability of each output token.
    pub logprobs: Option<bool>,
    /// With `logprobs`: also the N most likely alternatives (0–20).
    pub top_logprobs: Option<u32>,
    /// Tools the model may call.
    pub tools: Option<Vec<Tool>>,
    /// `none`, `auto`, `required` or a named function; only `none` and `auto` are served.
    pub tool_choice: Option<Value>,
    /// Variables for the chat template (`enable_thinking`).
    pub chat_template_kwargs: Option<TemplateKwargs>,
    /// The settings shared with completions.
    #[serde(flatten)]
    pub common: CommonFields,
}

/// `chat_template_kwargs`.
#[derive(Debug, Default, Deserialize)]
pub struct TemplateKwargs {
    /// Gemma 4's thinking mode.
    pub enable_thinking: Option<bool>,
}

/// One message of a conversation.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (a string or a list of text parts); may be null for assistant tool calls.
    pub content: Option<Content>,
    /// The sender's name (ignored).
    pub name: Option<String>,
    /// Calls an assistant message made.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a tool message answers.
    pub tool_call_id: Option<String>,
}

/// Message content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// A list of parts (only `text` parts are served).
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// The part type (`text`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A tool call inside an assistant message of the conversation.
#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    /// The call id.
    pub id: Option<String>,
    /// The called function.
    pub function: FunctionCall,
}

/// A function call: name and JSON-encoded arguments.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct FunctionCall {
    /// The function name.
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

/// A tool the model may call.
#[derive(Debug, Deserialize)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

/// A callable function's declaration.
#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// A JSON schema of its arguments.
    pub parameters: Option<Value>,
}

/// A `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The prompt: a string or a list of token ids (one prompt per request).
    pub prompt: Prompt,
    /// Most tokens to generate (default 16).
    pub max_tokens: Option<u64>,
    /// Return log-probabilities with this many alternatives (0–20).
    pub logprobs: Option<u32>,
    /// Not supported (must be false).
    pub echo: Option<bool>,
    /// Not supported (must be absent).
    pub suffix: Option<String>,
    /// The settings shared with chat completions.
    #[serde(flatten)]
    pub common: CommonFields,
}

/// A completions prompt.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text (BOS is added).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// A list of texts.
    Texts(Vec<String>),
    /// A list of token lists.
    TokenLists(Vec<Vec<u32>>),
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// A `chat.completion` object.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    /// The completion id.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix time of creation.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// The single choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One choice of a chat completion.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The reply.
    pub message: AssistantMessage,
    /// Log-probabilities when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
}

/// The assistant's reply.
#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The answer text (null when the reply is only tool calls).
    pub content: Option<String>,
    /// The model's thinking (Gemma 4 thinking mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tools the model called.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A tool call made by the model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// Position among the calls of the reply (streaming only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// The call id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The call.
    pub function: FunctionCall,
}

/// `logprobs` of a chat choice or chunk.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per output token.
    pub content: Vec<TokenLogprob>,
}

/// The log-probability of one output token and its alternatives.
#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    /// The token text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative token.
#[derive(Clone, Debug, Serialize)]
pub struct TopLogprob {
    /// The token text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// A `chat.completion.chunk` object (one server-sent event).
#[derive(Debug, Serialize)]
pub struct ChatChunk {
    /// The completion id (the same in every chunk).
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix time of creation.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// The delta (empty in the usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// Token counts: null in every chunk but the last when `include_usage` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a chunk.
#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What is new.
    pub delta: Delta,
    /// Log-probabilities of the tokens behind this delta.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<&'static str>,
}

/// The new part of the assistant message.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New answer text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New thinking text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Completed tool calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A `text_completion` object, whole or as one streamed chunk.
#[derive(Debug, Serialize)]
pub struct Completion {
    /// The completion id.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix time of creation.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// The single choice (empty in the usage chunk of a stream).
    pub choices: Vec<CompletionChoice>,
    /// Token counts (always set when not streaming).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice of a completion.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    /// The generated text (or its new part when streaming).
    pub text: String,
    /// Always 0.
    pub index: u32,
    /// Log-probabilities when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length`; null until the last chunk of a stream.
    pub finish_reason: Option<&'static str>,
}

/// The legacy completions `logprobs` object.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// The most likely alternatives at each position, text → log-probability.
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    /// Character offset of each token in the generated text.
    pub text_offset: Vec<usize>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Serialize)]
pub struct ModelCard {
    /// Its name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    /// `markbase`.
    pub owned_by: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_forms() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},
                {"role":"user","content":[{"type":"text","text":"a"}]},
                {"role":"assistant","content":null,"tool_calls":[
                    {"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"c1","content":"42"}],
                "temperature":0,"stop":"x","seed":-3,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.common.temperature, Some(0.0));
        assert!(matches!(r.common.stop, Some(Stop::One(ref s)) if s == "x"));
        assert_eq!(r.common.seed, Some(-3));
        assert!(matches!(r.messages[1].content, Some(Content::Parts(_))));
        assert_eq!(
            r.messages[2].tool_calls.as_ref().unwrap()[0].function.name,
            "f"
        );
    }

    #[test]
    fn completion_prompt_forms() {
        for (text, want_tokens) in [
            (r#"{"prompt":"hi"}"#, false),
            (r#"{"prompt":[1,2,3]}"#, true),
        ] {
            let r: CompletionRequest = serde_json::from_str(text).unwrap();
            assert_eq!(matches!(r.prompt, Prompt::Tokens(_)), want_tokens, "{text}");
        }
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":["a","b"]}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::Texts(ref v) if v.len() == 2));
    }

    #[test]
    fn chunk_usage_is_null_absent_or_set() {
        let chunk = |usage| ChatChunk {
            id: "x".into(),
            object: "chat.completion.chunk",
            created: 0,
            model: "m".into(),
            choices: vec![],
            usage,
        };
        let v = serde_json::to_value(chunk(None)).unwrap();
        assert!(v.get("usage").is_none());
        let v = serde_json::to_value(chunk(Some(None))).unwrap();
        assert!(v["usage"].is_null());
        let v = serde_json::to_value(chunk(Some(Some(Usage::default())))).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 0);
    }
}
