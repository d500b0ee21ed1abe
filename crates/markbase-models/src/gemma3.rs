//! Gemma 3 text models (270M – 27B): hyper-parameters → weight names → forward on a [`Backend`].
//!
//! See docs/models/gemma3.md. Per layer: sandwich-normed attention (q/k RMSNorm, half-split
//! RoPE, GQA, sliding or full causal mask) and a gelu-tanh gated MLP; embeddings scaled by
//! sqrt(D); tied LM head unless the file has its own.

use std::sync::Mutex;

use markbase_core::backend::{AttnSpec, Backend, NewKv, NormOut, Rope, ValueRows};
use markbase_core::config::{Gemma3Config, LayerKind, RopeConfig};
use markbase_core::{Error, Result};

use crate::lm_head::{HeadNorm, HeadWork, LmHead, LmHeadMode};
use crate::paged::{ChunkLayout, PagedKv, SeqStep, StepModel, StepOutput};
use crate::weights::WeightStore;

/// Token rows run through the layers together; larger steps are processed in chunks of this
/// size.
pub const MAX_BATCH: usize = 512;

/// Weights of one decoder layer.
struct Layer<B: Backend> {
    kind: LayerKind,
    attn_norm: B::Vector,
    q: B::Matrix,
    k: B::Matrix,
    v: B::Matrix,
    o: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    post_attn_norm: B::Vector,
    ffn_norm: B::Vector,
    gate: B::Matrix,
    up: B::Matrix,
    down: B::Matrix,
    post_ffn_norm: B::Vector,
}

/// Activation buffers for one chunk of up to [`MAX_BATCH`] tokens, allocated once.
struct Workspace<B: Backend> {
    h: B::Buffer,
    x: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    head: HeadWork<B>,
}

/// A loaded Gemma 3 text model on backend `B`.
pub struct Gemma3<B: Backend> {
    cfg: Gemma3Config,
    backend: B,
    embed: B::Matrix,
    head: LmHead<B>,
    layers: Vec<Layer<B>>,
    work: Mutex<Workspace<B>>,
}

/// Converts a config RoPE into the backend's form (all pairs rotate).
fn rope_of(r: &RopeConfig, head_dim: usize) -> Rope {
    Rope {
        theta: r.theta as f32,
        linear_factor: r.linear_factor as f32,
        rotated_pairs: head_dim / 2,
    }
}

