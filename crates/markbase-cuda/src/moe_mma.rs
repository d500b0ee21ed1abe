//! The grouped MoE expert products on the tensor cores (kernels/moe_mma.cu): each tile of up
//! to 8 pairs of one expert is one 8-column n-tile (or of up to 16, two n-tiles), so a warp
//! streams 16 of the expert's rows once for the tile's pairs. The activations are rounded to 16 bits (bf16 for bf16 weights,
//! f16 for the others) as the dense tensor-core products round theirs, the gated launch stores
//! gelu_tanh(gate) · up rounded for the down launch, and quantized weights are dequantized to
//! f16 in registers (each weight rounded once, as mmq.cu does).

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::{int, CudaBackend};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Values of a row a kernel unit covers (moe_mma.cu): rows must be whole units.
const UNIT: usize = 64;
/// Warps of a block, each a tile of rows.
const BLOCK_WARPS: usize = 8;

/// Whether the grouped expert products of experts stored as `gate_up` and `down`, `dim` values
/// wide with experts `width` wide, run on the tensor cores (on a device of compute capability
/// 8.0 or newer): weights of bf16, f16, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K or Q5_K, and both widths
/// whole 64-value units.
pub fn moe_on_tensor_cores(gate_up: GgmlType, down: GgmlType, dim: usize, width: usize) -> bool {
    let takes = |ty| {
        matches!(
            ty,
            GgmlType::BF16
                | GgmlType::F16
                | GgmlType::Q4_0
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q5_K
        )
    };
    takes(gate_up) && takes(down) && dim.is_multiple_of(UNIT) && width.is_multiple_of(UNIT)
}

/// The 16-bit type the products of weights stored as `ty` read their activations in
/// (`rounded_bits` in common.cuh): 1 bf16, 2 f16.
pub(crate) fn activation_kind(ty: GgmlType) -> i32 {
    if ty == GgmlType::BF16 {
        1
    } else {
        2
    }
}

/// Which pairs share an expert product launch's tiles.
pub(crate) enum MoeTiles {
    /// moe_group's tiles at this device address: up to `pairs_a_tile` (8 or 16) pairs of one
    /// expert each, `most` of them at most (the grid's height; blocks past the last tile
    /// exit).
    Grouped {
        tiles: u64,
        most: usize,
        pairs_a_tile: usize,
    },
    /// One tile a pair, its expert read from the f32 ids at `ids` (a bad id raises the error
    /// word at `err` and gives outputs of 0).
    PerPair {
        ids: u64,
        pairs: usize,
        n_experts: usize,
        err: u64,
    },
}

/// What one expert product launch stores.
pub(crate) enum MoeOutput {
    /// gelu_tanh(gate) · up of the gated matrix's `rows` outputs, as 16-bit values of the kind
    /// given (`activation_kind` of the down weights).
    Gated(i32),
    /// The `rows` outputs as floats.
    Plain,
}

impl CudaBackend {
    /// One expert product on the tensor cores for every tile of `tiles`: `w` stacks the
    /// experts (each 2·`rows` rows when gated, else `rows`), `x` holds the slots' (the pairs')
    /// 16-bit activation rows (`w.cols` values each), `out` gets [slot][rows].
    pub(crate) fn moe_mma(
        &self,
        w: &CudaMatrix,
        rows: usize,
        x: u64,
        tiles: MoeTiles,
        output: MoeOutput,
        out: u64,
    ) -> Result<()> {
        let (gated, kind, per_warp) = match output {
            MoeOutput::Gated(kind) => (1, kind, 8),
            MoeOutput::Plain => (0, 0, 16),
        };
        let (tiles, height, ids, n_experts, err, wide) = match tiles {
            MoeTiles::Grouped {
                tiles,
                most,
                pairs_a_tile,
            } => (tiles, most, 0, 0, 0, pairs_a_tile > 8),
            MoeTiles::PerPair {
                ids,
                pairs,
                n_experts,
                err,
            } => (0, pairs, ids, n_experts, err, false),
        };
        // Tiles of 16 pairs: two n-tiles a warp (moe_mma_<format>_16).
        let variant = if wide { 16 } else { 0 };
        let blocks = rows.div_ceil(per_warp).div_ceil(BLOCK_WARPS);
        self.launch_fn(
            &self
                .kernels
                .func_for(Module::Moe, "moe_mma", w.ty, variant)?,
            Grid::new(
                (int("row blocks", blocks)? as u32, height as u32),
                32 * BLOCK_WARPS as u32,
            ),
            &[
                Arg::U64(w.ptr),
                Arg::U64(w.row_bytes as u64),
                Arg::I32(int("expert row width", w.cols)?),
                Arg::I32(int("expert rows", rows)?),
                Arg::U64(x),
                Arg::U64(tiles),
                Arg::U64(ids),
                Arg::I32(int("experts", n_experts)?),
                Arg::U64(err),
                Arg::I32(gated),
                Arg::I32(kind),
                Arg::U64(out),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_cores_take_whole_units_of_their_formats() {
        assert!(moe_on_tensor_cores(
            GgmlType::BF16,
            GgmlType::BF16,
            2816,
            704
        ));
        assert!(moe_on_tensor_cores(
            GgmlType::Q4_K,
            GgmlType::Q8_0,
            2816,
            704
        ));
        assert!(!moe_on_tensor_cores(GgmlType::Q8_0, GgmlType::Q8_0, 96, 64));
        assert!(!moe_on_tensor_cores(
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            2816,
            704
        ));
        // llama.cpp's Q4_K_M of 26B-A4B: Q4_K gate/up, Q5_0 down (704 wide) on most layers.
        assert!(moe_on_tensor_cores(
            GgmlType::Q4_K,
            GgmlType::Q5_0,
            2816,
            704
        ));
        // llama.cpp's Q5_K_M: Q5_K gate/up, Q5_1 down (704 wide) on most layers.
        assert!(moe_on_tensor_cores(
            GgmlType::Q5_K,
            GgmlType::Q5_1,
            2816,
            704
        ));
        assert!(!moe_on_tensor_cores(
            GgmlType::Q5_1,
            GgmlType::Q5_1,
            2816,
            96
        ));
        // Google's Q4_0 files: every expert matrix in Q4_0.
        assert!(moe_on_tensor_cores(
            GgmlType::Q4_0,
            GgmlType::Q4_0,
            2816,
            704
        ));
        assert!(!moe_on_tensor_cores(GgmlType::F32, GgmlType::F32, 256, 128));
        assert_eq!(activation_kind(GgmlType::BF16), 1);
        assert_eq!(activation_kind(GgmlType::Q8_0), 2);
    }
}
