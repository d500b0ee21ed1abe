//! Gemma 4 config loading: every fixture form, GGUF metadata = config.json, clear errors.

use std::path::PathBuf;

use markbase_core::config::LayerKind;
use markbase_core::gguf::GgufFile;
use markbase_core::Error;
use markbase_models::gemma4_config::{Gemma4Config, Gemma4Moe, Gemma4Ple};
use serde_json::{json, Value};

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma4")
        .join(name)
}

fn hf(name: &str) -> Gemma4Config {
    Gemma4Config::from_hf_file(&dir(name).join("config.json")).unwrap()
}

#[test]
fn fixture_configs_resolve_every_layer() {
    let c = hf("e2b_like");
    let src: Vec<_> = c.layers.iter().map(|l| l.kv_source).collect();
    assert_eq!(
        src,
        [None, None, None, None, None, Some(3), Some(3), Some(4)]
    );
    let ff: Vec<_> = c.layers.iter().map(|l| l.n_ff).collect();
    assert_eq!(ff, [48, 48, 48, 48, 48, 96, 96, 96]);
    assert_eq!(c.layers[4].head_dim, 64);
    assert_eq!(c.layers[4].kind, LayerKind::Full);
    assert_eq!(c.ple, Some(Gemma4Ple { dim: 8, vocab: 512 }));
    assert_eq!(c.rope_full.rotated_pairs(64), 8);
    assert_eq!(c.rope_sliding.rotated_pairs(32), 16);

    let c = hf("e4b_like");
    let hd: Vec<_> = c.layers.iter().map(|l| l.head_dim).collect();
    assert_eq!(hd, [32, 32, 32, 32, 32, 64, 32, 64]);
    assert!(c.layers.iter().all(|l| l.n_kv_heads == 2));
    assert_eq!(c.layers[6].kv_source, Some(4));
    assert_eq!(c.layers[7].kv_source, Some(5));

    let c = hf("dense31b_like");
    assert_eq!((c.layers[5].n_kv_heads, c.layers[5].has_v), (1, false));
    assert_eq!((c.layers[0].n_kv_heads, c.layers[0].has_v), (2, true));
    assert_eq!(c.ple, None);

    let c = hf("moe26b_like");
    assert_eq!(
        c.moe,
        Some(Gemma4Moe {
            n_experts: 8,
            top_k: 2,
            expert_ff: 12
        })
    );
    assert_eq!((c.layers[5].head_dim, c.layers[5].n_kv_heads), (64, 1));

    let c = hf("unified12b_like");
    assert_eq!((c.ple, c.moe, c.n_kv_shared), (None, None, 0));
    assert_eq!((c.layers[7].n_kv_heads, c.layers[7].has_v), (1, false));
    assert_eq!(c.final_logit_softcap, Some(30.0));
}

/// The GGUF twins' metadata resolves to the same layers as their config.json.
#[test]
fn gguf_metadata_matches_config_json() {
    for name in ["e2b_like", "e4b_like", "dense31b_like", "moe26b_like"] {
        let h = hf(name);
        let g = Gemma4Config::from_gguf(&GgufFile::open(dir(name).join("model.gguf")).unwrap())
            .unwrap();
        assert_eq!(g.layers, h.layers, "{name}");
        assert_eq!(g.rope_full, h.rope_full, "{name}");
        assert_eq!(g.rope_sliding, h.rope_sliding, "{name}");
        assert_eq!((g.ple, g.moe), (h.ple, h.moe), "{name}");
        assert_eq!(g.double_wide_mlp, h.double_wide_mlp, "{name}");
        assert_eq!(
            (
                g.n_vocab,
                g.d_model,
                g.n_heads,
                g.sliding_window,
                g.context_length
            ),
            (
                h.n_vocab,
                h.d_model,
                h.n_heads,
                h.sliding_window,
                h.context_length
            ),
            "{name}"
        );
        assert_eq!(g.final_logit_softcap, h.final_logit_softcap, "{name}");
    }
}

fn base() -> Value {
    let text = std::fs::read_to_string(dir("dense31b_like").join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn err_with(edit: impl FnOnce(&mut Value)) -> String {
    let mut v = base();
    edit(&mut v);
    let e = Gemma4Config::from_hf_json(&v).unwrap_err();
    assert!(
        matches!(e, Error::Config(_) | Error::Unsupported(_)),
        "unexpected error kind {e:?}"
    );
    e.to_string()
}

/// A change to the base config.
type Edit = Box<dyn FnOnce(&mut Value)>;

#[test]
fn inconsistent_or_unknown_fields_are_clear_errors() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["num_kv_shared_layers"] = json!(8)),
            "num_kv_shared_layers",
        ),
        (
            Box::new(|v| v["num_key_value_heads"] = json!(3)),
            "KV heads",
        ),
        (
            Box::new(|v| v["layer_types"][2] = json!("local")),
            "layer_types[2]",
        ),
        (
            Box::new(|v| v["rope_parameters"]["full_attention"]["rope_type"] = json!("yarn")),
            "rope_type 'yarn'",
        ),
        (
            Box::new(|v| v["enable_moe_block"] = json!(true)),
            "num_experts is missing",
        ),
        (
            Box::new(|v| {
                v["enable_moe_block"] = json!(true);
                v["num_experts"] = json!(4);
                v["top_k_experts"] = json!(5);
                v["moe_intermediate_size"] = json!(8);
            }),
            "top 5",
        ),
        (
            Box::new(|v| {
                v["attention_k_eq_v"] = json!(false);
                v["num_global_key_value_heads"] = json!(1);
            }),
            "num_global_key_value_heads",
        ),
        (
            Box::new(|v| v["per_layer_config"] = json!({"5": {"head_dim": 64, "rope": 1}})),
            "per_layer_config.5.rope",
        ),
        (
            Box::new(|v| v["per_layer_config"] = json!({"9": {"head_dim": 64}})),
            "layer 9",
        ),
        (
            Box::new(|v| v["global_head_dim"] = json!(1024)),
            "head_dim 1024",
        ),
        (
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("model_type");
            }),
            "model_type is missing",
        ),
        (Box::new(|v| v["model_type"] = json!("llama")), "llama"),
        (Box::new(|v| v["hidden_activation"] = json!("silu")), "silu"),
        (
            Box::new(|v| v["hidden_size"] = json!("32")),
            "hidden_size should be",
        ),
    ];
    for (edit, want) in cases {
        let e = err_with(edit);
        assert!(e.contains(want), "error '{e}' should mention '{want}'");
    }
}
