//! The Gemma 4 tokenizer (merge-ranked BPE from `tokenizer.json`) and chat template of the
//! e4b_like fixture against the Python `tokenizers` library / transformers
//! (tests/fixtures/gemma4/e4b_like/tokenizer_reference.json).

use std::path::PathBuf;

use markbase_core::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4/e4b_like")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(dir().join("tokenizer_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn encodes_and_decodes_like_the_reference() {
    let tok = Tokenizer::from_hf_file(&dir().join("tokenizer.json")).unwrap();
    let r = reference();
    assert_eq!(tok.vocab_size(), r["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)));
    for case in r["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids_no_bos"]),
            "{text:?}"
        );
        // Python renders every special token; MarkBase's decode leaves control tokens out.
        let mut want = case["decoded"].as_str().unwrap().to_string();
        for &id in &ids(&case["ids"]) {
            if tok.is_control(id) {
                want = want.replacen(tok.token_text(id).unwrap(), "", 1);
            }
        }
        assert_eq!(tok.decode(&ids(&case["ids"])), want, "{text:?}");
    }
    for (text, id) in [("<turn|>", 106), ("<|turn>", 105), ("<|tool_response>", 50)] {
        assert_eq!(tok.token_id(text), Some(id));
    }
}

/// Every chat case, thinking on (`enable_thinking`) included, renders and encodes as
/// transformers does.
#[test]
fn chat_template_renders_like_transformers() {
    let tok = Tokenizer::from_hf_file(&dir().join("tokenizer.json")).unwrap();
    let template = ChatTemplate::for_hf_dir(&dir()).unwrap().unwrap();
    let mut checked = 0;
    for case in reference()["chat"].as_array().unwrap() {
        let kwargs = case["kwargs"].as_object().unwrap();
        let thinking = kwargs.get("enable_thinking").map(|v| v.as_bool().unwrap());
        assert!(
            kwargs.keys().all(|k| k == "enable_thinking"),
            "unexpected template arguments in {}",
            case["name"]
        );
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let text = template
            .render_with_thinking(&messages, add, "<bos>", "<eos>", thinking)
            .unwrap();
        assert_eq!(text, case["rendered"].as_str().unwrap(), "{}", case["name"]);
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&case["ids"]));
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} chat cases checked");
}
