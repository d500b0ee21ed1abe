//! Bad inputs give a one-line `error: …` naming the problem, exit code 1, never a panic.

mod common;

use common::gguf_writer::{GgufWriter, Value};
use common::{assert_one_line_error, markbase, tiny_gemma3};

fn write(dir: &std::path::Path, name: &str, w: &GgufWriter) -> String {
    let p = dir.join(name);
    w.write(&p);
    p.to_string_lossy().into_owned()
}

#[test]
fn tiny_model_runs_end_to_end() {
    // The crafted model is valid: the failures below come from what each test breaks.
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    let out = markbase(
        &[
            "-m",
            &m,
            "run",
            "--raw",
            "--temperature",
            "0",
            "--max-tokens",
            "5",
            "--json",
            "ab",
        ],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let prompt: Vec<u64> = serde_json::from_value(v["prompt_token_ids"].clone()).unwrap();
    assert_eq!(prompt[0], 2, "BOS first: {v}");
    let n = v["output_token_ids"].as_array().unwrap().len();
    assert!(n <= 5, "{v}");
    if v["finish_reason"] == "length" {
        assert_eq!(n, 5, "{v}");
    }
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let full = tiny_gemma3(64).to_bytes();
    // Cut in the tensor data, then in the header.
    for cut in [full.len() - 100, 200] {
        let p = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &full[..cut]).unwrap();
        let out = markbase(&["-m", p.to_str().unwrap(), "run", "hi"], dir.path());
        assert_one_line_error(&out, &["truncated"]);
    }
}

#[test]
fn truncated_real_model_file() {
    // A prefix of the real default model: header complete, tensor data cut short.
    let real = markbase_engine::pull::default_model_path().expect("default model");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("prefix.gguf");
    let mut f = std::fs::File::open(real).unwrap();
    let mut buf = vec![0u8; 8 << 20];
    std::io::Read::read_exact(&mut f, &mut buf).unwrap();
    std::fs::write(&p, &buf).unwrap();
    let out = markbase(&["-m", p.to_str().unwrap(), "run", "hi"], dir.path());
    assert_one_line_error(&out, &["truncated GGUF", "tensor"]);
}

#[test]
fn wrong_magic() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = tiny_gemma3(64).to_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let p = dir.path().join("magic.gguf");
    std::fs::write(&p, bytes).unwrap();
    let out = markbase(&["-m", p.to_str().unwrap(), "run", "hi"], dir.path());
    assert_one_line_error(&out, &["not a GGUF file", "GGML"]);
}

#[test]
fn unknown_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_gemma3(64);
    w.kv("general.architecture", Value::Str("mamba9".into()));
    let m = write(dir.path(), "arch.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["architecture", "mamba9"]);
}

#[test]
fn bad_tokenizer_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_gemma3(64);
    w.kv("tokenizer.ggml.model", Value::Str("wordpiece".into()));
    let m = write(dir.path(), "wordpiece.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["tokenizer model 'wordpiece'", "gemma4"]);
    // Token types that do not match the token list.
    let mut short = tiny_gemma3(64);
    short.kv("tokenizer.ggml.token_type", Value::I32Array(vec![3, 3, 3]));
    let m = write(dir.path(), "short_types.gguf", &short);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["3 token types for 267 tokens"]);
    // A merge-rank BPE vocabulary without merges, or with a merge that is not two pieces.
    w.kv("tokenizer.ggml.model", Value::Str("gemma4".into()));
    let m = write(dir.path(), "no_merges.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["no tokenizer.ggml.merges"]);
    w.kv(
        "tokenizer.ggml.merges",
        Value::StrArray(vec!["a b".into(), "ab".into()]),
    );
    let m = write(dir.path(), "bad_merge.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["tokenizer.ggml.merges[1]", "\"ab\""]);
}

#[test]
fn unsupported_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_gemma3(64);
    // ggml type 16 is IQ2_XXS (66 bytes per 256 weights); MarkBase does not read it.
    w.tensor_raw("blk.0.extra.weight", &[256], 16, vec![0; 66]);
    let m = write(dir.path(), "type.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["IQ2_XXS", "blk.0.extra.weight"]);
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_gemma3(64);
    w.remove_tensor("blk.1.ffn_down.weight");
    let m = write(dir.path(), "missing.gguf", &w);
    let out = markbase(&["-m", &m, "run", "hi"], dir.path());
    assert_one_line_error(&out, &["missing tensor", "blk.1.ffn_down.weight"]);
}

