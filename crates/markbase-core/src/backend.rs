//! The seam between model code and compute devices: a trait of coarse, fused operations.
//!
//! A model's forward is written once against [`Backend`]. Every buffer is owned by the backend
//! (host memory on the CPU, device memory on a GPU); the model allocates its buffers once — a
//! workspace sized for the largest batch of tokens it will run, plus the KV cache — and a forward
//! step then allocates nothing. Operations are *enqueued*: a GPU backend launches kernels on one
//! stream and never waits; the only host/device synchronisation of a step is
//! [`Backend::read`], which copies the logits back. On the CPU every call simply runs.
//!
//! Batches are "flat": an activation buffer holds `n` token rows of a fixed width, and
//! per-token positions / KV slots are passed explicitly, so one step carries tokens of several
//! sequences (decode tokens and prefill chunks together), each token's cache slots coming from
//! its sequence's block table ([`KvLayout`]).
//!
//! Shapes follow PyTorch: a weight matrix is `[n_out, k]`, row-major (ggml `{k, n_out}`).

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::GgmlType;
use crate::sampling::Draw;
use crate::{Error, Result};

/// Bytes of a stored tensor on the host: borrowed from a mapped file, or owned.
#[derive(Clone)]
pub enum HostBytes {
    /// A byte range of a memory-mapped file (zero-copy).
    Mapped {
        /// The mapped file.
        map: Arc<Mmap>,
        /// The tensor's bytes within it.
        range: Range<usize>,
    },
    /// Bytes produced at load time (e.g. a converted norm vector).
    Owned(Arc<[u8]>),
}

impl HostBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            HostBytes::Mapped { map, range } => &map[range.clone()],
            HostBytes::Owned(b) => b,
        }
    }
}

/// A weight matrix as stored: `rows` rows of `cols` weights in format `ty` (GGUF blocks as in
/// the file, or plain F32/F16/BF16 from safetensors).
#[derive(Clone)]
pub struct HostMatrix {
    /// Name, for error messages.
    pub name: String,
    /// Storage format.
    pub ty: GgmlType,
    /// Output rows (`n_out`).
    pub rows: usize,
    /// Weights per row (`k`).
    pub cols: usize,
    /// The data, `rows * ty.bytes_for(cols)` bytes.
    pub bytes: HostBytes,
}

impl HostMatrix {
    /// Checks that the byte length matches the shape and format.
    pub fn check(&self) -> Result<()> {
        let row = self.ty.bytes_for(self.cols).map_err(|e| Error::BadTensor {
            name: self.name.clone(),
            problem: e.to_string(),
        })?;
        let want = row * self.rows;
        let got = self.bytes.as_slice().len();
        if want != got {
            return Err(Error::BadTensor {
                name: self.name.clone(),
                problem: format!(
                    "{got} bytes for [{}, {}] {}; expected {want}",
                    self.rows, self.cols, self.ty
                ),
            });
        }
        Ok(())
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.as_slice().len() / self.rows.max(1)
    }
}

/// Where the rows of a [`Backend::copy_rows`] lie in a buffer: row `i` starts at
/// `offset + i · stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// Start of row 0.
    pub offset: usize,
    /// Distance between row starts.
    pub stride: usize,
}

impl Strided {
    /// Start of row `i`.
    pub fn at(&self, i: usize) -> usize {
        self.offset + i * self.stride
    }
}

/// Rotary position embedding parameters (half-split / NeoX pairing `(i, i + head_dim/2)`).
///
/// Pair `i` turns by `pos · θ^(−2i/head_dim) / linear_factor` for `i < rotated_pairs`; the
/// remaining pairs are left as they are. Gemma 3 rotates all `head_dim/2` pairs; Gemma 4's
/// proportional RoPE rotates only a leading part of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base θ.
    pub theta: f32,
    /// Linear position scaling (1 = none).
    pub linear_factor: f32,
    /// Pairs that rotate (at most `head_dim / 2`).
    pub rotated_pairs: usize,
}

