//! Gemma 4 text decoders (E2B, E4B, 12B unified, 26B-A4B MoE, 31B): weights → forward on a
//! [`Backend`].
//!
//! See docs/models/gemma4.md §2. One layer, in order:
//!
//! 1. attention on `input_layernorm(h)`: q/k RMSNorm (gain `w`, not `1 + w`), v_norm (plain
//!    RMSNorm of V; with k_eq_v V is the *raw* K projection), half-split RoPE — all pairs on
//!    sliding layers, only the leading `partial · head_dim / 2` pairs on full layers with
//!    frequencies over the whole head ("proportional") — scale 1.0, GQA. Full layers may have
//!    another head dim (512 vs 256) and fewer KV heads. KV-shared layers (E2B/E4B) have no K/V
//!    weights and read the cache of the last non-shared layer of their type;
//!    `h += post_attention_layernorm(o)`;
//! 2. dense gelu-tanh MLP on `pre_feedforward_layernorm(h)` (double width on KV-shared layers
//!    with `use_double_wide_mlp`); with MoE the router reads the un-normed residual `h`
//!    (softmax → top-k → renormalise → per-expert scale), the experts read
//!    `pre_feedforward_layernorm_2(h)`, and the two branches meet as
//!    `post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts)`;
//!    `h += post_feedforward_layernorm(…)`;
//! 3. per-layer embeddings (E2B/E4B): `h += post_per_layer_input_norm(W_proj(gelu(W_gate h) ·
//!    ple[l]))`;
//! 4. `h *= layer_scalar`.
//!
//! Embeddings are scaled by `sqrt(D)` rounded to the table's dtype (bf16/f16, as HF does); the
//! LM head is the embedding; final logits are soft-capped.

use std::sync::Mutex;

use markbase_core::backend::{
    AttnSpec, Backend, HostMatrix, NewKv, NormOut, Rope, Strided, ValueRows,
};
use markbase_core::config::LayerKind;
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::gemma4_config::{Gemma4Config, Gemma4Layer, Gemma4Rope};
use crate::lm_head::{HeadNorm, HeadWork, LmHead, LmHeadMode};
use crate::paged::{ChunkLayout, PagedKv, SeqStep, StepModel, StepOutput};
use crate::weights::WeightStore;

/// Token rows run through the layers together; larger steps are processed in chunks of this
/// size. 1 024 rows make the prefill products larger than 512 did (E4B bf16 pp4096 on the
/// H200: 37 573 against 34 776 t/s; 2 048: 37 194; docs/perf.md, session 19), for a sliding
/// ring of window + 1 024 positions a sequence.
pub const MAX_BATCH: usize = 1024;

/// K/V projections of a layer that owns a cache.
struct KvWeights<B: Backend> {
    k: B::Matrix,
    /// `None` with k_eq_v: V is the raw K projection.
    v: Option<B::Matrix>,
    k_norm: B::Vector,
}

/// The mixture-of-experts block of a layer.
struct MoeWeights<B: Backend> {
    /// `[E, D]` router projection.
    router: B::Matrix,
    /// `router.scale · D^-0.5`, applied as the gain of the router's RMSNorm.
    router_gain: B::Vector,
    /// `[E]` per-expert output factors.
    expert_scale: B::Vector,
    /// `[E · 2F, D]`: expert `e`'s gate rows `e·2F ..`, then its `F` up rows.
    gate_up: B::Matrix,
    /// `[E · D, F]`.
    down: B::Matrix,
    pre_norm_2: B::Vector,
    post_norm_1: B::Vector,
    post_norm_2: B::Vector,
}

/// Per-layer-embedding weights of a layer.
struct PleWeights<B: Backend> {
    /// `[P, D]`.
    gate: B::Matrix,
    /// `[D, P]`.
    proj: B::Matrix,
    post_norm: B::Vector,
}

/// Weights of one decoder layer.
struct Layer<B: Backend> {
    geo: Gemma4Layer,
    /// Index of the cache this layer writes (own) or reads (KV-shared).
    cache: usize,
    attn_norm: B::Vector,
    q: B::Matrix,
    q_norm: B::Vector,
    /// `None` on KV-shared layers.
    kv: Option<KvWeights<B>>,
    o: B::Matrix,
    post_attn_norm: B::Vector,
    ffn_norm: B::Vector,
    gate: B::Matrix,
    up: B::Matrix,
    down: B::Matrix,
    post_ffn_norm: B::Vector,
    moe: Option<MoeWeights<B>>,
    ple: Option<PleWeights<B>>,
    scalar: f32,
}

