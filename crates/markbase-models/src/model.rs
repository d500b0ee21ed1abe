//! The public face of a loaded model: open a source, load it, make caches, run forwards.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use markbase_core::config::{Gemma3Config, LayerKind};
use markbase_core::gguf::GgufFile;
use markbase_core::safetensors::SafetensorsDir;
use markbase_core::sampling::Draw;
use markbase_core::{Error, Result};
use markbase_cpu::CpuBackend;
use markbase_cuda::CudaBackend;

use crate::device::{Device, DeviceBackend};
use crate::gemma3::Gemma3;
use crate::gemma4::Gemma4;
use crate::gemma4_config::Gemma4Config;
use crate::lm_head::LmHeadMode;
use crate::paged::{SeqStep, StepOutput};
use crate::runner::Runner;
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

/// How to load a model (by default: on the CPU, every core, no progress report, the LM head
/// `Auto`, f16 copies on).
#[derive(Clone, Copy)]
pub struct LoadOptions<'a> {
    /// Where the model runs.
    pub device: Device,
    /// Compute threads of the CPU backend (0 = all cores).
    pub threads: usize,
    /// Called with (bytes done, bytes total) as weights are prepared.
    pub progress: Option<&'a (dyn Fn(u64, u64) + Sync)>,
    /// How the LM head is evaluated.
    pub lm_head: LmHeadMode,
    /// On CUDA: quantized weight matrices get f16 copies, made at their first product of more
    /// than 64 token rows while the GPU has room, which such products then read (faster
    /// batches and prefill for more device memory; `markbase-cuda`'s f16_copies.rs).
    pub f16_copies: bool,
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        LoadOptions {
            device: Device::default(),
            threads: 0,
            progress: None,
            lm_head: LmHeadMode::default(),
            f16_copies: true,
        }
    }
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
    /// How the LM head is evaluated ("exact" or "screened (...)").
    pub lm_head: String,
    /// What the model runs on ("cpu (2 threads)", "cuda:0 NVIDIA H200").
    pub device: String,
    /// Every hyper-parameter as (name, value).
    pub hyper_params: Vec<(String, String)>,
}

impl ModelInfo {
    /// One `name: value` line per hyper-parameter.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "architecture: {}\ndevice: {}\nweight_bytes: {}\nlm_head: {}\n",
            self.architecture, self.device, self.weight_bytes, self.lm_head
        );
        for (k, v) in &self.hyper_params {
            s.push_str(&format!("{k}: {v}\n"));
        }
        s
    }
}

/// Which logits [`Model::forward`] returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Logits {
    /// Only the last token's (`n_vocab` values).
    Last,
    /// Every token's (row-major tokens × `n_vocab`).
    All,
    /// None: only the id of the last token's largest logit (ties: the lowest id), chosen where
    /// the model runs, so no logits cross to the host ([`StepOutput::ids`]).
    Greedy,
    /// None: only the id the last token's logits give under the draw
    /// ([`Backend::sample`](markbase_core::backend::Backend::sample)), chosen where the model
    /// runs ([`StepOutput::ids`]).
    Sample(Draw),
}

/// A loaded model, ready to run on the device it was loaded onto.
pub struct Model {
    info: ModelInfo,
    inner: Box<dyn Runner>,
}

/// The hyper-parameters of an architecture MarkBase runs.
enum ArchConfig {
    Gemma3(Gemma3Config),
    Gemma4(Gemma4Config),
}

/// Paged key/value storage shared by many sequences (see [`crate::paged`]), on the device of
/// the model that made it: per layer that owns a cache, `blocks(kind) · block_size` slots.
/// Which sequence owns which block is the caller's business ([`Model::step`] takes each
/// sequence's block tables).
pub struct KvPool {
    /// The storage: a [`crate::paged::PagedKv`] of the model's backend.
    pub(crate) kv: Box<dyn Any + Send + Sync>,
    /// Slots per block.
    pub(crate) block_size: usize,
    /// Blocks of each kind (indexed by [`crate::paged::kind_index`]).
    pub(crate) n_blocks: [usize; 2],
    /// Layers that own K/V buffers.
    pub(crate) n_caches: usize,
    /// Whether some of them are sliding-window layers.
    pub(crate) has_sliding: bool,
}

