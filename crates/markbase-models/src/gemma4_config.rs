//! Gemma 4 text-decoder hyper-parameters, from a Hugging Face `config.json` or GGUF metadata.
//!
//! See docs/models/gemma4.md §1. Both sources produce a [`Gemma4Config`] in which every layer's
//! geometry is resolved ([`Gemma4Layer`]): attention kind, head dim, KV heads, MLP width, whether
//! it has a V projection, and which layer's KV cache it reads (KV sharing).

use std::path::Path;

use markbase_core::config::{Fields, LayerKind};
use markbase_core::gguf::GgufFile;
use markbase_core::{Error, Result};
use serde_json::{Map, Value};

/// RoPE of one layer type (half-split pairing `(i, i + head_dim/2)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma4Rope {
    /// Base θ.
    pub theta: f64,
    /// Divides every inverse frequency (`rope_parameters.factor`, 1 = none).
    pub factor: f64,
    /// Fraction of the head's pairs that rotate (`partial_rotary_factor` of the "proportional"
    /// type; 1 for "default"). Frequencies are always `θ^(−2i/head_dim)` over the full head.
    pub partial: f64,
}

impl Gemma4Rope {
    /// Pairs that rotate in a head of `head_dim` (HF: `int(partial · head_dim // 2)`).
    pub fn rotated_pairs(&self, head_dim: usize) -> usize {
        ((self.partial * head_dim as f64) as usize / 2).min(head_dim / 2)
    }
}

/// Mixture-of-experts block settings (26B-A4B).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma4Moe {
    /// Experts per layer.
    pub n_experts: usize,
    /// Experts used per token.
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub expert_ff: usize,
}

/// Per-layer embeddings (E2B / E4B).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma4Ple {
    /// Width of one layer's slice (`hidden_size_per_layer_input`).
    pub dim: usize,
    /// Rows of the per-layer embedding table (`vocab_size_per_layer_input`).
    pub vocab: usize,
}

/// The resolved geometry of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemma4Layer {
    /// Sliding-window or full attention.
    pub kind: LayerKind,
    /// Head dimension (`head_dim` on sliding layers, `global_head_dim` on full ones).
    pub head_dim: usize,
    /// KV heads of this layer (of its source layer when KV-shared).
    pub n_kv_heads: usize,
    /// Dense MLP intermediate size (doubled on KV-shared layers with `use_double_wide_mlp`).
    pub n_ff: usize,
    /// Whether the layer has its own `v_proj` (false: V is the raw K projection, k_eq_v).
    pub has_v: bool,
    /// `Some(src)`: a KV-shared layer that reads layer `src`'s cache and owns no K/V weights.
    pub kv_source: Option<usize>,
}

/// Hyper-parameters of a Gemma 4 text decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Config {
    /// Vocabulary size (rows of `embed_tokens`).
    pub n_vocab: usize,
    /// Hidden size D.
    pub d_model: usize,
    /// Query heads (every layer).
    pub n_heads: usize,
    /// Longest context.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Keys a sliding layer sees, the current one included.
    pub sliding_window: usize,
    /// `cap · tanh(logits / cap)` on the final logits, if set.
    pub final_logit_softcap: Option<f64>,
    /// RoPE of sliding layers.
    pub rope_sliding: Gemma4Rope,
    /// RoPE of full layers.
    pub rope_full: Gemma4Rope,
    /// Per-layer embeddings, if the model has them.
    pub ple: Option<Gemma4Ple>,
    /// The MoE block, if every layer has one.
    pub moe: Option<Gemma4Moe>,
    /// Trailing layers that reuse an earlier layer's KV cache.
    pub n_kv_shared: usize,
    /// Whether full layers take V from the K projection.
    pub k_eq_v: bool,
    /// Whether KV-shared layers have a doubled MLP.
    pub double_wide_mlp: bool,
    /// Every layer, resolved.
    pub layers: Vec<Gemma4Layer>,
}

/// Raw per-type settings before the layers are resolved.
struct Raw {
    kinds: Vec<LayerKind>,
    head_dim: usize,
    kv_heads: usize,
    /// Per layer `(head_dim, kv_heads)` overrides (full layers).
    overrides: Vec<Option<(usize, usize)>>,
    n_ff: Vec<usize>,
    n_kv_shared: usize,
    k_eq_v: bool,
    double_wide_mlp: bool,
}

