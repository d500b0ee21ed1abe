//! Gemma 4 forward against transformers on the tiny random models of tests/fixtures/gemma4
//! (written by scripts/make_gemma4_fixtures.py; see its README for the structures and traps
//! each one covers).
//!
//! Tolerances:
//! * f32 logits: per position, `max |ours − ref| / max |ref| ≤ 1e-4` (transformers' own
//!   prefill-vs-decode noise is ~1e-5 of that scale), for whole-sequence prefill, for prefill
//!   followed by one-token decode steps, and for the GGUF twins;
//! * per-token NLL `−log softmax(logits[i])[ids[i+1]]` within 1e-3 nats;
//! * bf16 weights (`e4b_like_bf16`): the argmax at every position equals transformers' bf16
//!   argmax exactly (the fixture guarantees a top1−top2 margin ≥ 1.0 in transformers' bf16 run;
//!   MarkBase computes in f32 on the bf16 weights, with the bf16-rounded embedding scale).

use std::path::PathBuf;

use markbase_models::{LoadOptions, Logits, Model, ModelSource};
use serde_json::Value;

const REL_TOL: f32 = 1e-4;
const NLL_TOL: f64 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma4")
        .join(name)
}

struct Reference {
    ids: Vec<u32>,
    vocab: usize,
    json: Value,
}

