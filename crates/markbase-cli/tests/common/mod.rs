//! Shared helpers of the CLI tests: running the binary, and a tiny Gemma 3 GGUF.

#![allow(dead_code)] // Each test file uses its own subset.

pub mod gguf_writer;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use gguf_writer::{GgufWriter, Value};

/// Runs `markbase` with `args`, no stdin, and a private empty cache so nothing is pulled by
/// accident.
pub fn markbase(args: &[&str], home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_markbase"))
        .args(args)
        .env("MARKBASE_HOME", home)
        .stdin(Stdio::null())
        .output()
        .expect("run markbase")
}

/// Asserts the run failed with exit code 1 and exactly one stderr line `error: …` containing
/// every `needle`; returns that line.
pub fn assert_one_line_error(out: &Output, needles: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "{line}");
    assert!(!line.contains("panicked"), "{line}");
    for n in needles {
        assert!(line.contains(n), "{line:?} does not mention {n:?}");
    }
    // Shown with --nocapture, to read the messages a user gets.
    eprintln!("{line}");
    line.to_string()
}

/// Deterministic pseudo-random weights in [-scale, scale).
fn weights(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Sizes of the tiny model.
pub const D: u64 = 16;
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const HEAD_DIM: u64 = 8;
const FF: u64 = 32;

/// The tiny model's vocabulary and GGUF token types: 6 specials (`<pad>` 0, `<eos>` 1,
/// `<bos>` 2, `<unk>` 3, `<start_of_turn>` 4, `<end_of_turn>` 5), the 256 byte tokens (6..=261),
/// then `▁` 262, `a` 263, `b` 264, `ab` 265, `▁a` 266.
pub fn tiny_vocab() -> (Vec<String>, Vec<i32>) {
    let specials = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<start_of_turn>",
        "<end_of_turn>",
    ];
    let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3, 3, 3, 2, 3, 3];
    for b in 0..=255u32 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for piece in ["▁", "a", "b", "ab", "▁a"] {
        tokens.push(piece.to_string());
        types.push(1);
    }
    (tokens, types)
}

/// A complete, valid tiny Gemma 3 model (2 layers, F32 weights, byte-level vocabulary with
/// Gemma's special tokens) whose context holds `context` tokens.
pub fn tiny_gemma3(context: u32) -> GgufWriter {
    let mut w = GgufWriter::default();
    let (tokens, types) = tiny_vocab();
    let n_vocab = tokens.len() as u64;
    let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
    w.kv("general.architecture", Value::Str("gemma3".into()))
        .kv("gemma3.context_length", Value::U32(context))
        .kv("gemma3.embedding_length", Value::U32(D as u32))
        .kv("gemma3.block_count", Value::U32(2))
        .kv("gemma3.feed_forward_length", Value::U32(FF as u32))
        .kv("gemma3.attention.head_count", Value::U32(HEADS as u32))
        .kv(
            "gemma3.attention.head_count_kv",
            Value::U32(KV_HEADS as u32),
        )
        .kv("gemma3.attention.key_length", Value::U32(HEAD_DIM as u32))
        .kv("gemma3.attention.value_length", Value::U32(HEAD_DIM as u32))
        .kv("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6))
        .kv("gemma3.attention.sliding_window", Value::U32(4))
        .kv("gemma3.rope.freq_base", Value::F32(1e6))
        .kv("tokenizer.ggml.model", Value::Str("llama".into()))
        .kv("tokenizer.ggml.tokens", Value::StrArray(tokens))
        .kv("tokenizer.ggml.scores", Value::F32Array(scores))
        .kv("tokenizer.ggml.token_type", Value::I32Array(types))
        .kv("tokenizer.ggml.bos_token_id", Value::U32(2))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.unknown_token_id", Value::U32(3))
        .kv("tokenizer.ggml.add_bos_token", Value::Bool(true))
        .kv("tokenizer.ggml.add_space_prefix", Value::Bool(false));
    let mut seed = 0u64;
    let mut mat = |w: &mut GgufWriter, name: &str, dims: &[u64], scale: f32| {
        seed += 1;
        let n = dims.iter().product::<u64>() as usize;
        w.tensor_f32(name, dims, &weights(n, seed, scale));
    };
    mat(&mut w, "token_embd.weight", &[D, n_vocab], 0.5);
    mat(&mut w, "output_norm.weight", &[D], 0.1);
    let (qd, kvd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for i in 0..2 {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        mat(&mut w, &n("attn_norm"), &[D], 0.1);
        mat(&mut w, &n("attn_q"), &[D, qd], 0.3);
        mat(&mut w, &n("attn_k"), &[D, kvd], 0.3);
        mat(&mut w, &n("attn_v"), &[D, kvd], 0.3);
        mat(&mut w, &n("attn_output"), &[qd, D], 0.3);
        mat(&mut w, &n("attn_q_norm"), &[HEAD_DIM], 0.1);
        mat(&mut w, &n("attn_k_norm"), &[HEAD_DIM], 0.1);
        mat(&mut w, &n("post_attention_norm"), &[D], 0.1);
        mat(&mut w, &n("ffn_norm"), &[D], 0.1);
        mat(&mut w, &n("ffn_gate"), &[D, FF], 0.3);
        mat(&mut w, &n("ffn_up"), &[D, FF], 0.3);
        mat(&mut w, &n("ffn_down"), &[FF, D], 0.3);
        mat(&mut w, &n("post_ffw_norm"), &[D], 0.1);
    }
    w
}
