//! The Gemma 4 tokenizer (merge-ranked BPE, from `tokenizer.json` and from the GGUF twin's
//! `tokenizer.ggml.*` metadata) and chat template of the e4b_like fixture against the Python
//! `tokenizers` library / transformers (tests/fixtures/gemma4/e4b_like/tokenizer_reference.json).

use std::path::PathBuf;

use markbase_core::gguf::GgufFile;
use markbase_core::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4/e4b_like")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(dir().join("tokenizer_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture's tokenizer and chat template from each file that carries them.
fn sources() -> Vec<(&'static str, Tokenizer, ChatTemplate)> {
    let gguf = GgufFile::open(dir().join("model.gguf")).unwrap();
    vec![
        (
            "tokenizer.json",
            Tokenizer::from_hf_file(&dir().join("tokenizer.json")).unwrap(),
            ChatTemplate::for_hf_dir(&dir()).unwrap().unwrap(),
        ),
        (
            "model.gguf",
            Tokenizer::from_gguf(&gguf).unwrap(),
            ChatTemplate::for_gguf(&gguf).unwrap(),
        ),
    ]
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
    let r = reference();
    for (source, tok, _) in sources() {
        assert_eq!(
            tok.vocab_size(),
            r["vocab_size"].as_u64().unwrap() as usize,
            "{source}"
        );
        assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)), "{source}");
        assert!(tok.adds_bos(), "{source}");
        for case in r["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text, true).unwrap(),
                ids(&case["ids"]),
                "{source}: {text:?}"
            );
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids(&case["ids_no_bos"]),
                "{source}: {text:?}"
            );
            // Python renders every special token; MarkBase's decode leaves control tokens out.
            let mut want = case["decoded"].as_str().unwrap().to_string();
            for &id in &ids(&case["ids"]) {
                if tok.is_control(id) {
                    want = want.replacen(tok.token_text(id).unwrap(), "", 1);
                }
            }
            assert_eq!(tok.decode(&ids(&case["ids"])), want, "{source}: {text:?}");
        }
        for (text, id) in [("<turn|>", 106), ("<|turn>", 105), ("<|tool_response>", 50)] {
            assert_eq!(tok.token_id(text), Some(id), "{source}");
        }
    }
}

/// Every chat case, thinking on (`enable_thinking`) included, renders and encodes as
/// transformers does, from both sources.
#[test]
fn chat_template_renders_like_transformers() {
    let mut checked = 0;
    for (source, tok, template) in sources() {
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
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            let add = case["add_generation_prompt"].as_bool().unwrap();
            let text = template
                .render_with_thinking(&messages, add, "<bos>", "<eos>", thinking)
                .unwrap();
            assert_eq!(
                text,
                case["rendered"].as_str().unwrap(),
                "{source}: {}",
                case["name"]
            );
            assert_eq!(
                tok.encode(&text, false).unwrap(),
                ids(&case["ids"]),
                "{source}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} chat cases checked");
}
