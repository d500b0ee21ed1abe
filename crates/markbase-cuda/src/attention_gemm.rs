//! Prefill attention on the tensor cores. The split-K kernel gives each query row its own
//! warp walking the keys, which suits decode (one row per sequence) but reads every key and
//! value once per query row: a 4 096-token prompt read ≈ 1 TB of cache per pass of the layers.
//! Here, per sequence of the step: its visible keys and values are gathered into contiguous
//! rows once, then for each KV head a batched TF32 product gives the scores of that head's
//! query heads, `attn_softmax_rows` scales, soft-caps, masks and normalises them in place, and a
//! second batched product weights the values, writing the output rows in place.

use markbase_core::backend::{first_visible_key, AttnSpec, KvLayout};
use markbase_core::Result;

use crate::backend::{int, CudaBackend};
use crate::blas::{Blas, Operand};
use crate::buffer::CudaBuffer;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Fewest query rows every sequence of a step needs for [`CudaBackend::attention_gemm`]
/// (fewer, e.g. decode rows, take the split-K kernel).
pub const ATTN_GEMM_MIN_ROWS: usize = 32;
/// Most scores (f32) held at once: a sequence's query rows are taken in tiles that keep one
/// KV head's scores within this (256 MiB).
const MAX_SCORES: usize = 64 << 20;

/// Whether `layout` suits the products: at least one row, and every sequence with rows has
/// [`ATTN_GEMM_MIN_ROWS`] or more.
pub(crate) fn attention_gemm_suits(layout: &KvLayout<'_>) -> bool {
    let rows = layout.seq_start.windows(2).map(|w| (w[1] - w[0]) as usize);
    let mut any = false;
    for r in rows.filter(|&r| r > 0) {
        if r < ATTN_GEMM_MIN_ROWS {
            return false;
        }
        any = true;
    }
    any
}

/// Rounds a float count up to 64 (256-byte boundaries for the products' operands).
fn padded(n: usize) -> usize {
    n.div_ceil(64) * 64
}

impl CudaBackend {
    /// [`markbase_core::backend::Backend::attention`] through batched products (checked by the
    /// caller: spec, layout and buffer sizes).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_gemm(
        &self,
        blas: &Blas,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (hd, nh, kvh) = (spec.head_dim, spec.n_heads, spec.n_kv_heads);
        let (group, row) = (nh / kvh, kvh * hd);
        let window = spec.window.unwrap_or(0);
        let mut s = self.scratch()?;
        let positions = self.upload_idx(layout.positions)?;
        let tables = self.upload_idx(layout.block_tables)?;
        for seq in 0..layout.n_seqs() {
            let (r0, r1) = (
                layout.seq_start[seq] as usize,
                layout.seq_start[seq + 1] as usize,
            );
            let pos = &layout.positions[r0..r1];
            let (Some(&hi), Some(&lo)) = (pos.iter().max(), pos.iter().min()) else {
                continue;
            };
            let k_lo = first_visible_key(lo as usize, spec.window);
            let n_keys = hi as usize + 1 - k_lo;
            // Score rows start 128-byte aligned: cuBLASLt picks its fast kernels only for
            // aligned operands.
            let ld = n_keys.div_ceil(32) * 32;
            let tile = (MAX_SCORES / (group * ld)).clamp(1, r1 - r0);
            let keys = padded(n_keys * row);
            let base = s
                .floats
                .get(&self.dev.stream, 2 * keys + group * tile * ld)?;
            let (kg, vg, scores) = (base, base + 4 * keys as u64, base + 8 * keys as u64);
            self.run(
                Module::Attention,
                "kv_gather",
                Grid::new((int("keys", n_keys)? as u32, 1), 256),
                &[
                    Arg::U64(k_cache.ptr),
                    Arg::U64(v_cache.ptr),
                    Arg::U64(tables + 4 * (seq * layout.table_width) as u64),
                    Arg::I32(int("block size", layout.block_size)?),
                    Arg::I32(int("row", row)?),
                    Arg::I32(int("first key", k_lo)?),
                    Arg::U64(kg),
                    Arg::U64(vg),
                ],
            )?;
            // A KV head's keys / values: hd × n_keys column-major, shared by the batch.
            let kv_op = Operand {
                rows: hd,
                cols: n_keys,
                ld: row,
                stride: 0,
            };
            for t0 in (r0..r1).step_by(tile) {
                let nt = tile.min(r1 - t0);
                // Query / output rows of the batch's heads: hd × nt, one head to the next.
                let rows_op = Operand {
                    rows: hd,
                    cols: nt,
                    ld: nh * hd,
                    stride: hd,
                };
                let scores_op = Operand {
                    rows: n_keys,
                    cols: nt,
                    ld,
                    stride: nt * ld,
                };
                for g in 0..kvh {
                    let first = 4 * ((t0 * nh + g * group) * hd) as u64;
                    let head = 4 * (g * hd) as u64;
                    // SAFETY: every operand lies inside its buffer: the caller checked q and
                    // out against the rows, the scratch holds the gathered keys and a tile's
                    // scores.
                    self.queue_gemm(unsafe {
                        blas.gemm_batched_tf32(
                            true,
                            (kg + head, kv_op),
                            (q.ptr + first, rows_op),
                            (scores, scores_op),
                            group,
                        )
                    })?;
                    self.run(
                        Module::Attention,
                        "attn_softmax_rows",
                        Grid::new((int("score rows", group * nt)? as u32, 1), 256),
                        &[
                            Arg::U64(scores),
                            Arg::I32(int("keys", n_keys)?),
                            Arg::I32(int("score row stride", ld)?),
                            Arg::I32(int("first key", k_lo)?),
                            Arg::U64(positions + 4 * t0 as u64),
                            Arg::I32(int("rows", nt)?),
                            Arg::I32(int("window", window)?),
                            Arg::F32(spec.scale),
                            Arg::F32(spec.softcap.unwrap_or(0.0)),
                        ],
                    )?;
                    // SAFETY: as above.
                    self.queue_gemm(unsafe {
                        blas.gemm_batched_tf32(
                            false,
                            (vg + head, kv_op),
                            (scores, scores_op),
                            (out.ptr + first, rows_op),
                            group,
                        )
                    })?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout<'a>(seq_start: &'a [u32]) -> KvLayout<'a> {
        KvLayout {
            block_size: 16,
            positions: &[],
            seq_start,
            block_tables: &[],
            table_width: 0,
        }
    }

    #[test]
    fn products_take_steps_whose_sequences_all_have_many_rows() {
        let m = ATTN_GEMM_MIN_ROWS as u32;
        assert!(attention_gemm_suits(&layout(&[0, m])));
        assert!(attention_gemm_suits(&layout(&[0, m, m, 3 * m])));
        assert!(!attention_gemm_suits(&layout(&[0, m, m + 1])));
        assert!(!attention_gemm_suits(&layout(&[0, 0])));
        assert!(!attention_gemm_suits(&layout(&[0])));
    }
}
