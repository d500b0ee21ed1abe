//! Request settings → engine settings: sampling parameters, stop strings, token limits.

use markbase_engine::SamplingParams;

use crate::error::ApiError;
use crate::openai::CommonFields;

/// Most stop strings a request may give.
const MAX_STOPS: usize = 16;
/// Most alternatives per token for log-probabilities.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The settings of one request, checked.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Sampling parameters (seed resolved).
    pub sampling: SamplingParams,
    /// Stop strings (empty ones dropped).
    pub stop_strings: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Generate past end-of-turn tokens.
    pub ignore_eos: bool,
}

/// Checks the shared fields and maps them to engine settings.
pub fn settings(c: &CommonFields) -> Result<Settings, ApiError> {
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid_param(
            "n",
            format!("n = {n}: only one choice per request is served"),
        ));
    }
    for (name, v) in [
        ("frequency_penalty", c.frequency_penalty),
        ("presence_penalty", c.presence_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid_param(
                name,
                format!("{name} is not supported (use repetition_penalty)"),
            ));
        }
    }
    if let Some(f) = &c.response_format {
        if f.get("type").and_then(|t| t.as_str()) != Some("text") {
            return Err(ApiError::invalid_param(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_k: c.top_k.unwrap_or(0),
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        repeat_last_n: 64,
        seed: c.seed.map(|s| s as u64).unwrap_or_else(fresh_seed),
    };
    if let Err(e) = sampling.validate() {
        let msg = e.to_string();
        let param = ["temperature", "top-p", "min-p", "repeat penalty"]
            .into_iter()
            .zip(["temperature", "top_p", "min_p", "repetition_penalty"])
            .find(|(k, _)| msg.contains(k))
            .map(|(_, p)| p)
            .unwrap_or("temperature");
        return Err(ApiError::invalid_param(param, msg));
    }
    let stop_strings: Vec<String> = c
        .stop
        .as_ref()
        .map(crate::openai::Stop::to_vec)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    if stop_strings.len() > MAX_STOPS {
        return Err(ApiError::invalid_param(
            "stop",
            format!("at most {MAX_STOPS} stop strings are accepted"),
        ));
    }
    Ok(Settings {
        sampling,
        stop_strings,
        stream: c.stream.unwrap_or(false),
        include_usage: c
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        ignore_eos: c.ignore_eos.unwrap_or(false),
    })
}

/// The number of tokens to generate: `requested` (checked against the server's `limit` and the
/// context left after the prompt), else as many as both allow.
pub fn max_tokens(
    requested: Option<u64>,
    param: &str,
    limit: usize,
    prompt_tokens: usize,
    context: usize,
) -> Result<usize, ApiError> {
    let room = context.saturating_sub(prompt_tokens);
    if room == 0 {
        return Err(ApiError::invalid_param(
            "messages",
            format!("the prompt has {prompt_tokens} tokens, which fills the context of {context} tokens"),
        )
        .with_code("context_length_exceeded"));
    }
    match requested {
        None => Ok(limit.min(room)),
        Some(0) => Err(ApiError::invalid_param(param, format!("{param} must be at least 1"))),
        Some(n) if n > limit as u64 => Err(ApiError::invalid_param(
            param,
            format!("{param} = {n} is larger than this server's limit of {limit}"),
        )),
        Some(n) if n as usize > room => Err(ApiError::invalid_param(
            param,
            format!(
                "the prompt ({prompt_tokens} tokens) plus {param} = {n} is more than the context of {context} tokens"
            ),
        )
        .with_code("context_length_exceeded")),
        Some(n) => Ok(n as usize),
    }
}

/// A seed that differs between requests.
fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: serde_json::Value) -> CommonFields {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn defaults_follow_openai() {
        let s = settings(&common(serde_json::json!({}))).unwrap();
        assert_eq!(s.sampling.temperature, 1.0);
        assert_eq!(s.sampling.top_p, 1.0);
        assert_eq!((s.sampling.top_k, s.sampling.min_p), (0, 0.0));
        assert!(!s.stream && !s.include_usage && !s.ignore_eos);
        let s = settings(&common(
            serde_json::json!({"seed": 5, "stop": ["a", ""], "temperature": 0}),
        ))
        .unwrap();
        assert_eq!(s.sampling.seed, 5);
        assert_eq!(s.stop_strings, ["a"]);
        assert_eq!(s.sampling.temperature, 0.0);
    }

    #[test]
    fn out_of_range_settings_name_the_field() {
        for (json, param) in [
            (serde_json::json!({"temperature": -1}), "temperature"),
            (serde_json::json!({"top_p": 0}), "top_p"),
            (serde_json::json!({"min_p": 2}), "min_p"),
            (serde_json::json!({"n": 2}), "n"),
            (
                serde_json::json!({"presence_penalty": 0.5}),
                "presence_penalty",
            ),
        ] {
            let e = settings(&common(json.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{json}");
        }
    }

    #[test]
    fn max_tokens_limits() {
        assert_eq!(max_tokens(None, "max_tokens", 100, 10, 50).unwrap(), 40);
        assert_eq!(max_tokens(None, "max_tokens", 30, 10, 50).unwrap(), 30);
        assert_eq!(max_tokens(Some(5), "max_tokens", 30, 10, 50).unwrap(), 5);
        assert!(max_tokens(Some(0), "max_tokens", 30, 10, 50).is_err());
        assert!(max_tokens(Some(31), "max_tokens", 30, 10, 50).is_err());
        let e = max_tokens(Some(30), "max_tokens", 100, 30, 50).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(max_tokens(None, "max_tokens", 100, 50, 50).is_err());
    }
}
