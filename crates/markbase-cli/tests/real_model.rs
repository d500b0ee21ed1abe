//! The CLI on the real default model (pulled once into the cache and shared by every test).

mod common;

use std::path::PathBuf;

use common::markbase;

fn model() -> String {
    let p: PathBuf = markbase_engine::pull::default_model_path().expect("default model");
    p.to_string_lossy().into_owned()
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn tokenize_json() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let v = json_of(&markbase(
        &["-m", &m, "tokenize", "--json", "Hello world"],
        dir.path(),
    ));
    assert_eq!(v, serde_json::json!({"ids": [2, 9259, 1902]}));
    let v = json_of(&markbase(
        &["-m", &m, "tokenize", "--json", "--no-bos", "Hello world"],
        dir.path(),
    ));
    assert_eq!(v, serde_json::json!({"ids": [9259, 1902]}));
}

/// The greedy continuations transformers gives for the same GGUF (committed fixture).
fn greedy_fixture() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma3_270m/greedy.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn run_raw_greedy_json_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let fixture = greedy_fixture();
    let case = &fixture["prompts"][0];
    let text = case["text"].as_str().unwrap();
    let args = [
        "-m",
        &m,
        "run",
        "--raw",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--json",
        text,
    ];
    let v = json_of(&markbase(&args, dir.path()));
    assert_eq!(v["prompt_token_ids"], case["prompt_ids"]);
    let want: Vec<_> = case["continuation_ids"].as_array().unwrap()[..8].to_vec();
    assert_eq!(v["output_token_ids"].as_array().unwrap(), &want, "{v}");
    assert_eq!(v["finish_reason"], "length");
    let decoded = json_of(&markbase(
        &[
            "-m",
            &m,
            "tokenize",
            "--json",
            "--no-bos",
            v["text"].as_str().unwrap(),
        ],
        dir.path(),
    ));
    assert_eq!(
        decoded["ids"], v["output_token_ids"],
        "text is the decoded ids"
    );
    assert!(v["timings"]["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(v["timings"]["prefill_tokens"] == 6);
}

#[test]
fn run_chat_template_with_seed_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let args = [
        "-m",
        &m,
        "run",
        "--seed",
        "11",
        "--max-tokens",
        "12",
        "--json",
        "Name a colour.",
    ];
    let a = json_of(&markbase(&args, dir.path()));
    let b = json_of(&markbase(&args, dir.path()));
    assert_eq!(a["output_token_ids"], b["output_token_ids"]);
    assert_eq!(a["text"], b["text"]);
    // The chat template wraps the prompt in turns.
    let prompt = a["prompt_token_ids"].as_array().unwrap();
    assert_eq!(prompt[..2], [serde_json::json!(2), serde_json::json!(105)]);
}

#[test]
fn perplexity_json_shape() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, \
         and the clocks were striking thirteen. All happy families are alike; each unhappy \
         family is unhappy in its own way.",
    )
    .unwrap();
    let tokens = json_of(&markbase(
        &[
            "-m",
            &m,
            "tokenize",
            "--json",
            &std::fs::read_to_string(&text).unwrap(),
        ],
        dir.path(),
    ));
    let n = tokens["ids"].as_array().unwrap().len();
    let one = json_of(&markbase(
        &[
            "-m",
            &m,
            "perplexity",
            "--json",
            "-f",
            text.to_str().unwrap(),
        ],
        dir.path(),
    ));
    let nll = one["nll"].as_array().unwrap();
    assert_eq!(nll.len(), n - 1, "positions 1..n-1");
    let mean = nll.iter().map(|x| x.as_f64().unwrap()).sum::<f64>() / nll.len() as f64;
    assert!((one["mean_nll"].as_f64().unwrap() - mean).abs() < 1e-9);
    let ppl = one["ppl"].as_f64().unwrap();
    assert!((ppl - mean.exp()).abs() < 1e-6 * ppl);
    assert!(ppl > 1.0 && ppl < 1000.0, "{ppl}");
    // Small windows: still one NLL per predicted token, and the first window is unchanged.
    let win = json_of(&markbase(
        &[
            "-m",
            &m,
            "perplexity",
            "--json",
            "--ctx",
            "16",
            "-f",
            text.to_str().unwrap(),
        ],
        dir.path(),
    ));
    let wnll = win["nll"].as_array().unwrap();
    assert_eq!(wnll.len(), n - 1);
    for i in 0..15 {
        let (a, b) = (wnll[i].as_f64().unwrap(), nll[i].as_f64().unwrap());
        assert!(
            (a - b).abs() < 1e-3 * b.abs().max(1.0),
            "position {}: {a} vs {b}",
            i + 1
        );
    }
    // The same tokens given as ids give the same result.
    let ids = dir.path().join("ids.txt");
    let list: Vec<String> = tokens["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    std::fs::write(&ids, list.join(" ")).unwrap();
    let by_ids = json_of(&markbase(
        &[
            "-m",
            &m,
            "perplexity",
            "--json",
            "--tokens-file",
            ids.to_str().unwrap(),
        ],
        dir.path(),
    ));
    assert_eq!(by_ids["nll"].as_array().unwrap().len(), n - 1);
    assert!((by_ids["ppl"].as_f64().unwrap() - ppl).abs() < 1e-6 * ppl);
}

#[test]
fn bench_json_shape() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let v = json_of(&markbase(
        &[
            "-m", &m, "bench", "-p", "16", "-n", "4", "-r", "2", "--json",
        ],
        dir.path(),
    ));
    let device = v["device"].as_str().unwrap();
    assert!(
        device.starts_with("cpu (") && device.ends_with(" threads)"),
        "{v}"
    );
    let r = v["results"].as_array().unwrap();
    assert_eq!(r[0]["test"], "pp16");
    assert_eq!(r[1]["test"], "tg4");
    for x in r {
        assert!(x["tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");
        assert_eq!(x["samples"].as_array().unwrap().len(), 2);
    }
}

#[test]
fn chat_answers_each_line_until_exit() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let sampling = ["--temperature", "0", "--max-tokens", "12"];
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_markbase"))
        .args(["-m", &m, "chat"])
        .args(sampling)
        .env("MARKBASE_HOME", dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"My name is Ada.\nWhat is my name?\n/exit\nNever read.\n")
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // The first turn is exactly what `run` answers to the same message.
    let mut args = vec!["-m", m.as_str(), "run", "--json"];
    args.extend(sampling);
    args.push("My name is Ada.");
    let first = json_of(&markbase(&args, dir.path()));
    let first_text = first["text"].as_str().unwrap();
    assert!(
        stdout.starts_with(&format!("{first_text}\n")),
        "{stdout:?} vs {first_text:?}"
    );
    // A second reply follows.
    let rest = &stdout[first_text.len() + 1..];
    assert!(!rest.trim().is_empty(), "{stdout:?}");
    assert!(rest.ends_with('\n'), "{stdout:?}");
}

#[test]
fn inspect_shows_metadata_tensors_and_template() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let out = markbase(&["-m", &m, "inspect"], dir.path());
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("general.architecture (string) = \"gemma3\""),
        "{s}"
    );
    assert!(
        s.contains("tokenizer.ggml.tokens (array) = [262144 × string]"),
        "{s}"
    );
    assert!(s.contains("token_embd.weight"), "{s}");
    assert!(s.contains("sliding_window: 512"), "{s}");
    assert!(s.contains("chat template: "), "{s}");
    assert!(s.lines().count() < 400, "long arrays must be summarised");
}
