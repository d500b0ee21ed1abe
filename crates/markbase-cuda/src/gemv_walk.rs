//! The gated feed-forward's first half for one token row of Q4_K, Q5_K or Q6_K weights (or Q8_0,
//! Q4_0 or Q5_0 weights of whole 256-value units), and the product of one token row with a
//! matrix of many rows (an LM head), as walks (kernels/gemv_walk.cu): each warp walks groups of row pairs (a gate row
//! and its up row; or rows r and rows/2 + r of one matrix) grid-stride, their 16- or 32-byte
//! slices dealt evenly to its lanes, several slices' loads in flight a lane. Each block holds
//! the activations as Q4_K tiles in dynamic shared memory: copied from the producer's
//! (`gemv_q4k_tiles`), or quantized from the row.

use cudarc::driver::CudaFunction;
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::{blocks, int, CudaBackend};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Warps of a block.
const BLOCK_WARPS: usize = 8;

/// Shared memory a block holds one activation row of `k` values in: 640 bytes a 256-value
/// unit (common.cuh, `q4k_tiles_row_bytes`).
fn tiles_bytes(k: usize) -> usize {
    640 * (k / 256)
}

/// Row pairs of a warp's group for rows `k` values wide: 1 where the pair's slices (8 a unit,
/// 2 rows) fall evenly on the 32 lanes, else 2.
fn pairs_per_group(k: usize) -> usize {
    if (k / 256).is_multiple_of(2) {
        1
    } else {
        2
    }
}

/// Rows from which a one-token product of a walk's format walks its matrix as two halves
/// (`gemv_halves_walk`): LM heads (E4B's 262 144 rows ran at 1.9 TB/s as `gemv`, docs/perf.md
/// session 30). Smaller matrices measured no faster on the walk (session 28).
pub(crate) const HALVES_WALK_MIN_ROWS: usize = 65_536;

impl CudaBackend {
    /// `out = gelu_tanh(gate · x) · (up · x)` for one token row `x` (shapes checked by the
    /// caller: rows of `gemv_takes_16_bit_activations`);
    /// `tiles`: the row's Q4_K tiles, or 0. As many blocks as the groups need, at most as many
    /// as are resident at once.
    pub(crate) fn gemv_gelu_walk(
        &self,
        x: u64,
        (gate, up): (&CudaMatrix, &CudaMatrix),
        out: u64,
        tiles: u64,
    ) -> Result<()> {
        let k = gate.cols;
        let (f, grid) = self.walk_kernel("gemv_gelu_walk", gate.ty, k, gate.rows)?;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::U64(gate.ptr),
                Arg::U64(up.ptr),
                Arg::U64(gate.row_bytes as u64),
                Arg::I32(int("rows", gate.rows)?),
                Arg::I32(int("cols", k)?),
                Arg::U64(x),
                Arg::U64(out),
                Arg::U64(tiles),
            ],
        )
    }

    /// `out = w · x` for one token row `x` and a matrix of a walk's format of an even number of
    /// rows (shapes checked by the caller), walked as the pairs of its two halves; `tiles` as
    /// for [`CudaBackend::gemv_gelu_walk`].
    pub(crate) fn gemv_halves_walk(
        &self,
        x: u64,
        w: &CudaMatrix,
        out: u64,
        tiles: u64,
    ) -> Result<()> {
        let (k, half) = (w.cols, w.rows / 2);
        let (f, grid) = self.walk_kernel("gemv_halves_walk", w.ty, k, half)?;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::U64(w.ptr),
                Arg::U64(w.row_bytes as u64),
                Arg::I32(int("rows", half)?),
                Arg::I32(int("cols", k)?),
                Arg::U64(x),
                Arg::U64(out),
                Arg::U64(tiles),
            ],
        )
    }

    /// The walk kernel `prefix` for `pairs` row pairs of `k` values stored as `ty`, and its
    /// grid: as many blocks as the groups need, at most as many as are resident at once.
    fn walk_kernel(
        &self,
        prefix: &'static str,
        ty: GgmlType,
        k: usize,
        pairs: usize,
    ) -> Result<(CudaFunction, Grid)> {
        let p = pairs_per_group(k);
        let shared = tiles_bytes(k) as u32;
        if shared > self.dev.max_block_shared() {
            return Err(Error::Unsupported(format!(
                "cuda {prefix}: rows of {k} values need {shared} bytes of shared memory a block \
                 for one token row of {ty} weights, more than the GPU's {}",
                self.dev.max_block_shared()
            )));
        }
        let f = self
            .kernels
            .func_for_with_shared(Module::Gemv, prefix, ty, p as u32, shared)?;
        let threads = 32 * BLOCK_WARPS as u32;
        let key = (prefix, ty, p as u32, shared);
        let resident = self.resident_blocks(key, &f, threads)?;
        let groups = pairs.div_ceil(p);
        let mut grid = Grid::new((blocks(groups, BLOCK_WARPS).min(resident), 1), threads);
        grid.shared = shared;
        Ok((f, grid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lane_gets_the_same_units() {
        // E2B's, E4B's, 26B-A4B's and 31B's widths (6, 10, 11 and 21 super-blocks), 256.
        for (k, want) in [(1536, 1), (2560, 1), (2816, 2), (5376, 2), (256, 2)] {
            let p = pairs_per_group(k);
            assert_eq!(p, want, "k = {k}");
            assert_eq!(2 * p * (k / 256) * 8 % 32, 0, "k = {k}");
        }
        assert_eq!(tiles_bytes(2560), 6_400);
    }
}
