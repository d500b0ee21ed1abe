//! Mixture-of-experts feed-forward: routing limits and the two expert paths, the (token,
//! expert) pairs grouped by expert on the device or taken pair by pair (moe.cu; their
//! tensor-core products in moe_mma.rs).

use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::{blocks, int, CudaBackend};
use crate::buffer::{CudaBuffer, CudaMatrix};
use crate::kernels::{Arg, Grid};
use crate::moe_mma::{activation_kind, MoeOutput, MoeTiles};
use crate::sources::{define_number, defines_from_env, Module};

/// Most experts `moe_route` handles (8 per lane), and the grouped `moe_ffn`: `moe_group`
/// takes a thread per expert, a block of this many threads (`MOE_MAX_EXPERTS` in moe.cu).
pub(crate) const MAX_EXPERTS: usize = 256;

/// Most blocks a grid's second dimension holds (CUDA's limit): `moe_ffn`'s tokens and
/// pairs.
pub(crate) const MAX_GRID_Y: usize = 65_535;

/// Most experts `moe_route` chooses for a token (a lane keeps each choice).
pub(crate) const MAX_TOP_K: usize = 32;

/// Tokens from which `moe_ffn` groups the (token, expert) pairs by expert on the device and
/// reads an expert's rows once for up to `MOE_TILE` of its pairs; with fewer, each pair reads
/// its expert's rows. Grouping costs two more launches (one of them a single block) and
/// eight-row products for every tile however few its pairs, and it saves only the repeated
/// reads: under uniform routing, top-8 of 128 experts (26B-A4B), n tokens' 8·n pairs fall on
/// ≈ 128·(1 − (15/16)^n) distinct experts — 29 for 32 pairs at n = 4 (10 % repeated), 52 for
/// 64 at n = 8 (19 %), 83 for 128 at n = 16 (35 %), 126 for 512 at n = 64 (75 %). Measured
/// at 64 tokens and in prefill (26B-A4B bf16, H200: tg32@b64 1 080 → 1 555 t/s, pp512 1 143 →
/// 2 027); the threshold itself is not tuned. Decode of one sequence keeps the per-pair path.
const MOE_GROUP_FROM: usize = 8;

/// `MOE_GROUP_FROM` where the products run on the tensor cores (`moe_on_tensor_cores`; the
/// per-pair path's down products too) over 16-bit float experts, and over quantized ones.
/// Measured on the H200 (26B-A4B, `bench -p 0 -n 32`, grouped from 4 → from 9, docs/perf.md
/// session 35): bf16 4 tokens 701.26 → 708.89 t/s, 5 814.20 → 804.75, 6 916.37 → 879.25, 8
/// 1 005.69 → 979.56; Q8_0 707.55 → 788.75, 800.04 → 844.88, 785.15 → 941.71, 985.13 →
/// 1 051.19; Q4_K 757.08 → 842.87, 888.05 → 888.05, 904.69 → 1 004.13, 1 110.93 → 1 117.23.
/// Above 8 tokens not measured.
const MOE_MMA_GROUP_FROM: (usize, usize) = (5, 9);

/// Pairs a grouped MoE block reads an expert's rows for: `MOE_TILE` in moe.cu.
const MOE_TILE: usize = 8;

/// Pairs a tile of the tensor-core products over quantized experts holds in launches of more
/// than `WIDE_FROM` pairs an expert: two n-tiles a warp (moe_mma_<format>_16), each weight
/// dequantized once for up to 16 pairs rather than once for each 8. One 26B-A4B layer's
/// experts at 256 tokens (`cuda_bench --moe --tokens 256`, H100, docs/perf.md session 57), µs
/// in tiles of 8 → 16: Q4_K + Q5_0 (Q4_K_M) 633.6 → 562.4, Q5_K + Q5_1 683.3 → 577.8, Q4_K +
/// Q8_0 681.9 → 550.7, Q8_0 748.4 → 548.3, Q4_0 695.0 → 631.0; bf16 645.5 → 718.1 (no
/// dequantization to share, twice the activation registers), so 16-bit experts keep tiles of 8.
const WIDE_TILE: usize = 16;