impl Gemma4Config {
    /// Layers that own a KV cache (every layer that is not KV-shared).
    pub fn kv_layers(&self) -> usize {
        self.layers.len() - self.n_kv_shared
    }

    /// Every hyper-parameter as (name, value), for `inspect`.
    pub fn describe(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = vec![
            ("n_vocab".into(), self.n_vocab.to_string()),
            ("d_model".into(), self.d_model.to_string()),
            ("n_layers".into(), self.layers.len().to_string()),
            ("n_heads".into(), self.n_heads.to_string()),
            ("context_length".into(), self.context_length.to_string()),
            ("rms_eps".into(), format!("{:e}", self.rms_eps)),
            ("sliding_window".into(), self.sliding_window.to_string()),
            (
                "final_logit_softcap".into(),
                self.final_logit_softcap
                    .map_or("none".into(), |c| c.to_string()),
            ),
            (
                "rope_sliding".into(),
                format!(
                    "theta {} factor {} partial {}",
                    self.rope_sliding.theta, self.rope_sliding.factor, self.rope_sliding.partial
                ),
            ),
            (
                "rope_full".into(),
                format!(
                    "theta {} factor {} partial {}",
                    self.rope_full.theta, self.rope_full.factor, self.rope_full.partial
                ),
            ),
            ("n_kv_shared_layers".into(), self.n_kv_shared.to_string()),
            ("attention_k_eq_v".into(), self.k_eq_v.to_string()),
            ("double_wide_mlp".into(), self.double_wide_mlp.to_string()),
            (
                "per_layer_input".into(),
                self.ple.map_or("none".into(), |p| {
                    format!("dim {} vocab {}", p.dim, p.vocab)
                }),
            ),
            (
                "moe".into(),
                self.moe.map_or("none".into(), |m| {
                    format!(
                        "{} experts, top {}, expert ff {}",
                        m.n_experts, m.top_k, m.expert_ff
                    )
                }),
            ),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            let kind = match l.kind {
                LayerKind::Sliding => "sliding",
                LayerKind::Full => "full",
            };
            let shared = l
                .kv_source
                .map_or(String::new(), |s| format!(", KV from layer {s}"));
            let v_proj = if l.has_v || l.kv_source.is_some() {
                ""
            } else {
                ", k_eq_v"
            };
            v.push((
                format!("layer.{i}"),
                format!(
                    "{kind}, head_dim {}, kv_heads {}, ff {}{v_proj}{shared}",
                    l.head_dim, l.n_kv_heads, l.n_ff
                ),
            ));
        }
        v
    }