impl<B: Backend> Gemma3<B> {
    /// Loads weights from `store` onto `backend`, the LM head per `lm_head`.
    /// `progress(done, total)` is called as weight bytes are prepared.
    pub fn load(
        cfg: Gemma3Config,
        store: &WeightStore,
        backend: B,
        lm_head: LmHeadMode,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Self> {
        let hf = matches!(store, WeightStore::Hf { .. });
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.n_ff);
        let (qd, kvd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let names = Names { hf };
        let (embed_name, out_name, final_name) = names.globals();
        let lm_head_present = store.has(out_name);
        if !cfg.tie_embeddings && !lm_head_present {
            return Err(Error::MissingTensor(out_name.to_string()));
        }
        let mut all: Vec<String> = vec![embed_name.into(), final_name.into()];
        if lm_head_present {
            all.push(out_name.into());
        }
        for i in 0..cfg.n_layers {
            all.extend(names.layer(i).iter().map(|s| s.to_string()));
        }
        let total: u64 = all.iter().map(|n| store.n_bytes(n)).sum();
        let mut done = 0u64;
        let mut tick = |name: &str| {
            done += store.n_bytes(name);
            progress(done, total);
        };
        progress(0, total);

        let norm = |name: &str, len: usize| -> Result<B::Vector> {
            backend.load_vector(&store.norm(name, len, hf)?)
        };
        let embed_m = store.matrix(embed_name, cfg.n_vocab, d)?;
        let embed = backend.load_matrix(&embed_m)?;
        tick(embed_name);
        let final_norm = HeadNorm {
            weight: norm(final_name, d)?,
            eps: cfg.rms_eps as f32,
            softcap: cfg.final_logit_softcap.map(|c| c as f32),
        };
        tick(final_name);
        let head = if lm_head_present {
            let head_m = store.matrix(out_name, cfg.n_vocab, d)?;
            let own = backend.load_matrix(&head_m)?;
            tick(out_name);
            LmHead::load(&backend, &head_m, Some(own), final_norm, lm_head)?
        } else {
            LmHead::load(&backend, &embed_m, None, final_norm, lm_head)?
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = names.layer(i);
            let mut mat = |name: &str, rows: usize, cols: usize| -> Result<B::Matrix> {
                let m = backend.load_matrix(&store.matrix(name, rows, cols)?)?;
                tick(name);
                Ok(m)
            };
            let q = mat(&n[1], qd, d)?;
            let k = mat(&n[2], kvd, d)?;
            let v = mat(&n[3], kvd, d)?;
            let o = mat(&n[4], d, qd)?;
            let gate = mat(&n[9], ff, d)?;
            let up = mat(&n[10], ff, d)?;
            let down = mat(&n[11], d, ff)?;
            let layer = Layer {
                kind: cfg.layer_kind(i),
                attn_norm: norm(&n[0], d)?,
                q,
                k,
                v,
                o,
                q_norm: norm(&n[5], hd)?,
                k_norm: norm(&n[6], hd)?,
                post_attn_norm: norm(&n[7], d)?,
                ffn_norm: norm(&n[8], d)?,
                gate,
                up,
                down,
                post_ffn_norm: norm(&n[12], d)?,
            };
            for name in [&n[0], &n[5], &n[6], &n[7], &n[8], &n[12]] {
                tick(name);
            }
            layers.push(layer);
        }
        let work = Mutex::new(Workspace {
            h: backend.alloc(MAX_BATCH * d)?,
            x: backend.alloc(MAX_BATCH * d)?,
            q: backend.alloc(MAX_BATCH * qd)?,
            k: backend.alloc(MAX_BATCH * kvd)?,
            v: backend.alloc(MAX_BATCH * kvd)?,
            attn: backend.alloc(MAX_BATCH * qd)?,
            proj: backend.alloc(MAX_BATCH * d)?,
            gate: backend.alloc(MAX_BATCH * ff)?,
            up: backend.alloc(MAX_BATCH * ff)?,
            head: HeadWork::new(&backend, d, cfg.n_vocab)?,
        });
        Ok(Gemma3 {
            cfg,
            backend,
            embed,
            head,
            layers,
            work,
        })
    }

    /// The LM head.
    pub fn head(&self) -> &LmHead<B> {
        &self.head
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    /// A paged KV pool on this model's backend: `blocks[0]` full-attention and `blocks[1]`
    /// sliding-window blocks of `block_size` slots (what [`crate::Model::new_kv_pool`] makes
    /// on the model's device).
    pub fn new_kv_pool(&self, block_size: usize, blocks: [usize; 2]) -> Result<PagedKv<B>> {
        PagedKv::new(&self.backend, &self.caches(), block_size, blocks)
    }

    /// One step over several sequences on this model's backend (as [`crate::Model::step`]).
    pub fn step(&self, pool: &mut PagedKv<B>, seqs: &[SeqStep]) -> Result<StepOutput> {
        crate::paged::step(self, pool, seqs)
    }

    /// Every decoder layer for one chunk of tokens; leaves the hidden state in `w.h`.
    fn layers_forward(
        &self,
        w: &mut Workspace<B>,
        kv: &mut PagedKv<B>,
        l: &ChunkLayout,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let be = &self.backend;
        let n = l.n();
        let (d, hd, ff) = (cfg.d_model, cfg.head_dim, cfg.n_ff);
        let eps = cfg.rms_eps as f32;
        be.embed(&self.embed, &l.tokens, (d as f32).sqrt(), &mut w.h)?;
        if let Some(first) = self.layers.first() {
            be.rms_norm(
                &w.h,
                Some(&first.attn_norm),
                eps,
                n,
                d,
                &mut w.x,
                NormOut::Write,
            )?;
        }
        for (li, (layer, (kc, vc, _))) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            let (rope, window) = match layer.kind {
                LayerKind::Full => (rope_of(&cfg.rope_global, hd), None),
                LayerKind::Sliding => (rope_of(&cfg.rope_local, hd), Some(cfg.sliding_window)),
            };
            // Attention block on x = input_layernorm(h).
            be.matmul_many(
                &w.x,
                n,
                &mut [
                    (&layer.q, &mut w.q),
                    (&layer.k, &mut w.k),
                    (&layer.v, &mut w.v),
                ],
            )?;
            let spec = AttnSpec {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: hd,
                scale: cfg.attn_scale(),
                window,
                softcap: cfg.attn_logit_softcap.map(|c| c as f32),
            };
            let new_kv = NewKv {
                k: &mut w.k,
                v: ValueRows::AsIs(&w.v),
                k_norm: &layer.k_norm,
                slots: l.slots(layer.kind),
            };
            be.rope_attention(
                &mut w.q,
                &layer.q_norm,
                eps,
                Some(new_kv),
                &rope,
                &spec,
                &l.kv(layer.kind),
                kc,
                vc,
                &mut w.attn,
            )?;
            be.matmul(&w.attn, n, &layer.o, &mut w.proj)?;
            be.residual_norm(
                &w.proj,
                &layer.post_attn_norm,
                eps,
                n,
                d,
                &mut w.h,
                1.0,
                Some((&layer.ffn_norm, &mut w.x)),
            )?;
            // MLP block on x = pre_feedforward_layernorm(h); its residual add also norms h
            // for the next layer.
            be.gated_ffn(
                &w.x,
                n,
                &layer.gate,
                &layer.up,
                &layer.down,
                ff,
                &mut w.gate,
                &mut w.up,
                &mut w.proj,
            )?;
            let next = self.layers.get(li + 1).map(|l| (&l.attn_norm, &mut w.x));
            be.residual_norm(
                &w.proj,
                &layer.post_ffn_norm,
                eps,
                n,
                d,
                &mut w.h,
                1.0,
                next,
            )?;
        }
        Ok(())
    }
}

impl<B: Backend> StepModel for Gemma3<B> {
    type Backend = B;

