//! `--synthetic VARIANT[:FORMAT[:SEED]]`: released shapes (gemma4.md §1.3), lazy generation,
//! determinism and the stored formats.

use markbase_core::quant::{dequantize_row, GgmlType};
use markbase_models::synthetic::{SyntheticSpec, SyntheticWeights, Variant};

fn weights(spec: &str) -> SyntheticWeights {
    SyntheticWeights::new(SyntheticSpec::parse(spec).unwrap()).unwrap()
}

fn shape(w: &SyntheticWeights, name: &str) -> Vec<usize> {
    w.tensors()
        .get(name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .shape
        .clone()
}

#[test]
fn parses_specs_and_rejects_bad_ones() {
    let s = SyntheticSpec::parse("26B-A4B:q4_k:7").unwrap();
    assert_eq!(
        (s.variant, s.format, s.seed),
        (Variant::B26A4, GgmlType::Q4_K, 7)
    );
    let s = SyntheticSpec::parse("e2b").unwrap();
    assert_eq!(
        (s.variant, s.format, s.seed),
        (Variant::E2b, GgmlType::BF16, 0)
    );
    assert_eq!(s.describe(), "e2b:bf16:0");
    let s = SyntheticSpec::parse("e4b:Q4_K_M").unwrap();
    assert_eq!((s.format, s.mix_m), (GgmlType::Q4_K, true));
    assert_eq!(s.describe(), "e4b:q4_k_m:0");
    let s = SyntheticSpec::parse("e4b:q5_k_m:3").unwrap();
    assert_eq!(
        (s.format, s.mix_m, s.describe().as_str()),
        (GgmlType::Q5_K, true, "e4b:q5_k_m:3")
    );
    let s = SyntheticSpec::parse("e4b:q4_0").unwrap();
    assert_eq!(
        (s.format, s.mix_m, s.describe().as_str()),
        (GgmlType::Q4_0, false, "e4b:q4_0:0")
    );
    for bad in [
        "",
        "e3b",
        "e2b:q3_k",
        "e2b:q4_k_s",
        "e2b:bf16:x",
        "e2b:bf16:1:2",
    ] {
        let e = SyntheticSpec::parse(bad).unwrap_err().to_string();
        assert!(e.contains("synthetic"), "{bad}: {e}");
    }
}

/// Projection shapes quoted in gemma4.md §1.3 and §1.1, per variant.
#[test]
fn tensors_have_the_released_shapes() {
    let w = weights("31b");
    assert_eq!(w.config().layers.len(), 60);
    assert_eq!(shape(&w, "layers.5.self_attn.q_proj.weight"), [16384, 5376]);
    assert_eq!(shape(&w, "layers.5.self_attn.k_proj.weight"), [2048, 5376]);
    assert!(!w.has("layers.5.self_attn.v_proj.weight"));
    assert_eq!(shape(&w, "layers.5.self_attn.o_proj.weight"), [5376, 16384]);
    assert_eq!(shape(&w, "layers.0.self_attn.q_proj.weight"), [8192, 5376]);
    assert_eq!(shape(&w, "layers.0.self_attn.v_proj.weight"), [4096, 5376]);

    let w = weights("e2b");
    assert_eq!(shape(&w, "layers.0.self_attn.q_proj.weight"), [2048, 1536]);
    assert_eq!(shape(&w, "layers.0.self_attn.k_proj.weight"), [256, 1536]);
    assert_eq!(shape(&w, "layers.4.self_attn.q_proj.weight"), [4096, 1536]);
    assert_eq!(shape(&w, "layers.4.self_attn.v_proj.weight"), [512, 1536]);
    assert_eq!(shape(&w, "layers.14.mlp.gate_proj.weight"), [6144, 1536]);
    assert_eq!(shape(&w, "layers.15.mlp.gate_proj.weight"), [12288, 1536]);
    assert!(!w.has("layers.15.self_attn.k_proj.weight"));
    assert_eq!(shape(&w, "embed_tokens_per_layer.weight"), [262144, 8960]);
    let shared: Vec<_> = w.config().layers.iter().map(|l| l.kv_source).collect();
    assert_eq!(shared[15], Some(13));
    assert_eq!(shared[19], Some(14));
    assert_eq!(shared[14], None);

    let w = weights("e4b");
    assert_eq!(shape(&w, "embed_tokens_per_layer.weight"), [262144, 10752]);
    assert_eq!(w.config().layers[24].kv_source, Some(22));
    assert_eq!(w.config().layers[41].kv_source, Some(23));

    let w = weights("26b-a4b");
    assert_eq!(shape(&w, "layers.5.self_attn.q_proj.weight"), [8192, 2816]);
    assert_eq!(shape(&w, "layers.5.self_attn.k_proj.weight"), [1024, 2816]);
    assert_eq!(
        shape(&w, "layers.0.experts.gate_up_proj"),
        [128, 1408, 2816]
    );
    assert_eq!(shape(&w, "layers.0.experts.down_proj"), [128, 2816, 704]);
    assert_eq!(shape(&w, "layers.0.mlp.gate_proj.weight"), [2112, 2816]);

    let w = weights("12b");
    assert_eq!(shape(&w, "layers.5.self_attn.q_proj.weight"), [8192, 3840]);
    assert_eq!(shape(&w, "layers.5.self_attn.k_proj.weight"), [512, 3840]);
    assert!(!w.has("embed_tokens_per_layer.weight"));
}

/// Byte counts follow the format; Q4_K rows that do not split into 256-blocks fall back to
/// Q8_0, and the per-layer embedding table stays at 8 bits.
#[test]
fn formats_and_byte_counts() {
    let bf16 = weights("26b-a4b:bf16");
    let q4 = weights("26b-a4b:q4_k");
    let t = &q4.tensors()["layers.0.experts.gate_up_proj"];
    assert_eq!(t.ty, GgmlType::Q4_K);
    assert_eq!(t.n_bytes, 128 * 1408 * 2816 / 256 * 144);
    assert_eq!(
        q4.tensors()["layers.0.experts.down_proj"].ty,
        GgmlType::Q8_0
    );
    assert_eq!(q4.tensors()["norm.weight"].ty, GgmlType::F32);
    assert!(q4.weight_bytes() * 2 < bf16.weight_bytes());
    let e = weights("e2b:q4_k");
    assert_eq!(
        e.tensors()["embed_tokens_per_layer.weight"].ty,
        GgmlType::Q8_0
    );
    assert_eq!(
        bf16.tensors()["embed_tokens.weight"].n_bytes,
        262144 * 2816 * 2
    );
}

/// `q4_k_m` stores what llama.cpp's Q4_K_M stores in Q6_K: the tied embedding, and `v_proj`
/// and the down projections on the layers of `use_more_bits` (E4B, 42 layers: 0–4, 36–41
/// and 7, 10, …, 34; `v_proj` counted over the 24 layers that have one: 0–2, 21–23 and 5, 8,
/// …, 20 of those); the rest as `q4_k`.
#[test]
fn q4_k_m_follows_llama_cpp_mix() {
    let ty = |w: &SyntheticWeights, name: &str| w.tensors()[name].ty;
    let m = weights("e4b:q4_k_m");
    assert_eq!(ty(&m, "embed_tokens.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&m, "embed_tokens_per_layer.weight"), GgmlType::Q8_0);
    let down = |i: usize| ty(&m, &format!("layers.{i}.mlp.down_proj.weight"));
    let six: Vec<usize> = (0..42).filter(|&i| down(i) == GgmlType::Q6_K).collect();
    let mut want: Vec<usize> = (0..5).chain(36..42).chain((7..36).step_by(3)).collect();
    want.sort();
    assert_eq!(six, want);
    assert!((0..42).all(|i| down(i) == GgmlType::Q6_K || down(i) == GgmlType::Q4_K));
    let v_layers: Vec<usize> = (0..42)
        .filter(|i| m.has(&format!("layers.{i}.self_attn.v_proj.weight")))
        .collect();
    assert_eq!(v_layers.len(), 24);
    let v_six: Vec<usize> = v_layers
        .iter()
        .enumerate()
        .filter(|(_, i)| ty(&m, &format!("layers.{i}.self_attn.v_proj.weight")) == GgmlType::Q6_K)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(v_six, [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
    assert_eq!(ty(&m, "layers.7.mlp.up_proj.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&m, "layers.7.self_attn.q_proj.weight"), GgmlType::Q4_K);
    let plain = weights("e4b:q4_k");
    assert!(m.weight_bytes() > plain.weight_bytes());
    // 26B-A4B's down projections (the experts' 704 wide, the dense one's 2 112) have no whole
    // super-blocks: llama.cpp's fallbacks, Q6_K to Q8_0 (layer 0) and Q4_K to Q5_0 (layer 4).
    let moe = weights("26b-a4b:q4_k_m");
    assert_eq!(ty(&moe, "layers.0.experts.down_proj"), GgmlType::Q8_0);
    assert_eq!(ty(&moe, "layers.4.experts.down_proj"), GgmlType::Q5_0);
    assert_eq!(ty(&moe, "layers.4.mlp.down_proj.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&moe, "embed_tokens.weight"), GgmlType::Q6_K);
    assert_eq!(
        ty(&weights("26b-a4b:q4_k"), "layers.5.experts.down_proj"),
        GgmlType::Q8_0
    );
    let row = m
        .matrix("layers.0.mlp.down_proj.weight", 2560, 10240)
        .unwrap();
    assert_eq!(row.ty, GgmlType::Q6_K);
}

/// `q5_k_m` is the same mix over Q5_K, whose rows without whole super-blocks fall back to
/// Q5_1 (llama.cpp's fallback).
#[test]
fn q5_k_m_mixes_as_q4_k_m_over_q5_k() {
    let ty = |w: &SyntheticWeights, name: &str| w.tensors()[name].ty;
    let (m4, m5) = (weights("e4b:q4_k_m"), weights("e4b:q5_k_m"));
    for (name, t) in m4.tensors() {
        let want = match t.ty {
            GgmlType::Q4_K => GgmlType::Q5_K,
            other => other,
        };
        assert_eq!(ty(&m5, name), want, "{name}");
    }
    assert_eq!(
        ty(&weights("e4b:q5_k"), "layers.0.mlp.down_proj.weight"),
        GgmlType::Q5_K
    );
    let moe = weights("26b-a4b:q5_k_m");
    assert_eq!(ty(&moe, "layers.0.experts.down_proj"), GgmlType::Q8_0);
    assert_eq!(ty(&moe, "layers.4.experts.down_proj"), GgmlType::Q5_1);
    assert_eq!(ty(&moe, "layers.4.experts.gate_up_proj"), GgmlType::Q5_K);
}

/// Generated tensors are a pure function of (seed, name), of sane magnitude in every format.
#[test]
fn generation_is_deterministic_and_sane() {
    for spec in ["e2b:bf16", "e2b:q8_0", "e2b:q4_k", "e2b:q5_k", "e2b:q4_0"] {
        let w = weights(spec);
        let name = "layers.3.self_attn.q_proj.weight";
        let a = w.matrix(name, 2048, 1536).unwrap();
        let b = w.matrix(name, 2048, 1536).unwrap();
        assert_eq!(a.bytes.as_slice(), b.bytes.as_slice(), "{spec}");
        let other = weights(&format!("{spec}:1"))
            .matrix(name, 2048, 1536)
            .unwrap();
        assert_ne!(a.bytes.as_slice(), other.bytes.as_slice(), "{spec}");
        let mut row = vec![0f32; 1536];
        let rb = a.row_bytes();
        dequantize_row(a.ty, &a.bytes.as_slice()[..rb], &mut row).unwrap();
        let amp = (3.0f32 / 1536.0).sqrt();
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        assert!(max <= amp * 1.05, "{spec}: max {max} vs {amp}");
        // Uniform on ±amp has mean square amp²/3.
        assert!(
            (mean_sq / (amp * amp / 3.0) - 1.0).abs() < 0.3,
            "{spec}: mean square {mean_sq}"
        );
        let v = w.vector("layers.3.input_layernorm.weight", 1536).unwrap();
        assert!(v.iter().all(|x| (0.89..=1.11).contains(x)));
        assert!(w.matrix(name, 1536, 2048).is_err());
        assert!(w.vector("layers.3.self_attn.q_proj.weight", 1536).is_err());
    }
}
