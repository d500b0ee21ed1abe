//! Model hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.
//!
//! Gemma 3 text models only for now (see docs/models/gemma3.md §1). Both sources produce the same
//! [`Gemma3Config`]; HF class defaults are applied to fields a released config omits.

use std::path::Path;

use serde_json::{Map, Value};

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// Which attention a layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Causal attention over a window of `sliding_window` keys (the current token included).
    Sliding,
    /// Causal attention over the whole context.
    Full,
}

/// Rotary position embedding of one layer kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base θ.
    pub theta: f64,
    /// Linear scaling factor (positions are divided by it); 1 means none.
    pub linear_factor: f64,
}

/// Gemma 3 text-model hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// Rows of the embedding matrix (= logits per token).
    pub n_vocab: usize,
    /// Hidden size D.
    pub d_model: usize,
    /// Number of decoder layers.
    pub n_layers: usize,
    /// MLP intermediate size.
    pub n_ff: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA groups).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Keys seen by a sliding layer, the current one included.
    pub sliding_window: usize,
    /// Attention kind of every layer.
    pub layer_kinds: Vec<LayerKind>,
    /// RoPE of full-attention layers.
    pub rope_global: RopeConfig,
    /// RoPE of sliding layers.
    pub rope_local: RopeConfig,
    /// Attention scores are multiplied by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f64,
    /// Final logit softcap, if any (none for released Gemma 3).
    pub final_logit_softcap: Option<f64>,
    /// Attention-score softcap, if any (none for released Gemma 3).
    pub attn_logit_softcap: Option<f64>,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_embeddings: bool,
}

impl Gemma3Config {
    /// The attention-score scale `query_pre_attn_scalar^-0.5`.
    pub fn attn_scale(&self) -> f32 {
        (1.0 / self.query_pre_attn_scalar.sqrt()) as f32
    }