    /// Reads a Hugging Face `config.json` file (see [`Gemma4Config::from_hf_json`]).
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: invalid JSON: {e}", path.display())))?;
        Self::from_hf_json(&value).map_err(|e| match e {
            Error::Config(msg) => Error::Config(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Whether a parsed `config.json` describes a Gemma 4 model (`model_type` `gemma4`,
    /// `gemma4_text`, `gemma4_unified` or `gemma4_unified_text`).
    pub fn is_gemma4_json(root: &Value) -> bool {
        matches!(
            root.get("model_type").and_then(Value::as_str),
            Some("gemma4" | "gemma4_text" | "gemma4_unified" | "gemma4_unified_text")
        )
    }

    /// Reads a parsed `config.json`: `gemma4` / `gemma4_unified` with the text model in
    /// `text_config`, or a flat `gemma4_text` / `gemma4_unified_text`. Accepts both the
    /// `global_head_dim` / `num_global_key_value_heads` form and the `per_layer_config` form
    /// (which wins when present).
    pub fn from_hf_json(root: &Value) -> Result<Self> {
        let root = root
            .as_object()
            .ok_or_else(|| Error::Config("config.json is not a JSON object".into()))?;
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text = match model_type {
            "gemma4_text" | "gemma4_unified_text" => root,
            "gemma4" | "gemma4_unified" => match root.get("text_config") {
                Some(Value::Object(t)) => t,
                Some(_) => return Err(Error::Config("text_config is not an object".into())),
                None => {
                    return Err(Error::Config(format!(
                        "model_type {model_type} without a text_config"
                    )))
                }
            },
            "" => return Err(Error::Config("model_type is missing".into())),
            other => {
                return Err(Error::Unsupported(format!(
                    "architecture '{other}' (expected a gemma4 config)"
                )))
            }
        };
        if let Some(t) = text.get("model_type").and_then(Value::as_str) {
            if !matches!(t, "gemma4_text" | "gemma4_unified_text") {
                return Err(Error::Config(format!(
                    "text_config.model_type is '{t}', expected gemma4_text or gemma4_unified_text"
                )));
            }
        }
        let f = Fields(text);
        let n_layers = f.usize("num_hidden_layers", 0)?;
        let act = f.str("hidden_activation", "gelu_pytorch_tanh")?;
        if act != "gelu_pytorch_tanh" && act != "gelu_tanh" {
            return Err(Error::Unsupported(format!(
                "hidden_activation '{act}' (Gemma 4 uses gelu_pytorch_tanh)"
            )));
        }
        if f.bool("attention_bias", false)? {
            return Err(Error::Unsupported("attention_bias true".into()));
        }
        if f.str("use_bidirectional_attention", "")? == "all" {
            return Err(Error::Unsupported(
                "use_bidirectional_attention \"all\" (non-causal text model)".into(),
            ));
        }
        let kinds = match text.get("layer_types") {
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(Error::Config(format!(
                        "layer_types[{i}] is {v}, expected \"sliding_attention\" or \"full_attention\""
                    ))),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(Value::Null) | None => (0..n_layers)
                .map(|i| {
                    if (i + 1) % 6 == 0 || i + 1 == n_layers {
                        LayerKind::Full
                    } else {
                        LayerKind::Sliding
                    }
                })
                .collect(),
            Some(other) => {
                return Err(Error::Config(format!(
                    "layer_types should be a list, is {other}"
                )))
            }
        };
        let head_dim = f.usize("head_dim", 256)?;
        let kv_heads = f.usize("num_key_value_heads", 0)?;
        let k_eq_v = f.bool("attention_k_eq_v", false)?;
        let overrides = hf_overrides(text, &kinds, head_dim, kv_heads, k_eq_v)?;
        let double_wide_mlp = f.bool("use_double_wide_mlp", false)?;
        let n_ff = vec![f.usize("intermediate_size", 0)?; kinds.len()];
        // The unified (12B) text config has no per-layer-input fields; gemma4_text defaults to 256.
        let unified = model_type.starts_with("gemma4_unified");
        let ple_dim = f.usize("hidden_size_per_layer_input", if unified { 0 } else { 256 })?;
        let ple = (ple_dim > 0)
            .then(|| -> Result<Gemma4Ple> {
                Ok(Gemma4Ple {
                    dim: ple_dim,
                    vocab: f.usize("vocab_size_per_layer_input", 262_144)?,
                })
            })
            .transpose()?;
        let moe = if f.bool("enable_moe_block", false)? {
            Some(Gemma4Moe {
                n_experts: f.require_usize("num_experts")?,
                top_k: f.require_usize("top_k_experts")?,
                expert_ff: f.require_usize("moe_intermediate_size")?,
            })
        } else {
            None
        };
        let rope = hf_rope(text)?;
        let raw = Raw {
            kinds,
            head_dim,
            kv_heads,
            overrides,
            n_ff,
            n_kv_shared: f.usize("num_kv_shared_layers", 0)?,
            k_eq_v,
            double_wide_mlp,
        };
        let tie = match root.get("tie_word_embeddings") {
            Some(v) if !v.is_null() => Fields(root).bool("tie_word_embeddings", true)?,
            _ => f.bool("tie_word_embeddings", true)?,
        };
        if !tie {
            return Err(Error::Unsupported(
                "tie_word_embeddings false (Gemma 4 ties the LM head to the embedding)".into(),
            ));
        }
        Self::build(
            Gemma4Config {
                n_vocab: f.usize("vocab_size", 262_144)?,
                d_model: f.usize("hidden_size", 0)?,
                n_heads: f.usize("num_attention_heads", 0)?,
                context_length: f.usize("max_position_embeddings", 131_072)?,
                rms_eps: f.f64("rms_norm_eps", 1e-6)?,
                sliding_window: f.usize("sliding_window", 512)?,
                final_logit_softcap: f.opt_f64("final_logit_softcapping")?,
                rope_sliding: rope.0,
                rope_full: rope.1,
                ple,
                moe,
                n_kv_shared: 0,
                k_eq_v,
                double_wide_mlp,
                layers: Vec::new(),
            },
            raw,
        )
    }

    /// Reads `gemma4.*` metadata of a GGUF file (gemma4.md §6.3). The vocabulary size is the
    /// second dimension of `token_embd.weight`; whether full layers lack `attn_v` (k_eq_v) and
    /// how many pairs proportional RoPE turns (leading 1.0 entries of `rope_freqs`) are read
    /// from the tensors.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.architecture()?;
        if arch != "gemma4" {
            return Err(Error::Unsupported(format!(
                "architecture '{arch}' (expected gemma4) in {}",
                file.path().display()
            )));
        }
        Self::from_gguf_inner(file).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", file.path().display())),
            other => other,
        })
    }

    fn from_gguf_inner(file: &GgufFile) -> Result<Self> {
        let key = |k: &str| format!("gemma4.{k}");
        let req = |k: &str| -> Result<usize> { Ok(file.require_u64(&key(k))? as usize) };
        let opt =
            |k: &str| -> Result<Option<usize>> { Ok(file.get_u64(&key(k))?.map(|v| v as usize)) };
        let n_layers = req("block_count")?;
        let n_heads = req("attention.head_count")?;
        // A scalar, or one value per layer.
        let per_layer = |k: &str| -> Result<Option<Vec<usize>>> {
            if let Some(a) = file.get(&key(k)).and_then(|v| v.as_array()) {
                let v = a
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .map(|u| u as usize)
                            .ok_or_else(|| Error::Config(format!("gemma4.{k} holds a non-integer")))
                    })
                    .collect::<Result<Vec<_>>>()?;
                if v.len() != n_layers {
                    return Err(Error::Config(format!(
                        "gemma4.{k} has {} entries for {n_layers} layers",
                        v.len()
                    )));
                }
                return Ok(Some(v));
            }
            Ok(file.get_u64(&key(k))?.map(|s| vec![s as usize; n_layers]))
        };
        let kinds: Vec<LayerKind> = match file
            .get_array(&key("attention.sliding_window_pattern"))?
        {
            Some(a) => {
                if a.len() != n_layers {
                    return Err(Error::Config(format!(
                        "gemma4.attention.sliding_window_pattern has {} entries for {n_layers} layers",
                        a.len()
                    )));
                }
                a.iter()
                    .map(|b| match b.as_bool() {
                        Some(true) => Ok(LayerKind::Sliding),
                        Some(false) => Ok(LayerKind::Full),
                        None => Err(Error::Config(
                            "gemma4.attention.sliding_window_pattern holds a non-boolean".into(),
                        )),
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                return Err(Error::Config(
                    "gemma4.attention.sliding_window_pattern is missing".into(),
                ))
            }
        };
        let head_dim_full = req("attention.key_length")?;
        let head_dim = opt("attention.key_length_swa")?.unwrap_or(head_dim_full);
        for (k, want) in [
            ("attention.value_length", head_dim_full),
            ("attention.value_length_swa", head_dim),
        ] {
            if let Some(v) = opt(k)? {
                if v != want {
                    return Err(Error::Config(format!(
                        "gemma4.{k} {v} differs from the key length {want}"
                    )));
                }
            }
        }
        let kv = per_layer("attention.head_count_kv")?.unwrap_or(vec![n_heads; n_layers]);
        let n_ff = per_layer("feed_forward_length")?
            .ok_or_else(|| Error::Config("gemma4.feed_forward_length is missing".into()))?;
        let kv_sliding = kinds
            .iter()
            .zip(&kv)
            .find(|(k, _)| **k == LayerKind::Sliding)
            .map_or(kv[0], |(_, &v)| v);
        let k_eq_v = kinds.iter().enumerate().any(|(i, k)| {
            *k == LayerKind::Full
                && file.tensor(&format!("blk.{i}.attn_v.weight")).is_none()
                && file.tensor(&format!("blk.{i}.attn_k.weight")).is_some()
        });
        let overrides = kinds
            .iter()
            .zip(&kv)
            .map(|(k, &h)| (*k == LayerKind::Full).then_some((head_dim_full, h)))
            .collect();
        let n_kv_shared = opt("attention.shared_kv_layers")?.unwrap_or(0);
        // With double-wide MLP the per-layer widths already hold the doubled values.
        let ple_dim = opt("embedding_length_per_layer_input")?.unwrap_or(0);
        let ple = if ple_dim > 0 {
            let t = file
                .tensor("per_layer_token_embd.weight")
                .ok_or_else(|| Error::MissingTensor("per_layer_token_embd.weight".into()))?;
            if t.dims.len() != 2 {
                return Err(Error::BadTensor {
                    name: "per_layer_token_embd.weight".into(),
                    problem: format!("{} dimensions, expected 2", t.dims.len()),
                });
            }
            Some(Gemma4Ple {
                dim: ple_dim,
                vocab: t.dims[1] as usize,
            })
        } else {
            None
        };
        let moe = match opt("expert_count")? {
            Some(e) if e > 0 => Some(Gemma4Moe {
                n_experts: e,
                top_k: req("expert_used_count")?,
                expert_ff: req("expert_feed_forward_length")?,
            }),
            _ => None,
        };
        let partial = match file.tensor("rope_freqs.weight") {
            None => 1.0,
            Some(t) => {
                let mut f = vec![0f32; t.n_elements() as usize];
                markbase_core::quant::dequantize_row(t.dtype, file.tensor_data(t), &mut f)
                    .map_err(|e| Error::BadTensor {
                        name: "rope_freqs.weight".into(),
                        problem: e.to_string(),
                    })?;
                let ones = f.iter().take_while(|&&v| v == 1.0).count();
                if f[ones..].iter().any(|&v| v < 1e20) || f.len() * 2 != head_dim_full {
                    return Err(Error::Unsupported(format!(
                        "rope_freqs of {} entries other than 1.0 then ≥1e20 for head_dim {head_dim_full}",
                        f.len()
                    )));
                }
                ones as f64 * 2.0 / head_dim_full as f64
            }
        };
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::MissingTensor("token_embd.weight".into()))?;
        let d_model = req("embedding_length")?;
        if embd.dims.len() != 2 || embd.dims[0] as usize != d_model {
            return Err(Error::BadTensor {
                name: "token_embd.weight".into(),
                problem: format!("shape {:?}, expected {{{d_model}, n_vocab}}", embd.dims),
            });
        }
        let raw = Raw {
            kinds,
            head_dim,
            kv_heads: kv_sliding,
            overrides,
            n_ff,
            n_kv_shared,
            k_eq_v,
            double_wide_mlp: false,
        };
        let cfg = Gemma4Config {
            n_vocab: embd.dims[1] as usize,
            d_model,
            n_heads,
            context_length: req("context_length")?,
            rms_eps: file
                .get_f64(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            sliding_window: req("attention.sliding_window")?,
            final_logit_softcap: file.get_f64(&key("final_logit_softcapping"))?,
            rope_sliding: Gemma4Rope {
                theta: file
                    .get_f64(&key("rope.freq_base_swa"))?
                    .unwrap_or(10_000.0),
                factor: 1.0,
                partial: 1.0,
            },
            rope_full: Gemma4Rope {
                theta: file.get_f64(&key("rope.freq_base"))?.unwrap_or(1e6),
                factor: 1.0,
                partial,
            },
            ple,
            moe,
            n_kv_shared: 0,
            k_eq_v,
            double_wide_mlp: false,
            layers: Vec::new(),
        };
        let mut cfg = Self::build(cfg, raw)?;
        let shared = cfg.kv_layers();
        cfg.double_wide_mlp = cfg.n_kv_shared > 0
            && cfg.layers[shared..]
                .iter()
                .all(|l| l.n_ff == 2 * cfg.layers[0].n_ff);
        Ok(cfg)
    }

    /// Resolves every layer from the raw settings and checks the whole.
    fn build(mut cfg: Gemma4Config, raw: Raw) -> Result<Self> {
        let n = raw.kinds.len();
        let err = |m: String| Err(Error::Config(m));
        if raw.n_kv_shared >= n && n > 0 {
            return err(format!(
                "num_kv_shared_layers {} leaves no KV-producing layer of {n}",
                raw.n_kv_shared
            ));
        }
        let first_shared = n - raw.n_kv_shared;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let kind = raw.kinds[i];
            let (head_dim, n_kv_heads) = raw.overrides[i].unwrap_or((raw.head_dim, raw.kv_heads));
            let kv_source = if i >= first_shared {
                let src = (0..first_shared).rev().find(|&j| raw.kinds[j] == kind);
                match src {
                    Some(s) => Some(s),
                    None => {
                        return err(format!(
                            "KV-shared layer {i} has no earlier non-shared layer of its type"
                        ))
                    }
                }
            } else {
                None
            };
            let wide = raw.double_wide_mlp && kv_source.is_some();
            layers.push(Gemma4Layer {
                kind,
                head_dim,
                n_kv_heads,
                n_ff: if wide { raw.n_ff[i] * 2 } else { raw.n_ff[i] },
                has_v: kv_source.is_none() && !(raw.k_eq_v && kind == LayerKind::Full),
                kv_source,
            });
        }
        // A shared layer reads its source's cache, so the geometry must agree.
        for i in first_shared..n {
            let src = layers[layers[i].kv_source.unwrap_or(i)];
            if (src.head_dim, src.n_kv_heads) != (layers[i].head_dim, layers[i].n_kv_heads) {
                return err(format!(
                    "KV-shared layer {i} has head_dim {} / {} KV heads but its source has {} / {}",
                    layers[i].head_dim, layers[i].n_kv_heads, src.head_dim, src.n_kv_heads
                ));
            }
        }
        cfg.layers = layers;
        cfg.n_kv_shared = raw.n_kv_shared;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the hyper-parameters against each other.
    fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(m));
        for (name, v) in [
            ("vocab_size", self.n_vocab),
            ("hidden_size", self.d_model),
            ("num_hidden_layers", self.layers.len()),
            ("num_attention_heads", self.n_heads),
            ("max_position_embeddings", self.context_length),
            ("sliding_window", self.sliding_window),
        ] {
            if v == 0 {
                return err(format!("{name} is 0 or missing"));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.n_kv_heads == 0 || !self.n_heads.is_multiple_of(l.n_kv_heads) {
                return err(format!(
                    "layer {i}: {} attention heads are not a multiple of {} KV heads",
                    self.n_heads, l.n_kv_heads
                ));
            }
            if l.head_dim == 0 || l.head_dim % 2 != 0 || l.head_dim > 512 {
                return err(format!(
                    "layer {i}: head_dim {} must be even, non-zero and at most 512",
                    l.head_dim
                ));
            }
            if l.n_ff == 0 {
                return err(format!("layer {i}: intermediate size is 0"));
            }
        }
        for (name, r) in [("sliding", self.rope_sliding), ("full", self.rope_full)] {
            let ok = r.theta > 0.0 && r.factor > 0.0 && r.partial > 0.0 && r.partial <= 1.0;
            if !ok {
                return err(format!(
                    "{name} RoPE theta {} / factor {} / partial_rotary_factor {} out of range",
                    r.theta, r.factor, r.partial
                ));
            }
        }
        if let Some(m) = self.moe {
            if m.n_experts == 0 || m.top_k == 0 || m.top_k > m.n_experts || m.expert_ff == 0 {
                return err(format!(
                    "MoE with {} experts, top {}, expert size {} is inconsistent",
                    m.n_experts, m.top_k, m.expert_ff
                ));
            }
        }
        if let Some(p) = self.ple {
            if p.vocab == 0 {
                return err("vocab_size_per_layer_input is 0 with per-layer inputs".into());
            }
        }
        if let Some(c) = self.final_logit_softcap {
            if c.is_nan() || c <= 0.0 {
                return err(format!("final_logit_softcapping {c} must be positive"));
            }
        }
        if self.rms_eps.is_nan() || self.rms_eps < 0.0 {
            return err(format!("rms_norm_eps {} is negative", self.rms_eps));
        }
        Ok(())
    }
}