/// Pairs an expert, on average, past which a launch over quantized experts takes tiles of
/// `WIDE_TILE` pairs (`wide_tiles_from_env`). 26B-A4B (H100, docs/perf.md session 57) at 256
/// sequences: Q4_K_M 9 563.17 → 11 194.46 t/s, Q5_K_M 9 713.93 → 10 538.37. At 128 (8 pairs
/// an expert) tiles of 16 from 6 pairs an expert were mixed — one layer's experts Q8_0 507.2 →
/// 454.3 µs, but Q4_K_M 394.4 → 414.6 and Q5_K_M 393.4 → 439.2 — and Q4_K_M's step the same
/// (7 586.72 / 7 593.65 t/s).
const WIDE_FROM: usize = 8;

/// `WIDE_FROM`, or what the define `MOE_WIDE_FROM` of `MARKBASE_CUDA_DEFINES` sets (0: never;
/// 1–16), as `None` for never.
pub(crate) fn wide_tiles_from_env() -> Result<Option<usize>> {
    let from = define_number(&defines_from_env()?, "MOE_WIDE_FROM", (0, 16), WIDE_FROM)?;
    Ok(Some(from).filter(|&f| f > 0))
}

/// Pairs a tile of one grouped `moe_ffn` launch holds: `WIDE_TILE` where its products run
/// on the tensor cores over quantized experts (`gate_up`'s format) and its `pairs` are more
/// than `wide_from` an expert of the `n_experts`; else `MOE_TILE`.
fn tile_pairs(
    tensor_cores: bool,
    gate_up: GgmlType,
    pairs: usize,
    n_experts: usize,
    wide_from: Option<usize>,
) -> usize {
    let quantized = !matches!(gate_up, GgmlType::BF16 | GgmlType::F16);
    match wide_from {
        Some(from) if tensor_cores && quantized && pairs > from * n_experts => WIDE_TILE,
        _ => MOE_TILE,
    }
}

/// Whether `moe_ffn` of `n` tokens over `n_experts` experts stored as `gate_up`, `dim` wide
/// with experts `width` wide, groups the pairs by expert (from `MOE_GROUP_FROM` tokens,
/// `MOE_MMA_GROUP_FROM` where the products run `on_tensor_cores`; rows of a width that is not
/// a multiple of 8 — only plain-float ones can be — stay on the per-pair path, moe.cu's
/// `moe_row_dot`). The per-pair gate/up products, and the grouped ones off the tensor cores,
/// take their activations as GEMVs do (`gemv_takes_16_bit_activations`).
pub fn moe_groups_pairs(
    n: usize,
    n_experts: usize,
    gate_up: GgmlType,
    (dim, width): (usize, usize),
    on_tensor_cores: bool,
) -> bool {
    let from = match (on_tensor_cores, gate_up) {
        (false, _) => MOE_GROUP_FROM,
        (true, GgmlType::BF16 | GgmlType::F16) => MOE_MMA_GROUP_FROM.0,
        (true, _) => MOE_MMA_GROUP_FROM.1,
    };
    n >= from && n_experts <= MAX_EXPERTS && dim.is_multiple_of(8) && width.is_multiple_of(8)
}

/// Most tiles (up to `tile` pairs of one expert) `pairs` pairs over `n_experts` experts can
/// need: Σ ⌈c_e / T⌉ ≤ (pairs + (T − 1)·m) / T for m ≤ min(experts, pairs) experts with
/// pairs. The grouped kernels' grids are this tall (blocks past the last tile exit).
fn moe_most_tiles(pairs: usize, n_experts: usize, tile: usize) -> usize {
    (pairs + (tile - 1) * n_experts.min(pairs)) / tile
}

