//! Products of a few token rows on the tensor cores (kernels/mmq.cu): Q4_K, Q5_K, Q6_K, Q8_0,
//! Q4_0 and Q5_0 weights (rows of whole 256-value units) of 2–48 token rows (launches of
//! several matrices, q/k/v: up to 64), dequantized to f16 in registers, on the f16 rounded copy
//! of the activations.
//! The weights stream once for up to 32 tokens (a launch). Up to `MAX_PRODUCTS` matrices of
//! one width take one launch, or a gated pair (gate and up) whose launch stores
//! gelu_tanh(gate) · up as the 16-bit activations of the down product. Warps walk row tiles of
//! 16 rows; matrices of few tiles split their units over several items a tile, whose parts the
//! tile's last warp adds in order (a ticket a tile in `tickets`).

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::{int, CudaBackend, Scratch};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid, ProductArgs};
use crate::sources::Module;

/// Token rows for which a product of Q4_K or Q8_0 weights runs here rather than as GEMVs
/// (fewer) or as cuBLAS on weights dequantized to f16 (more). Measured on the H200
/// (`bench -p 0 -n 32`, docs/perf.md sessions 31–33), E4B Q4_K: 2 / 3 / 4 / 8 / 16 / 32
/// sequences 581 / 684 / 761 / 861 / 887 / 3 176 t/s before, 647 / 936 / 1 242 / 2 255 /
/// 3 602 / 4 838 here (session 31), and with the gated pair in one launch and the split parts
/// added in parallel 8 / 16 / 32 sequences 2 196 / 3 567 / 4 838 → 2 434 / 3 918 / 5 564. More
/// than `LAUNCH_TOKENS` run as two launches: 40 / 48 sequences 3 870 / 4 663 on cuBLAS →
/// 4 755 / 5 227 here, but 64 sequences 6 088 → 5 693, so 64 stay on cuBLAS. E4B Q8_0
/// (session 33): 8 / 16 / 32 / 48 sequences 817 / 846 / 3 318 / 4 946 → 2 261 / 3 705 /
/// 5 414 / 5 015.
const MMQ_TOKENS: std::ops::RangeInclusive<usize> = 2..=48;
/// Token rows up to which a launch of several matrices of one width (q, k and v) runs here:
/// cuBLAS dequantizes and multiplies each matrix apart, while one launch here takes them all
/// (two launches from 33 rows). H200, E4B's q, k and v at 64 rows (`cuda_bench --gemv --tokens
/// 64`): Q4_K 81.1 → 29.0 µs, Q8_0 70.2 → 28.8, Q4_0 66.9 → 27.6; `bench -p 0 -n 32 -b 64`:
/// E4B Q4_K_M 6 037 / 6 068 → 6 353 / 6 344 t/s, Q4_0 6 743 / 6 749 → 6 910 / 6 917 (docs/perf.md
/// session 38).
const MANY_TOKENS: usize = 64;
/// Token rows one launch takes at most (4 n-tiles of 8, `MMQ_KERNEL(q4_k, …, 4)`); more run
/// as several launches, each reading the weights. 8 n-tiles in one launch spilled 752 bytes
/// and ran 48 / 64 sequences at 3 355 / 3 700 t/s (session 32).
const LAUNCH_TOKENS: usize = 32;
/// Warps of a block.
const BLOCK_WARPS: usize = 8;
/// Most dynamic shared memory of a block (a split's activations): two blocks fit a
/// multiprocessor.
const MAX_SHARED: usize = 100 << 10;
/// Row tiles whose launches may split their units: one ticket each.
pub(crate) const TICKETS: usize = 1 << 16;
/// Items (a row tile over a split) a launch aims for a multiprocessor: matrices of fewer row
/// tiles split their units until they have that many, one a warp. 16 made E4B Q4_K's
/// 8-sequence step 15 % slower (the parts' fix-up), 4 up to 4 % slower (docs/perf.md
/// session 31).
const ITEMS_PER_SM: usize = 8;
/// Blocks resident on a multiprocessor (`__launch_bounds__(256, 2)`).
const BLOCKS_PER_SM: usize = 2;