/// Shape and masking of one attention call.
///
/// A query row at position `p` sees keys at positions `max(0, p − window + 1) ..= p` of its own
/// sequence (all of `0..=p` without a window); where those keys live is a [`KvLayout`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnSpec {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; query head `h` uses KV head `h / (n_heads / n_kv_heads)`.
    pub n_kv_heads: usize,
    /// Dimension of a head (≤ 512).
    pub head_dim: usize,
    /// Score multiplier (e.g. `query_pre_attn_scalar^-0.5`).
    pub scale: f32,
    /// Sliding window in keys, the current one included; `None` = full causal.
    pub window: Option<usize>,
    /// `cap · tanh(s / cap)` on scores, if set.
    pub softcap: Option<f32>,
}

/// The first key position a query at position `p` sees: under a sliding `window` (the
/// current key included) `p − window + 1`, at least 0; without one, 0.
pub fn first_visible_key(p: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (p + 1).saturating_sub(w))
}

/// Where the query rows of one step and their keys live in a paged KV cache.
///
/// A layer's cache is a run of blocks of `block_size` slots (`n_kv_heads · head_dim` values per
/// slot); slot `b · block_size + i` is slot `i` of block `b`. The step's query rows are grouped
/// by sequence: rows `seq_start[s] .. seq_start[s + 1]` belong to sequence `s` (so
/// `seq_start.len()` is the number of sequences + 1 and its last entry the number of rows).
/// Row `t` sits at position `positions[t]`. Sequence `s` keeps key position `j` in block
/// `block_tables[s · table_width + j / block_size]`, slot `j % block_size` of it. Only the
/// entries of blocks a query can see are read (a sliding layer's table may hold anything,
/// e.g. `u32::MAX`, for blocks that left the window).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout<'a> {
    /// Slots per block.
    pub block_size: usize,
    /// Position of each query row.
    pub positions: &'a [u32],
    /// First row of each sequence, then the row count.
    pub seq_start: &'a [u32],
    /// Row-major `[sequences, table_width]` block tables.
    pub block_tables: &'a [u32],
    /// Entries per sequence in `block_tables`.
    pub table_width: usize,
}