#[test]
fn prompt_longer_than_model_context() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "ctx.gguf", &tiny_gemma3(16));
    // 40 bytes → 40 byte tokens + BOS.
    let prompt = "x".repeat(40);
    let out = markbase(&["-m", &m, "run", "--raw", &prompt], dir.path());
    assert_one_line_error(&out, &["41 tokens", "context of 16"]);
}

#[test]
fn prompt_longer_than_ctx_option() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "ctx.gguf", &tiny_gemma3(64));
    // 12 byte tokens + BOS.
    let prompt = "x".repeat(12);
    let out = markbase(
        &["-m", &m, "run", "--raw", "--ctx", "8", &prompt],
        dir.path(),
    );
    assert_one_line_error(
        &out,
        &["prompt of 13 tokens does not fit the context of 8 tokens"],
    );
}

#[test]
fn missing_model_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nope.gguf");
    let out = markbase(&["-m", p.to_str().unwrap(), "tokenize", "hi"], dir.path());
    assert_one_line_error(&out, &["nope.gguf"]);
}

#[test]
fn bad_sampling_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    let out = markbase(&["-m", &m, "run", "--top-p", "0", "ab"], dir.path());
    assert_one_line_error(&out, &["top-p"]);
}

#[test]
fn bench_batches() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    let args = ["-m", &m, "bench", "-p", "0", "-n", "3", "-r", "1", "--json"];
    let out = markbase(&[&args[..], &["-b", "1,3"]].concat(), dir.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tests: Vec<(String, u64)> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["test"].as_str().unwrap().to_string(),
                r["n_tokens"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tests,
        [("tg3".to_string(), 3), ("tg3@b3".to_string(), 9)],
        "{v}"
    );
    let out = markbase(&[&args[..], &["-b", "0"]].concat(), dir.path());
    assert_one_line_error(&out, &["batch of at least one sequence"]);
}

#[test]
fn bad_tokens_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    let t = dir.path().join("ids.txt");
    std::fs::write(&t, "2 7 seven 9").unwrap();
    let out = markbase(
        &["-m", &m, "perplexity", "--tokens-file", t.to_str().unwrap()],
        dir.path(),
    );
    assert_one_line_error(&out, &["token #3 'seven'"]);
    std::fs::write(&t, "2 7 100000").unwrap();
    let out = markbase(
        &["-m", &m, "perplexity", "--tokens-file", t.to_str().unwrap()],
        dir.path(),
    );
    assert_one_line_error(&out, &["100000", "vocabulary"]);
}

#[test]
fn pull_without_python_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_markbase"))
        .arg("pull")
        .env("MARKBASE_HOME", dir.path())
        .env("MARKBASE_PYTHON", dir.path().join("no-such-python3"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_one_line_error(
        &out,
        &[
            "cannot pull the default model",
            "no-such-python3",
            "not found",
        ],
    );
    let model = dir.path().join("models").join("gemma-3-270m-q4_k_m.gguf");
    assert!(!model.exists());
}

#[test]
fn cuda_device_without_a_gpu() {
    // Where a usable GPU exists the commands run on it; elsewhere (CI) each names the problem
    // in one line.
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    let commands: [&[&str]; 2] = [
        &[
            "run",
            "--raw",
            "--temperature",
            "0",
            "--max-tokens",
            "2",
            "ab",
        ],
        &["bench", "-p", "4", "-n", "2", "-r", "1"],
    ];
    for cmd in commands {
        let mut args = vec!["-m", &m, "--device", "cuda"];
        args.extend_from_slice(cmd);
        let out = markbase(&args, dir.path());
        if out.status.success() {
            eprintln!("{}: ran on a GPU", cmd[0]);
            continue;
        }
        assert_one_line_error(&out, &["cannot load the model", "CUDA"]);
    }
}

#[test]
fn malformed_device() {
    let dir = tempfile::tempdir().unwrap();
    let m = write(dir.path(), "tiny.gguf", &tiny_gemma3(64));
    for bad in ["gpu", "cuda:x", "cuda:"] {
        let out = markbase(&["-m", &m, "--device", bad, "run", "ab"], dir.path());
        let stderr = String::from_utf8_lossy(&out.stderr);
        // A usage error from the argument parser: exit code 2, before anything is loaded.
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        let first = stderr.lines().next().unwrap_or_default();
        assert!(first.starts_with("error: "), "{stderr}");
        assert!(
            first.contains(&format!("'{bad}' is not a device (cpu, cuda, cuda:N)")),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
