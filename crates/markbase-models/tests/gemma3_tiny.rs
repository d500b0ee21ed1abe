//! The tiny random Gemma 3 fixture (scripts/make_gemma3_tiny_fixture.py) against transformers'
//! float32 eager logits.

use std::path::PathBuf;

use markbase_core::Error;
use markbase_models::{LoadOptions, Logits, Model, ModelSource};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma3_tiny")
}

fn load() -> (Model, Vec<u32>, Vec<f32>) {
    let dir = fixture_dir();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let bytes = std::fs::read(dir.join("logits.f32")).unwrap();
    let want: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let src = ModelSource::open(&dir).unwrap();
    let model = Model::load(
        &src,
        &LoadOptions {
            threads: 2,
            progress: None,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    (model, tokens, want)
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// Max |a − b| / max |b| of one position, and argmax agreement.
fn check_row(pos: usize, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err / scale < 1e-4,
        "position {pos}: relative error {} (max |diff| {err}, max |ref| {scale})",
        err / scale
    );
    assert_eq!(argmax(got), argmax(want), "position {pos}: argmax differs");
}

#[test]
fn whole_sequence_prefill_matches_transformers() {
    let (model, tokens, want) = load();
    let nv = model.info().n_vocab;
    assert_eq!(nv, 300);
    assert_eq!(want.len(), tokens.len() * nv);
    let mut cache = model.new_cache(tokens.len()).unwrap();
    let got = model.forward(&mut cache, &tokens, Logits::All).unwrap();
    assert_eq!(cache.len(), tokens.len());
    for p in 0..tokens.len() {
        check_row(p, &got[p * nv..(p + 1) * nv], &want[p * nv..(p + 1) * nv]);
    }
}

#[test]
fn prefix_prefill_then_decode_matches_transformers() {
    let (model, tokens, want) = load();
    let nv = model.info().n_vocab;
    for prefix in [1, 5, 11] {
        let mut cache = model.new_cache(32).unwrap();
        let got = model
            .forward(&mut cache, &tokens[..prefix], Logits::Last)
            .unwrap();
        check_row(prefix - 1, &got, &want[(prefix - 1) * nv..prefix * nv]);
        for p in prefix..tokens.len() {
            let got = model
                .forward(&mut cache, &tokens[p..p + 1], Logits::Last)
                .unwrap();
            check_row(p, &got, &want[p * nv..(p + 1) * nv]);
        }
    }
}

#[test]
fn truncate_and_rerun_reproduces_logits() {
    let (model, tokens, want) = load();
    let nv = model.info().n_vocab;
    let mut cache = model.new_cache(tokens.len()).unwrap();
    model.forward(&mut cache, &tokens, Logits::Last).unwrap();
    cache.truncate(12).unwrap();
    let got = model
        .forward(&mut cache, &tokens[12..], Logits::All)
        .unwrap();
    for p in 12..tokens.len() {
        let r = p - 12;
        check_row(p, &got[r * nv..(r + 1) * nv], &want[p * nv..(p + 1) * nv]);
    }
}

#[test]
fn overflow_and_bad_tokens_are_errors() {
    let (model, tokens, _) = load();
    assert!(matches!(
        model.new_cache(65),
        Err(Error::ContextOverflow {
            tokens: 65,
            context: 64
        })
    ));
    let mut cache = model.new_cache(10).unwrap();
    let e = model
        .forward(&mut cache, &tokens, Logits::Last)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ContextOverflow {
                tokens: 20,
                context: 10
            }
        ),
        "{e}"
    );
    assert_eq!(cache.len(), 0);
    let e = model.forward(&mut cache, &[300], Logits::Last).unwrap_err();
    assert!(e.to_string().contains("token id 300"), "{e}");
}

