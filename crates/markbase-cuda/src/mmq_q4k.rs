//! Products of 3–32 token rows with Q4_K weights on the tensor cores (kernels/mmq_q4k.cu):
//! the 4-bit weights stream once for all the tokens and are dequantized to f16 in registers,
//! the activations come as their f16 rounded copy. Blocks take tiles of 16 rows a warp; a
//! matrix with few tiles splits its super-blocks over several blocks a tile, whose parts the
//! tile's last block adds in order (a ticket a tile in `tickets`).

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::{int, CudaBackend, Scratch};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Token rows from which a Q4_K product runs here rather than as GEMVs, and up to which it
/// does (more take cuBLAS on weights dequantized to f16): 4 n-tiles of 8 at most
/// (`MMQ_KERNEL(4)`). Measured on the H200 (E4B Q4_K, `bench -p 0 -n 32`, docs/perf.md session
/// 31): 2 sequences 570.74 t/s as GEMVs against 527.86 here; 64 sequences 6 058.32 on cuBLAS
/// against 4 968.65 here (8 n-tiles); 4 / 8 / 16 / 32 sequences 764 / 862 / 878 / 3 164 before,
/// 1 011 / 1 879 / 3 231 / 5 004 here.
pub(crate) const MMQ_TOKENS: std::ops::RangeInclusive<usize> = 3..=32;
/// Warps of a block.
const BLOCK_WARPS: u32 = 8;
/// Dynamic shared memory of a block: two stages of 64 token slices of 576 bytes
/// (`MMQ_STAGE_BYTES`).
const SHARED_BYTES: u32 = 2 * 64 * 576;
/// Row tiles whose launches may split their super-blocks: one ticket each.
pub(crate) const TICKETS: usize = 1 << 16;
/// Blocks a launch aims for a multiprocessor: matrices of fewer row tiles split their
/// super-blocks until they have that many (or one stage a split).
const BLOCKS_PER_SM: usize = 2;

/// Whether a product of `n` token rows with weights stored as `ty` runs here.
pub fn q4k_mma_suits(ty: GgmlType, n: usize) -> bool {
    ty == GgmlType::Q4_K && MMQ_TOKENS.contains(&n)
}

/// How a launch covers a matrix: `nt` n-tiles of 8 tokens, `tiles` row tiles of 16·nt rows,
/// each tile's super-blocks in `splits` runs of `per_split`.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    nt: usize,
    tiles: usize,
    splits: usize,
    per_split: usize,
}

/// The launch shape for `n` tokens (`MMQ_TOKENS`) and a matrix of `rows` rows of `k` values (a
/// multiple of 256) on `sms` multiprocessors.
fn shape(rows: usize, k: usize, n: usize, sms: usize) -> Shape {
    let nt = match n.div_ceil(8) {
        1 => 1,
        2 => 2,
        _ => 4,
    };
    // A stage takes one super-block a warp of each row tile's 8 / nt warps.
    let wk = 8 / nt;
    let tiles = rows.div_ceil(16 * nt);
    let blocks = k / 256;
    let stages = blocks.div_ceil(wk);
    let want = if tiles > TICKETS {
        1
    } else {
        (BLOCKS_PER_SM * sms).div_ceil(tiles).clamp(1, stages)
    };
    let per_split = stages.div_ceil(want) * wk;
    Shape {
        nt,
        tiles,
        splits: blocks.div_ceil(per_split),
        per_split,
    }
}

impl CudaBackend {
    /// `out = x · wᵀ` for `n` token rows (`MMQ_TOKENS`) whose activations `xh` are rounded to
    /// f16, with Q4_K weights `w` (sizes checked by the caller). The parts of split tiles go to
    /// the f16 tile scratch, which the caller does not hold `xh` in.
    pub(crate) fn mmq_q4k(
        &self,
        s: &mut Scratch,
        xh: u64,
        n: usize,
        w: &CudaMatrix,
        out: u64,
    ) -> Result<()> {
        let sh = shape(w.rows, w.cols, n, self.dev.multiprocessors() as usize);
        let parts = if sh.splits > 1 {
            s.tiles.get(&self.dev.stream, 2 * sh.splits * n * w.rows)?
        } else {
            0
        };
        let f = self.kernels.func_for_with_shared(
            Module::Gemv,
            "mmq",
            GgmlType::Q4_K,
            sh.nt as u32,
            SHARED_BYTES,
        )?;
        let mut grid = Grid::new(
            (int("row tiles", sh.tiles)? as u32, sh.splits as u32),
            32 * BLOCK_WARPS,
        );
        grid.shared = SHARED_BYTES;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::U64(w.ptr),
                Arg::U64(w.row_bytes as u64),
                Arg::I32(int("rows", w.rows)?),
                Arg::I32(int("cols", w.cols)?),
                Arg::U64(xh),
                Arg::I32(n as i32),
                Arg::U64(out),
                Arg::U64(parts),
                Arg::U64(self.mmq_tickets()),
                Arg::I32(sh.splits as i32),
                Arg::I32(sh.per_split as i32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_every_super_block_once_and_fill_the_gpu() {
        // E4B's products on an H200 (132 multiprocessors): o / down, gate, k, q, the LM head.
        for (rows, k) in [
            (2560, 2048),
            (2560, 10_240),
            (10_240, 2560),
            (512, 2560),
            (2048, 2560),
            (262_144, 2560),
            (2560, 256),
            (67, 12_800),
        ] {
            for n in [3, 8, 9, 16, 17, 25, 32] {
                let sh = shape(rows, k, n, 132);
                let blocks = k / 256;
                assert!(sh.nt * 8 >= n && (sh.nt == 1 || sh.nt * 4 < n), "{n}");
                assert_eq!(sh.tiles, rows.div_ceil(16 * sh.nt));
                assert_eq!(sh.per_split % (8 / sh.nt), 0);
                assert!(sh.splits * sh.per_split >= blocks);
                assert!((sh.splits - 1) * sh.per_split < blocks, "no empty split");
                if sh.splits > 1 {
                    assert!(sh.tiles <= TICKETS);
                }
                // At least half the blocks aimed for, or as many splits as stages.
                let stages = blocks.div_ceil(8 / sh.nt);
                assert!(
                    2 * sh.tiles * sh.splits >= (264).min(sh.tiles * stages),
                    "{rows}x{k} n={n}: {sh:?}"
                );
            }
        }
        assert_eq!(
            shape(2560, 10_240, 8, 132),
            Shape {
                nt: 1,
                tiles: 160,
                splits: 2,
                per_split: 24
            }
        );
    }

    #[test]
    fn q4k_products_of_3_to_32_rows_take_the_tensor_cores() {
        assert!(!q4k_mma_suits(GgmlType::Q4_K, 2));
        assert!(q4k_mma_suits(GgmlType::Q4_K, 3) && q4k_mma_suits(GgmlType::Q4_K, 32));
        assert!(!q4k_mma_suits(GgmlType::Q4_K, 33));
        assert!(!q4k_mma_suits(GgmlType::Q6_K, 8));
    }
}
