//! A crafted GGUF with a merge-rank BPE vocabulary (`tokenizer.ggml.model = "gemma4"`): merges
//! apply in rank order, and a string stored twice (real Gemma 4 GGUFs store three) maps to its
//! later id, as llama.cpp's map does, while the vocabulary keeps every id.

mod common;

use common::gguf_writer::Value;
use common::{markbase, tiny_gemma3, tiny_vocab};

#[test]
fn bpe_vocabulary_with_a_duplicated_string() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_gemma3(64);
    // tiny_vocab, then "ab" (265) stored again as 267.
    let (mut tokens, mut types) = tiny_vocab();
    tokens.push("ab".into());
    types.push(1);
    w.kv("tokenizer.ggml.model", Value::Str("gemma4".into()))
        .kv("tokenizer.ggml.tokens", Value::StrArray(tokens))
        .kv("tokenizer.ggml.token_type", Value::I32Array(types))
        .kv(
            "tokenizer.ggml.merges",
            Value::StrArray(vec!["▁ a".into(), "a b".into()]),
        );
    let path = dir.path().join("bpe.gguf");
    w.write(&path);
    let ids = |text: &str| -> Vec<u64> {
        let out = markbase(
            &["-m", path.to_str().unwrap(), "tokenize", "--json", text],
            dir.path(),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    // "ab" merges to its later id; " a" merges first ("▁ a" ranks above "a b"), then "b" is
    // left alone; "c" has no piece and falls back to its byte; specials are cut out first.
    assert_eq!(ids("ab"), [2, 267]);
    assert_eq!(ids(" ab"), [2, 266, 264]);
    assert_eq!(ids("c<end_of_turn>"), [2, 6 + 0x63, 5]);
}