impl KvPool {
    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks for layers of `kind`.
    pub fn blocks(&self, kind: LayerKind) -> usize {
        self.n_blocks[crate::paged::kind_index(kind)]
    }
}

/// Slots per block of a [`KvCache`].
const CACHE_BLOCK: usize = 16;

/// The key/value cache of one sequence: a private [`KvPool`] whose full-attention layers get a
/// block per 16 positions and whose sliding layers reuse a ring of blocks.
pub struct KvCache {
    pool: KvPool,
    /// Block table of full-attention layers: block `i` for positions `16·i ..`.
    full: Vec<u32>,
    /// Block table of sliding layers: logical block `i` in ring block `i % ring`.
    sliding: Vec<u32>,
    /// Blocks in the sliding ring.
    ring: usize,
    /// Most tokens [`Model::forward`] runs at once (the ring holds a chunk and its window).
    chunk: usize,
    len: usize,
    capacity: usize,
    window: usize,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most tokens it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `n` tokens. Fails when sliding-window layers no longer hold the keys
    /// position `n` would need (going back more than about a chunk of tokens).
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.len {
            return Ok(());
        }
        let has_sliding = self.pool.has_sliding;
        let lo = (n + 1).saturating_sub(self.window);
        // Ring block of position q was last overwritten by the latest position in it.
        let oldest_kept = ((self.len - 1) / CACHE_BLOCK + 1).saturating_sub(self.ring);
        if has_sliding && n > 0 && lo / CACHE_BLOCK < oldest_kept {
            return Err(Error::Invalid(format!(
                "cannot truncate the KV cache from {} to {n} tokens: sliding layers keep only the last {} blocks",
                self.len, self.ring
            )));
        }
        self.len = n;
        Ok(())
    }

    /// Forgets every token.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Layers that own K/V buffers (Gemma 4's KV-shared layers own none).
    pub fn n_layer_caches(&self) -> usize {
        self.pool.n_caches
    }
}

/// The key/value caches of sequences that decode in lockstep, one token each per step
/// ([`Model::forward_batch`]): batched-decode benchmarks. Every sequence holds the same number
/// of tokens.
pub struct BatchCache {
    pool: KvPool,
    /// Per sequence, its full-attention block table.
    full: Vec<Vec<u32>>,
    /// Per sequence, its sliding ring's block table.
    sliding: Vec<Vec<u32>>,
    len: usize,
    capacity: usize,
}

impl BatchCache {
    /// Tokens held by each sequence.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sequences in the batch.
    pub fn seqs(&self) -> usize {
        self.full.len()
    }

    /// Forgets every token.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl Model {
    /// Loads the model of `src` onto `opts.device`.
    pub fn load(src: &ModelSource, opts: &LoadOptions) -> Result<Model> {
        let (store, cfg) = match src {
            ModelSource::Gguf(file) => {
                let cfg = match file.architecture()? {
                    "gemma3" => ArchConfig::Gemma3(Gemma3Config::from_gguf(file)?),
                    "gemma4" => ArchConfig::Gemma4(Gemma4Config::from_gguf(file)?),
                    arch => {
                        return Err(Error::Unsupported(format!(
                            "architecture '{arch}' in {} (MarkBase runs gemma3 and gemma4)",
                            file.path().display()
                        )))
                    }
                };
                (WeightStore::Gguf(file.clone()), cfg)
            }
            ModelSource::HfDir(dir) => {
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                let json: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| Error::Config(format!("{}: invalid JSON: {e}", path.display())))?;
                let cfg = if Gemma4Config::is_gemma4_json(&json) {
                    ArchConfig::Gemma4(Gemma4Config::from_hf_file(&path)?)
                } else {
                    ArchConfig::Gemma3(Gemma3Config::from_hf_file(&path)?)
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
                (store, cfg)
            }
        };
        Self::load_on_device(cfg, &store, opts)
    }