    /// Layer `i`'s attention kind.
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        self.layer_kinds[i]
    }

    /// Name/value pairs of every hyper-parameter, for `inspect`.
    pub fn describe(&self) -> Vec<(String, String)> {
        let kinds: String = self
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Sliding => 'S',
                LayerKind::Full => 'F',
            })
            .collect();
        let rope = |r: &RopeConfig| {
            if r.linear_factor == 1.0 {
                format!("theta {}", r.theta)
            } else {
                format!("theta {}, linear x{}", r.theta, r.linear_factor)
            }
        };
        let opt = |v: Option<f64>| v.map_or("none".to_string(), |v| v.to_string());
        vec![
            ("vocab".into(), self.n_vocab.to_string()),
            ("d_model".into(), self.d_model.to_string()),
            ("layers".into(), self.n_layers.to_string()),
            ("ffn".into(), self.n_ff.to_string()),
            ("heads".into(), self.n_heads.to_string()),
            ("kv_heads".into(), self.n_kv_heads.to_string()),
            ("head_dim".into(), self.head_dim.to_string()),
            ("context_length".into(), self.context_length.to_string()),
            ("rms_eps".into(), self.rms_eps.to_string()),
            ("sliding_window".into(), self.sliding_window.to_string()),
            ("layer_kinds".into(), kinds),
            ("rope_global".into(), rope(&self.rope_global)),
            ("rope_local".into(), rope(&self.rope_local)),
            (
                "query_pre_attn_scalar".into(),
                self.query_pre_attn_scalar.to_string(),
            ),
            ("final_logit_softcap".into(), opt(self.final_logit_softcap)),
            ("attn_logit_softcap".into(), opt(self.attn_logit_softcap)),
            ("tie_embeddings".into(), self.tie_embeddings.to_string()),
        ]
    }

    /// Reads `gemma3.*` metadata of a GGUF file (architecture must be `gemma3`).
    ///
    /// The vocabulary size is the second dimension of `token_embd.weight`; the 5:1 layer
    /// pattern, local θ 10 000 and the attention scale (27B rule: `D/H` for 62 layers, else
    /// head_dim) are not stored in GGUF and follow llama.cpp.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.architecture()?;
        if arch != "gemma3" {
            return Err(Error::Unsupported(format!(
                "architecture '{arch}' (expected gemma3) in {}",
                file.path().display()
            )));
        }
        let key = |k: &str| format!("gemma3.{k}");
        let req = |k: &str| -> Result<usize> { Ok(file.require_u64(&key(k))? as usize) };
        let d_model = req("embedding_length")?;
        let n_layers = req("block_count")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = match file.get_u64(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_heads,
        };
        let head_dim = match file.get_u64(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_heads > 0 => d_model / n_heads,
            None => 0,
        };
        if let Some(v) = file.get_u64(&key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(Error::Config(format!(
                    "{}: attention.value_length {v} differs from key_length {head_dim}",
                    file.path().display()
                )));
            }
        }
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| Error::MissingTensor("token_embd.weight".into()))?;
        if embd.dims.len() != 2 || embd.dims[0] as usize != d_model {
            return Err(Error::BadTensor {
                name: "token_embd.weight".into(),
                problem: format!("shape {:?}, expected {{{d_model}, n_vocab}}", embd.dims),
            });
        }
        if let Some(tokens) = file.get_array("tokenizer.ggml.tokens")? {
            if tokens.len() as u64 > embd.dims[1] {
                return Err(Error::Config(format!(
                    "{}: {} tokenizer tokens but token_embd.weight has only {} rows",
                    file.path().display(),
                    tokens.len(),
                    embd.dims[1]
                )));
            }
        }
        let scaling = match file.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => 1.0,
            Some("linear") => file.get_f64(&key("rope.scaling.factor"))?.ok_or_else(|| {
                Error::Config("gemma3.rope.scaling.type is linear but no factor".into())
            })?,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "gemma3 RoPE scaling type '{other}'"
                )))
            }
        };
        let query_pre_attn_scalar = if n_layers == 62 && n_heads > 0 {
            (d_model / n_heads) as f64
        } else {
            head_dim as f64
        };
        let cfg = Gemma3Config {
            n_vocab: embd.dims[1] as usize,
            d_model,
            n_layers,
            n_ff: req("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            context_length: req("context_length")?,
            rms_eps: file
                .get_f64(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            sliding_window: req("attention.sliding_window")?,
            layer_kinds: pattern_kinds(n_layers, 6),
            rope_global: RopeConfig {
                theta: file.get_f64(&key("rope.freq_base"))?.unwrap_or(1e6),
                linear_factor: scaling,
            },
            rope_local: RopeConfig {
                theta: 10_000.0,
                linear_factor: 1.0,
            },
            query_pre_attn_scalar,
            final_logit_softcap: file.get_f64(&key("final_logit_softcapping"))?,
            attn_logit_softcap: file.get_f64(&key("attn_logit_softcapping"))?,
            tie_embeddings: file.tensor("output.weight").is_none(),
        };
        cfg.validate()
            .map_err(|e| Error::Config(format!("{}: {e}", file.path().display())))?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json` file (see [`Gemma3Config::from_hf_json`]).
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: invalid JSON: {e}", path.display())))?;
        Self::from_hf_json(&value).map_err(|e| match e {
            Error::Config(msg) => Error::Config(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Reads a parsed `config.json`: `model_type` `gemma3_text`, or `gemma3` with the text
    /// model in `text_config`. Accepts `layer_types` or the 6-layer pattern, and RoPE settings
    /// as `rope_parameters` (per layer type or flat), `rope_theta` / `rope_local_base_freq`,
    /// and `rope_scaling`, in any mix.
    pub fn from_hf_json(root: &Value) -> Result<Self> {
        let root = root
            .as_object()
            .ok_or_else(|| Error::Config("config.json is not a JSON object".into()))?;
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text = match model_type {
            "gemma3_text" => root,
            "gemma3" => match root.get("text_config") {
                Some(Value::Object(t)) => t,
                Some(_) => return Err(Error::Config("text_config is not an object".into())),
                None => {
                    return Err(Error::Config(
                        "model_type gemma3 without a text_config".into(),
                    ))
                }
            },
            "" => return Err(Error::Config("model_type is missing".into())),
            other => {
                return Err(Error::Unsupported(format!(
                    "architecture '{other}' (MarkBase reads gemma3 and gemma3_text configs)"
                )))
            }
        };
        let f = Fields(text);
        let n_layers = f.usize("num_hidden_layers", 26)?;
        let n_heads = f.usize("num_attention_heads", 8)?;
        let act = f.str("hidden_activation", "gelu_pytorch_tanh")?;
        if act != "gelu_pytorch_tanh" && act != "gelu_tanh" {
            return Err(Error::Unsupported(format!(
                "hidden_activation '{act}' (Gemma 3 uses gelu_pytorch_tanh)"
            )));
        }
        let layer_kinds = match text.get("layer_types") {
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
            Some(Value::Null) | None => {
                let pattern = match text.get("sliding_window_pattern") {
                    Some(v) if !v.is_null() => f.usize("sliding_window_pattern", 6)?,
                    _ => f.usize("_sliding_window_pattern", 6)?,
                };
                if pattern == 0 {
                    return Err(Error::Config("sliding_window_pattern is 0".into()));
                }
                pattern_kinds(n_layers, pattern)
            }
            Some(other) => {
                return Err(Error::Config(format!(
                    "layer_types should be a list, is {other}"
                )))
            }
        };
        let (rope_global, rope_local) = hf_rope(text)?;
        let cfg = Gemma3Config {
            n_vocab: f.usize("vocab_size", 262_208)?,
            d_model: f.usize("hidden_size", 2304)?,
            n_layers,
            n_ff: f.usize("intermediate_size", 9216)?,
            n_heads,
            n_kv_heads: f.usize("num_key_value_heads", 4)?,
            head_dim: f.usize("head_dim", 256)?,
            context_length: f.usize("max_position_embeddings", 131_072)?,
            rms_eps: f.f64("rms_norm_eps", 1e-6)?,
            sliding_window: f.usize("sliding_window", 4096)?,
            layer_kinds,
            rope_global,
            rope_local,
            query_pre_attn_scalar: f.f64("query_pre_attn_scalar", 256.0)?,
            final_logit_softcap: f.opt_f64("final_logit_softcapping")?,
            attn_logit_softcap: f.opt_f64("attn_logit_softcapping")?,
            tie_embeddings: match root.get("tie_word_embeddings") {
                Some(v) if !v.is_null() => Fields(root).bool("tie_word_embeddings", true)?,
                _ => f.bool("tie_word_embeddings", true)?,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the hyper-parameters against each other.
    fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(m));
        for (name, v) in [
            ("vocabulary size", self.n_vocab),
            ("hidden size", self.d_model),
            ("layer count", self.n_layers),
            ("intermediate size", self.n_ff),
            ("head count", self.n_heads),
            ("KV head count", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("context length", self.context_length),
            ("sliding window", self.sliding_window),
        ] {
            if v == 0 {
                return err(format!("{name} is 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return err(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > 512 {
            return err(format!(
                "head_dim {} must be even and at most 512",
                self.head_dim
            ));
        }
        if self.layer_kinds.len() != self.n_layers {
            return err(format!(
                "{} layer types listed for {} layers",
                self.layer_kinds.len(),
                self.n_layers
            ));
        }
        if self.query_pre_attn_scalar.is_nan() || self.query_pre_attn_scalar <= 0.0 {
            return err(format!(
                "query_pre_attn_scalar {} must be positive",
                self.query_pre_attn_scalar
            ));
        }
        for (name, r) in [("global", self.rope_global), ("local", self.rope_local)] {
            if r.theta.is_nan()
                || r.theta <= 0.0
                || r.linear_factor.is_nan()
                || r.linear_factor <= 0.0
            {
                return err(format!(
                    "{name} RoPE theta {} / factor {} must be positive",
                    r.theta, r.linear_factor
                ));
            }
        }
        if self.rms_eps.is_nan() || self.rms_eps < 0.0 {
            return err(format!("rms_norm_eps {} is negative", self.rms_eps));
        }
        Ok(())
    }
}

/// Layer `i` is full attention iff `(i + 1) % pattern == 0`.
fn pattern_kinds(n_layers: usize, pattern: usize) -> Vec<LayerKind> {
    (0..n_layers)
        .map(|i| {
            if (i + 1).is_multiple_of(pattern) {
                LayerKind::Full
            } else {
                LayerKind::Sliding
            }
        })
        .collect()
}

/// Global and local RoPE from every config form of gemma3.md §1.4.
fn hf_rope(text: &Map<String, Value>) -> Result<(RopeConfig, RopeConfig)> {
    let f = Fields(text);
    let params = match text.get("rope_parameters") {
        Some(Value::Object(p)) => Some(p),
        Some(Value::Null) | None => None,
        Some(other) => {
            return Err(Error::Config(format!(
                "rope_parameters should be an object, is {other}"
            )))
        }
    };
    // Per-layer-type form, or a flat form that applies to the global layers.
    let (full, sliding) = match params {
        Some(p) if p.contains_key("full_attention") || p.contains_key("sliding_attention") => {
            let get = |k: &str| match p.get(k) {
                Some(Value::Object(o)) => Ok(Some(o)),
                Some(Value::Null) | None => Ok(None),
                Some(other) => Err(Error::Config(format!(
                    "rope_parameters.{k} should be an object, is {other}"
                ))),
            };
            (get("full_attention")?, get("sliding_attention")?)
        }
        Some(p) => (Some(p), None),
        None => (None, None),
    };
    let theta_of = |o: Option<&Map<String, Value>>, what: &str| -> Result<Option<f64>> {
        match o {
            Some(o) => Fields(o).opt_f64("rope_theta").map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("rope_parameters.{what}: {m}")),
                other => other,
            }),
            None => Ok(None),
        }
    };
    let global_theta = match theta_of(full, "full_attention")? {
        Some(t) => t,
        None => f.f64("rope_theta", 1e6)?,
    };
    let local_theta = match theta_of(sliding, "sliding_attention")? {
        Some(t) => t,
        None => f.f64("rope_local_base_freq", 10_000.0)?,
    };
    let scaling_obj = match full {
        Some(o) if o.contains_key("rope_type") || o.contains_key("type") => Some(o),
        _ => match text.get("rope_scaling") {
            Some(Value::Object(o)) => Some(o),
            Some(Value::Null) | None => None,
            Some(other) => {
                return Err(Error::Config(format!(
                    "rope_scaling should be an object or null, is {other}"
                )))
            }
        },
    };
    let global_factor = linear_factor(scaling_obj, "global")?;
    let local_factor = linear_factor(sliding, "sliding_attention")?;
    Ok((
        RopeConfig {
            theta: global_theta,
            linear_factor: global_factor,
        },
        RopeConfig {
            theta: local_theta,
            linear_factor: local_factor,
        },
    ))
}

/// The linear factor of a RoPE scaling object (`default` -> 1).
fn linear_factor(obj: Option<&Map<String, Value>>, what: &str) -> Result<f64> {
    let Some(o) = obj else { return Ok(1.0) };
    let ty = o
        .get("rope_type")
        .or_else(|| o.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match ty {
        "default" => Ok(1.0),
        "linear" => Fields(o).f64("factor", f64::NAN).and_then(|v| {
            if v.is_nan() {
                Err(Error::Config(format!(
                    "{what} RoPE scaling is linear but has no factor"
                )))
            } else {
                Ok(v)
            }
        }),
        other => Err(Error::Unsupported(format!(
            "{what} RoPE scaling type '{other}' (Gemma 3 uses default or linear)"
        ))),
    }
}

/// Typed access to the fields of a JSON object (a Hugging Face `config.json` or one of its
/// sections), with defaults: a field that is absent or `null` takes the default, a present
/// field of the wrong type is an error naming the field.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl Fields<'_> {
    /// Field `k`, unless absent or `null`.
    pub fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    /// Field `k` as a non-negative integer, or `default`.
    pub fn usize(&self, k: &str, default: usize) -> Result<usize> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| {
                Error::Config(format!("{k} should be a non-negative integer, is {v}"))
            }),
        }
    }

    /// Field `k` as a non-negative integer; an error where it is absent.
    pub fn require_usize(&self, k: &str) -> Result<usize> {
        if self.get(k).is_none() {
            return Err(Error::Config(format!("{k} is missing")));
        }
        self.usize(k, 0)
    }

    /// Field `k` as a number, or `default`.
    pub fn f64(&self, k: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(k)?.unwrap_or(default))
    }

    /// Field `k` as a number, if present.
    pub fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        self.get(k)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| Error::Config(format!("{k} should be a number, is {v}")))
            })
            .transpose()
    }

    /// Field `k` as true or false, or `default`.
    pub fn bool(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::Config(format!("{k} should be true or false, is {v}"))),
        }
    }

    /// Field `k` as a string, or `default`.
    pub fn str(&self, k: &str, default: &'static str) -> Result<String> {
        match self.get(k) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| Error::Config(format!("{k} should be a string, is {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Gemma3Config> {
        Gemma3Config::from_hf_json(&v)
    }

    #[test]
    fn released_1b_style_config_uses_defaults_and_pattern() {
        let c = parse(json!({
            "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
            "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "sliding_window": 512, "rope_scaling": null,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window_pattern": 6, "vocab_size": 262144
        }))
        .unwrap();
        assert_eq!(c.n_vocab, 262_144);
        assert_eq!(c.layer_kinds[5], LayerKind::Full);
        assert_eq!(c.layer_kinds[4], LayerKind::Sliding);
        assert_eq!(
            c.layer_kinds
                .iter()
                .filter(|k| **k == LayerKind::Full)
                .count(),
            4
        );
        assert_eq!(c.rope_global.theta, 1e6);
        assert_eq!(c.rope_global.linear_factor, 1.0);
        assert_eq!(c.rope_local.theta, 1e4);
        assert_eq!(c.attn_scale(), 1.0 / 16.0);
        assert_eq!(c.context_length, 131_072);
        assert_eq!(c.rms_eps, 1e-6);
    }

    #[test]
    fn multimodal_config_with_text_config_and_linear_scaling() {
        let c = parse(json!({
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                "head_dim": 128, "query_pre_attn_scalar": 168,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024
            },
            "vision_config": {}
        }))
        .unwrap();
        assert_eq!(c.n_vocab, 262_208);
        assert_eq!(c.rope_global.linear_factor, 8.0);
        assert_eq!(c.rope_global.theta, 1e6);
        assert_eq!(c.rope_local.linear_factor, 1.0);
        assert!((c.attn_scale() - 1.0 / 168f32.sqrt()).abs() < 1e-7);
        assert_eq!(c.sliding_window, 1024);
    }

    #[test]
    fn per_layer_type_rope_parameters_and_layer_types() {
        let c = parse(json!({
            "model_type": "gemma3_text", "num_hidden_layers": 3,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}
            },
            "rope_theta": 1.0, "rope_local_base_freq": 1.0
        }))
        .unwrap();
        assert_eq!(
            c.layer_kinds,
            vec![LayerKind::Full, LayerKind::Sliding, LayerKind::Full]
        );
        assert_eq!(
            c.rope_global,
            RopeConfig {
                theta: 5e5,
                linear_factor: 4.0
            }
        );
        assert_eq!(
            c.rope_local,
            RopeConfig {
                theta: 2e4,
                linear_factor: 1.0
            }
        );
    }

    #[test]
    fn mixed_form_rope_parameters_without_thetas() {
        let c = parse(json!({
            "model_type": "gemma3_text", "num_hidden_layers": 12,
            "_sliding_window_pattern": 4, "rope_scaling": null,
            "rope_parameters": {
                "full_attention": {"rope_type": "default"},
                "sliding_attention": {"rope_type": "default"}
            },
            "rope_theta": 2000000.0, "rope_local_base_freq": 5000.0
        }))
        .unwrap();
        assert_eq!(c.rope_global.theta, 2e6);
        assert_eq!(c.rope_local.theta, 5e3);
        assert_eq!(c.layer_kinds[3], LayerKind::Full);
        assert_eq!(c.layer_kinds[5], LayerKind::Sliding);
        assert_eq!(c.layer_kinds[7], LayerKind::Full);
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse(json!({"model_type": "llama"})).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(m) if m.contains("architecture 'llama'")),
            "{e}"
        );
        let e = parse(
            json!({"model_type": "gemma3_text", "num_attention_heads": 6,
            "num_key_value_heads": 4}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a multiple"), "{e}");
        let e = parse(json!({"model_type": "gemma3_text", "num_hidden_layers": 2,
            "layer_types": ["full_attention"]}))
        .unwrap_err();
        assert!(e.to_string().contains("1 layer types listed for 2"), "{e}");
        let e = parse(json!({"model_type": "gemma3_text", "hidden_size": "big"})).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let e = parse(json!({"model_type": "gemma3"})).unwrap_err();
        assert!(e.to_string().contains("text_config"), "{e}");
        let e = parse(json!({"model_type": "gemma3_text",
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
        .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
    }

    #[test]
    fn fields_take_defaults_for_absent_or_null_and_name_a_wrongly_typed_field() {
        let v = json!({"n": 3, "x": 0.5, "on": false, "s": "gelu", "gone": null, "bad": "big",
            "neg": -1});
        let f = Fields(v.as_object().unwrap());
        assert_eq!(f.usize("n", 7).unwrap(), 3);
        assert_eq!(f.usize("gone", 7).unwrap(), 7);
        assert_eq!(f.usize("absent", 7).unwrap(), 7);
        assert_eq!(f.require_usize("n").unwrap(), 3);
        assert_eq!(f.f64("x", 1.0).unwrap(), 0.5);
        assert_eq!(f.opt_f64("gone").unwrap(), None);
        assert!(!f.bool("on", true).unwrap());
        assert_eq!(f.str("s", "none").unwrap(), "gelu");
        assert_eq!(f.str("absent", "none").unwrap(), "none");
        for (e, want) in [
            (f.require_usize("gone").unwrap_err(), "gone is missing"),
            (
                f.usize("neg", 0).unwrap_err(),
                "neg should be a non-negative integer, is -1",
            ),
            (
                f.f64("bad", 0.0).unwrap_err(),
                "bad should be a number, is \"big\"",
            ),
            (
                f.bool("n", true).unwrap_err(),
                "n should be true or false, is 3",
            ),
            (f.str("x", "").unwrap_err(), "x should be a string, is 0.5"),
        ] {
            assert!(matches!(&e, Error::Config(m) if m == want), "{e}");
        }
    }
}