/// Model-wide per-layer-embedding weights.
struct PleGlobals<B: Backend> {
    /// `[V_ple, L·P]`.
    table: B::Matrix,
    table_scale: f32,
    /// `[L·P, D]`.
    model_proj: B::Matrix,
    proj_norm: B::Vector,
}

/// Activation buffers for one chunk of up to [`MAX_BATCH`] tokens, allocated once.
struct Workspace<B: Backend> {
    h: B::Buffer,
    x: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    /// The raw value projection, before v_norm (read while attention writes `attn`).
    v_raw: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate: B::Buffer,
    up: B::Buffer,
    /// MoE: the mixed dense + expert branch, the router's input, the experts' input and
    /// output, routing.
    mix: B::Buffer,
    x2: B::Buffer,
    x3: B::Buffer,
    experts: B::Buffer,
    router_logits: B::Buffer,
    route_w: B::Buffer,
    route_ids: B::Buffer,
    /// PLE: every layer's inputs `[n, L·P]`, the projection scratch, one layer's slice, the gate.
    ple_all: B::Buffer,
    ple_ctx: B::Buffer,
    ple_l: B::Buffer,
    ple_gate: B::Buffer,
    head: HeadWork<B>,
}

/// A loaded Gemma 4 text model on backend `B`.
pub struct Gemma4<B: Backend> {
    cfg: Gemma4Config,
    backend: B,
    embed: B::Matrix,
    head: LmHead<B>,
    embed_scale: f32,
    ple: Option<PleGlobals<B>>,
    layers: Vec<Layer<B>>,
    /// Geometry of each cache: (kind, KV row width).
    caches: Vec<(LayerKind, usize)>,
    work: Mutex<Workspace<B>>,
}

/// The backend's RoPE for a layer of `head_dim`.
fn rope_of(r: &Gemma4Rope, head_dim: usize) -> Rope {
    Rope {
        theta: r.theta as f32,
        linear_factor: r.factor as f32,
        rotated_pairs: r.rotated_pairs(head_dim),
    }
}

/// `x` rounded to the precision of a table stored as `ty` (HF casts the embedding scale to the
/// weight dtype before multiplying); other formats use the exact value, as llama.cpp does.
fn round_to_dtype(x: f32, ty: GgmlType) -> f32 {
    let bits = x.to_bits();
    match ty {
        GgmlType::BF16 => f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000),
        // Normal-range values only (the scales are ≥ 1): keep 10 mantissa bits, ties to even.
        GgmlType::F16 => f32::from_bits((bits + 0xfff + ((bits >> 13) & 1)) & !0x1fff),
        _ => x,
    }
}