#[test]
fn info_reports_the_fixture_shape() {
    let (model, _, _) = load();
    let info = model.info();
    assert_eq!(info.architecture, "gemma3");
    assert_eq!(
        (
            info.n_layers,
            info.d_model,
            info.n_heads,
            info.n_kv_heads,
            info.head_dim
        ),
        (7, 64, 4, 2, 32)
    );
    assert_eq!(info.sliding_window, 8);
    assert_eq!(info.context_length, 64);
    let size = std::fs::metadata(fixture_dir().join("model.safetensors"))
        .unwrap()
        .len();
    assert!(info.weight_bytes > size * 9 / 10 && info.weight_bytes <= size);
    assert!(info.describe().contains("layer_kinds: SSSSSFS"));
}

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn gguf_q8_0_f16_fixture_matches_transformers() {
    let (_, tokens, _) = load();
    let dir = fixture_dir().join("gguf");
    let want = read_f32(&dir.join("logits.f32"));
    let src = ModelSource::open(&dir.join("model.gguf")).unwrap();
    assert!(matches!(src, ModelSource::Gguf(_)));
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let progress = |done: u64, total: u64| {
        assert!(done <= total);
        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    let opts = LoadOptions {
        threads: 2,
        progress: Some(&progress),
        ..LoadOptions::default()
    };
    let model = Model::load(&src, &opts).unwrap();
    assert!(calls.load(std::sync::atomic::Ordering::Relaxed) > 7);
    let nv = model.info().n_vocab;
    let mut cache = model.new_cache(tokens.len()).unwrap();
    let got = model
        .forward(&mut cache, &tokens[..9], Logits::All)
        .unwrap();
    for p in 0..9 {
        check_row(p, &got[p * nv..(p + 1) * nv], &want[p * nv..(p + 1) * nv]);
    }
    for p in 9..tokens.len() {
        let got = model
            .forward(&mut cache, &tokens[p..p + 1], Logits::Last)
            .unwrap();
        check_row(p, &got, &want[p * nv..(p + 1) * nv]);
    }
}

/// A copy of the HF fixture with tensors renamed/converted, in a fresh temp dir.
fn variant(
    tag: &str,
    config: serde_json::Value,
    rename: &dyn Fn(&str) -> Option<String>,
    bf16: bool,
) -> PathBuf {
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, SafeTensors};
    let dir = std::env::temp_dir().join(format!("markbase-g3-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = std::fs::read(fixture_dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.iter() {
        let Some(new) = rename(name) else { continue };
        let raw = if bf16 {
            view.data()
                .chunks_exact(4)
                .flat_map(|c| {
                    half::bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
                })
                .collect()
        } else {
            view.data().to_vec()
        };
        data.push((new, view.shape().to_vec(), raw));
    }
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

fn fixture_config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("config.json")).unwrap())
        .unwrap()
}

fn prefill_all(dir: &std::path::Path, tokens: &[u32]) -> markbase_core::Result<Vec<f32>> {
    let model = Model::load(&ModelSource::open(dir)?, &LoadOptions::default())?;
    let mut cache = model.new_cache(tokens.len())?;
    model.forward(&mut cache, tokens, Logits::All)
}

#[test]
fn multimodal_layout_with_language_model_prefix_matches() {
    let (_, tokens, want) = load();
    let nv = 300;
    let config = serde_json::json!({
        "model_type": "gemma3",
        "text_config": fixture_config(),
        "vision_config": {"model_type": "siglip_vision_model"},
    });
    for prefix in ["language_model.model.", "model.language_model."] {
        let rename = |n: &str| Some(n.replacen("model.", prefix, 1));
        let dir = variant(&prefix.replace('.', "_"), config.clone(), &rename, false);
        let got = prefill_all(&dir, &tokens).unwrap();
        for p in 0..tokens.len() {
            check_row(p, &got[p * nv..(p + 1) * nv], &want[p * nv..(p + 1) * nv]);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn bf16_weights_stay_close_to_f32_reference() {
    let (_, tokens, want) = load();
    let nv = 300;
    let dir = variant("bf16", fixture_config(), &|n| Some(n.to_string()), true);
    let got = prefill_all(&dir, &tokens).unwrap();
    let mut agree = 0;
    for p in 0..tokens.len() {
        let (g, w) = (&got[p * nv..(p + 1) * nv], &want[p * nv..(p + 1) * nv]);
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err / scale < 0.05,
            "position {p}: bf16 relative error {}",
            err / scale
        );
        agree += usize::from(argmax(g) == argmax(w));
    }
    assert!(
        agree >= tokens.len() - 2,
        "argmax agrees at {agree} positions"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_models_give_clear_errors() {
    let (_, tokens, _) = load();
    let mut config = fixture_config();
    config["model_type"] = "llama".into();
    let dir = variant("arch", config, &|n| Some(n.to_string()), false);
    let e = prefill_all(&dir, &tokens).unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("architecture 'llama'")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let drop_k = |n: &str| (n != "model.layers.3.self_attn.k_proj.weight").then(|| n.to_string());
    let dir = variant("missing", fixture_config(), &drop_k, false);
    let e = prefill_all(&dir, &tokens).unwrap_err();
    assert!(
        matches!(&e, Error::MissingTensor(n) if n == "model.layers.3.self_attn.k_proj.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let mut config = fixture_config();
    config["intermediate_size"] = 128.into();
    let dir = variant("shape", config, &|n| Some(n.to_string()), false);
    let e = prefill_all(&dir, &tokens).unwrap_err();
    assert!(
        matches!(&e, Error::BadTensor { name, .. } if name == "model.layers.0.mlp.gate_proj.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let e = ModelSource::open(&fixture_dir().join("nope.gguf"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("nope.gguf"), "{e}");
}
