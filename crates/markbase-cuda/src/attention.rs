//! Decode and prefill attention over the paged KV cache: the split-K kernels (attention.cu),
//! their variant that norms and turns the new queries and keys itself, the RoPE frequency
//! tables, and the checks on specs, RoPE and cache slots that the KV-writing kernels share.

use markbase_core::backend::{first_visible_key, AttnSpec, Backend, KvLayout, Rope, ValueRows};
use markbase_core::{Error, Result};

use crate::attention_flash::{attention_flash_suits, flash_kernel};
use crate::backend::{blocks, int, need, CudaBackend};
use crate::buffer::CudaBuffer;
use crate::kernels::{Arg, AttnArgs, Grid};
use crate::sources::Module;

/// Warps the attention kernel aims to keep busy (query rows × key splits × warps a block).
const ATTN_TARGET_WARPS: usize = 1024;

/// Warps of an attention block, sharing one query row's keys: `ATTN_ROW_WARPS` in
/// attention.cu.
const ATTN_ROW_WARPS: usize = 8;

/// Fewest keys a split of a row takes (four a warp of its block, eight times over) before the
/// row is split across blocks, which costs a second kernel merging their results.
const ATTN_MIN_CHUNK: usize = 4 * ATTN_ROW_WARPS * 8;

/// Largest head dimension (lanes hold head_dim / 32 ≤ 16 values).
const MAX_HEAD_DIM: usize = 512;

/// Whether the split-K attention kernels take `spec`: head_dim 32 · (1, 2, 4, 8 or 16), whole
/// query-head groups, a window of at least one key.
fn split_attention_suits(spec: &AttnSpec) -> bool {
    spec.head_dim.is_multiple_of(32)
        && [1, 2, 4, 8, 16].contains(&(spec.head_dim / 32))
        && spec.n_kv_heads > 0
        && spec.n_heads.is_multiple_of(spec.n_kv_heads)
        && spec.window != Some(0)
}

/// What `attn_rope_partial_*` takes besides `AttnArgs` (`AttnRope` in attention.cu): the
/// query norm, the RoPE table and the new keys and values, if any.
pub(crate) struct FusedRope<'a> {
    /// Query norm weights.
    pub(crate) q_norm: u64,
    /// The norms' epsilon.
    pub(crate) eps: f32,
    /// The RoPE frequencies (`rope_table`).
    pub(crate) freqs: u64,
    /// Pairs that turn.
    pub(crate) pairs: i32,
    /// The new keys and values; `None` on a layer that only reads the cache.
    pub(crate) new: Option<NewRows<'a>>,
}

/// A fused step's new keys and values on the device.
pub(crate) struct NewRows<'a> {
    /// Raw key rows.
    pub(crate) k: u64,
    /// Value rows (raw when `v_norm` is 1).
    pub(crate) v: u64,
    /// Key norm weights.
    pub(crate) k_norm: u64,
    /// 1: the values go through a weightless RMSNorm on the way to the cache.
    pub(crate) v_norm: i32,
    /// The cache row of each token.
    pub(crate) slots: &'a [u32],
}

/// Errors unless the RoPE kernels can turn heads of `head_dim` by `rope`.
pub(crate) fn check_rope(rope: &Rope, head_dim: usize) -> Result<()> {
    if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM || rope.rotated_pairs > head_dim / 2 {
        return Err(Error::Invalid(format!(
            "cuda rope: head_dim {head_dim} with {} rotated pairs",
            rope.rotated_pairs
        )));
    }
    Ok(())
}

/// The rows a KV-writing kernel reads the values from and its `v_norm` flag: normed values go
/// from the raw rows straight to the cache through the kernel's weightless RMSNorm (the
/// scratch is not used).
pub(crate) fn value_rows(v: ValueRows<'_, CudaBuffer>) -> (&CudaBuffer, i32) {
    match v {
        ValueRows::AsIs(v) => (v, 0),
        ValueRows::Normed { raw, .. } => (raw, 1),
    }
}

/// Errors unless a cache holds row `slots.max()` of width `row`.
pub(crate) fn check_slots(
    slots: &[u32],
    row: usize,
    k_cache: &CudaBuffer,
    v_cache: &CudaBuffer,
) -> Result<()> {
    match slots.iter().max() {
        Some(&s) => need(
            "kv cache",
            k_cache.len().min(v_cache.len()),
            (s as usize + 1) * row,
        ),
        None => Ok(()),
    }
}

