//! Products of 2–32 token rows with Q4_K weights on the tensor cores (kernels/mmq_q4k.cu):
//! the 4-bit weights stream once for all the tokens and are dequantized to f16 in registers,
//! the activations come as their f16 rounded copy. Up to `MAX_PRODUCTS` matrices of one width
//! take one launch. Warps walk row tiles of 16 rows; matrices of few tiles split their
//! super-blocks over several items a tile, whose parts the tile's last warp adds in order (a
//! ticket a tile in `tickets`).

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::{int, CudaBackend, Scratch};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid, ProductArgs};
use crate::sources::Module;

/// Token rows from which a Q4_K product runs here rather than as GEMVs, and up to which it
/// does (more take cuBLAS on weights dequantized to f16): 4 n-tiles of 8 at most
/// (`MMQ_KERNEL(4)`). Measured on the H200 (E4B Q4_K, `bench -p 0 -n 32`, docs/perf.md session
/// 31): 2 / 3 / 4 / 8 / 16 / 32 sequences 581 / 684 / 761 / 861 / 887 / 3 176 t/s before,
/// 647 / 936 / 1 242 / 2 255 / 3 602 / 4 838 here; 64 sequences 6 058 on cuBLAS against
/// 4 969 on this kernel's first version (8 n-tiles).
pub(crate) const MMQ_TOKENS: std::ops::RangeInclusive<usize> = 2..=32;
/// Warps of a block.
const BLOCK_WARPS: usize = 8;
/// Bytes one token's 256 activations of a super-block take in shared memory
/// (`MMQ_TOKEN_BYTES`).
const TOKEN_BYTES: usize = 576;
/// Most dynamic shared memory of a block (a split's activations): two blocks fit a
/// multiprocessor.
const MAX_SHARED: usize = 100 << 10;
/// Row tiles whose launches may split their super-blocks: one ticket each.
pub(crate) const TICKETS: usize = 1 << 16;
/// Items (a row tile over a split) a launch aims for a multiprocessor: matrices of fewer row
/// tiles split their super-blocks until they have that many, one a warp. 16 made E4B's
/// 8-sequence step 15 % slower (the parts' fix-up), 4 up to 4 % slower (docs/perf.md
/// session 31).
const ITEMS_PER_SM: usize = 8;
/// Blocks resident on a multiprocessor (`__launch_bounds__(256, 2)`).
const BLOCKS_PER_SM: usize = 2;

/// Whether a product of `n` token rows with weights stored as `ty` runs here.
pub fn q4k_mma_suits(ty: GgmlType, n: usize) -> bool {
    ty == GgmlType::Q4_K && MMQ_TOKENS.contains(&n)
}

/// How a launch covers its matrices' `tiles` row tiles of 16 rows: `nt` n-tiles of 8 tokens,
/// each tile's super-blocks in `splits` runs of `per_split`, `blocks` blocks a split.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    nt: usize,
    splits: usize,
    per_split: usize,
    blocks: usize,
}

impl Shape {
    /// Dynamic shared memory of a block: its split's activations.
    fn shared(&self) -> usize {
        8 * self.nt * self.per_split * TOKEN_BYTES
    }
}

/// The launch shape for `n` tokens (`MMQ_TOKENS`) and `tiles` row tiles of `k` values (a
/// multiple of 256) on `sms` multiprocessors; None where the tiles are too many to split.
fn shape(tiles: usize, k: usize, n: usize, sms: usize) -> Option<Shape> {
    let nt = match n.div_ceil(8) {
        1 => 1,
        2 => 2,
        _ => 4,
    };
    let blocks = k / 256;
    let most_per_split = (MAX_SHARED / (8 * nt * TOKEN_BYTES)).min(blocks);
    let want = (ITEMS_PER_SM * sms)
        .div_ceil(tiles)
        .clamp(blocks.div_ceil(most_per_split), blocks);
    let per_split = blocks.div_ceil(want);
    let splits = blocks.div_ceil(per_split);
    if splits > 1 && tiles > TICKETS {
        return None;
    }
    let resident = (BLOCKS_PER_SM * sms / splits).max(1);
    Some(Shape {
        nt,
        splits,
        per_split,
        blocks: tiles.div_ceil(BLOCK_WARPS).min(resident),
    })
}