/// Per-layer `(head_dim, kv_heads)` of full layers from `per_layer_config` (wins) or
/// `global_head_dim` / `num_global_key_value_heads`.
fn hf_overrides(
    text: &Map<String, Value>,
    kinds: &[LayerKind],
    head_dim: usize,
    kv_heads: usize,
    k_eq_v: bool,
) -> Result<Vec<Option<(usize, usize)>>> {
    let f = Fields(text);
    match text.get("per_layer_config") {
        Some(Value::Object(map)) => {
            let mut out = vec![None; kinds.len()];
            for (k, v) in map {
                let i: usize = k.parse().map_err(|_| {
                    Error::Config(format!("per_layer_config key '{k}' is not a layer index"))
                })?;
                if i >= kinds.len() {
                    return Err(Error::Config(format!(
                        "per_layer_config names layer {i} of {}",
                        kinds.len()
                    )));
                }
                let o = v.as_object().ok_or_else(|| {
                    Error::Config(format!("per_layer_config.{k} should be an object, is {v}"))
                })?;
                if let Some(bad) = o
                    .keys()
                    .find(|k| !matches!(k.as_str(), "head_dim" | "num_key_value_heads"))
                {
                    return Err(Error::Config(format!(
                        "per_layer_config.{k}.{bad} is not a known per-layer setting"
                    )));
                }
                let lf = Fields(o);
                out[i] = Some((
                    lf.usize("head_dim", head_dim)?,
                    lf.usize("num_key_value_heads", kv_heads)?,
                ));
            }
            Ok(out)
        }
        Some(Value::Null) | None => {
            let global_hd = f.usize("global_head_dim", 512)?;
            let global_kv = match f.get("num_global_key_value_heads") {
                None => kv_heads,
                Some(_) => {
                    let g = f.usize("num_global_key_value_heads", kv_heads)?;
                    if !k_eq_v && g != kv_heads {
                        return Err(Error::Config(format!(
                            "num_global_key_value_heads {g} only applies with attention_k_eq_v (which is false)"
                        )));
                    }
                    g
                }
            };
            Ok(kinds
                .iter()
                .map(|k| (*k == LayerKind::Full).then_some((global_hd, global_kv)))
                .collect())
        }
        Some(other) => Err(Error::Config(format!(
            "per_layer_config should be an object, is {other}"
        ))),
    }
}

