//! Chat templates against transformers' renderer (tests/fixtures/tokenizer/chat_templates.json,
//! written by scripts/make_tokenizer_fixtures.py): Gemma 3's own template and a ChatML-style one
//! that relies on trim_blocks / lstrip_blocks and Python string methods; the built-in Gemma
//! template must render exactly what Gemma 3's own template renders.

use std::path::PathBuf;

use markbase_core::tokenizer::{ChatMessage, ChatTemplate};
use serde_json::Value;

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer/chat_templates.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("parses")
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn renders_like_transformers() {
    let fx = fixture();
    let mut n = 0;
    for case in fx["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let src = fx["templates"][name].as_str().unwrap();
        let tmpl = ChatTemplate::from_source(src).expect("compiles");
        assert!(!tmpl.is_builtin());
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = tmpl
            .render(&messages(&case["messages"]), gen, "<bos>", "<eos>")
            .unwrap();
        assert_eq!(got, case["rendered"].as_str().unwrap(), "{name} {gen}");
        n += 1;
    }
    assert!(n >= 8);
}

#[test]
fn builtin_gemma_matches_gemma3_own_template() {
    let fx = fixture();
    let builtin = ChatTemplate::builtin_gemma();
    assert!(builtin.is_builtin());
    let mut n = 0;
    for case in fx["cases"].as_array().unwrap() {
        if case["template"] != "gemma3" {
            continue;
        }
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = builtin
            .render(&messages(&case["messages"]), gen, "<bos>", "<eos>")
            .unwrap();
        assert_eq!(got, case["rendered"].as_str().unwrap());
        n += 1;
    }
    assert!(n >= 4);
}

#[test]
fn gemma3_own_template_rejects_non_alternating_roles() {
    let fx = fixture();
    let tmpl = ChatTemplate::from_source(fx["templates"]["gemma3"].as_str().unwrap()).unwrap();
    let msgs = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let e = tmpl.render(&msgs, true, "<bos>", "<eos>").unwrap_err();
    assert!(
        e.to_string().contains("Conversation roles must alternate"),
        "{e}"
    );
}

#[test]
fn hf_dir_template_sources() {
    let dir = std::env::temp_dir().join(format!("markbase-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert!(ChatTemplate::for_hf_dir(&dir).unwrap().is_none());
    let cfg = serde_json::json!({"chat_template": [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}
    ]});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let t = ChatTemplate::for_hf_dir(&dir).unwrap().expect("template");
    let msgs = [ChatMessage::new("user", "hi")];
    assert_eq!(t.render(&msgs, false, "<s>", "</s>").unwrap(), "<s>hi");
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages | length }}").unwrap();
    let t = ChatTemplate::for_hf_dir(&dir).unwrap().expect("template");
    assert_eq!(t.render(&msgs, false, "<s>", "</s>").unwrap(), "J1");
    std::fs::write(dir.join("chat_template.jinja"), "{% for %}").unwrap();
    let e = ChatTemplate::for_hf_dir(&dir).err().expect("syntax error");
    assert!(e.to_string().contains("chat_template.jinja"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