impl CudaBackend {
    /// `out_i = x · w_iᵀ` for `n` token rows (`MMQ_TOKENS`) whose activations `xh` are rounded
    /// to f16, with Q4_K matrices of one width (up to `MAX_PRODUCTS`; sizes checked by the
    /// caller), in one launch; false (nothing queued) where the matrices have too many rows,
    /// or a block would need more shared memory than the device gives one (GPUs of compute
    /// capability 8.6 and 8.9 give 99 KB).
    /// The parts of split tiles go to the f16 tile scratch, which the caller does not hold
    /// `xh` in.
    pub(crate) fn mmq_q4k(
        &self,
        s: &mut Scratch,
        xh: u64,
        n: usize,
        products: &[(&CudaMatrix, u64)],
    ) -> Result<bool> {
        let w0 = products[0].0;
        let tiles: usize = products.iter().map(|(w, _)| w.rows.div_ceil(16)).sum();
        let total_rows: usize = products.iter().map(|(w, _)| w.rows).sum();
        let sms = self.dev.multiprocessors() as usize;
        let Some(sh) = shape(tiles, w0.cols, n, sms) else {
            return Ok(false);
        };
        if sh.shared() > self.dev.max_block_shared() as usize {
            return Ok(false);
        }
        let parts = if sh.splits > 1 {
            s.tiles
                .get(&self.dev.stream, 2 * sh.splits * n * total_rows)?
        } else {
            0
        };
        let mut args = ProductArgs {
            count: products.len() as i32,
            ..ProductArgs::default()
        };
        for (i, &(w, out)) in products.iter().enumerate() {
            args.w[i] = w.ptr;
            args.out[i] = out;
            args.rows[i] = int("rows", w.rows)?;
        }
        let shared = sh.shared() as u32;
        let f = self.kernels.func_for_with_shared(
            Module::Gemv,
            "mmq",
            GgmlType::Q4_K,
            sh.nt as u32,
            shared,
        )?;
        let mut grid = Grid::new(
            (sh.blocks as u32, sh.splits as u32),
            32 * BLOCK_WARPS as u32,
        );
        grid.shared = shared;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::Products(args),
                Arg::U64(w0.row_bytes as u64),
                Arg::I32(int("cols", w0.cols)?),
                Arg::U64(xh),
                Arg::I32(n as i32),
                Arg::I32(int("rows", total_rows)?),
                Arg::U64(parts),
                Arg::U64(self.mmq_tickets()),
                Arg::I32(sh.splits as i32),
                Arg::I32(sh.per_split as i32),
            ],
        )?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_every_super_block_once_and_fit_shared_memory() {
        // E4B's launches on an H200 (132 multiprocessors), as (row tiles, width): q/k/v, o,
        // gate + up, down, the PLE gate and projection, the LM head; a short odd matrix.
        for (tiles, k) in [
            (192, 2560),
            (160, 2048),
            (1280, 2560),
            (160, 10_240),
            (16, 2560),
            (160, 256),
            (16_384, 2560),
            (5, 12_800),
        ] {
            for n in [2, 8, 9, 16, 17, 25, 32] {
                let sh = shape(tiles, k, n, 132).unwrap();
                let blocks = k / 256;
                assert!(sh.nt * 8 >= n && (sh.nt == 1 || sh.nt * 4 < n), "{n}");
                assert!(sh.splits * sh.per_split >= blocks);
                assert!((sh.splits - 1) * sh.per_split < blocks, "no empty split");
                assert!(sh.shared() <= MAX_SHARED, "{tiles}x{k} n={n}: {sh:?}");
                assert!(sh.blocks * sh.splits <= 2 * 132 || sh.blocks == 1);
                assert!(sh.blocks >= 1 && sh.blocks <= tiles.div_ceil(8));
                // Enough items, or one super-block a split.
                assert!(
                    2 * tiles * sh.splits >= 8 * 132 || sh.per_split == 1,
                    "{tiles}x{k} n={n}: {sh:?}"
                );
            }
        }
        assert_eq!(
            shape(160, 10_240, 8, 132),
            Some(Shape {
                nt: 1,
                splits: 7,
                per_split: 6,
                blocks: 20
            })
        );
        assert_eq!(shape(TICKETS + 1, 12_800, 32, 132), None);
    }

    #[test]
    fn q4k_products_of_2_to_32_rows_take_the_tensor_cores() {
        assert!(!q4k_mma_suits(GgmlType::Q4_K, 1));
        assert!(q4k_mma_suits(GgmlType::Q4_K, 2) && q4k_mma_suits(GgmlType::Q4_K, 32));
        assert!(!q4k_mma_suits(GgmlType::Q4_K, 33));
        assert!(!q4k_mma_suits(GgmlType::Q6_K, 8));
    }
}
