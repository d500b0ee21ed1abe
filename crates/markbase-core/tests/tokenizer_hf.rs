//! The tokenizer.json path: a small BPE with byte fallback built by the `tokenizers` Python
//! package, against the ids and decodings Python gave (tests/fixtures/tokenizer/tiny_bpe,
//! written by scripts/make_tokenizer_fixtures.py).

use std::path::PathBuf;

use markbase_core::tokenizer::Tokenizer;
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer/tiny_bpe")
}

fn load() -> (Tokenizer, Value) {
    let dir = fixture_dir();
    let tok = Tokenizer::from_hf_file(&dir.join("tokenizer.json")).expect("tokenizer.json");
    let text = std::fs::read_to_string(dir.join("expected.json")).expect("expected.json");
    (
        tok,
        serde_json::from_str(&text).expect("expected.json parses"),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn encodes_and_decodes_like_python() {
    let (tok, exp) = load();
    assert_eq!(tok.vocab_size() as u64, exp["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.bos_id().map(u64::from), exp["bos_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), exp["eos_id"].as_u64());
    assert!(tok.adds_bos(), "the post-processor puts <bos> in front");
    let cases = exp["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), want[1..], "{text:?}");
        assert_eq!(
            tok.decode(&got),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn streaming_matches_decode_and_never_splits_characters() {
    let (tok, exp) = load();
    let mut byte_pieces = 0;
    for case in exp["cases"].as_array().unwrap() {
        let ids = ids(&case["ids"]);
        byte_pieces += ids
            .iter()
            .filter(|&&i| tok.token_text(i).is_some_and(|t| t.starts_with("<0x")))
            .count();
        let mut stream = tok.stream_decoder();
        let mut out = String::new();
        for &id in &ids {
            let piece = stream.push(id);
            assert!(
                !piece.contains('\u{FFFD}'),
                "{piece:?} in {:?}",
                case["text"]
            );
            out += &piece;
        }
        out += &stream.finish();
        assert_eq!(out, case["decoded"].as_str().unwrap());
    }
    assert!(byte_pieces > 20, "the fixture exercises byte fallback");
}

#[test]
fn special_tokens_and_lookups() {
    let (tok, _) = load();
    let sot = tok.token_id("<start_of_turn>").expect("<start_of_turn>");
    assert!(tok.is_control(sot));
    let note = tok.token_id("<note>").expect("non-special added token");
    assert!(!tok.is_control(note));
    assert_eq!(tok.token_text(sot), Some("<start_of_turn>"));
    assert_eq!(tok.decode(&[sot, note]), "<note>");
    assert_eq!(tok.decode(&[u32::MAX]), "\u{FFFD}");
}

#[test]
fn missing_or_bad_file_is_a_clear_error() {
    let missing = fixture_dir().join("no-such-tokenizer.json");
    let e = Tokenizer::from_hf_file(&missing).err().expect("error");
    assert!(e.to_string().contains("no-such-tokenizer.json"), "{e}");
    let bad = std::env::temp_dir().join(format!(
        "markbase-bad-tokenizer-{}.json",
        std::process::id()
    ));
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let e = Tokenizer::from_hf_file(&bad).err().expect("error");
    std::fs::remove_file(&bad).ok();
    assert!(e.to_string().contains("markbase-bad-tokenizer"), "{e}");
}
