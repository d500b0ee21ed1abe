//! Log-probabilities in the two OpenAI shapes (chat's `content` list, completions' columns).

use markbase_core::tokenizer::Tokenizer;
use serde_json::Value;

use crate::generate::TokenInfo;
use crate::openai::{ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob};

/// A token's text and bytes: a byte piece (`<0xE2>`) is its one byte (its text is then U+FFFD).
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let byte = tok
        .token_text(id)
        .and_then(|t| t.strip_prefix("<0x")?.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok());
    match byte {
        Some(b) => (String::from_utf8_lossy(&[b]).into_owned(), vec![b]),
        None => {
            let text = tok.decode(&[id]);
            let bytes = text.as_bytes().to_vec();
            (text, bytes)
        }
    }
}

/// An f32 as the shortest decimal that reads back to it (-0.75, not -0.75000001).
fn short(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map(Value::from)
        .unwrap_or(Value::Null)
}

/// Chat `logprobs` of `tokens`.
pub fn chat(tok: &Tokenizer, tokens: &[TokenInfo]) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| {
                let (token, bytes) = token_text(tok, t.id);
                TokenLogprob {
                    token,
                    logprob: t.logprob,
                    bytes,
                    top_logprobs: t
                        .top
                        .iter()
                        .map(|&(id, logprob)| {
                            let (token, bytes) = token_text(tok, id);
                            TopLogprob {
                                token,
                                logprob,
                                bytes,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Completions `logprobs` of `tokens`; `offset` is the text length (in characters) before the
/// first of them and is advanced past them.
pub fn completion(tok: &Tokenizer, tokens: &[TokenInfo], offset: &mut usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        let (text, _) = token_text(tok, t.id);
        out.text_offset.push(*offset);
        *offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(t.logprob);
        out.top_logprobs.push(
            t.top
                .iter()
                .map(|&(id, lp)| (token_text(tok, id).0, short(lp)))
                .collect(),
        );
    }
    out
}