impl<B: Backend> Gemma4<B> {
    /// Loads weights from `store` onto `backend`, the LM head per `lm_head`.
    /// `progress(done, total)` is called as weight bytes are prepared.
    pub fn load(
        cfg: Gemma4Config,
        store: &WeightStore,
        backend: B,
        lm_head: LmHeadMode,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Self> {
        let names = Names {
            hf: !matches!(store, WeightStore::Gguf(_)),
        };
        let d = cfg.d_model;
        let n_layers = cfg.layers.len();
        let total: u64 = tensor_shapes(&names, &cfg)
            .iter()
            .map(|(n, _)| store.n_bytes(n))
            .sum();
        let done = std::cell::Cell::new(0u64);
        let tick = |name: &str| {
            done.set(done.get() + store.n_bytes(name));
            progress(done.get(), total);
        };
        progress(0, total);
        let mat = |name: &str, rows: usize, cols: usize| -> Result<B::Matrix> {
            let m = backend.load_matrix(&store.matrix(name, rows, cols)?)?;
            tick(name);
            Ok(m)
        };
        let vec_of = |name: &str, len: usize| -> Result<Vec<f32>> {
            let v = store.norm(name, len, false)?;
            tick(name);
            Ok(v)
        };
        let norm = |name: &str, len: usize| -> Result<B::Vector> {
            backend.load_vector(&vec_of(name, len)?)
        };

        let g = names.globals();
        let embed_m = store.matrix(g.embed, cfg.n_vocab, d)?;
        let embed_scale = round_to_dtype((d as f32).sqrt(), embed_m.ty);
        let embed = backend.load_matrix(&embed_m)?;
        tick(g.embed);
        let final_norm = HeadNorm {
            weight: norm(g.final_norm, d)?,
            eps: cfg.rms_eps as f32,
            softcap: cfg.final_logit_softcap.map(|c| c as f32),
        };
        let head = LmHead::load(&backend, &embed_m, None, final_norm, lm_head)?;
        let ple = match cfg.ple {
            Some(p) => {
                let table_m = store.matrix(g.ple_table, p.vocab, n_layers * p.dim)?;
                let table_scale = round_to_dtype((p.dim as f32).sqrt(), table_m.ty);
                let table = backend.load_matrix(&table_m)?;
                tick(g.ple_table);
                Some(PleGlobals {
                    table,
                    table_scale,
                    model_proj: mat(g.ple_model_proj, n_layers * p.dim, d)?,
                    proj_norm: norm(g.ple_proj_norm, p.dim)?,
                })
            }
            None => None,
        };

        let mut caches = Vec::new();
        let mut cache_of = vec![0usize; n_layers];
        let mut layers = Vec::with_capacity(n_layers);
        for (i, geo) in cfg.layers.iter().copied().enumerate() {
            let n = names.layer(i);
            let hd = geo.head_dim;
            let (qd, kvd) = (cfg.n_heads * hd, geo.n_kv_heads * hd);
            let cache = match geo.kv_source {
                Some(src) => cache_of[src],
                None => {
                    caches.push((geo.kind, kvd));
                    caches.len() - 1
                }
            };
            cache_of[i] = cache;
            let kv = match geo.kv_source {
                Some(_) => None,
                None => Some(KvWeights {
                    k: mat(&n.k, kvd, d)?,
                    v: if geo.has_v {
                        Some(mat(&n.v, kvd, d)?)
                    } else {
                        None
                    },
                    k_norm: norm(&n.k_norm, hd)?,
                }),
            };
            let moe = match cfg.moe {
                Some(m) => {
                    let (e, f) = (m.n_experts, m.expert_ff);
                    let gain: Vec<f32> = vec_of(&n.router_scale, d)?
                        .iter()
                        .map(|s| s * (d as f32).powf(-0.5))
                        .collect();
                    let gate_up = expert_matrix(store, &n.gate_up_exps, e, 2 * f, d)?;
                    let down = expert_matrix(store, &n.down_exps, e, d, f)?;
                    let w = MoeWeights {
                        router: mat(&n.router, e, d)?,
                        router_gain: backend.load_vector(&gain)?,
                        expert_scale: norm(&n.expert_scale, e)?,
                        gate_up: backend.load_matrix(&gate_up)?,
                        down: backend.load_matrix(&down)?,
                        pre_norm_2: norm(&n.pre_ffn_norm_2, d)?,
                        post_norm_1: norm(&n.post_ffn_norm_1, d)?,
                        post_norm_2: norm(&n.post_ffn_norm_2, d)?,
                    };
                    tick(&n.gate_up_exps);
                    tick(&n.down_exps);
                    Some(w)
                }
                None => None,
            };
            let ple = match cfg.ple {
                Some(p) => Some(PleWeights {
                    gate: mat(&n.ple_gate, p.dim, d)?,
                    proj: mat(&n.ple_proj, d, p.dim)?,
                    post_norm: norm(&n.ple_post_norm, d)?,
                }),
                None => None,
            };
            layers.push(Layer {
                geo,
                cache,
                attn_norm: norm(&n.attn_norm, d)?,
                q: mat(&n.q, qd, d)?,
                q_norm: norm(&n.q_norm, hd)?,
                kv,
                o: mat(&n.o, d, qd)?,
                post_attn_norm: norm(&n.post_attn_norm, d)?,
                ffn_norm: norm(&n.ffn_norm, d)?,
                gate: mat(&n.gate, geo.n_ff, d)?,
                up: mat(&n.up, geo.n_ff, d)?,
                down: mat(&n.down, d, geo.n_ff)?,
                post_ffn_norm: norm(&n.post_ffn_norm, d)?,
                moe,
                ple,
                scalar: vec_of(&n.scalar, 1)?[0],
            });
        }

        let b = MAX_BATCH;
        let max_q = cfg.layers.iter().map(|l| cfg.n_heads * l.head_dim).max();
        let max_kv = cfg.layers.iter().map(|l| l.n_kv_heads * l.head_dim).max();
        let max_ff = cfg.layers.iter().map(|l| l.n_ff).max();
        let (max_q, max_kv, max_ff) =
            (max_q.unwrap_or(0), max_kv.unwrap_or(0), max_ff.unwrap_or(0));
        let (n_exp, top_k) = cfg.moe.map_or((0, 0), |m| (m.n_experts, m.top_k));
        let ple_w = cfg.ple.map_or(0, |p| p.dim);
        let work = Mutex::new(Workspace {
            h: backend.alloc(b * d)?,
            x: backend.alloc(b * d)?,
            q: backend.alloc(b * max_q)?,
            k: backend.alloc(b * max_kv)?,
            v: backend.alloc(b * max_kv)?,
            v_raw: backend.alloc(b * max_kv)?,
            attn: backend.alloc(b * max_q)?,
            proj: backend.alloc(b * d)?,
            gate: backend.alloc(b * max_ff)?,
            up: backend.alloc(b * max_ff)?,
            mix: backend.alloc(if n_exp > 0 { b * d } else { 0 })?,
            x2: backend.alloc(if n_exp > 0 { b * d } else { 0 })?,
            x3: backend.alloc(if n_exp > 0 { b * d } else { 0 })?,
            experts: backend.alloc(if n_exp > 0 { b * d } else { 0 })?,
            router_logits: backend.alloc(b * n_exp)?,
            route_w: backend.alloc(b * top_k)?,
            route_ids: backend.alloc(b * top_k)?,
            ple_all: backend.alloc(b * n_layers * ple_w)?,
            ple_ctx: backend.alloc(b * n_layers * ple_w)?,
            ple_l: backend.alloc(b * ple_w)?,
            ple_gate: backend.alloc(b * ple_w)?,
            head: HeadWork::new(&backend, d, cfg.n_vocab)?,
        });
        Ok(Gemma4 {
            cfg,
            backend,
            embed,
            head,
            embed_scale,
            ple,
            layers,
            caches,
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
    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    /// A paged KV pool on this model's backend: `blocks[0]` full-attention and `blocks[1]`
    /// sliding-window blocks of `block_size` slots (what [`crate::Model::new_kv_pool`] makes
    /// on the model's device).
    pub fn new_kv_pool(&self, block_size: usize, blocks: [usize; 2]) -> Result<PagedKv<B>> {
        PagedKv::new(&self.backend, &self.caches, block_size, blocks)
    }

    /// One step over several sequences on this model's backend (as [`crate::Model::step`]).
    pub fn step(&self, pool: &mut PagedKv<B>, seqs: &[SeqStep]) -> Result<StepOutput> {
        crate::paged::step(self, pool, seqs)
    }

    /// The per-layer inputs of every layer for `n` tokens into `w.ple_all` (`[n, L·P]`):
    /// `(RMSNorm(W_plmp h0 · D^-0.5) + E_ple[tok] · sqrt(P)) · 2^-0.5` (gemma4.md §2.3).
    fn per_layer_inputs(&self, w: &mut Workspace<B>, tokens: &[u32]) -> Result<()> {
        let Some(ple) = &self.ple else {
            return Ok(());
        };
        let be = &self.backend;
        let n = tokens.len();
        let (d, l) = (self.cfg.d_model, self.cfg.layers.len());
        let p = self.cfg.ple.map_or(0, |p| p.dim);
        be.embed(&ple.table, tokens, ple.table_scale, &mut w.ple_all)?;
        be.matmul(&w.h, n, &ple.model_proj, &mut w.ple_ctx)?;
        be.scale(&mut w.ple_ctx, (d as f32).powf(-0.5), n * l * p)?;
        be.rms_norm(
            &w.ple_ctx,
            Some(&ple.proj_norm),
            self.cfg.rms_eps as f32,
            n * l,
            p,
            &mut w.ple_all,
            NormOut::AddTo,
        )?;
        be.scale(&mut w.ple_all, std::f32::consts::FRAC_1_SQRT_2, n * l * p)
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
        let d = cfg.d_model;
        let eps = cfg.rms_eps as f32;
        be.embed(&self.embed, &l.tokens, self.embed_scale, &mut w.h)?;
        self.per_layer_inputs(w, &l.tokens)?;
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
        for (li, layer) in self.layers.iter().enumerate() {
            // Each layer's last residual add also scales by the layer scalar and norms `h`
            // for the next layer's attention.
            let next = self.layers.get(li + 1).map(|l| &l.attn_norm);
            self.attention_block(w, kv, l, layer)?;
            let Some(ple) = &layer.ple else {
                self.ffn_block(w, layer, n, layer.scalar, next)?;
                continue;
            };
            self.ffn_block(w, layer, n, 1.0, None)?;
            let p = ple_width(cfg);
            let stride = cfg.layers.len() * p;
            let from = Strided {
                offset: li * p,
                stride,
            };
            be.gelu_matmul_mul(
                &w.h,
                n,
                &ple.gate,
                p,
                &w.ple_all,
                from,
                &mut w.ple_gate,
                &mut w.ple_l,
            )?;
            be.matmul(&w.ple_gate, n, &ple.proj, &mut w.proj)?;
            be.residual_norm(
                &w.proj,
                &ple.post_norm,
                eps,
                n,
                d,
                &mut w.h,
                layer.scalar,
                next.map(|v| (v, &mut w.x)),
            )?;
        }
        Ok(())
    }

    /// `h += post_attention_layernorm(attention(x))` for one layer, `x` being
    /// `input_layernorm(h)` on entry; leaves `x = pre_feedforward_layernorm(h)` (and in a
    /// mixture-of-experts layer the router's input `x2` and the experts' `x3`).
    fn attention_block(
        &self,
        w: &mut Workspace<B>,
        paged: &mut PagedKv<B>,
        l: &ChunkLayout,
        layer: &Layer<B>,
    ) -> Result<()> {
        let n = l.n();
        let cfg = &self.cfg;
        let be = &self.backend;
        let (d, hd, kvh) = (cfg.d_model, layer.geo.head_dim, layer.geo.n_kv_heads);
        let eps = cfg.rms_eps as f32;
        let (rope, window) = match layer.geo.kind {
            LayerKind::Full => (rope_of(&cfg.rope_full, hd), None),
            LayerKind::Sliding => (rope_of(&cfg.rope_sliding, hd), Some(cfg.sliding_window)),
        };
        // q, k and v (or q alone on a KV-shared layer) in one call: a backend may share the
        // activations' rounding or a launch between them.
        match layer.kv.as_ref().map(|kv| (&kv.k, kv.v.as_ref())) {
            Some((k, Some(v))) => be.matmul_many(
                &w.x,
                n,
                &mut [(&layer.q, &mut w.q), (k, &mut w.k), (v, &mut w.v_raw)],
            )?,
            Some((k, None)) => {
                be.matmul_many(&w.x, n, &mut [(&layer.q, &mut w.q), (k, &mut w.k)])?
            }
            None => be.matmul(&w.x, n, &layer.q, &mut w.q)?,
        }
        let spec = AttnSpec {
            n_heads: cfg.n_heads,
            n_kv_heads: kvh,
            head_dim: hd,
            scale: 1.0,
            window,
            softcap: None,
        };
        let (kc, vc, _) = &mut paged.layers[layer.cache];
        // q (and k) normed and turned, new keys and values written, attention: one call, which
        // a backend may run as one pass on decode steps.
        let new_kv = match &layer.kv {
            Some(kv) => {
                // v_norm: weightless RMSNorm of V (its raw projection is in `v_raw`), on the
                // way to the cache; under k_eq_v V is the raw K projection, normed here
                // before `k` is normed and turned.
                let v = if kv.v.is_some() {
                    ValueRows::Normed {
                        raw: &w.v_raw,
                        scratch: &mut w.v,
                    }
                } else {
                    be.rms_norm(&w.k, None, eps, n * kvh, hd, &mut w.v, NormOut::Write)?;
                    ValueRows::AsIs(&w.v)
                };
                Some(NewKv {
                    k: &mut w.k,
                    v,
                    k_norm: &kv.k_norm,
                    slots: l.slots(layer.geo.kind),
                })
            }
            None => None,
        };
        be.rope_attention(
            &mut w.q,
            &layer.q_norm,
            eps,
            new_kv,
            &rope,
            &spec,
            &l.kv(layer.geo.kind),
            kc,
            vc,
            &mut w.attn,
        )?;
        be.matmul(&w.attn, n, &layer.o, &mut w.proj)?;
        let next = (&layer.ffn_norm, &mut w.x);
        let Some(moe) = &layer.moe else {
            let norm = &layer.post_attn_norm;
            return be.residual_norm(&w.proj, norm, eps, n, d, &mut w.h, 1.0, Some(next));
        };
        // A mixture-of-experts layer's router and experts norm the same residual as its
        // feed-forward: `x2` and `x3` in the same pass.
        be.residual_norms(
            &w.proj,
            &layer.post_attn_norm,
            eps,
            n,
            d,
            &mut w.h,
            1.0,
            next,
            &mut [(&moe.router_gain, &mut w.x2), (&moe.pre_norm_2, &mut w.x3)],
        )
    }

    /// `h = (h + post_feedforward_layernorm(mlp(x) [+ experts(…)])) · scale` for one layer,
    /// `x` being `pre_feedforward_layernorm(h)` on entry; with `next`, `x = next(h)` after.
    fn ffn_block(
        &self,
        w: &mut Workspace<B>,
        layer: &Layer<B>,
        n: usize,
        scale: f32,
        next: Option<&B::Vector>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let be = &self.backend;
        let (d, ff) = (cfg.d_model, layer.geo.n_ff);
        let eps = cfg.rms_eps as f32;
        let dense = |w: &mut Workspace<B>| {
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
            )
        };
        let (Some(moe), Some(m)) = (&layer.moe, cfg.moe) else {
            dense(w)?;
            return be.residual_norm(
                &w.proj,
                &layer.post_ffn_norm,
                eps,
                n,
                d,
                &mut w.h,
                scale,
                next.map(|v| (v, &mut w.x)),
            );
        };
        // The router (its input and the experts' were normed with `x`), then the dense
        // feed-forward, whose last product the experts' first one may run beside: the two
        // branches meet in the closing norm.
        be.matmul(&w.x2, n, &moe.router, &mut w.router_logits)?;
        be.moe_route(
            &w.router_logits,
            n,
            m.n_experts,
            m.top_k,
            &moe.expert_scale,
            &mut w.route_w,
            &mut w.route_ids,
        )?;
        dense(w)?;
        be.next_beside_previous();
        be.moe_ffn(
            &w.x3,
            n,
            &moe.gate_up,
            &moe.down,
            m.n_experts,
            m.top_k,
            &w.route_w,
            &w.route_ids,
            &mut w.experts,
        )?;
        be.moe_residual_norm(
            (&w.proj, &moe.post_norm_1),
            (&w.experts, &moe.post_norm_2),
            &mut w.mix,
            &layer.post_ffn_norm,
            eps,
            n,
            d,
            &mut w.h,
            scale,
            next.map(|v| (v, &mut w.x)),
        )
    }
}

impl<B: Backend> StepModel for Gemma4<B> {
    type Backend = B;

    fn backend(&self) -> &B {
        &self.backend
    }

    /// One cache per KV-producing layer.
    fn caches(&self) -> Vec<(LayerKind, usize)> {
        self.caches.clone()
    }

    /// Every token needs a row in the embedding and per-layer tables.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            return Err(Error::Invalid(format!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.n_vocab
            )));
        }
        if let Some(p) = self.cfg.ple {
            if let Some(&t) = tokens.iter().find(|&&t| t as usize >= p.vocab) {
                return Err(Error::Invalid(format!(
                    "token id {t} is outside the per-layer embedding table of {}",
                    p.vocab
                )));
            }
        }
        Ok(())
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
        if kv.geometry != self.caches {
            return Err(Error::Invalid("KV cache belongs to another model".into()));
        }
        self.check_tokens(&l.tokens)?;
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

