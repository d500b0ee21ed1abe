//! `markbase` on the tiny Gemma 4 models of tests/fixtures/gemma4 and on `--synthetic`
//! variants: perplexity against transformers, `run` with the chat template and the Gemma 4
//! stop tokens, instant `inspect` of a synthetic model.

mod common;

use std::path::PathBuf;

use common::{assert_one_line_error, markbase};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma4")
        .join(name)
}

fn json_file(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `markbase perplexity --tokens-file --json`: per-token NLL within 1e-3 of transformers', for
/// every structure, from safetensors and from the GGUF twins.
#[test]
fn perplexity_nll_matches_transformers() {
    let home = tempfile::tempdir().unwrap();
    let cases = [
        ("e2b_like", ""),
        ("e4b_like", ""),
        ("dense31b_like", ""),
        ("moe26b_like", ""),
        ("unified12b_like", ""),
        ("e2b_like", "model.gguf"),
        ("e4b_like", "model.gguf"),
        ("dense31b_like", "model.gguf"),
        ("moe26b_like", "model.gguf"),
    ];
    for (name, file) in cases {
        let r = json_file(fixture(name).join("reference.json"));
        let ids: Vec<String> = r["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let tokens = home.path().join(format!("{name}.txt"));
        std::fs::write(&tokens, ids.join(" ")).unwrap();
        let model = fixture(name).join(file);
        let out = markbase(
            &[
                "-m",
                model.to_str().unwrap(),
                "perplexity",
                "--tokens-file",
                tokens.to_str().unwrap(),
                "--json",
            ],
            home.path(),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name} {file}: {stderr}");
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let (got, want) = (got["nll"].as_array().unwrap(), r["nll"].as_array().unwrap());
        assert_eq!(got.len(), want.len(), "{name} {file}");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() <= 1e-3, "{name} {file}: nll[{i}] {a} vs {b}");
        }
    }
}

/// `markbase run` on a Gemma 4 directory (and its GGUF twin): the prompt is the chat
/// template's rendering (ids as transformers tokenizes it; thinking off and, with `--think`,
/// on) and the stop tokens are EOS, `<turn|>` and `<|tool_response>` (generation_config.json's
/// [1, 106, 50]).
#[test]
fn run_applies_the_chat_template_and_gemma4_stop_tokens() {
    let home = tempfile::tempdir().unwrap();
    let dir = fixture("e4b_like");
    let reference = json_file(dir.join("tokenizer_reference.json"));
    let chat_ids = |name: &str| {
        reference["chat"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()["ids"]
            .clone()
    };
    let v = run_hello(&dir, &["--max-tokens", "4"], home.path());
    assert_eq!(v["prompt_token_ids"], chat_ids("user_only"));
    assert!(v["output_token_ids"].as_array().unwrap().len() <= 4);

    // The GGUF twin carries the same tokenizer and template in its metadata.
    let v = run_hello(&dir.join("model.gguf"), &["--max-tokens", "1"], home.path());
    assert_eq!(v["prompt_token_ids"], chat_ids("user_only"));

    // `--think` turns the template's thinking mode on (a system turn with `<|think|>`).
    let v = run_hello(&dir, &["--max-tokens", "1", "--think"], home.path());
    assert_eq!(v["prompt_token_ids"], chat_ids("thinking_no_system"));

    let out = markbase(&["-m", dir.to_str().unwrap(), "inspect"], home.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("stop tokens [1, 106, 50]"), "{text}");
    assert!(text.contains("architecture: gemma4"), "{text}");
}

/// `markbase -m MODEL run --temperature 0 EXTRA --json Hello`, which must succeed: its JSON.
fn run_hello(model: &std::path::Path, extra: &[&str], home: &std::path::Path) -> Value {
    let mut args = vec!["-m", model.to_str().unwrap(), "run", "--temperature", "0"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--json", "Hello"]);
    let out = markbase(&args, home);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `--synthetic` inspect reports the variant's tensors and bytes without generating them (a
/// 16 GiB model inspected at once), and bad specs or tokenizer-needing commands are clear
/// errors.
#[test]
fn synthetic_inspect_is_instant_and_errors_are_clear() {
    let home = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    let out = markbase(&["--synthetic", "31b:q4_k", "inspect"], home.path());
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let bytes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("weight_bytes: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(bytes > 15 << 30 && bytes < 20 << 30, "{bytes}");
    assert!(text.contains("layers.5.self_attn.k_proj.weight"), "{text}");
    assert!(took.as_secs() < 10, "inspect took {took:?}");

    let out = markbase(&["--synthetic", "7b", "bench"], home.path());
    assert_one_line_error(&out, &["synthetic variant '7b'"]);
    let out = markbase(&["--synthetic", "e2b", "run", "hi"], home.path());
    assert_one_line_error(&out, &["no tokenizer"]);
}