impl KvLayout<'_> {
    /// Sequences in the step.
    pub fn n_seqs(&self) -> usize {
        self.seq_start.len().saturating_sub(1)
    }

    /// Checks the layout's own consistency and that every block a query of a layer with
    /// `window` can see lies in a cache of `n_blocks` blocks.
    pub fn check(&self, window: Option<usize>, n_blocks: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Invalid(format!("kv layout: {what}")));
        if self.block_size == 0 {
            return bad("block size 0".into());
        }
        let n = self.positions.len();
        if self.seq_start.first() != Some(&0)
            || self.seq_start.last().map(|&l| l as usize) != Some(n)
            || self.seq_start.windows(2).any(|w| w[0] > w[1])
        {
            return bad(format!(
                "sequence starts {:?} do not split {n} rows",
                self.seq_start
            ));
        }
        if self.block_tables.len() < self.n_seqs() * self.table_width {
            return bad(format!(
                "{} table entries for {} sequences of {}",
                self.block_tables.len(),
                self.n_seqs(),
                self.table_width
            ));
        }
        for s in 0..self.n_seqs() {
            let table = &self.block_tables[s * self.table_width..][..self.table_width];
            let rows = self.seq_start[s] as usize..self.seq_start[s + 1] as usize;
            for &p in &self.positions[rows] {
                let p = p as usize;
                let lo = first_visible_key(p, window);
                for b in lo / self.block_size..=p / self.block_size {
                    match table.get(b) {
                        Some(&id) if (id as usize) < n_blocks => {}
                        Some(&id) => {
                            return bad(format!(
                                "sequence {s} maps block {b} to {id}, outside the {n_blocks} blocks"
                            ))
                        }
                        None => {
                            return bad(format!(
                                "position {p} of sequence {s} is beyond its table of {} blocks",
                                self.table_width
                            ))
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The value rows that [`Backend::rope_write_kv`] and [`Backend::rope_attention`] write to the
/// cache.
pub enum ValueRows<'a, Buf> {
    /// Stored as they are.
    AsIs(&'a Buf),
    /// Each value head through a weightless RMSNorm first (Gemma 4's `v_norm`, with the
    /// norms' epsilon). `scratch` (as large as `raw`) may receive the normed rows on the way;
    /// a backend that norms them straight into the cache leaves it as it was.
    Normed {
        /// The value projection's rows.
        raw: &'a Buf,
        /// Room for the normed rows.
        scratch: &'a mut Buf,
    },
}

/// The new keys and values a layer brings to the cache in [`Backend::rope_attention`]: its
/// raw key rows `k` (`n_kv_heads · head_dim` per token), normed with `k_norm` and turned by
/// RoPE, and its value rows `v`, both written to cache rows `slots[t]`.
pub struct NewKv<'a, B: Backend + ?Sized> {
    /// The key projection's rows (contents unspecified afterwards).
    pub k: &'a mut B::Buffer,
    /// The value rows.
    pub v: ValueRows<'a, B::Buffer>,
    /// The per-head key norm's weights.
    pub k_norm: &'a B::Vector,
    /// The cache row of each token: the slot `layout` maps its position to.
    pub slots: &'a [u32],
}

/// What [`Backend::rms_norm`] does with its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormOut {
    /// `out = norm(x)`.
    Write,
    /// `out += norm(x)` (fused residual add).
    AddTo,
}

/// A compute device: owns buffers and weights and runs the fused operations of a forward pass.
///
/// Lengths are in f32 elements; `n` counts token rows. Implementations check sizes and return
/// [`Error::Invalid`] on a mismatch rather than panic.
pub trait Backend: Send + Sync {
    /// An activation buffer (f32 on the CPU; a device allocation on a GPU).
    type Buffer: Send + Sync;
    /// A weight matrix ready for [`Backend::matmul`] / [`Backend::embed`].
    type Matrix: Send + Sync;
    /// A small f32 vector (norm weights).
    type Vector: Send + Sync;

    /// A short name ("cpu", "cuda:0").
    fn name(&self) -> String;
    /// Prepares a stored matrix (the CPU uses the mapped bytes in place and touches every page;
    /// a GPU copies the blocks to device memory as stored).
    fn load_matrix(&self, m: &HostMatrix) -> Result<Self::Matrix>;
    /// Prepares a vector of f32 values.
    fn load_vector(&self, v: &[f32]) -> Result<Self::Vector>;
    /// A zeroed buffer of `len` f32.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;

    /// `out[t] = table[tokens[t]] · scale` (gather, dequantize, scale) for each token.
    fn embed(
        &self,
        table: &Self::Matrix,
        tokens: &[u32],
        scale: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// Row-wise RMSNorm of `n` rows of `dim`: `x · rsqrt(mean(x²) + eps) · weight` (no weight:
    /// plain normalisation), written to or added into `out` per [`NormOut`].
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: Option<&Self::Vector>,
        eps: f32,
        n: usize,
        dim: usize,
        out: &mut Self::Buffer,
        mode: NormOut,
    ) -> Result<()>;
    /// A block's closing residual and the next block's opening norm in one pass over `n` rows
    /// of `dim`: `h = (h + rms_norm(y) · weight) · scale`, then with `next = Some((w, x))`
    /// `x = rms_norm(h) · w` (a layer's post-norm, residual add and layer scalar, then the
    /// following pre-norm). The default is [`Backend::rms_norm`] twice and [`Backend::scale`];
    /// a backend may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn residual_norm(
        &self,
        y: &Self::Buffer,
        weight: &Self::Vector,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut Self::Buffer,
        scale: f32,
        next: Option<(&Self::Vector, &mut Self::Buffer)>,
    ) -> Result<()> {
        self.rms_norm(y, Some(weight), eps, n, dim, h, NormOut::AddTo)?;
        if scale != 1.0 {
            self.scale(h, scale, n * dim)?;
        }
        match next {
            Some((w, x)) => self.rms_norm(h, Some(w), eps, n, dim, x, NormOut::Write),
            None => Ok(()),
        }
    }
    /// A hint that the next operation neither reads what the operation before it writes nor
    /// writes what that one reads or writes, so a backend may run the two at the same time
    /// (the CUDA backend: where the next operation's first kernel can start beside the kernel
    /// ahead). Operations after the next one wait for both as usual. The default ignores it.
    fn next_beside_previous(&self) {}
    /// [`Backend::residual_norm`] with its next norm and `extra` norms more of the new `h`,
    /// each `out = rms_norm(h) · gain` (a mixture-of-experts layer's router and expert-input
    /// norms beside its feed-forward's). The default is [`Backend::residual_norm`], then
    /// [`Backend::rms_norm`] for each extra; a backend may compute them in one pass (the same
    /// `rms(h)`) and may support only a few extras (an error says so).
    #[allow(clippy::too_many_arguments)]
    fn residual_norms(
        &self,
        y: &Self::Buffer,
        weight: &Self::Vector,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut Self::Buffer,
        scale: f32,
        next: (&Self::Vector, &mut Self::Buffer),
        extra: &mut [(&Self::Vector, &mut Self::Buffer)],
    ) -> Result<()> {
        self.residual_norm(y, weight, eps, n, dim, h, scale, Some(next))?;
        for (w, out) in extra.iter_mut() {
            self.rms_norm(h, Some(w), eps, n, dim, out, NormOut::Write)?;
        }
        Ok(())
    }
    /// A mixture-of-experts layer's closing (Gemma 4 26B-A4B): [`Backend::residual_norm`] of
    /// `y = rms_norm(dense) · w_dense + rms_norm(experts) · w_experts` over `n` rows of `dim`
    /// (the dense feed-forward's and the experts' post-norms, summed, before the layer's
    /// post-norm `weight`). The default writes `y` into `mix` ([`Backend::rms_norm`] twice)
    /// and calls [`Backend::residual_norm`]; a backend may fuse them, leaving `mix` as it was.
    #[allow(clippy::too_many_arguments)]
    fn moe_residual_norm(
        &self,
        (dense, w_dense): (&Self::Buffer, &Self::Vector),
        (experts, w_experts): (&Self::Buffer, &Self::Vector),
        mix: &mut Self::Buffer,
        weight: &Self::Vector,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut Self::Buffer,
        scale: f32,
        next: Option<(&Self::Vector, &mut Self::Buffer)>,
    ) -> Result<()> {
        self.rms_norm(dense, Some(w_dense), eps, n, dim, mix, NormOut::Write)?;
        self.rms_norm(experts, Some(w_experts), eps, n, dim, mix, NormOut::AddTo)?;
        self.residual_norm(mix, weight, eps, n, dim, h, scale, next)
    }
    /// `out[n, w.rows] = x[n, w.cols] · wᵀ`, any stored format (decode: one dot per weight row;
    /// prefill: each weight row is read once for all `n` tokens).
    fn matmul(
        &self,
        x: &Self::Buffer,
        n: usize,
        w: &Self::Matrix,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// Several products of the same activations, `out = x · wᵀ` for each `(w, out)` of
    /// `products` (`n` rows; e.g. a layer's q, k and v projections). The default runs them one
    /// by one; a backend may share work between them (one launch, one rounding of `x`).
    fn matmul_many(
        &self,
        x: &Self::Buffer,
        n: usize,
        products: &mut [(&Self::Matrix, &mut Self::Buffer)],
    ) -> Result<()> {
        for (w, out) in products.iter_mut() {
            self.matmul(x, n, w, out)?;
        }
        Ok(())
    }
    /// A coarse copy of a large LM head (`head`, as stored) in this backend's screening format,
    /// for [`Backend::matmul_screened`]; `None` where the backend does not screen (the
    /// default) or the head's shape does not suit its format.
    fn load_screen(&self, head: &HostMatrix) -> Result<Option<Self::Matrix>> {
        let _ = head;
        Ok(None)
    }
    /// An LM head with a coarse twin: `out[n, exact.rows] = x · exactᵀ` where only the
    /// `top_k` largest logits of each row (as `coarse` ranks them) are guaranteed to be computed
    /// from `exact`; the others may come from `coarse`, a low-bit copy of the same matrix
    /// ([`Backend::load_screen`]).
    /// Reading the small copy for every row and the exact rows only for the leaders is what
    /// makes a huge-vocabulary head fast where memory bandwidth is scarce. The default computes
    /// every logit from `exact`.
    fn matmul_screened(
        &self,
        x: &Self::Buffer,
        n: usize,
        coarse: &Self::Matrix,
        exact: &Self::Matrix,
        top_k: usize,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (coarse, top_k);
        self.matmul(x, n, exact, out)
    }
    /// The greedy pick of each of `n` rows of `x · exactᵀ` (`n_vocab = exact.rows`): the index
    /// of the largest logit (ties: the lowest index), with `coarse` ranking the vocabulary as
    /// in [`Backend::matmul_screened`], whose result `logits` may receive as scratch. A backend
    /// may decide a row from fewer exact leaders than `top_k` when the coarse logits leave no
    /// doubt. The default is `matmul_screened` then [`Backend::argmax`].
    #[allow(clippy::too_many_arguments)]
    fn argmax_screened(
        &self,
        x: &Self::Buffer,
        n: usize,
        coarse: &Self::Matrix,
        exact: &Self::Matrix,
        top_k: usize,
        n_vocab: usize,
        logits: &mut Self::Buffer,
    ) -> Result<Vec<u32>> {
        self.matmul_screened(x, n, coarse, exact, top_k, logits)?;
        self.argmax(logits, n, n_vocab)
    }
    /// In place on `n` tokens × `n_heads` heads of `head_dim`: optional per-head RMSNorm with
    /// `norm = (weight, eps)`, then RoPE at `positions[t]`.
    #[allow(clippy::too_many_arguments)]
    fn head_norm_rope(
        &self,
        x: &mut Self::Buffer,
        n_heads: usize,
        head_dim: usize,
        norm: Option<(&Self::Vector, f32)>,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()>;
    /// A layer's queries and new keys and values, between the q/k/v products and attention:
    /// per-head RMSNorm of `q` and `k` (weights `norms.0`, `norms.1`, epsilon `norms.2`), then
    /// RoPE at `positions[t]`, both in place; then `k` and `v` (see [`ValueRows`]) written to
    /// cache rows `slots[t]`. Head counts and width come from `spec`. The default is two
    /// [`Backend::head_norm_rope`]s, the value norm (if any) and [`Backend::write_kv`]; a
    /// backend may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        q: &mut Self::Buffer,
        k: &mut Self::Buffer,
        v: ValueRows<'_, Self::Buffer>,
        spec: &AttnSpec,
        norms: (&Self::Vector, &Self::Vector, f32),
        rope: &Rope,
        positions: &[u32],
        slots: &[u32],
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    ) -> Result<()> {
        let (q_norm, k_norm, eps) = norms;
        let (hd, kvh) = (spec.head_dim, spec.n_kv_heads);
        self.head_norm_rope(q, spec.n_heads, hd, Some((q_norm, eps)), rope, positions)?;
        self.head_norm_rope(k, kvh, hd, Some((k_norm, eps)), rope, positions)?;
        let v = match v {
            ValueRows::AsIs(v) => v,
            ValueRows::Normed { raw, scratch } => {
                let rows = positions.len() * kvh;
                self.rms_norm(raw, None, eps, rows, hd, scratch, NormOut::Write)?;
                &*scratch
            }
        };
        self.write_kv(k, v, kvh * hd, slots, k_cache, v_cache)
    }
    /// Copies `n = slots.len()` rows of `k` and `v` (width `row`) into cache rows `slots[t]`
    /// (with a paged cache: `block · block_size + offset`, see [`KvLayout`]).
    #[allow(clippy::too_many_arguments)]
    fn write_kv(
        &self,
        k: &Self::Buffer,
        v: &Self::Buffer,
        row: usize,
        slots: &[u32],
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    ) -> Result<()>;
    /// Softmax attention of the `layout.positions.len()` query rows `q` (`n_heads · head_dim`
    /// wide) over the paged cache (`n_kv_heads · head_dim` per slot), per [`AttnSpec`], each
    /// row over its own sequence's keys; `out` like `q`.
    fn attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// A layer's attention from its raw query rows `q`: per-head RMSNorm of `q` (weights
    /// `q_norm`, epsilon `eps`) and RoPE at `layout.positions[t]`; with `new_kv`, its keys
    /// normed and turned alike (weights `k_norm`, the same `eps`) and written with its values
    /// to the cache (as [`Backend::rope_write_kv`]); then [`Backend::attention`] into `out`.
    /// Without `new_kv` (a layer reading another layer's cache) the cache is only read.
    /// Afterwards the contents of `q` and of `new_kv`'s `k` (and a [`ValueRows::Normed`]
    /// scratch) are unspecified: a backend may leave them raw. The default is
    /// [`rope_attention_in_steps`]; a backend may fuse it into one pass, e.g. for decode steps.
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        q: &mut Self::Buffer,
        q_norm: &Self::Vector,
        eps: f32,
        new_kv: Option<NewKv<'_, Self>>,
        rope: &Rope,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        rope_attention_in_steps(
            self, q, q_norm, eps, new_kv, rope, spec, layout, k_cache, v_cache, out,
        )
    }
    /// Mixture-of-experts routing of `n` tokens, each a row of `n_experts` router logits:
    /// softmax over all experts, keep the `top_k` most probable (ties: lower id first),
    /// renormalise those probabilities to sum 1 and multiply each by `expert_scale[e]`. Writes
    /// per token `top_k` weights to `weights` and the chosen expert ids (as f32) to `ids`.
    #[allow(clippy::too_many_arguments)]
    fn moe_route(
        &self,
        logits: &Self::Buffer,
        n: usize,
        n_experts: usize,
        top_k: usize,
        expert_scale: &Self::Vector,
        weights: &mut Self::Buffer,
        ids: &mut Self::Buffer,
    ) -> Result<()>;
    /// Routed expert MLPs of `n` tokens: `out[t] = Σ_j weights[t·top_k + j] ·
    /// expert_{ids[t·top_k + j]}(x[t])` with `expert_e(x) = down_e(gelu_tanh(gate_e x) ⊙ up_e x)`.
    /// `gate_up` stacks the experts as `[E·2F, D]` (expert `e`: gate rows `e·2F .. e·2F + F`,
    /// then its `F` up rows); `down` as `[E·D, F]`.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &self,
        x: &Self::Buffer,
        n: usize,
        gate_up: &Self::Matrix,
        down: &Self::Matrix,
        n_experts: usize,
        top_k: usize,
        weights: &Self::Buffer,
        ids: &Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]`.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_off: usize,
        dst: &mut Self::Buffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()>;
    /// `rows` copies of `len` values, row `i` from `src[from.at(i)..]` to `dst[to.at(i)..]`
    /// (e.g. one layer's slice of every token's per-layer inputs). The default copies row by
    /// row; a device backend queues one operation.
    fn copy_rows(
        &self,
        src: &Self::Buffer,
        from: Strided,
        dst: &mut Self::Buffer,
        to: Strided,
        rows: usize,
        len: usize,
    ) -> Result<()> {
        for i in 0..rows {
            self.copy(src, from.at(i), dst, to.at(i), len)?;
        }
        Ok(())
    }
    /// The gated feed-forward's first half for `n` rows of `x`: `gate_out = gelu_tanh(x ·
    /// gateᵀ) ⊙ (x · upᵀ)`, `n × ff` values where `ff` is the rows of `gate` and `up`;
    /// `up_out` (as large) is scratch. The default is two [`Backend::matmul`]s and
    /// [`Backend::gelu_tanh_mul`]; a backend may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn gelu_gated_matmul(
        &self,
        x: &Self::Buffer,
        n: usize,
        gate: &Self::Matrix,
        up: &Self::Matrix,
        ff: usize,
        gate_out: &mut Self::Buffer,
        up_out: &mut Self::Buffer,
    ) -> Result<()> {
        self.matmul(x, n, gate, gate_out)?;
        self.matmul(x, n, up, up_out)?;
        self.gelu_tanh_mul(gate_out, up_out, n * ff)
    }
    /// The gated feed-forward of `n` rows of `x`: `out = (gelu_tanh(x · gateᵀ) ⊙ (x · upᵀ)) ·
    /// downᵀ`, where `ff` is the rows of `gate` and `up` and the columns of `down`; `gate_out`
    /// and `up_out` (`n × ff` each) are scratch. The default is
    /// [`Backend::gelu_gated_matmul`] then [`Backend::matmul`]; a backend may keep the `n × ff`
    /// activations in a narrower type between the products.
    #[allow(clippy::too_many_arguments)]
    fn gated_ffn(
        &self,
        x: &Self::Buffer,
        n: usize,
        gate: &Self::Matrix,
        up: &Self::Matrix,
        down: &Self::Matrix,
        ff: usize,
        gate_out: &mut Self::Buffer,
        up_out: &mut Self::Buffer,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        self.gelu_gated_matmul(x, n, gate, up, ff, gate_out, up_out)?;
        self.matmul(gate_out, n, down, out)
    }
    /// `out[t, r] = gelu_tanh(x_t · w_r) · other[from.offset + t·from.stride + r]` for `n`
    /// token rows and the `rows` rows of `w` (Gemma 4's per-layer-input gate times the layer's
    /// slice of the per-layer inputs). The default copies the slice into `scratch` (`n × rows`), runs
    /// [`Backend::matmul`] and [`Backend::gelu_tanh_mul`]; a backend may read the slice in
    /// place and fuse them (leaving `scratch` untouched).
    #[allow(clippy::too_many_arguments)]
    fn gelu_matmul_mul(
        &self,
        x: &Self::Buffer,
        n: usize,
        w: &Self::Matrix,
        rows: usize,
        other: &Self::Buffer,
        from: Strided,
        out: &mut Self::Buffer,
        scratch: &mut Self::Buffer,
    ) -> Result<()> {
        gelu_matmul_mul_in_steps(self, x, n, w, rows, other, from, out, scratch)
    }
    /// `gate[i] = gelu_tanh(gate[i]) · up[i]` for `i < len`.
    fn gelu_tanh_mul(&self, gate: &mut Self::Buffer, up: &Self::Buffer, len: usize) -> Result<()>;
    /// `x[i] += y[i]` for `i < len`.
    fn add(&self, x: &mut Self::Buffer, y: &Self::Buffer, len: usize) -> Result<()>;
    /// `x[i] *= s` for `i < len`.
    fn scale(&self, x: &mut Self::Buffer, s: f32, len: usize) -> Result<()>;
    /// `x[i] = cap · tanh(x[i] / cap)` for `i < len`.
    fn softcap(&self, x: &mut Self::Buffer, cap: f32, len: usize) -> Result<()>;
    /// Copies host values into the start of `dst` (asynchronous on a GPU).
    fn write(&self, src: &[f32], dst: &mut Self::Buffer) -> Result<()>;
    /// The index of the largest of each of `rows` rows of `n` values of `x` (ties: the lowest
    /// index; NaN never wins), computed where `x` lives: only the indices come back to the host
    /// (a step's one synchronisation, as [`Backend::read`]).
    fn argmax(&self, x: &Self::Buffer, rows: usize, n: usize) -> Result<Vec<u32>>;
    /// The token each of `rows` rows of `n` values of `x` picks under its draw (`draws[r]`:
    /// [`crate::sampling::pick`], greedy at temperature 0). A GPU backend picks where `x` lives,
    /// so only the ids come back (a step's one synchronisation, as [`Backend::read`]); this
    /// default reads the rows to the host and picks there.
    fn sample(&self, x: &Self::Buffer, rows: usize, n: usize, draws: &[Draw]) -> Result<Vec<u32>> {
        if draws.len() != rows {
            return Err(Error::Invalid(format!(
                "sample: {} draws for {rows} rows",
                draws.len()
            )));
        }
        draws.iter().try_for_each(Draw::check)?;
        let mut host = vec![0f32; rows * n];
        self.read(x, &mut host)?;
        let mut cand = Vec::new();
        Ok(host
            .chunks(n.max(1))
            .zip(draws)
            .map(|(row, d)| crate::sampling::pick(d, &mut cand, row))
            .collect())
    }
    /// Copies the first `dst.len()` values of `x` to the host — the step's one synchronisation.
    fn read(&self, x: &Self::Buffer, dst: &mut [f32]) -> Result<()>;
}

/// [`Backend::gelu_matmul_mul`] as three operations: the slice copied into `scratch`, the
/// product into `out`, then [`Backend::gelu_tanh_mul`].
#[allow(clippy::too_many_arguments)]
pub fn gelu_matmul_mul_in_steps<B: Backend + ?Sized>(
    be: &B,
    x: &B::Buffer,
    n: usize,
    w: &B::Matrix,
    rows: usize,
    other: &B::Buffer,
    from: Strided,
    out: &mut B::Buffer,
    scratch: &mut B::Buffer,
) -> Result<()> {
    let to = Strided {
        offset: 0,
        stride: rows,
    };
    be.copy_rows(other, from, scratch, to, n, rows)?;
    be.matmul(x, n, w, out)?;
    be.gelu_tanh_mul(out, scratch, n * rows)
}

/// [`Backend::rope_attention`] as two operations: [`Backend::rope_write_kv`] (or, without
/// new keys, [`Backend::head_norm_rope`] of the queries), then [`Backend::attention`].
#[allow(clippy::too_many_arguments)]
pub fn rope_attention_in_steps<B: Backend + ?Sized>(
    be: &B,
    q: &mut B::Buffer,
    q_norm: &B::Vector,
    eps: f32,
    new_kv: Option<NewKv<'_, B>>,
    rope: &Rope,
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    k_cache: &mut B::Buffer,
    v_cache: &mut B::Buffer,
    out: &mut B::Buffer,
) -> Result<()> {
    let positions = layout.positions;
    match new_kv {
        Some(NewKv {
            k,
            v,
            k_norm,
            slots,
        }) => be.rope_write_kv(
            q,
            k,
            v,
            spec,
            (q_norm, k_norm, eps),
            rope,
            positions,
            slots,
            k_cache,
            v_cache,
        )?,
        None => be.head_norm_rope(
            q,
            spec.n_heads,
            spec.head_dim,
            Some((q_norm, eps)),
            rope,
            positions,
        )?,
    }
    be.attention(q, k_cache, v_cache, spec, layout, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_hides_keys_before_it() {
        assert_eq!(first_visible_key(100, None), 0);
        assert_eq!(first_visible_key(100, Some(8)), 93);
        assert_eq!(first_visible_key(3, Some(8)), 0);
        assert_eq!(first_visible_key(7, Some(1)), 7);
    }
}