/// Every tensor of the model in HF spelling (without the `model.` prefix) with its PyTorch
/// shape; stacked experts are `[E, rows, cols]`.
pub(crate) fn hf_tensor_shapes(cfg: &Gemma4Config) -> Vec<(String, Vec<usize>)> {
    tensor_shapes(&Names { hf: true }, cfg)
}

/// Every tensor of the model in `names`' spelling with its PyTorch shape.
fn tensor_shapes(names: &Names, cfg: &Gemma4Config) -> Vec<(String, Vec<usize>)> {
    let g = names.globals();
    let (d, l, h) = (cfg.d_model, cfg.layers.len(), cfg.n_heads);
    let mut v: Vec<(String, Vec<usize>)> = vec![
        (g.embed.into(), vec![cfg.n_vocab, d]),
        (g.final_norm.into(), vec![d]),
    ];
    if let Some(p) = cfg.ple {
        v.push((g.ple_table.into(), vec![p.vocab, l * p.dim]));
        v.push((g.ple_model_proj.into(), vec![l * p.dim, d]));
        v.push((g.ple_proj_norm.into(), vec![p.dim]));
    }
    for (i, geo) in cfg.layers.iter().enumerate() {
        let n = names.layer(i);
        let (hd, kvd, ff) = (geo.head_dim, geo.n_kv_heads * geo.head_dim, geo.n_ff);
        v.extend([
            (n.attn_norm, vec![d]),
            (n.q, vec![h * hd, d]),
            (n.q_norm, vec![hd]),
            (n.o, vec![d, h * hd]),
            (n.post_attn_norm, vec![d]),
            (n.ffn_norm, vec![d]),
            (n.gate, vec![ff, d]),
            (n.up, vec![ff, d]),
            (n.down, vec![d, ff]),
            (n.post_ffn_norm, vec![d]),
            (n.scalar, vec![1]),
        ]);
        if geo.kv_source.is_none() {
            v.push((n.k, vec![kvd, d]));
            v.push((n.k_norm, vec![hd]));
            if geo.has_v {
                v.push((n.v, vec![kvd, d]));
            }
        }
        if let Some(p) = cfg.ple {
            v.extend([
                (n.ple_gate, vec![p.dim, d]),
                (n.ple_proj, vec![d, p.dim]),
                (n.ple_post_norm, vec![d]),
            ]);
        }
        if let Some(m) = cfg.moe {
            let (e, f) = (m.n_experts, m.expert_ff);
            v.extend([
                (n.router, vec![e, d]),
                (n.router_scale, vec![d]),
                (n.expert_scale, vec![e]),
                (n.gate_up_exps, vec![e, 2 * f, d]),
                (n.down_exps, vec![e, d, f]),
                (n.pre_ffn_norm_2, vec![d]),
                (n.post_ffn_norm_1, vec![d]),
                (n.post_ffn_norm_2, vec![d]),
            ]);
        }
    }
    v
}

