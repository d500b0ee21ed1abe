//! The public face of a loaded model: open a source, load it, make caches, run forwards.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use markbase_core::config::{Gemma3Config, LayerKind};
use markbase_core::gguf::GgufFile;
use markbase_core::safetensors::SafetensorsDir;
use markbase_core::{Error, Result};
use markbase_cpu::CpuBackend;

use crate::gemma3::{Gemma3, Gemma3Cache};
use crate::gemma4::{Gemma4, Gemma4Cache};
use crate::gemma4_config::Gemma4Config;
use crate::synthetic::{SyntheticSpec, SyntheticWeights};
use crate::weights::WeightStore;

/// Where a model's weights and hyper-parameters come from.
#[derive(Clone)]
pub enum ModelSource {
    /// An opened GGUF file.
    Gguf(Arc<GgufFile>),
    /// A Hugging Face directory with config.json and *.safetensors.
    HfDir(PathBuf),
}

impl ModelSource {
    /// Opens a `.gguf` file or a directory holding `config.json` and safetensors weights.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            if !path.join("config.json").is_file() {
                return Err(Error::Format(format!(
                    "{}: a model directory needs a config.json",
                    path.display()
                )));
            }
            return Ok(ModelSource::HfDir(path.to_path_buf()));
        }
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        Ok(ModelSource::Gguf(Arc::new(GgufFile::open(path)?)))
    }
}

/// How to load a model.
#[derive(Clone, Copy, Default)]
pub struct LoadOptions<'a> {
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Called with (bytes done, bytes total) as weights are prepared.
    pub progress: Option<&'a (dyn Fn(u64, u64) + Sync)>,
}

/// Facts about a loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Architecture name (e.g. `gemma3`).
    pub architecture: String,
    /// Logits per token.
    pub n_vocab: usize,
    /// Longest context.
    pub context_length: usize,
    /// Decoder layers.
    pub n_layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding-window size of local layers.
    pub sliding_window: usize,
    /// Bytes of weights used.
    pub weight_bytes: u64,
    /// Every hyper-parameter as (name, value).
    pub hyper_params: Vec<(String, String)>,
}

impl ModelInfo {
    /// One `name: value` line per hyper-parameter.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "architecture: {}\nweight_bytes: {}\n",
            self.architecture, self.weight_bytes
        );
        for (k, v) in &self.hyper_params {
            s.push_str(&format!("{k}: {v}\n"));
        }
        s
    }
}

/// Which logits [`Model::forward`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (`n_vocab` values).
    Last,
    /// Every token's (row-major tokens × `n_vocab`).
    All,
}

/// A loaded model, ready to run on the CPU.
pub struct Model {
    info: ModelInfo,
    inner: Arch,
}

/// The architecture-specific model.
enum Arch {
    Gemma3(Box<Gemma3<CpuBackend>>),
    Gemma4(Box<Gemma4<CpuBackend>>),
}

/// The key/value cache of one sequence.
pub struct KvCache {
    inner: ArchCache,
    window: usize,
    n_layers: usize,
}

/// The architecture-specific cache.
enum ArchCache {
    Gemma3(Gemma3Cache<CpuBackend>),
    Gemma4(Gemma4Cache<CpuBackend>),
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        match &self.inner {
            ArchCache::Gemma3(c) => c.len(),
            ArchCache::Gemma4(c) => c.len(),
        }
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most tokens it can hold.
    pub fn capacity(&self) -> usize {
        match &self.inner {
            ArchCache::Gemma3(c) => c.capacity(),
            ArchCache::Gemma4(c) => c.capacity(),
        }
    }

    /// Keeps the first `n` tokens. Fails when sliding-window layers no longer hold the keys
    /// position `n` would need (going back more than about `MAX_BATCH` tokens).
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        match &mut self.inner {
            ArchCache::Gemma3(c) => c.truncate(n, self.window),
            ArchCache::Gemma4(c) => c.truncate(n, self.window),
        }
    }

    /// Forgets every token.
    pub fn clear(&mut self) {
        match &mut self.inner {
            ArchCache::Gemma3(c) => c.clear(),
            ArchCache::Gemma4(c) => c.clear(),
        }
    }

    /// Layers that own K/V buffers (Gemma 4's KV-shared layers own none).
    pub fn n_layer_caches(&self) -> usize {
        match &self.inner {
            ArchCache::Gemma3(_) => self.n_layers,
            ArchCache::Gemma4(c) => c.n_layer_caches(),
        }
    }
}