/// How the kernels of a weight format cut a row (mmq.cu's `MmqK`, `MmqQ6k`, `MmqQ8_0`,
/// `MmqLegacy`).
struct Format {
    /// Values a unit covers (`F::K`).
    unit: usize,
    /// Shared memory a token's unit of activations takes (`F::TOKEN_BYTES`).
    token_bytes: usize,
    /// The most n-tiles of 8 tokens a kernel takes.
    most_nt: usize,
}

/// The kernels' cut of rows stored as `ty`, for the formats they take.
fn format(ty: GgmlType) -> Option<Format> {
    match ty {
        // A super-block (Q6_K's as laid out on the device), a regrouped group of 8 blocks
        // (Q8_0; Q4_0 and Q5_0 laid out: layout.rs): the same activation slots.
        GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K
        | GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q5_0 => Some(Format {
            unit: 256,
            token_bytes: 576,
            most_nt: 4,
        }),
        _ => None,
    }
}

/// Whether a product of `n` token rows with weights stored as `ty`, rows `cols` wide, runs here
/// (where the device allows, `CudaBackend::mmq_takes` says): a format of the kernels, rows of
/// whole units, `mmq_rows`.
pub fn mma_suits(ty: GgmlType, cols: usize, n: usize) -> bool {
    format(ty).is_some_and(|f| cols.is_multiple_of(f.unit)) && mmq_rows(n)
}

/// Whether a launch of `matrices` matrices of one storage (`ty`, rows `cols` wide) for `n`
/// token rows runs here (where the device allows): `mma_suits`, or several matrices of up to
/// `MANY_TOKENS` rows.
pub fn mma_suits_many(ty: GgmlType, cols: usize, n: usize, matrices: usize) -> bool {
    mma_suits(ty, cols, n) || (matrices >= 2 && n <= MANY_TOKENS && mma_suits(ty, cols, 2))
}

/// Whether products of `n` token rows run here where their format and width do (`mma_suits`).
pub(crate) fn mmq_rows(n: usize) -> bool {
    MMQ_TOKENS.contains(&n)
}

/// How a launch covers its matrices' `tiles` row tiles: `nt` n-tiles of 8 tokens, each tile's
/// units in `splits` runs of `per_split`, `blocks` blocks a split.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    nt: usize,
    splits: usize,
    per_split: usize,
    blocks: usize,
}

impl Shape {
    /// Dynamic shared memory of a block: its split's activations.
    fn shared(&self, f: &Format) -> usize {
        8 * self.nt * self.per_split * f.token_bytes
    }
}

/// The launch shape for `n` tokens (at most 8 · `f.most_nt`) and `tiles` row tiles of `k`
/// values (a multiple of `f.unit`) on `sms` multiprocessors; None where the tiles are too many
/// to split.
fn shape(f: &Format, tiles: usize, k: usize, n: usize, sms: usize) -> Option<Shape> {
    let nt = n.div_ceil(8).next_power_of_two().min(f.most_nt);
    let units = k / f.unit;
    let most_per_split = (MAX_SHARED / (8 * nt * f.token_bytes)).min(units);
    let want = (ITEMS_PER_SM * sms)
        .div_ceil(tiles)
        .clamp(units.div_ceil(most_per_split), units);
    let per_split = units.div_ceil(want);
    let splits = units.div_ceil(per_split);
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

/// What one launch computes: products of matrices of one width, or a gated pair.
pub(crate) enum Job<'a> {
    /// `out_i = x · w_iᵀ` as f32 (up to `MAX_PRODUCTS` matrices).
    Products(&'a [(&'a CudaMatrix, u64)]),
    /// `out = gelu_tanh(x · gateᵀ) · (x · upᵀ)` rounded to the activations' 16-bit type.
    Gated {
        gate: &'a CudaMatrix,
        up: &'a CudaMatrix,
        out: u64,
    },
}