    fn backend(&self) -> &B {
        &self.backend
    }

    /// Every layer owns a cache.
    fn caches(&self) -> Vec<(LayerKind, usize)> {
        let row = self.cfg.n_kv_heads * self.cfg.head_dim;
        self.layers.iter().map(|l| (l.kind, row)).collect()
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            Some(t) => Err(Error::Invalid(format!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.n_vocab
            ))),
            None => Ok(()),
        }
    }

    fn max_rows(&self) -> usize {
        MAX_BATCH
    }

    fn n_vocab(&self) -> usize {
        self.cfg.n_vocab
    }

    fn run_chunk(
        &self,
        kv: &mut PagedKv<B>,
        l: &ChunkLayout,
        logits: &mut [f32],
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        if kv.geometry != self.caches() {
            return Err(Error::Invalid("KV cache belongs to another model".into()));
        }
        // The workspace is scratch that every chunk overwrites: a panic in an earlier step
        // leaves nothing to distrust.
        let mut work = self.work.lock().unwrap_or_else(|e| e.into_inner());
        self.layers_forward(&mut work, kv, l)?;
        let w = &mut *work;
        self.head.run_step(
            &self.backend,
            &self.embed,
            &w.h,
            l,
            &mut w.head,
            logits,
            ids,
        )
    }
}

/// Tensor names in GGUF or HF spelling (HF names without the model prefix).
struct Names {
    hf: bool,
}

impl Names {
    /// Embedding, separate LM head, final norm.
    fn globals(&self) -> (&'static str, &'static str, &'static str) {
        if self.hf {
            ("embed_tokens.weight", "lm_head.weight", "norm.weight")
        } else {
            ("token_embd.weight", "output.weight", "output_norm.weight")
        }
    }

    /// Layer `i`'s tensors: attn_norm, q, k, v, o, q_norm, k_norm, post_attn_norm, ffn_norm,
    /// gate, up, down, post_ffn_norm.
    fn layer(&self, i: usize) -> [String; 13] {
        let names: [&str; 13] = if self.hf {
            [
                "input_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "post_feedforward_layernorm",
            ]
        } else {
            [
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "attn_q_norm",
                "attn_k_norm",
                "post_attention_norm",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
                "post_ffw_norm",
            ]
        };
        let block = if self.hf { "layers" } else { "blk" };
        names.map(|n| format!("{block}.{i}.{n}.weight"))
    }
}