impl Model {
    /// Loads the model of `src` onto the CPU.
    pub fn load(src: &ModelSource, opts: &LoadOptions) -> Result<Model> {
        let (store, gemma4) = match src {
            ModelSource::Gguf(file) => {
                let arch = file.architecture()?;
                let g4 = match arch {
                    "gemma3" => None,
                    "gemma4" => Some(Gemma4Config::from_gguf(file)?),
                    _ => {
                        return Err(Error::Unsupported(format!(
                            "architecture '{arch}' in {} (MarkBase runs gemma3 and gemma4)",
                            file.path().display()
                        )))
                    }
                };
                (WeightStore::Gguf(file.clone()), g4)
            }
            ModelSource::HfDir(dir) => {
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                let json: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| Error::Config(format!("{}: invalid JSON: {e}", path.display())))?;
                let g4 = if Gemma4Config::is_gemma4_json(&json) {
                    Some(Gemma4Config::from_hf_file(&path)?)
                } else {
                    None
                };
                let st = SafetensorsDir::open(dir)?;
                let prefix = ["model.", "language_model.model.", "model.language_model."]
                    .into_iter()
                    .find(|p| st.get(&format!("{p}embed_tokens.weight")).is_some())
                    .ok_or_else(|| {
                        Error::MissingTensor(format!(
                            "model.embed_tokens.weight (in {})",
                            dir.display()
                        ))
                    })?;
                let store = WeightStore::Hf {
                    st,
                    prefix: prefix.to_string(),
                };
                (store, g4)
            }
        };
        if let Some(cfg) = gemma4 {
            return Self::load_gemma4(cfg, &store, opts);
        }
        let backend = CpuBackend::new(opts.threads)?;
        let last = std::cell::Cell::new(0u64);
        let progress = |done: u64, total: u64| {
            last.set(done);
            if let Some(p) = opts.progress {
                p(done, total);
            }
        };
        let cfg = match src {
            ModelSource::Gguf(file) => Gemma3Config::from_gguf(file)?,
            ModelSource::HfDir(dir) => Gemma3Config::from_hf_file(&dir.join("config.json"))?,
        };
        let inner = Gemma3::load(cfg.clone(), &store, backend, &progress)?;
        let info = ModelInfo {
            architecture: "gemma3".into(),
            n_vocab: cfg.n_vocab,
            context_length: cfg.context_length,
            n_layers: cfg.n_layers,
            d_model: cfg.d_model,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            sliding_window: cfg.sliding_window,
            weight_bytes: last.get(),
            hyper_params: cfg.describe(),
        };
        Ok(Model {
            info,
            inner: Arch::Gemma3(Box::new(inner)),
        })
    }

    /// Loads a Gemma 4 model from `store` onto the CPU.
    fn load_gemma4(cfg: Gemma4Config, store: &WeightStore, opts: &LoadOptions) -> Result<Model> {
        let backend = CpuBackend::new(opts.threads)?;
        let last = std::cell::Cell::new(0u64);
        let progress = |done: u64, total: u64| {
            last.set(done);
            if let Some(p) = opts.progress {
                p(done, total);
            }
        };
        let inner = Gemma4::load(cfg.clone(), store, backend, &progress)?;
        let first_full = cfg.layers.iter().find(|l| l.kind == LayerKind::Full);
        let sliding = cfg.layers.iter().find(|l| l.kind == LayerKind::Sliding);
        let main = sliding.or(first_full).copied();
        let info = ModelInfo {
            architecture: "gemma4".into(),
            n_vocab: cfg.n_vocab,
            context_length: cfg.context_length,
            n_layers: cfg.layers.len(),
            d_model: cfg.d_model,
            n_heads: cfg.n_heads,
            n_kv_heads: main.map_or(0, |l| l.n_kv_heads),
            head_dim: main.map_or(0, |l| l.head_dim),
            sliding_window: cfg.sliding_window,
            weight_bytes: last.get(),
            hyper_params: cfg.describe(),
        };
        Ok(Model {
            info,
            inner: Arch::Gemma4(Box::new(inner)),
        })
    }

    /// Builds a model with random weights at a released Gemma 4 variant's shapes (see
    /// [`crate::synthetic`]); every tensor is generated here.
    pub fn load_synthetic(spec: &SyntheticSpec, opts: &LoadOptions) -> Result<Model> {
        let weights = Arc::new(SyntheticWeights::new(*spec)?);
        let cfg = weights.config().clone();
        Self::load_gemma4(cfg, &WeightStore::Synthetic(weights), opts)
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// A cache for up to `max_tokens` tokens (ContextOverflow beyond the context length).
    pub fn new_cache(&self, max_tokens: usize) -> Result<KvCache> {
        let inner = match &self.inner {
            Arch::Gemma3(m) => ArchCache::Gemma3(m.new_cache(max_tokens)?),
            Arch::Gemma4(m) => ArchCache::Gemma4(m.new_cache(max_tokens)?),
        };
        Ok(KvCache {
            inner,
            window: self.info.sliding_window,
            n_layers: self.info.n_layers,
        })
    }

    /// Runs `tokens` at positions `cache.len()..`, appends them to the cache, and returns the
    /// logits of the last token or of every token (row-major tokens × n_vocab).
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let all = logits == Logits::All;
        match (&self.inner, &mut cache.inner) {
            (Arch::Gemma3(m), ArchCache::Gemma3(c)) => m.forward(c, tokens, all),
            (Arch::Gemma4(m), ArchCache::Gemma4(c)) => m.forward(c, tokens, all),
            _ => Err(Error::Invalid("KV cache belongs to another model".into())),
        }
    }
}
