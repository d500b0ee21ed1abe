//! The default model's tokenizer (built from the GGUF metadata) against transformers and the
//! SentencePiece library on ~80 varied strings (tests/fixtures/tokenizer/gemma3_270m.json,
//! written by scripts/make_tokenizer_fixtures.py).
//!
//! Ours must equal SentencePiece everywhere, and transformers wherever transformers agrees with
//! SentencePiece (all but long runs of spaces, where transformers' GGUF conversion loses the
//! atomic user-defined whitespace pieces; see the fixture's `notes`).
//!
//! The model path comes from `MARKBASE_TEST_MODEL` when set, else the pulled default model.

use std::path::PathBuf;
use std::time::Instant;

use markbase_core::gguf::GgufFile;
use markbase_core::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::Value;

fn model_path() -> PathBuf {
    match std::env::var_os("MARKBASE_TEST_MODEL").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => markbase_engine::pull::default_model_path().expect("default model"),
    }
}

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer/gemma3_270m.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("parses")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn load() -> (GgufFile, Tokenizer) {
    let gguf = GgufFile::open(model_path()).expect("open GGUF");
    let start = Instant::now();
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    let took = start.elapsed();
    eprintln!("Tokenizer::from_gguf: {took:?}");
    assert!(
        took.as_secs_f64() < 3.0,
        "building the tokenizer took {took:?}"
    );
    (gguf, tok)
}

#[test]
fn matches_transformers_and_sentencepiece() {
    let (_gguf, tok) = load();
    let fx = fixture();
    assert_eq!(tok.vocab_size() as u64, fx["vocab_size"].as_u64().unwrap());
    let mut same_as_hf = 0;
    let mut differ = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let hf = ids(&case["hf_ids"]);
        let spm = ids(&case["spm_ids"]);
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, spm, "SentencePiece reference, {text:?}");
        if got == hf {
            same_as_hf += 1;
            assert_eq!(
                tok.decode(&got),
                case["hf_decoded"].as_str().unwrap(),
                "{text:?}"
            );
        } else {
            differ.push(text.to_owned());
        }
    }
    assert!(
        same_as_hf >= 50,
        "only {same_as_hf} strings equal transformers"
    );
    let listed: Vec<String> = fx["strings_where_hf_and_spm_differ"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(differ, listed);
    eprintln!(
        "{same_as_hf} strings equal transformers; {} differ (space runs)",
        differ.len()
    );
}

#[test]
fn round_trips_and_streams() {
    let (_gguf, tok) = load();
    let fx = fixture();
    let mut byte_pieces = 0;
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text, false).unwrap();
        // Control tokens are not rendered, and a literal `▁` comes back as a space.
        let has_control = got.iter().any(|&i| tok.is_control(i));
        if !has_control && !text.contains('\u{2581}') {
            assert_eq!(tok.decode(&got), text, "round trip");
        }
        byte_pieces += got
            .iter()
            .filter(|&&i| tok.token_text(i).is_some_and(|t| t.starts_with("<0x")))
            .count();
        let mut stream = tok.stream_decoder();
        let mut out = String::new();
        for &id in &got {
            let piece = stream.push(id);
            assert!(!piece.contains('\u{FFFD}'), "{piece:?} in {text:?}");
            out += &piece;
        }
        out += &stream.finish();
        assert_eq!(out, tok.decode(&got), "{text:?}");
    }
    assert!(byte_pieces >= 8, "the fixture reaches byte fallback");
}

#[test]
fn special_tokens_and_chat_prompt() {
    let (gguf, tok) = load();
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.eos_id(), Some(1));
    assert!(tok.adds_bos());
    let sot = tok.token_id("<start_of_turn>").unwrap();
    let eot = tok.token_id("<end_of_turn>").unwrap();
    assert_eq!((sot, eot), (105, 106));
    assert!(tok.is_control(eot) && !tok.is_control(107));
    assert_eq!(tok.token_text(107), Some("\n"));
    assert_eq!(tok.decode(&[2, 105, 107, 106]), "\n");

    let tmpl = ChatTemplate::for_gguf(&gguf).unwrap();
    assert!(
        tmpl.is_builtin(),
        "the default model carries no chat template"
    );
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
    ];
    let text = tmpl.render(&msgs, true, "<bos>", "<eos>").unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(&ids[..3], &[2, 105, tok.token_id("user").unwrap()]);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "one BOS");
    assert_eq!(ids.iter().filter(|&&i| i == 106).count(), 1);
    let model = tok.encode("<start_of_turn>model\n", false).unwrap();
    assert!(ids.ends_with(&model));
}

/// Encoding time grows linearly with the text (a quadratic merge loop would take 16× longer
/// for 4× the text; the check allows 10× so that a loaded machine does not fail it).
#[test]
fn encoding_time_is_linear_in_the_text() {
    let (_gguf, tok) = load();
    let fx = fixture();
    let mut text = String::new();
    while text.len() < 1 << 20 {
        for case in fx["cases"].as_array().unwrap() {
            text += case["text"].as_str().unwrap();
            text.push(' ');
        }
    }
    let cut = (text.len() / 4..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    let quarter = &text[..cut];
    let time = |t: &str| {
        let start = Instant::now();
        let ids = tok.encode(t, false).unwrap();
        (start.elapsed().as_secs_f64(), ids.len())
    };
    let (t_quarter, _) = time(quarter);
    let (t_all, n) = time(&text);
    eprintln!(
        "encoded {} bytes into {n} tokens in {t_all:.3} s; a quarter in {t_quarter:.3} s",
        text.len()
    );
    assert!(
        t_all < 10.0 * t_quarter.max(1e-3),
        "4× the text took {:.1}× the time",
        t_all / t_quarter
    );
}