    /// Builds a model with random weights at a released Gemma 4 variant's shapes (see
    /// [`crate::synthetic`]) on `opts.device`; every tensor is generated here.
    pub fn load_synthetic(spec: &SyntheticSpec, opts: &LoadOptions) -> Result<Model> {
        let weights = Arc::new(SyntheticWeights::new(*spec)?);
        let cfg = ArchConfig::Gemma4(weights.config().clone());
        Self::load_on_device(cfg, &WeightStore::Synthetic(weights), opts)
    }

    /// Opens the backend `opts.device` names and loads the model onto it.
    fn load_on_device(cfg: ArchConfig, store: &WeightStore, opts: &LoadOptions) -> Result<Model> {
        match opts.device {
            Device::Cpu => Self::load_on(CpuBackend::new(opts.threads)?, cfg, store, opts),
            Device::Cuda(ordinal) => {
                let backend = CudaBackend::new(ordinal)?;
                backend.set_f16_copies(opts.f16_copies);
                Self::load_on(backend, cfg, store, opts)
            }
        }
    }

    /// Loads the model of `cfg` from `store` onto `backend`.
    fn load_on<B: DeviceBackend>(
        backend: B,
        cfg: ArchConfig,
        store: &WeightStore,
        opts: &LoadOptions,
    ) -> Result<Model> {
        let device = backend.describe();
        let last = std::cell::Cell::new(0u64);
        let progress = |done: u64, total: u64| {
            last.set(done);
            if let Some(p) = opts.progress {
                p(done, total);
            }
        };
        let (info, inner): (ModelInfo, Box<dyn Runner>) = match cfg {
            ArchConfig::Gemma3(cfg) => {
                let m = Gemma3::load(cfg.clone(), store, backend, opts.lm_head, &progress)?;
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
                    lm_head: m.head().describe(),
                    device,
                    hyper_params: cfg.describe(),
                };
                (info, Box::new(m))
            }
            ArchConfig::Gemma4(cfg) => {
                let m = Gemma4::load(cfg.clone(), store, backend, opts.lm_head, &progress)?;
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
                    lm_head: m.head().describe(),
                    device,
                    hyper_params: cfg.describe(),
                };
                (info, Box::new(m))
            }
        };
        Ok(Model { info, inner })
    }

    /// Facts about the model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Bytes of K and V that one position takes over all layers of `kind` that own a cache
    /// (0 when the model has no such layer).
    pub fn kv_bytes_per_token(&self, kind: LayerKind) -> usize {
        self.inner
            .caches()
            .iter()
            .filter(|g| g.0 == kind)
            .map(|g| 2 * g.1 * std::mem::size_of::<f32>())
            .sum()
    }

    /// Token-row counts whose first step plans its products once (the CUDA backend times
    /// cuBLASLt's algorithms, ≈ 0.3 s a count; nearby counts share a timing): a server runs
    /// a step of each before it takes requests. Empty where nothing is planned so (the CPU).
    pub fn warm_up_rows(&self) -> Vec<usize> {
        self.inner.warm_up_rows()
    }

    /// Token rows the model runs through its layers at once; a [`Model::step`] with more
    /// tokens is run in chunks of this many.
    pub fn max_step_rows(&self) -> usize {
        self.inner.max_rows()
    }

    /// A pool of `full_blocks` blocks for full-attention layers and `sliding_blocks` for
    /// sliding-window layers, `block_size` slots each.
    pub fn new_kv_pool(
        &self,
        block_size: usize,
        full_blocks: usize,
        sliding_blocks: usize,
    ) -> Result<KvPool> {
        self.inner
            .new_pool(block_size, [full_blocks, sliding_blocks])
    }

    /// One step over several sequences: each runs its tokens at positions `start ..`, writing
    /// their keys and values into the pool blocks its tables name, and attending over its own
    /// earlier tokens. Returns the logits and the picks the sequences asked for, in
    /// sequence order ([`StepOutput`]).
    pub fn step(&self, pool: &mut KvPool, seqs: &[SeqStep]) -> Result<StepOutput> {
        self.inner.step(pool, seqs)
    }

    /// Times the host has waited for the model's device since it was loaded (0 on the CPU,
    /// where the host computes itself): a decode step should add exactly one.
    pub fn host_waits(&self) -> u64 {
        self.inner.host_waits()
    }

    /// Time the host has spent waiting for the model's device since it was loaded (zero on
    /// the CPU). A step much longer than its wait is bound by the host queueing work.
    pub fn host_wait_time(&self) -> std::time::Duration {
        self.inner.host_wait_time()
    }

    /// Steps of this model's device that ran as one CUDA graph launch so far (0 on the CPU).
    pub fn graph_replays(&self) -> u64 {
        self.inner.graph_replays()
    }

    /// Device bytes held by f16 copies of quantized weights so far
    /// ([`LoadOptions::f16_copies`]; 0 on the CPU).
    pub fn f16_copy_bytes(&self) -> usize {
        self.inner.f16_copy_bytes()
    }

    /// The free and total memory of the model's GPU in bytes; `None` on the CPU.
    pub fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        self.inner.device_memory()
    }

    /// Checks that the model can run every token id (an [`Error::Invalid`] naming the first
    /// that it cannot).
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        self.inner.check_tokens(tokens)
    }

    /// A cache for up to `max_tokens` tokens (ContextOverflow beyond the context length).
    pub fn new_cache(&self, max_tokens: usize) -> Result<KvCache> {
        self.new_cache_with_chunk(max_tokens, self.max_step_rows())
    }

    /// A cache for up to `max_tokens` tokens whose sliding ring holds chunks of up to
    /// `chunk` tokens (at least 1) and their window: a smaller ring than
    /// [`Model::new_cache`]'s when `chunk` is below [`Model::max_step_rows`], at the cost of
    /// [`Model::forward`] running longer inputs in pieces of `chunk` tokens.
    pub fn new_cache_with_chunk(&self, max_tokens: usize, chunk: usize) -> Result<KvCache> {
        let chunk = chunk.clamp(1, self.max_step_rows());
        let (blocks, ring) = self.cache_blocks(max_tokens, chunk)?;
        Ok(KvCache {
            pool: self.new_kv_pool(CACHE_BLOCK, blocks, ring)?,
            full: (0..blocks as u32).collect(),
            sliding: (0..blocks).map(|i| (i % ring) as u32).collect(),
            ring,
            chunk,
            len: 0,
            capacity: max_tokens,
            window: self.info.sliding_window.max(1),
        })
    }

    /// Blocks of full-attention layers and of the sliding ring for one sequence of up to
    /// `max_tokens` tokens written in chunks of up to `chunk` (ContextOverflow beyond the
    /// context length).
    fn cache_blocks(&self, max_tokens: usize, chunk: usize) -> Result<(usize, usize)> {
        let limit = self.info.context_length;
        if max_tokens > limit {
            return Err(Error::ContextOverflow {
                tokens: max_tokens,
                context: limit,
            });
        }
        let blocks = max_tokens.max(1).div_ceil(CACHE_BLOCK);
        let window = self.info.sliding_window.max(1);
        // Writing a chunk must not overwrite keys its first token still sees.
        let ring = ((window - 1 + chunk).div_ceil(CACHE_BLOCK) + 1).min(blocks);
        Ok((blocks, ring))
    }

    /// Caches for `seqs` sequences of up to `max_tokens` tokens each that decode in lockstep
    /// ([`Model::forward_batch`]), in one shared pool.
    pub fn new_batch_cache(&self, seqs: usize, max_tokens: usize) -> Result<BatchCache> {
        if seqs == 0 {
            return Err(Error::Invalid("a batch needs at least one sequence".into()));
        }
        let (blocks, ring) = self.cache_blocks(max_tokens, self.max_step_rows())?;
        let table = |s: usize, per: usize, n: usize| -> Vec<u32> {
            (0..n).map(|i| (s * per + i % per) as u32).collect()
        };
        Ok(BatchCache {
            pool: self.new_kv_pool(CACHE_BLOCK, seqs * blocks, seqs * ring)?,
            full: (0..seqs).map(|s| table(s, blocks, blocks)).collect(),
            sliding: (0..seqs).map(|s| table(s, ring, blocks)).collect(),
            len: 0,
            capacity: max_tokens,
        })
    }

    /// Runs one token per sequence of `cache` (`tokens[s]` for sequence `s`), all at position
    /// `cache.len()`, in one step, and returns what `logits` asks for from each sequence:
    /// its logits row ([`Logits::Last`]; `All` is the same for one token) or its pick.
    pub fn forward_batch(
        &self,
        cache: &mut BatchCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<StepOutput> {
        if tokens.len() != cache.full.len() {
            return Err(Error::Invalid(format!(
                "forward_batch: {} tokens for {} sequences",
                tokens.len(),
                cache.full.len()
            )));
        }
        if cache.len >= cache.capacity {
            return Err(Error::ContextOverflow {
                tokens: cache.len + 1,
                context: cache.capacity,
            });
        }
        let seqs: Vec<SeqStep> = tokens
            .iter()
            .zip(cache.full.iter().zip(&cache.sliding))
            .map(|(t, (full, sliding))| SeqStep {
                tokens: std::slice::from_ref(t),
                start: cache.len,
                full_blocks: full,
                sliding_blocks: sliding,
                logits: Some(logits),
            })
            .collect();
        let out = self.step(&mut cache.pool, &seqs)?;
        cache.len += 1;
        Ok(out)
    }

    /// Runs `tokens` at positions `cache.len()..`, appends them to the cache, and returns the
    /// logits of the last token or of every token (row-major tokens × n_vocab); `Greedy` and
    /// `Sample` are for [`Model::forward_pick`], [`Model::step`] and [`Model::forward_batch`].
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        if matches!(logits, Logits::Greedy | Logits::Sample(_)) {
            return Err(Error::Invalid(
                "forward returns logits: picks come from Model::forward_pick or Model::step".into(),
            ));
        }
        Ok(self.forward_pieces(cache, tokens, logits)?.logits)
    }

    /// Runs `tokens` as [`Model::forward`] does and returns the last token's pick under
    /// `choice` (`Greedy` or `Sample`): on a GPU only the token id comes back.
    pub fn forward_pick(&self, cache: &mut KvCache, tokens: &[u32], choice: Logits) -> Result<u32> {
        if !matches!(choice, Logits::Greedy | Logits::Sample(_)) {
            return Err(Error::Invalid(
                "forward_pick picks a token: logits come from Model::forward".into(),
            ));
        }
        let out = self.forward_pieces(cache, tokens, choice)?;
        out.ids
            .last()
            .copied()
            .ok_or_else(|| Error::Invalid("forward_pick: the step made no pick".into()))
    }

    /// Runs `tokens` in pieces of the cache's chunk; `logits` applies to the last piece only
    /// where it asks for one row (`Last`, a pick), else to every piece.
    fn forward_pieces(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<StepOutput> {
        if tokens.is_empty() {
            return Err(Error::Invalid("forward called with no tokens".into()));
        }
        let end = cache.len + tokens.len();
        if end > cache.capacity {
            return Err(Error::ContextOverflow {
                tokens: end,
                context: cache.capacity,
            });
        }
        let start = cache.len;
        let mut out = StepOutput {
            logits: Vec::new(),
            ids: Vec::new(),
        };
        let pieces = tokens.chunks(cache.chunk);
        let last = pieces.len() - 1;
        for (i, piece) in pieces.enumerate() {
            // Earlier pieces of a one-row request give no logits and no pick.
            let want = match logits {
                Logits::All => Some(logits),
                _ if i < last => None,
                l => Some(l),
            };
            let seq = SeqStep {
                tokens: piece,
                start: cache.len,
                full_blocks: &cache.full,
                sliding_blocks: &cache.sliding,
                logits: want,
            };
            match self.step(&mut cache.pool, &[seq]) {
                Ok(step) => {
                    out.logits.extend(step.logits);
                    out.ids.extend(step.ids);
                }
                Err(e) => {
                    // A failed call keeps none of its tokens, as a one-piece call does.
                    cache.len = start;
                    return Err(e);
                }
            }
            cache.len += piece.len();
        }
        debug_assert_eq!(cache.len, end);
        Ok(out)
    }
}