/// `(sliding, full)` RoPE from `rope_parameters` keyed by layer type.
fn hf_rope(text: &Map<String, Value>) -> Result<(Gemma4Rope, Gemma4Rope)> {
    let params = match text.get("rope_parameters") {
        Some(Value::Object(p)) => Some(p),
        Some(Value::Null) | None => None,
        Some(other) => {
            return Err(Error::Config(format!(
                "rope_parameters should be an object, is {other}"
            )))
        }
    };
    let one = |kind: &str, theta: f64, default_type: &'static str| -> Result<Gemma4Rope> {
        let o = match params.and_then(|p| p.get(kind)) {
            Some(Value::Object(o)) => o,
            Some(Value::Null) | None => {
                return Ok(Gemma4Rope {
                    theta,
                    factor: 1.0,
                    partial: if default_type == "proportional" {
                        0.25
                    } else {
                        1.0
                    },
                })
            }
            Some(other) => {
                return Err(Error::Config(format!(
                    "rope_parameters.{kind} should be an object, is {other}"
                )))
            }
        };
        let f = Fields(o);
        let ctx = |e: Error| match e {
            Error::Config(m) => Error::Config(format!("rope_parameters.{kind}: {m}")),
            other => other,
        };
        let ty = f.str("rope_type", default_type).map_err(ctx)?;
        let partial = f.f64("partial_rotary_factor", 1.0).map_err(ctx)?;
        let partial = match ty.as_str() {
            "proportional" => partial,
            "default" if partial == 1.0 => 1.0,
            other => {
                return Err(Error::Unsupported(format!(
                "rope_parameters.{kind}: rope_type '{other}' with partial_rotary_factor {partial}"
            )))
            }
        };
        Ok(Gemma4Rope {
            theta: f.f64("rope_theta", theta).map_err(ctx)?,
            factor: f.f64("factor", 1.0).map_err(ctx)?,
            partial,
        })
    };
    Ok((
        one("sliding_attention", 10_000.0, "default")?,
        one("full_attention", 1_000_000.0, "proportional")?,
    ))
}