fn reference(name: &str) -> Reference {
    let path = fixture(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let ids = json["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let vocab = json["vocab_size"].as_u64().unwrap() as usize;
    Reference { ids, vocab, json }
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

fn load(path: PathBuf) -> Model {
    let src = ModelSource::open(&path).unwrap();
    Model::load(
        &src,
        &LoadOptions {
            threads: 2,
            progress: None,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

/// Per position: `max |got − want| / max |want|`, the worst over positions.
fn worst_rel(got: &[f32], want: &[Vec<f32>], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len() * vocab, "logit count");
    let mut worst = 0f32;
    for (p, w) in want.iter().enumerate() {
        let g = &got[p * vocab..(p + 1) * vocab];
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

fn prefill_all(model: &Model, ids: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache(ids.len()).unwrap();
    model.forward(&mut cache, ids, Logits::All).unwrap()
}

/// Prefill of `k` tokens (all logits), then one token at a time.
fn prefill_then_decode(model: &Model, ids: &[u32], k: usize) -> Vec<f32> {
    let mut cache = model.new_cache(ids.len()).unwrap();
    let mut out = model.forward(&mut cache, &ids[..k], Logits::All).unwrap();
    for &t in &ids[k..] {
        out.extend(model.forward(&mut cache, &[t], Logits::Last).unwrap());
    }
    assert_eq!(cache.len(), ids.len());
    out
}

fn nll(logits: &[f32], ids: &[u32], vocab: usize) -> Vec<f64> {
    (0..ids.len() - 1)
        .map(|i| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            lse - row[ids[i + 1] as usize] as f64
        })
        .collect()
}

/// Whole-sequence prefill, prefill + decode (split after 5 and after 13 tokens, both sides of
/// the sliding window of 8), and per-token NLL, for one f32 fixture directory.
fn check_f32(name: &str, file: Option<&str>) {
    let r = reference(name);
    let want = rows(&r.json["logits"]);
    let path = match file {
        Some(f) => fixture(name).join(f),
        None => fixture(name),
    };
    let model = load(path);
    assert_eq!(model.info().architecture, "gemma4");
    assert_eq!(model.info().n_vocab, r.vocab);
    let got = prefill_all(&model, &r.ids);
    let rel = worst_rel(&got, &want, r.vocab);
    eprintln!("{name} {file:?}: prefill worst relative error {rel:e}");
    assert!(
        rel <= REL_TOL,
        "{name} {file:?}: prefill relative error {rel:e}"
    );
    for k in [5, 13] {
        let got = prefill_then_decode(&model, &r.ids, k);
        let rel = worst_rel(&got, &want, r.vocab);
        eprintln!("{name} {file:?}: prefill {k} + decode worst relative error {rel:e}");
        assert!(
            rel <= REL_TOL,
            "{name} {file:?}: prefill {k} + decode relative error {rel:e}"
        );
    }
    let want_nll: Vec<f64> = r.json["nll"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let got_nll = nll(&got, &r.ids, r.vocab);
    assert_eq!(got_nll.len(), want_nll.len());
    for (i, (a, b)) in got_nll.iter().zip(&want_nll).enumerate() {
        assert!((a - b).abs() <= NLL_TOL, "{name}: nll[{i}] {a} vs {b}");
    }
}

#[test]
fn e2b_like_matches_transformers() {
    check_f32("e2b_like", None);
}

#[test]
fn e4b_like_matches_transformers() {
    check_f32("e4b_like", None);
}

#[test]
fn dense31b_like_matches_transformers() {
    check_f32("dense31b_like", None);
}

#[test]
fn moe26b_like_matches_transformers() {
    check_f32("moe26b_like", None);
}

#[test]
fn unified12b_like_matches_transformers() {
    check_f32("unified12b_like", None);
}

#[test]
fn e2b_like_gguf_matches_transformers() {
    check_f32("e2b_like", Some("model.gguf"));
}

#[test]
fn e4b_like_gguf_matches_transformers() {
    check_f32("e4b_like", Some("model.gguf"));
}

#[test]
fn dense31b_like_gguf_matches_transformers() {
    check_f32("dense31b_like", Some("model.gguf"));
}

#[test]
fn moe26b_like_gguf_matches_transformers() {
    check_f32("moe26b_like", Some("model.gguf"));
}

/// The GGUF twin and the safetensors directory give the same logits (same weights, same math).
#[test]
fn gguf_twins_equal_safetensors() {
    for name in ["e2b_like", "e4b_like", "dense31b_like", "moe26b_like"] {
        let r = reference(name);
        let st = prefill_all(&load(fixture(name)), &r.ids);
        let gg = prefill_all(&load(fixture(name).join("model.gguf")), &r.ids);
        let scale = st.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = st
            .iter()
            .zip(&gg)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= 1e-5 * scale, "{name}: GGUF vs safetensors {diff}");
    }
}

/// bf16 weights: greedy argmax per position equals transformers' bf16 argmax (exact).
#[test]
fn e4b_like_bf16_argmax_matches_transformers_bf16() {
    let r = reference("e4b_like_bf16");
    let want: Vec<usize> = r.json["bf16_argmax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let model = load(fixture("e4b_like_bf16"));
    for logits in [
        prefill_all(&model, &r.ids),
        prefill_then_decode(&model, &r.ids, 5),
    ] {
        let got: Vec<usize> = logits
            .chunks(r.vocab)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                    )
                    .0
            })
            .collect();
        assert_eq!(got, want);
    }
}

/// KV-shared layers own no cache: e2b_like has 8 layers of which 3 are shared, e4b_like 2.
#[test]
fn kv_shared_layers_allocate_no_cache() {
    for (name, owned) in [("e2b_like", 5), ("e4b_like", 6), ("dense31b_like", 8)] {
        let model = load(fixture(name));
        let cache = model.new_cache(24).unwrap();
        assert_eq!(cache.n_layer_caches(), owned, "{name}");
    }
}

/// Past the prefill chunk size and many windows: a 150-token prefill (several chunks, sliding
/// rings wrapping) gives the same logits as token-by-token decode and as a split prefill,
/// up to the rounding of the decode path's quantized activations.
#[test]
fn long_sequences_agree_across_chunks_and_decode() {
    for name in ["e2b_like", "moe26b_like"] {
        let r = reference(name);
        let ids: Vec<u32> = (0..150).map(|i| r.ids[(i * 7) % r.ids.len()]).collect();
        let model = load(fixture(name));
        let whole = prefill_all(&model, &ids);
        let want: Vec<Vec<f32>> = whole.chunks(r.vocab).map(<[f32]>::to_vec).collect();
        for split in [1, 70] {
            let got = prefill_then_decode(&model, &ids, split);
            let rel = worst_rel(&got, &want, r.vocab);
            // Decode rows of quantized weights take 16-bit quantized activations, prefill
            // rows f32 ones: the paths differ by that rounding (≈ 3e-5 here), not more.
            assert!(
                rel <= 1e-4,
                "{name}: split {split}: relative difference {rel:e}"
            );
        }
    }
}