impl Job<'_> {
    /// The first matrix (all share its format and width) and the launch's row tiles.
    fn first_and_tiles(&self) -> (&CudaMatrix, usize) {
        match self {
            Job::Products(products) => (
                products[0].0,
                products.iter().map(|(w, _)| w.rows.div_ceil(16)).sum(),
            ),
            Job::Gated { gate, .. } => (gate, gate.rows.div_ceil(8)),
        }
    }
}

impl CudaBackend {
    /// The launches of `job` for `n` token rows, if the kernels take it — (first token row,
    /// token rows, shape, shared memory) each, at most `LAUNCH_TOKENS` rows a launch: a
    /// format they have, a device of compute capability 8.0 or newer, `mma_suits` rows and
    /// width, tiles few enough to split, and shared
    /// memory the device gives a block (GPUs of compute capability 8.6 and 8.9 give 99 KB).
    fn mmq_plan(&self, job: &Job<'_>, n: usize) -> Option<Vec<(usize, usize, Shape, usize)>> {
        let (w0, tiles) = job.first_and_tiles();
        let f = format(w0.ty)?;
        let capable = self.dev.capability().0 >= 8;
        let matrices = match job {
            Job::Products(p) => p.len(),
            Job::Gated { .. } => 1,
        };
        if !capable || !mma_suits_many(w0.ty, w0.cols, n, matrices) {
            return None;
        }
        let sms = self.dev.multiprocessors() as usize;
        let most = self.dev.max_block_shared() as usize;
        (0..n)
            .step_by(LAUNCH_TOKENS)
            .map(|t0| {
                let len = (n - t0).min(LAUNCH_TOKENS);
                let sh = shape(&f, tiles, w0.cols, len, sms)?;
                let shared = sh.shared(&f);
                (shared <= most).then_some((t0, len, sh, shared))
            })
            .collect()
    }

    /// Whether `mmq` takes `job` for `n` token rows.
    pub(crate) fn mmq_takes(&self, job: &Job<'_>, n: usize) -> bool {
        self.mmq_plan(job, n).is_some()
    }