/// PLE slice width (0 without PLE).
fn ple_width(cfg: &Gemma4Config) -> usize {
    cfg.ple.map_or(0, |p| p.dim)
}

/// A stacked expert tensor `[E, rows, cols]` (GGUF `{cols, rows, E}`) as one `[E·rows, cols]`
/// matrix (the bytes are the same).
fn expert_matrix(
    store: &WeightStore,
    name: &str,
    experts: usize,
    rows: usize,
    cols: usize,
) -> Result<HostMatrix> {
    let want = [experts, rows, cols];
    let (full, ty, shape, bytes) = match store {
        WeightStore::Synthetic(w) => {
            let t = w
                .tensors()
                .get(name)
                .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
            if t.shape != want {
                return Err(Error::BadTensor {
                    name: name.to_string(),
                    problem: format!("shape {:?}, expected {want:?}", t.shape),
                });
            }
            return w.matrix(name, experts * rows, cols);
        }
        WeightStore::Gguf(f) => {
            let t = f.tensor(name).ok_or_else(|| {
                let hint = if f.tensor(&name.replace("gate_up", "gate")).is_some() {
                    " (this GGUF stores ffn_gate_exps / ffn_up_exps separately; MarkBase reads the fused ffn_gate_up_exps)"
                } else {
                    ""
                };
                Error::MissingTensor(format!("{name}{hint}"))
            })?;
            let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
            let start = t.offset as usize;
            let bytes = markbase_core::backend::HostBytes::Mapped {
                map: f.mmap().clone(),
                range: start..start + t.n_bytes as usize,
            };
            (name.to_string(), t.dtype, shape, bytes)
        }
        WeightStore::Hf { st, prefix } => {
            let full = format!("{prefix}{name}");
            let t = st
                .get(&full)
                .ok_or_else(|| Error::MissingTensor(full.clone()))?;
            (full, t.dtype, t.shape.clone(), st.bytes(t))
        }
    };
    if shape != want {
        return Err(Error::BadTensor {
            name: full,
            problem: format!("shape {shape:?}, expected {want:?}"),
        });
    }
    let m = HostMatrix {
        name: full,
        ty,
        rows: experts * rows,
        cols,
        bytes,
    };
    m.check()?;
    Ok(m)
}

