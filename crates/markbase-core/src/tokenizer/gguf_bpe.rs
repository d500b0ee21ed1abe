//! A GGUF merge-rank BPE vocabulary (`tokenizer.ggml.model = "gemma4"`) as a `tokenizers`
//! pipeline, the one Gemma 4's own `tokenizer.json` describes (gemma4.md §5.1): spaces become
//! `▁` (no dummy prefix), text is cut into runs of newlines and runs of everything else, each
//! run is merged pair by pair in merge-rank order over its characters, pieces without an id
//! fall back to `<0xXX>` byte tokens; control and user-defined tokens are added tokens, cut out
//! of the text first. The pipeline is written as `tokenizer.json` and parsed by the
//! `tokenizers` crate, so GGUF and Hugging Face files of one model encode through the same code.

use serde_json::{json, Map, Value};

use super::spm::{gguf_kinds, gguf_pieces};
use super::TokenKind;
use crate::gguf::GgufFile;
use crate::{Error, Result};

/// The `tokenizers` tokenizer of a GGUF whose vocabulary is merge-rank BPE, and the text of
/// every id (the GGUF's token list).
pub(super) fn tokenizer(gguf: &GgufFile) -> Result<(tokenizers::Tokenizer, Vec<String>)> {
    let where_ = gguf.path().display();
    let bad = |what: String| Error::Tokenizer(format!("{where_}: {what}"));
    let pieces = gguf_pieces(gguf)?;
    let kinds = gguf_kinds(gguf, pieces.len())?;
    let merges = gguf
        .get_array("tokenizer.ggml.merges")?
        .ok_or_else(|| bad("no tokenizer.ggml.merges (a BPE vocabulary needs them)".into()))?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let text = v.as_str().ok_or_else(|| {
                bad(format!(
                    "tokenizer.ggml.merges[{i}] is a {}, not a string",
                    v.type_name()
                ))
            })?;
            merge_pair(text).ok_or_else(|| {
                bad(format!(
                    "tokenizer.ggml.merges[{i}] {text:?} is not two pieces"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let unk = match gguf.get_u64("tokenizer.ggml.unknown_token_id")? {
        Some(id) => Some(pieces.get(id as usize).ok_or_else(|| {
            bad(format!(
                "tokenizer.ggml.unknown_token_id {id} is outside the vocabulary of {}",
                pieces.len()
            ))
        })?),
        None => None,
    };
    // A string stored twice keeps its later id (as llama.cpp's map does).
    let vocab: Map<String, Value> = pieces
        .iter()
        .enumerate()
        .map(|(id, p)| (p.clone(), json!(id)))
        .collect();
    let added: Vec<Value> = pieces
        .iter()
        .zip(&kinds)
        .enumerate()
        .filter(|(_, (_, k))| matches!(k, TokenKind::Control | TokenKind::UserDefined))
        .map(|(id, (p, _))| {
            json!({"id": id, "content": p, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated",
                          "invert": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    let tokenizer = spec
        .to_string()
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| bad(format!("BPE vocabulary: {e}")))?;
    Ok((tokenizer, pieces))
}

/// The two pieces of a GGUF merge `"a b"`: split at the first space after the first
/// character (a piece never starts a merge with its separator).
fn merge_pair(text: &str) -> Option<[&str; 2]> {
    let first = text.chars().next()?.len_utf8();
    let at = first + text[first..].find(' ')?;
    let (a, b) = (&text[..at], &text[at + 1..]);
    (!b.is_empty()).then_some([a, b])
}

#[cfg(test)]
mod tests {
    use super::merge_pair;

    #[test]
    fn merges_split_at_the_first_space_after_the_first_character() {
        assert_eq!(merge_pair("▁ t"), Some(["▁", "t"]));
        assert_eq!(merge_pair("\n\n \n"), Some(["\n\n", "\n"]));
        assert_eq!(merge_pair("  x"), Some([" ", "x"]));
        assert_eq!(merge_pair("ab"), None);
        assert_eq!(merge_pair("a "), None);
        assert_eq!(merge_pair(""), None);
    }
}