    /// Runs `job` for `n` token rows whose activations `xh` are rounded to the 16-bit type of
    /// the weights' products (f16), sizes checked by the caller, in one launch a
    /// `LAUNCH_TOKENS` rows; false (nothing queued) where the kernels do not take it
    /// (`mmq_plan`). The parts of split tiles go to the f16 tile scratch, which the caller
    /// does not hold `xh` in.
    pub(crate) fn mmq(&self, s: &mut Scratch, xh: u64, n: usize, job: Job<'_>) -> Result<bool> {
        let Some(launches) = self.mmq_plan(&job, n) else {
            return Ok(false);
        };
        let (w0, tiles) = job.first_and_tiles();
        let k = w0.cols;
        for (t0, len, sh, shared) in launches {
            let mut args = ProductArgs::default();
            let gated = match job {
                Job::Products(products) => {
                    args.count = products.len() as i32;
                    for (i, &(w, out)) in products.iter().enumerate() {
                        args.w[i] = w.ptr;
                        args.out[i] = out + 4 * (t0 * w.rows) as u64;
                        args.rows[i] = int("rows", w.rows)?;
                    }
                    false
                }
                Job::Gated { gate, up, out } => {
                    args.count = 2;
                    args.w[..2].copy_from_slice(&[gate.ptr, up.ptr]);
                    args.out[0] = out + 2 * (t0 * gate.rows) as u64;
                    args.rows[..2].copy_from_slice(&[int("rows", gate.rows)?; 2]);
                    true
                }
            };
            let parts = if sh.splits > 1 {
                // 16 floats a tile, token and split, in f16 slots.
                s.tiles
                    .get(&self.dev.stream, 32 * sh.splits * len * tiles)?
            } else {
                0
            };
            let kernel = self.kernels.func_for_with_shared(
                Module::Gemv,
                "mmq",
                w0.ty,
                sh.nt as u32,
                shared as u32,
            )?;
            let mut grid = Grid::new(
                (sh.blocks as u32, sh.splits as u32),
                32 * BLOCK_WARPS as u32,
            );
            grid.shared = shared as u32;
            self.launch_fn(
                &kernel,
                grid,
                &[
                    Arg::Products(args),
                    Arg::U64(w0.row_bytes as u64),
                    Arg::I32(int("cols", k)?),
                    Arg::U64(xh + 2 * (t0 * k) as u64),
                    Arg::I32(len as i32),
                    Arg::I32(gated.into()),
                    Arg::U64(parts),
                    Arg::U64(self.mmq_tickets()),
                    Arg::I32(sh.splits as i32),
                    Arg::I32(sh.per_split as i32),
                ],
            )?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_every_unit_once_and_fit_shared_memory() {
        // E4B's launches on an H200 (132 multiprocessors), as (row tiles, width): q/k/v, o,
        // gate + up (two matrices, or the gated pair: 1 280 tiles either way), down, the PLE
        // gate and projection, the LM head; a short odd matrix.
        let q4k = format(GgmlType::Q4_K).unwrap();
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
            // One launch's token rows (more take several).
            for n in [2, 8, 9, 16, 17, 25, 32] {
                let sh = shape(&q4k, tiles, k, n, 132).unwrap();
                let units = k / q4k.unit;
                assert!(sh.nt * 8 >= n && (sh.nt == 1 || sh.nt * 4 < n), "{n}");
                assert!(sh.nt <= q4k.most_nt && sh.nt.is_power_of_two());
                assert!(sh.splits * sh.per_split >= units);
                assert!((sh.splits - 1) * sh.per_split < units, "no empty split");
                assert!(sh.shared(&q4k) <= MAX_SHARED, "{tiles}x{k} n={n}: {sh:?}");
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
            shape(&q4k, 160, 10_240, 8, 132),
            Some(Shape {
                nt: 1,
                splits: 7,
                per_split: 6,
                blocks: 20
            })
        );
        assert_eq!(shape(&q4k, TICKETS + 1, 12_800, 32, 132), None);
    }

    #[test]
    fn few_token_products_take_the_tensor_cores() {
        let (q4k, q8) = (GgmlType::Q4_K, GgmlType::Q8_0);
        assert!(!mma_suits(q4k, 256, 1));
        assert!(mma_suits(q4k, 256, 2));
        assert!(mma_suits(q4k, 2560, 33) && mma_suits(q4k, 2560, 48));
        assert!(!mma_suits(q4k, 2560, 49));
        assert!(mma_suits(q8, 2560, 2) && mma_suits(q8, 512, 48));
        assert!(!mma_suits(q8, 2560, 1) && !mma_suits(q8, 2560, 49));
        // Q8_0 rows of a part group (layout.rs) stay on the other paths.
        assert!(!mma_suits(q8, 640, 8) && !mma_suits(q8, 96, 8));
        for ty in [GgmlType::Q5_K, GgmlType::Q6_K] {
            assert!(mma_suits(ty, 2560, 8) && !mma_suits(ty, 2560, 1));
        }
        // Q4_0 / Q5_0 rows of whole 8-block units (layout.rs); 640 wide stays as stored.
        for ty in [GgmlType::Q4_0, GgmlType::Q5_0] {
            assert!(mma_suits(ty, 2560, 8) && !mma_suits(ty, 640, 8) && !mma_suits(ty, 2560, 1));
        }
        assert!(!mma_suits(GgmlType::Q5_1, 2560, 8) && !mma_suits(GgmlType::BF16, 2560, 8));
        // Launches of several matrices (q, k, v) up to 64 rows; one matrix up to 48.
        assert!(mma_suits_many(q4k, 2560, 64, 3) && mma_suits_many(q4k, 2560, 64, 2));
        assert!(!mma_suits_many(q4k, 2560, 64, 1) && !mma_suits_many(q4k, 2560, 65, 3));
        assert!(!mma_suits_many(GgmlType::BF16, 2560, 64, 3));
    }
}