/// Names of the model-wide tensors.
struct GlobalNames {
    embed: &'static str,
    final_norm: &'static str,
    ple_table: &'static str,
    ple_model_proj: &'static str,
    ple_proj_norm: &'static str,
}

/// Names of one layer's tensors.
struct LayerNames {
    attn_norm: String,
    q: String,
    k: String,
    v: String,
    o: String,
    q_norm: String,
    k_norm: String,
    post_attn_norm: String,
    ffn_norm: String,
    gate: String,
    up: String,
    down: String,
    post_ffn_norm: String,
    scalar: String,
    ple_gate: String,
    ple_proj: String,
    ple_post_norm: String,
    router: String,
    router_scale: String,
    expert_scale: String,
    gate_up_exps: String,
    down_exps: String,
    pre_ffn_norm_2: String,
    post_ffn_norm_1: String,
    post_ffn_norm_2: String,
}

/// Tensor names in GGUF or HF spelling (HF names without the model prefix; gemma4.md §6.1).
struct Names {
    hf: bool,
}

impl Names {
    fn globals(&self) -> GlobalNames {
        if self.hf {
            GlobalNames {
                embed: "embed_tokens.weight",
                final_norm: "norm.weight",
                ple_table: "embed_tokens_per_layer.weight",
                ple_model_proj: "per_layer_model_projection.weight",
                ple_proj_norm: "per_layer_projection_norm.weight",
            }
        } else {
            GlobalNames {
                embed: "token_embd.weight",
                final_norm: "output_norm.weight",
                ple_table: "per_layer_token_embd.weight",
                ple_model_proj: "per_layer_model_proj.weight",
                ple_proj_norm: "per_layer_proj_norm.weight",
            }
        }
    }