impl CudaBackend {
    /// [`Backend::attention`], or with `fused` the split-K kernel's variant that norms and
    /// turns the raw queries (and the new keys, which it also stores) itself: the fused
    /// [`Backend::rope_attention`] of a step that [`CudaBackend::fuses_rope_attention`] accepts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_checked(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CudaBuffer,
        fused: Option<FusedRope<'_>>,
    ) -> Result<()> {
        let positions = layout.positions;
        let hd = spec.head_dim;
        if !split_attention_suits(spec) {
            return Err(Error::Invalid(format!(
                "cuda attention: unsupported spec {spec:?} (head_dim must be 32, 64, 128, 256 or 512)"
            )));
        }
        let len = positions.len() * spec.n_heads * hd;
        need("attention query", q.len(), len)?;
        need("attention output", out.len(), len)?;
        let block = layout.block_size * spec.n_kv_heads * hd;
        let n_blocks = k_cache.len().min(v_cache.len()) / block.max(1);
        layout.check(spec.window, n_blocks)?;
        if positions.is_empty() {
            return Ok(());
        }
        let flash =
            (fused.is_none() && self.dev.capability().0 >= 8 && attention_flash_suits(layout))
                .then(|| flash_kernel(hd, self.dev.max_block_shared()))
                .flatten();
        if let Some(kernel) = flash {
            return self.attention_flash(kernel, q, k_cache, v_cache, spec, layout, out);
        }
        let window = spec.window.unwrap_or(0);
        let max_vis = positions
            .iter()
            .map(|&p| {
                let p = p as usize;
                p - first_visible_key(p, spec.window) + 1
            })
            .max()
            .unwrap_or(1);
        let rows = positions.len() * spec.n_heads;
        let want = ATTN_TARGET_WARPS.div_ceil(rows * ATTN_ROW_WARPS).max(1);
        let chunk = max_vis.div_ceil(want).max(ATTN_MIN_CHUNK);
        let splits = max_vis.div_ceil(chunk);
        let mut s = self.scratch()?;
        let round = self.round_target(&mut s, (positions.len(), spec.n_heads * hd), false)?;
        let held = self.uploads()?;
        let pos = self.upload_idx(&held, positions)?;
        let seq_start = self.upload_idx(&held, layout.seq_start)?;
        let tables = self.upload_idx(&held, layout.block_tables)?;
        let part = if splits > 1 {
            s.floats.get(&self.dev.stream, rows * splits * (hd + 2))?
        } else {
            0
        };
        let args = AttnArgs {
            q: q.ptr,
            k_cache: k_cache.ptr,
            v_cache: v_cache.ptr,
            positions: pos,
            seq_start,
            block_tables: tables,
            out: out.ptr,
            part,
            n_tokens: int("tokens", positions.len())?,
            n_heads: spec.n_heads as i32,
            n_kv_heads: spec.n_kv_heads as i32,
            head_dim: hd as i32,
            scale: spec.scale,
            window: int("window", window)?,
            softcap: spec.softcap.unwrap_or(0.0),
            n_seqs: int("sequences", layout.n_seqs())?,
            table_width: int("table width", layout.table_width)?,
            block_size: int("block size", layout.block_size)?,
            chunk: chunk as i32,
            splits: splits as i32,
            rounded: round.at,
            round_kind: round.kind,
        };
        let grid = Grid::new(
            (int("attention rows", rows)? as u32, splits as u32),
            32 * ATTN_ROW_WARPS as u32,
        );
        match fused {
            None => {
                let name = match hd / 32 {
                    1 => "attn_partial_1",
                    2 => "attn_partial_2",
                    4 => "attn_partial_4",
                    8 => "attn_partial_8",
                    _ => "attn_partial_16",
                };
                self.run(Module::Attention, name, grid, &[Arg::Attn(args)])?;
            }
            Some(f) => {
                let name = match hd / 32 {
                    1 => "attn_rope_partial_1",
                    2 => "attn_rope_partial_2",
                    4 => "attn_rope_partial_4",
                    8 => "attn_rope_partial_8",
                    _ => "attn_rope_partial_16",
                };
                let (k, v, k_norm, v_norm, slots) = match f.new {
                    Some(r) => (
                        r.k,
                        r.v,
                        r.k_norm,
                        r.v_norm,
                        self.upload_idx(&held, r.slots)?,
                    ),
                    None => (0, 0, 0, 0, 0),
                };
                self.run(
                    Module::Attention,
                    name,
                    grid,
                    &[
                        Arg::Attn(args),
                        Arg::U64(k),
                        Arg::U64(v),
                        Arg::U64(f.q_norm),
                        Arg::U64(k_norm),
                        Arg::F32(f.eps),
                        Arg::U64(f.freqs),
                        Arg::I32(f.pairs),
                        Arg::I32(v_norm),
                        Arg::U64(slots),
                    ],
                )?;
            }
        }
        if splits > 1 {
            self.run(
                Module::Attention,
                "attn_combine",
                Grid::new((blocks(rows, 4), 1), 128),
                &[
                    Arg::U64(part),
                    Arg::I32(rows as i32),
                    Arg::I32(splits as i32),
                    Arg::I32(hd as i32),
                    Arg::U64(out.ptr),
                    Arg::U64(round.at),
                    Arg::I32(round.kind),
                ],
            )?;
        }
        s.rounded.hold(round, out.ptr, len, &self.queue);
        Ok(())
    }

    /// Whether [`Backend::rope_attention`] runs as one split-K kernel (`attn_rope_partial_*`)
    /// for this step: a decode step (no sequence brings more than one query row, so no row
    /// needs another row's new key, and the split-K path is the one attention takes) on a spec
    /// and RoPE the kernels take, whose new keys (if any) go to the very cache rows the layout
    /// maps their positions to (the kernel takes key `p` from registers, not from the cache).
    /// `slots`: the new keys' cache rows; `None` for a layer without new keys.
    pub fn fuses_rope_attention(
        &self,
        spec: &AttnSpec,
        rope: &Rope,
        layout: &KvLayout<'_>,
        slots: Option<&[u32]>,
    ) -> bool {
        let positions = layout.positions;
        let decode = !positions.is_empty()
            && layout.seq_start.first() == Some(&0)
            && layout.seq_start.last().map(|&l| l as usize) == Some(positions.len())
            && layout
                .seq_start
                .windows(2)
                .all(|w| w[0] <= w[1] && w[1] - w[0] <= 1);
        if !decode
            || !split_attention_suits(spec)
            || check_rope(rope, spec.head_dim).is_err()
            || attention_flash_suits(layout)
        {
            return false;
        }
        let Some(slots) = slots else {
            return true;
        };
        if slots.len() != positions.len() || layout.block_size == 0 {
            return false;
        }
        // Sequence s's one row is row seq_start[s].
        layout.seq_start.windows(2).enumerate().all(|(s, w)| {
            let t = w[0] as usize;
            if w[1] == w[0] {
                return true;
            }
            let p = positions[t] as usize;
            let entry = (p / layout.block_size < layout.table_width)
                .then(|| {
                    layout
                        .block_tables
                        .get(s * layout.table_width + p / layout.block_size)
                })
                .flatten();
            entry.is_some_and(|&b| {
                b as usize * layout.block_size + p % layout.block_size == slots[t] as usize
            })
        })
    }

    /// The device address of the RoPE frequencies `θ^(−2i/head_dim) / linear_factor` of the
    /// rotated pairs, computed on the host in f32 exactly as the CPU backend does (so both
    /// backends turn by bit-identical angles), uploaded once per parameter set.
    pub(crate) fn rope_table(&self, rope: &Rope, head_dim: usize) -> Result<u64> {
        let key = (
            rope.theta.to_bits(),
            rope.linear_factor.to_bits(),
            head_dim,
            rope.rotated_pairs,
        );
        let mut tables = self
            .rope_tables
            .lock()
            .map_err(|_| Error::Invalid("CUDA RoPE tables poisoned".into()))?;
        if let Some(t) = tables.get(&key) {
            return Ok(t.ptr);
        }
        let freqs: Vec<f32> = (0..rope.rotated_pairs)
            .map(|i| {
                let inv = 1.0 / rope.theta.powf((2 * i) as f32 / head_dim as f32);
                inv / rope.linear_factor
            })
            .collect();
        let t = self.load_vector(&freqs)?;
        let p = t.ptr;
        tables.insert(key, t);
        Ok(p)
    }
}