/// The inputs of one `moe_ffn` call, checked (its output apart): the tokens' rows `x` (`n` of
/// them), the stacked experts' matrices, the routing's `weights` and `ids` (`top_k` a token),
/// and whether the expert products run on the tensor cores.
#[derive(Clone, Copy)]
pub(crate) struct MoeCall<'a> {
    /// Token rows, `n` × the model width.
    pub(crate) x: &'a CudaBuffer,
    /// Tokens.
    pub(crate) n: usize,
    /// Every expert's gate and up rows, stacked.
    pub(crate) gate_up: &'a CudaMatrix,
    /// Every expert's down rows, stacked.
    pub(crate) down: &'a CudaMatrix,
    /// Experts in the stacks.
    pub(crate) n_experts: usize,
    /// Experts a token takes.
    pub(crate) top_k: usize,
    /// The expert products run on the tensor cores (`moe_on_tensor_cores`).
    pub(crate) tensor_cores: bool,
    /// Each pair's routing weight.
    pub(crate) weights: &'a CudaBuffer,
    /// Each pair's expert id.
    pub(crate) ids: &'a CudaBuffer,
}

impl CudaBackend {
    /// `moe_ffn` (arguments checked there) with the pairs grouped by expert on the device
    /// (moe.cu: `moe_group`, then the slots' token rows gathered, the gated activations of
    /// each tile of up to `MOE_TILE` pairs of one expert, its down products, and each token's
    /// weighted sum of its pairs' outputs in pair order), the products on the tensor cores
    /// where `tensor_cores` (moe_mma.rs) and as 8-token GEMVs otherwise. Float scratch (D
    /// and F are multiples of 8 here, so every row starts 32-byte aligned for the row-dot
    /// helpers' float4 loads): the gathered rows [pairs, D] (f32, or 16-bit for the tensor
    /// cores; then the down outputs, written after the gate/up kernel, their last reader, has
    /// finished), the gated activations [pairs, F] (f32 or 16-bit), and the ints `order`,
    /// `slot_of` [pairs] and `tiles` [3 · most tiles] (moe.cu).
    pub(crate) fn moe_ffn_grouped(&self, call: MoeCall<'_>, out: &mut CudaBuffer) -> Result<()> {
        let MoeCall {
            x,
            n,
            gate_up,
            down,
            n_experts,
            top_k,
            tensor_cores,
            weights,
            ids,
        } = call;
        let (d, f, pairs) = (gate_up.cols, down.cols, n * top_k);
        let tile = tile_pairs(
            tensor_cores,
            gate_up.ty,
            pairs,
            n_experts,
            self.moe_wide_from,
        );
        let most_tiles = moe_most_tiles(pairs, n_experts, tile);
        if most_tiles > MAX_GRID_Y {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: {pairs} pairs need a grid of {most_tiles} tiles (at most {MAX_GRID_Y})"
            )));
        }
        let mut s = self.scratch()?;
        let rows = s
            .floats
            .get(&self.dev.stream, pairs * (d + f + 2) + 3 * most_tiles)?;
        let h = rows + 4 * (pairs * d) as u64;
        let order = h + 4 * (pairs * f) as u64;
        let slot_of = order + 4 * pairs as u64;
        let tiles = slot_of + 4 * pairs as u64;
        let (di, fi, top) = (int("dim", d)?, int("expert width", f)?, top_k as i32);
        self.run(
            Module::Moe,
            "moe_group",
            Grid::new((1, 1), MAX_EXPERTS as u32),
            &[
                Arg::U64(ids.ptr),
                Arg::I32(int("pairs", pairs)?),
                Arg::I32(n_experts as i32),
                Arg::I32(tile as i32),
                Arg::I32(most_tiles as i32),
                Arg::U64(order),
                Arg::U64(slot_of),
                Arg::U64(tiles),
                Arg::U64(self.err.ptr),
            ],
        )?;
        if tensor_cores {
            // 16-bit slot rows at `rows` (the down outputs overwrite them once the gated
            // launch, their last reader, has finished), 16-bit gated activations at `h`.
            self.run(
                Module::Moe,
                "moe_gather_16",
                Grid::new((pairs as u32, 1), 256),
                &[
                    Arg::U64(x.ptr),
                    Arg::I32(di),
                    Arg::I32(top),
                    Arg::U64(order),
                    Arg::I32(activation_kind(gate_up.ty)),
                    Arg::U64(rows),
                ],
            )?;
            let gated = MoeOutput::Gated(activation_kind(down.ty));
            let grouped = || MoeTiles::Grouped {
                tiles,
                most: most_tiles,
                pairs_a_tile: tile,
            };
            self.moe_mma(gate_up, f, rows, grouped(), gated, h)?;
            self.moe_mma(down, d, h, grouped(), MoeOutput::Plain, rows)?;
        } else {
            self.run(
                Module::Moe,
                "moe_gather",
                Grid::new((pairs as u32, 1), 256),
                &[
                    Arg::U64(x.ptr),
                    Arg::I32(di),
                    Arg::I32(top),
                    Arg::U64(order),
                    Arg::U64(rows),
                ],
            )?;
            // An expert product per tile: `w`'s `out_rows` rows for the tile's pairs, `input` to
            // `output` (both grouped kernels take the same arguments).
            let grouped = |name, w: &CudaMatrix, out_rows: usize, input: u64, output: u64| {
                self.launch_fn(
                    &self.kernels.func_for(Module::Moe, name, w.ty, 0)?,
                    Grid::new((blocks(out_rows, 8), most_tiles as u32), 256),
                    &[
                        Arg::U64(w.ptr),
                        Arg::U64(w.row_bytes as u64),
                        Arg::I32(di),
                        Arg::I32(fi),
                        Arg::U64(input),
                        Arg::U64(tiles),
                        Arg::U64(output),
                    ],
                )
            };
            grouped("moe_gate_up_grouped", gate_up, f, rows, h)?;
            grouped("moe_down_grouped", down, d, h, rows)?;
        }
        self.run(
            Module::Moe,
            "moe_combine",
            Grid::new((blocks(d, 256), n as u32), 256),
            &[
                Arg::U64(rows),
                Arg::I32(di),
                Arg::I32(top),
                Arg::U64(weights.ptr),
                Arg::U64(slot_of),
                Arg::U64(out.ptr),
            ],
        )
    }

    /// `moe_ffn` (arguments checked there) pair by pair: each (token, expert) pair's gated
    /// activations [pairs, F] (16-bit where the down product runs on the tensor cores,
    /// `tensor_cores`), then its expert's outputs [pairs, D], then each token's weighted sum of
    /// its pairs' outputs.
    pub(crate) fn moe_ffn_per_pair(&self, call: MoeCall<'_>, out: &mut CudaBuffer) -> Result<()> {
        let MoeCall {
            x,
            n,
            gate_up,
            down,
            n_experts,
            top_k,
            tensor_cores,
            weights,
            ids,
        } = call;
        let (d, f, pairs) = (gate_up.cols, down.cols, n * top_k);
        if pairs > MAX_GRID_Y {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: {pairs} (token, expert) pairs in one call, each a grid row of \
                 the per-pair path (at most {MAX_GRID_Y})"
            )));
        }
        let beside = self.take_beside();
        let mut s = self.scratch()?;
        let h = s.moe_pairs.get(&self.dev.stream, pairs * (f + d))?;
        let y = h + 4 * (pairs * f) as u64;
        let (di, fi) = (int("dim", d)?, int("expert width", f)?);
        let pairs_i = pairs as u32;
        let err = self.err.ptr;
        let h_kind = if tensor_cores {
            activation_kind(down.ty)
        } else {
            0
        };
        self.launch_fn(
            &self
                .kernels
                .func_for(Module::Moe, "moe_gate_up", gate_up.ty, 0)?,
            Grid::new((blocks(f, 8), pairs_i), 256),
            &[
                Arg::U64(gate_up.ptr),
                Arg::U64(gate_up.row_bytes as u64),
                Arg::I32(di),
                Arg::I32(fi),
                Arg::U64(x.ptr),
                Arg::I32(top_k as i32),
                Arg::I32(n_experts as i32),
                Arg::U64(ids.ptr),
                Arg::I32(h_kind),
                Arg::U64(h),
                Arg::U64(err),
                Arg::I32(beside as i32),
            ],
        )?;
        if tensor_cores {
            let per_pair = MoeTiles::PerPair {
                ids: ids.ptr,
                pairs,
                n_experts,
                err,
            };
            self.moe_mma(down, d, h, per_pair, MoeOutput::Plain, y)?;
        } else {
            self.launch_fn(
                &self.kernels.func_for(Module::Moe, "moe_down", down.ty, 0)?,
                Grid::new((blocks(d, 8), pairs_i), 256),
                &[
                    Arg::U64(down.ptr),
                    Arg::U64(down.row_bytes as u64),
                    Arg::I32(di),
                    Arg::I32(fi),
                    Arg::U64(h),
                    Arg::I32(n_experts as i32),
                    Arg::U64(ids.ptr),
                    Arg::U64(y),
                    Arg::U64(err),
                ],
            )?;
        }
        self.run(
            Module::Moe,
            "moe_combine",
            Grid::new((blocks(d, 256), n as u32), 256),
            &[
                Arg::U64(y),
                Arg::I32(di),
                Arg::I32(top_k as i32),
                Arg::U64(weights.ptr),
                Arg::U64(0),
                Arg::U64(out.ptr),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crowded_launches_over_quantized_experts_take_wide_tiles() {
        // 26B-A4B (top 8 of 128 experts) at 129 sequences: more than 8 pairs an expert.
        let (crowded, experts, from) = (129 * 8, 128, Some(WIDE_FROM));
        // (tensor cores, gate/up format, pairs, the rule's pairs an expert, tile)
        for (cores, ty, pairs, from, tile) in [
            (true, GgmlType::Q4_K, crowded, from, WIDE_TILE),
            (true, GgmlType::Q8_0, crowded, from, WIDE_TILE),
            (true, GgmlType::Q4_K, 128 * 8, from, MOE_TILE),
            (true, GgmlType::Q4_K, 128 * 8, Some(7), WIDE_TILE),
            (true, GgmlType::Q4_K, crowded, None, MOE_TILE),
            (false, GgmlType::Q4_K, crowded, from, MOE_TILE),
            (true, GgmlType::BF16, crowded, from, MOE_TILE),
            (true, GgmlType::F16, crowded, from, MOE_TILE),
        ] {
            let got = tile_pairs(cores, ty, pairs, experts, from);
            assert_eq!(
                got, tile,
                "{ty} {pairs} pairs, from {from:?}, cores {cores}"
            );
        }
    }

    #[test]
    fn moe_most_tiles_is_the_most_any_split_of_the_pairs_needs() {
        // most[e][p]: the most tiles p pairs (some perhaps left out: bad ids) over e experts
        // can take, each expert cutting its pairs into tiles of `tile`.
        let (max_pairs, max_experts) = (40, 6);
        for tile in [MOE_TILE, WIDE_TILE] {
            let mut most = vec![vec![0usize; max_pairs + 1]; max_experts + 1];
            for e in 1..=max_experts {
                for p in 0..=max_pairs {
                    most[e][p] = (0..=p)
                        .map(|c| c.div_ceil(tile) + most[e - 1][p - c])
                        .max()
                        .unwrap();
                }
            }
            for (e, row) in most.iter().enumerate().skip(1) {
                for (p, &m) in row.iter().enumerate() {
                    let got = moe_most_tiles(p, e, tile);
                    assert_eq!(got, m, "{p} pairs over {e} experts in tiles of {tile}");
                }
            }
        }
    }
}