    fn layer(&self, i: usize) -> LayerNames {
        let hf = |s: &str| format!("layers.{i}.{s}");
        let gg = |s: &str| format!("blk.{i}.{s}");
        if self.hf {
            LayerNames {
                attn_norm: hf("input_layernorm.weight"),
                q: hf("self_attn.q_proj.weight"),
                k: hf("self_attn.k_proj.weight"),
                v: hf("self_attn.v_proj.weight"),
                o: hf("self_attn.o_proj.weight"),
                q_norm: hf("self_attn.q_norm.weight"),
                k_norm: hf("self_attn.k_norm.weight"),
                post_attn_norm: hf("post_attention_layernorm.weight"),
                ffn_norm: hf("pre_feedforward_layernorm.weight"),
                gate: hf("mlp.gate_proj.weight"),
                up: hf("mlp.up_proj.weight"),
                down: hf("mlp.down_proj.weight"),
                post_ffn_norm: hf("post_feedforward_layernorm.weight"),
                scalar: hf("layer_scalar"),
                ple_gate: hf("per_layer_input_gate.weight"),
                ple_proj: hf("per_layer_projection.weight"),
                ple_post_norm: hf("post_per_layer_input_norm.weight"),
                router: hf("router.proj.weight"),
                router_scale: hf("router.scale"),
                expert_scale: hf("router.per_expert_scale"),
                gate_up_exps: hf("experts.gate_up_proj"),
                down_exps: hf("experts.down_proj"),
                pre_ffn_norm_2: hf("pre_feedforward_layernorm_2.weight"),
                post_ffn_norm_1: hf("post_feedforward_layernorm_1.weight"),
                post_ffn_norm_2: hf("post_feedforward_layernorm_2.weight"),
            }
        } else {
            LayerNames {
                attn_norm: gg("attn_norm.weight"),
                q: gg("attn_q.weight"),
                k: gg("attn_k.weight"),
                v: gg("attn_v.weight"),
                o: gg("attn_output.weight"),
                q_norm: gg("attn_q_norm.weight"),
                k_norm: gg("attn_k_norm.weight"),
                post_attn_norm: gg("post_attention_norm.weight"),
                ffn_norm: gg("ffn_norm.weight"),
                gate: gg("ffn_gate.weight"),
                up: gg("ffn_up.weight"),
                down: gg("ffn_down.weight"),
                post_ffn_norm: gg("post_ffw_norm.weight"),
                scalar: gg("layer_output_scale.weight"),
                ple_gate: gg("inp_gate.weight"),
                ple_proj: gg("proj.weight"),
                ple_post_norm: gg("post_norm.weight"),
                router: gg("ffn_gate_inp.weight"),
                router_scale: gg("ffn_gate_inp.scale"),
                expert_scale: gg("ffn_down_exps.scale"),
                gate_up_exps: gg("ffn_gate_up_exps.weight"),
                down_exps: gg("ffn_down_exps.weight"),
                pre_ffn_norm_2: gg("pre_ffw_norm_2.weight"),
                post_ffn_norm_1: gg("post_ffw_norm_1.weight"),
                post_ffn_norm_2: gg("post_ffw_norm_2.weight"),
            }
        }
    }
}
