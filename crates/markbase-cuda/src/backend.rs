//! [`CudaBackend`]: the [`Backend`] operations as kernels queued on one stream. Nothing waits
//! for the device except [`Backend::read`] (and the token choosers in `sample`), so a model
//! step costs one host wait. Host-side index arrays (tokens, positions, slots, sequence starts,
//! block tables) are copied to a device scratch array in stream order before the kernel that
//! reads them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use cudarc::driver::CudaFunction;
use markbase_core::backend::{
    first_visible_key, rope_attention_in_steps, AttnSpec, Backend, HostMatrix, KvLayout, NewKv,
    NormOut, Rope, Strided, ValueRows,
};
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::attention_flash::{attention_flash_suits, flash_kernel};
use crate::blas::{Blas, GemmCall, GemmInput, GemmOutput};
use crate::buffer::{CudaBuffer, CudaMatrix, Growable};
use crate::device::{driver_err, Device};
use crate::device_wide::Pinned;
use crate::gemv_walk::HALVES_WALK_MIN_ROWS;
use crate::graph::{DeviceCopy, Op, Steps};
use crate::kernels::{Arg, AttnArgs, Grid, Kernels, Launch, ProductArgs, MAX_PRODUCTS};
use crate::mmq::{mma_suits, mmq_rows, Job, TICKETS as MMQ_TICKETS};
use crate::moe_mma::{activation_kind, moe_on_tensor_cores, MoeOutput, MoeTiles};
use crate::rounded::{CopyForm, QueueCount, RoundTarget, RoundedCopy, ROUND_Q4K_TILES};
use crate::sources::Module;

/// Token rows one GEMV launch reads each weight row for (the largest kernel variant).
const GEMV_MAX_ROWS: usize = 8;
/// Warps per multiprocessor a plain-float GEMV launch aims for (see `gemv_split`).
const GEMV_WARPS_PER_SM: usize = 8;
/// Up to this many token rows a matmul uses GEMV launches; above it, dequantize + cuBLAS.
const GEMV_UP_TO: usize = 16;
/// Up to this many token rows a bf16 matmul uses GEMV launches; above it, the tensor cores
/// (cuBLAS on the stored bf16 weights). Measured on the H200 (E4B bf16, `bench -b`, session
/// 7): GEMVs give 271 / 386 / 503 / 547 t/s at 2 / 4 / 8 / 16 sequences, the tensor cores
/// 210 / 412 / 841 / 1 729.
pub const BF16_GEMV_UP_TO: usize = 2;
/// Most f32 weights dequantized at once for a cuBLAS product (64 MiB of scratch).
const DEQUANT_TILE: usize = 16 << 20;
/// Most weights dequantized to f16 at once for a tensor-core product (128 MiB of scratch:
/// every matrix of E4B in one tile).
const HALF_TILE: usize = 64 << 20;
/// Rows of a dequantized tile (short of a whole matrix) are a multiple of this, so that the
/// product of every tile keeps its output aligned: an odd tile height left the later tiles'
/// output 4-byte aligned, and cuBLASLt chose a kernel ≈ 4× slower (H200, session 9).
const TILE_ROW_MULTIPLE: usize = 128;
/// Threads per block of the embed and dequant kernels: `DEQUANT_THREADS` in ops.cu, which
/// sizes its shared staging by it.
const DEQUANT_THREADS: usize = 128;
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
/// Most experts `moe_route` handles (8 per lane), and the grouped `moe_ffn`: `moe_group`
/// takes a thread per expert, a block of this many threads (`MOE_MAX_EXPERTS` in moe.cu).
const MAX_EXPERTS: usize = 256;
/// Most blocks a grid's second dimension holds (CUDA's limit): `moe_ffn`'s tokens and
/// pairs.
const MAX_GRID_Y: usize = 65_535;
/// Most experts `moe_route` chooses for a token (a lane keeps each choice).
const MAX_TOP_K: usize = 32;
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

/// Scratch space shared by operations (one operation uses it at a time; stream order makes
/// reuse safe).
pub(crate) struct Scratch {
    /// Float scratch: dequantized weight tiles, attention partials, rounded inputs, the
    /// grouped MoE path's intermediates.
    pub(crate) floats: Growable<f32>,
    /// The per-pair MoE path's intermediates, apart from `floats`: its first kernel may run
    /// beside the product ahead of it ([`CudaBackend::take_beside`]), which may use `floats`.
    pub(crate) moe_pairs: Growable<f32>,
    /// Weight tiles dequantized to f16 for the tensor cores.
    pub(crate) tiles: Growable<u16>,
    /// Chosen tokens of the samplers.
    pub(crate) picks: Growable<u32>,
    /// The rounded copy of the activations a producer kernel made for the next product.
    pub(crate) rounded: RoundedCopy,
}

/// The CUDA backend: one GPU, one stream.
pub struct CudaBackend {
    pub(crate) dev: Device,
    /// Every stream operation goes through it (steps replayed as CUDA graphs, `graph`); it
    /// drops its graphs before the kernels they launch are unloaded.
    pub(crate) steps: Steps,
    pub(crate) kernels: Kernels,
    pub(crate) blas: Option<Arc<Blas>>,
    pub(crate) scratch: Mutex<Scratch>,
    /// Work items queued on the stream (see `rounded`).
    pub(crate) queue: QueueCount,
    /// Error word raised by kernels (see common.cuh), checked at each `read`.
    err: CudaBuffer,
    /// The tensor-core Q4_K / Q8_0 products' tickets, one a row tile, zero between launches
    /// (`mmq`).
    mmq_tickets: CudaBuffer,
    err_host: Mutex<Pinned>,
    /// RoPE frequency tables by (θ bits, linear factor bits, head_dim, rotated pairs).
    rope_tables: Mutex<HashMap<(u32, u32, usize, usize), CudaBuffer>>,
    /// Held from a kernel's index uploads until the kernel is queued, and by a host wait before
    /// it starts the next step (which recycles the step's index arena): no other thread's wait
    /// can hand an uploaded array's place to another array before its reader is queued.
    uploads: Mutex<()>,
    /// Grids of the grid-stride kernels: resident blocks of (name prefix, format, variant,
    /// dynamic shared bytes a block) on the whole device, from the driver's occupancy.
    resident: Mutex<HashMap<ResidentKey, u32>>,
    /// Set by [`Backend::next_beside_previous`] to the calling thread: its next operation may
    /// run beside the one ahead of it. Taken by that thread's launches that can
    /// (`take_beside`), cleared by every launch (another thread's op becomes the one ahead).
    beside: Mutex<Option<ThreadId>>,
}

impl Drop for CudaBackend {
    /// Waits for the stream's work before the fields go (kernel modules, cuBLASLt, buffers): a
    /// module unloaded under a kernel still running faults it, and the fault stays on the
    /// context that every backend of the process shares.
    fn drop(&mut self) {
        let _ = self.dev.stream.synchronize();
    }
}

/// A grid-stride kernel's occupancy key: its name prefix, format and variant, and the dynamic
/// shared memory of a block.
pub(crate) type ResidentKey = (&'static str, GgmlType, u32, u32);

/// Widest row `residual_norm` holds in registers: 1 024 threads of
/// `RESIDUAL_NORM_PER_THREAD` (8) values (ops.cu).
const RESIDUAL_NORM_MAX_DIM: usize = 8 * 1024;
/// Most extra norms `residual_norm` writes beside its next norm (w3 / x3, w4 / x4 in ops.cu).
const EXTRA_NORMS: usize = 2;
/// Row counts up to which `residual_norm` takes more threads a row (decode steps).
const RESIDUAL_NORM_FEW_ROWS: usize = 64;
/// Widest row a norm writes as Q4_K tiles (common.cuh, `store_q4k_tiles`): the row passes
/// through 4 bytes a value of shared memory (32 KB here; a launch may ask for 48 KB with the
/// kernels' static arrays).
const Q4K_TILES_MAX_DIM: usize = 8 * 1024;

/// Proof of holding the backend's upload lock ([`CudaBackend::uploads`]).
pub(crate) struct Uploads<'a> {
    _guard: MutexGuard<'a, ()>,
}

pub(crate) fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(Error::Invalid(format!(
            "cuda {what}: buffer of {have} values, needs {want}"
        )));
    }
    Ok(())
}

/// Warps per weight row of a GEMV (gemv.cu): plain-float rows are shared by up to 8 warps
/// until the launch has `GEMV_WARPS_PER_SM` warps per multiprocessor, so a matrix of a few
/// hundred rows still keeps every multiprocessor reading. Rows on 16-bit activations
/// (quant.cuh, `i16_rows`: Q4_K, Q8_0 of whole groups; units of 256 values) take one warp
/// each in matrices of 2 blocks' rows or more per multiprocessor, for launches of any number
/// of token rows: each block stages all the activations of its
/// tokens, so sharing rows between more warps only means more blocks staging the same values.
/// Shorter matrices share rows of 16 or more units by 2 and of 32 or more by 4, so a
/// long row is not one warp's serial walk through its passes, but by no more warps than a
/// staged tile has passes of 4 units (`q4k_tile`: 2 for 8 token rows), which would
/// leave the others idle. Other quantized rows take one warp each.
fn gemv_split(w: &CudaMatrix, n: usize, multiprocessors: usize) -> usize {
    if gemv_takes_16_bit_activations(w.ty, w.cols) {
        if w.rows >= 2 * 8 * multiprocessors {
            return 1;
        }
        let by_length = match w.cols / 256 {
            32.. => 4,
            16.. => 2,
            _ => 1,
        };
        // The first launch's kernel is the widest, with the shortest tile.
        let variant = gemv_launches(n).next().map_or(1, |(_, _, v)| v);
        return by_length.min(q4k_tile(variant) / 4);
    }
    let plain = matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if !plain || !w.cols.is_multiple_of(8) {
        return 1;
    }
    let want = GEMV_WARPS_PER_SM * multiprocessors;
    let mut split = 1;
    while split < 8 && w.rows * split < want && w.cols / (8 * 32 * split) >= 2 {
        split *= 2;
    }
    split
}

/// Warps of a GEMV block for weights stored as `ty` whose rows `split` warps share:
/// plain-float rows take blocks of 4 warps, so a matrix of a few thousand rows spreads evenly
/// over the multiprocessors (E4B's down projection, 2 560 rows in blocks of 8, gave 56 of the
/// 132 three blocks and the rest two); quantized rows stage their activations per block of 8.
fn gemv_block_warps(ty: GgmlType, split: usize) -> usize {
    let plain = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if plain && split <= 4 {
        4
    } else {
        8
    }
}

/// Whether a product of `n` token rows with weights stored as `ty`, rows `cols` wide, runs as
/// GEMV launches (otherwise, where cuBLAS is present, on the tensor cores: cuBLAS, or for the
/// weights and rows of `mma_suits` the kernel of `mmq` where its plan takes them, on devices of
/// compute capability 8.0 and newer).
fn gemv_suits(n: usize, ty: GgmlType, cols: usize) -> bool {
    n <= GEMV_UP_TO && !(ty == GgmlType::BF16 && n > BF16_GEMV_UP_TO) && !mma_suits(ty, cols, n)
}

/// Whether a product of `n` token rows that takes its inputs as `inputs` under cuBLAS rounds
/// them (it runs on the tensor cores, not as GEMVs).
fn rounds_rows(inputs: ProductInputs, n: usize) -> bool {
    match inputs {
        ProductInputs::Bf16 => n > BF16_GEMV_UP_TO,
        // Quantized weights: those of `mma_suits` read `CopyForm::Mmq`; the rest are GEMVs up
        // to `GEMV_UP_TO` rows.
        ProductInputs::F16 => n > GEMV_UP_TO,
        ProductInputs::F32 => false,
    }
}

/// Whether a product of `n` token rows that reads its inputs in `form` (as the last product
/// that takes copies did) would read a producer's copy of them: tensor-core products their
/// rounding, one-token GEMVs on 16-bit activations (`gemv_q4k_tiles`) the tiles.
fn reads_copy(form: CopyForm, n: usize) -> bool {
    match form {
        CopyForm::Rounded(inputs) => rounds_rows(inputs, n),
        CopyForm::Q4kTiles => n == 1,
        CopyForm::Mmq => mmq_rows(n),
    }
}

/// The form in which a tensor-core product of `n` token rows with weights stored as `ty`, rows
/// `cols` wide, taking `inputs`, reads its activations' rounded copy.
pub(crate) fn rounded_form(ty: GgmlType, cols: usize, n: usize, inputs: ProductInputs) -> CopyForm {
    if mma_suits(ty, cols, n) {
        CopyForm::Mmq
    } else {
        CopyForm::Rounded(inputs)
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

/// Most tiles (up to `MOE_TILE` pairs of one expert) `pairs` pairs over `n_experts` experts
/// can need: Σ ⌈c_e / T⌉ ≤ (pairs + (T − 1)·m) / T for m ≤ min(experts, pairs) experts with
/// pairs. The grouped kernels' grids are this tall (blocks past the last tile exit).
fn moe_most_tiles(pairs: usize, n_experts: usize) -> usize {
    (pairs + (MOE_TILE - 1) * n_experts.min(pairs)) / MOE_TILE
}

/// The inputs of a product of `n` token rows with weights stored as `ty`, rows `cols` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductInputs {
    /// f32 activations and weights as stored (GEMVs; f32 and f16 weights under cuBLAS).
    F32,
    /// Activations rounded to bf16, weights as stored in bf16 (the tensor cores; how bf16
    /// models run everywhere).
    Bf16,
    /// Activations rounded to f16 (saturating at ±65 504) and quantized weights dequantized
    /// to f16 a tile at a time (the tensor cores; llama.cpp's cuBLAS path does the same).
    F16,
}

/// Whether a product with weights stored as `ty`, rows `cols` wide, that runs as GEMV launches
/// (`ProductInputs::F32`) takes its activations quantized to 16 bits (each 32 values as
/// integers times max|x| / 32767, the CPU path's scheme): every token row of a launch of Q4_K,
/// Q5_K or Q6_K rows, or of Q8_0, Q4_0 or Q5_0 rows of a multiple of 256 values (quant.cuh,
/// `i16_rows`), the MoE expert products included.
pub fn gemv_takes_16_bit_activations(ty: GgmlType, cols: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
        || (matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0)
            && cols.is_multiple_of(256))
}

/// Super-blocks of the tile in which a Q4_K GEMV kernel of `variant` token rows stages its
/// activations: `q4k_i16_tile` in quant.cuh (48 / variant rounded up to a multiple of 8).
fn q4k_tile(variant: u32) -> usize {
    (48 / variant as usize).div_ceil(8) * 8
}

/// How a product of `n` token rows with weights stored as `ty`, rows `cols` wide, takes its
/// inputs when cuBLAS is present (without it, every product is an f32 GEMV).
pub fn product_inputs(ty: GgmlType, cols: usize, n: usize) -> ProductInputs {
    if gemv_suits(n, ty, cols) || !cols.is_multiple_of(2) {
        ProductInputs::F32
    } else if ty == GgmlType::BF16 {
        ProductInputs::Bf16
    } else if ty.block_size() > 1 {
        ProductInputs::F16
    } else {
        ProductInputs::F32
    }
}

/// The launches a GEMV of `n` token rows takes: (first row, rows, kernel variant), at most
/// `GEMV_MAX_ROWS` rows each (the variant is the smallest kernel that holds them).
fn gemv_launches(n: usize) -> impl Iterator<Item = (usize, usize, u32)> {
    (0..n).step_by(GEMV_MAX_ROWS).map(move |t0| {
        let nt = (n - t0).min(GEMV_MAX_ROWS);
        (t0, nt, [1, 2, 4, 4, 8, 8, 8, 8][nt - 1])
    })
}

/// Rows of `w` dequantized per tile within about `elements` weights: the whole matrix where it
/// fits, else a multiple of `TILE_ROW_MULTIPLE` (at most 65 535, the launch grid's height).
fn tile_rows(elements: usize, w: &CudaMatrix) -> usize {
    let fit = (elements / w.cols.max(1)).min(65_535);
    if fit >= w.rows {
        w.rows
    } else {
        (fit / TILE_ROW_MULTIPLE).max(1) * TILE_ROW_MULTIPLE
    }
}

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
struct FusedRope<'a> {
    /// Query norm weights.
    q_norm: u64,
    /// The norms' epsilon.
    eps: f32,
    /// The RoPE frequencies (`rope_table`).
    freqs: u64,
    /// Pairs that turn.
    pairs: i32,
    /// The new keys and values; `None` on a layer that only reads the cache.
    new: Option<NewRows<'a>>,
}

/// A fused step's new keys and values on the device.
struct NewRows<'a> {
    /// Raw key rows.
    k: u64,
    /// Value rows (raw when `v_norm` is 1).
    v: u64,
    /// Key norm weights.
    k_norm: u64,
    /// 1: the values go through a weightless RMSNorm on the way to the cache.
    v_norm: i32,
    /// The cache row of each token.
    slots: &'a [u32],
}

/// Errors unless the RoPE kernels can turn heads of `head_dim` by `rope`.
fn check_rope(rope: &Rope, head_dim: usize) -> Result<()> {
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
fn value_rows(v: ValueRows<'_, CudaBuffer>) -> (&CudaBuffer, i32) {
    match v {
        ValueRows::AsIs(v) => (v, 0),
        ValueRows::Normed { raw, .. } => (raw, 1),
    }
}

/// Errors unless a cache holds row `slots.max()` of width `row`.
fn check_slots(
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

/// The grid of a norm over `n` rows of `dim` values in blocks of `threads`: a row a block,
/// with the row's 4·dim bytes of shared memory where it writes Q4_K tiles.
fn norm_grid(n: usize, threads: u32, dim: usize, round: RoundTarget) -> Result<Grid> {
    let mut grid = Grid::new((int("rows", n)? as u32, 1), threads);
    if round.kind == ROUND_Q4K_TILES {
        grid.shared = 4 * dim as u32;
    }
    Ok(grid)
}

pub(crate) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// `v` as a kernel's `int` argument, or an error naming `what`.
pub(crate) fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Invalid(format!("cuda {what}: {v} is too large")))
}

/// The kernel-name suffix of a weight format (`sources::FORMATS`).
pub(crate) fn format_suffix(ty: GgmlType) -> Result<&'static str> {
    crate::sources::FORMATS
        .iter()
        .find(|&&(t, _)| t == ty)
        .map(|&(_, s)| s)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "{ty} weights on the CUDA backend (an activation format)"
            ))
        })
}

impl CudaBackend {
    /// Opens GPU `ordinal` and prepares its kernels (compiled with NVRTC for the device's
    /// architecture on first use, then taken from the disk cache). Errors clearly when there
    /// is no driver, no GPU or no NVRTC.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let dev = Device::open(ordinal)?;
        let (major, minor) = dev.capability();
        let kernels = Kernels::load(&dev.ctx, (major * 10 + minor) as u32)?;
        let queue = QueueCount::default();
        let blas = Blas::new(&dev.stream, queue.clone())?.map(Arc::new);
        let graphs = std::env::var("MARKBASE_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let steps = Steps::new(&dev.stream, blas.clone(), graphs)?;
        if let Some(blas) = &blas {
            blas.attach(&steps);
        }
        let err = CudaBuffer::zeroed(&dev.stream, &steps, 1)?;
        let mmq_tickets = CudaBuffer::zeroed(&dev.stream, &steps, MMQ_TICKETS)?;
        // Written only by copies from the device.
        let err_host = Pinned::alloc(&dev.ctx, 1)?;
        Ok(CudaBackend {
            dev,
            kernels,
            blas,
            scratch: Mutex::new(Scratch {
                floats: Growable::new(&steps),
                moe_pairs: Growable::new(&steps),
                tiles: Growable::new(&steps),
                picks: Growable::new(&steps),
                rounded: RoundedCopy::new(&steps),
            }),
            steps,
            queue,
            err,
            mmq_tickets,
            err_host: Mutex::new(err_host),
            rope_tables: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
            uploads: Mutex::new(()),
            beside: Mutex::new(None),
        })
    }

    /// How many products have taken the rounded copy of their activations that the kernel
    /// before them wrote, instead of rounding them in a pass of their own.
    pub fn rounded_copies_used(&self) -> Result<u64> {
        Ok(self.scratch()?.rounded.used())
    }

    /// The tensor-core products' tickets (`mmq`).
    pub(crate) fn mmq_tickets(&self) -> u64 {
        self.mmq_tickets.ptr
    }

    /// The opened device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Whether cuBLAS was found (prefill products use it; without it they run as GEMVs).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    pub(crate) fn scratch(&self) -> Result<MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| Error::Invalid("CUDA scratch poisoned by an earlier panic".into()))
    }

    /// Queues kernel `f`.
    pub(crate) fn launch_fn(&self, f: &CudaFunction, grid: Grid, args: &[Arg]) -> Result<()> {
        self.queue.bump();
        self.clear_beside();
        let launch = Launch::new(f, grid, args, self.dev.early_launch());
        self.steps.lock()?.queue(Op::Kernel(launch))
    }

    /// Queues the cuBLASLt product `call`.
    pub(crate) fn queue_gemm(&self, call: Result<GemmCall>) -> Result<()> {
        self.clear_beside();
        self.steps.lock()?.queue(Op::Gemm(call?))
    }

    /// Queues a device-to-device copy.
    fn queue_copy(&self, copy: DeviceCopy) -> Result<()> {
        self.queue.bump();
        self.clear_beside();
        self.steps.lock()?.queue(Op::Copy(copy))
    }

    /// Whether the launch about to be queued may run beside the kernel ahead of it
    /// ([`Backend::next_beside_previous`] was called since the last launch, and kernels launch
    /// early on this device): its kernel then takes `beside` = 1 (`start_step` in common.cuh).
    /// Taking it clears it.
    pub(crate) fn take_beside(&self) -> bool {
        let Ok(mut b) = self.beside.lock() else {
            return false;
        };
        let mine = *b == Some(std::thread::current().id());
        if mine {
            *b = None;
        }
        mine && self.dev.early_launch()
    }

    /// Forgets a [`Backend::next_beside_previous`] hint: an operation was queued.
    fn clear_beside(&self) {
        if let Ok(mut b) = self.beside.lock() {
            *b = None;
        }
    }

    /// Runs `f`, which queues work that steps do not record (host copies, memsets,
    /// allocations), after any operations held back for a graph.
    pub(crate) fn foreign<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.steps.lock()?.foreign(f)
    }

    /// A step's host wait, the only one: queues the step (as graph segments where it repeats
    /// a recorded one), then a copy of the kernel error word and `copy` (a copy to host
    /// memory); waits for the device; starts the next step (capturing this one if it repeated
    /// the step before); then raises any error a kernel flagged. The recorder stays locked
    /// until the next step has started, so no other thread queues work or waits on the stream
    /// while a step is captured.
    pub(crate) fn host_wait<T>(&self, copy: impl FnOnce() -> Result<T>) -> Result<T> {
        let _uploads = self.uploads()?;
        let (out, flag) = {
            let mut steps = self.steps.lock()?;
            steps.finish_queueing()?;
            let mut host = self
                .err_host
                .lock()
                .map_err(|_| Error::Invalid("CUDA error word poisoned".into()))?;
            // SAFETY: the error word is one u32 (stored in an f32 slot); copy its bits.
            let word = unsafe { self.err.mem.transmute::<u32>(1) }
                .ok_or_else(|| Error::Invalid("CUDA error word".into()))?;
            self.dev
                .stream
                .memcpy_dtoh(&word, &mut **host)
                .map_err(|e| driver_err("error word copy", e))?;
            let out = self.dev.wait(copy);
            let flag = host.as_slice().map(|w| w[0]);
            steps.start_next_step();
            (out, flag)
        };
        let out = out?;
        self.take_kernel_error(flag.map_err(|e| driver_err("error word read", e))?)?;
        Ok(out)
    }

    /// Steps run as CUDA graph launches so far.
    pub fn graph_replays(&self) -> Result<u64> {
        Ok(self.steps.lock()?.replays())
    }

    /// Turns replaying steps as CUDA graphs on or off (on by default; off with the
    /// environment variable `MARKBASE_CUDA_GRAPHS=0`).
    pub fn set_graphs(&self, on: bool) -> Result<()> {
        self.steps.lock()?.set_enabled(on)
    }

    /// Whether steps are replayed as CUDA graphs.
    pub fn graphs_enabled(&self) -> Result<bool> {
        Ok(self.steps.lock()?.enabled())
    }

    /// Why graphs turned themselves off, if they did: capturing a step failed (the step still
    /// ran, and later steps run as queued).
    pub fn graphs_off_reason(&self) -> Result<Option<String>> {
        Ok(self.steps.lock()?.off_reason())
    }

    /// Waits until everything queued has run (a host wait, as at the end of a step).
    pub fn synchronize(&self) -> Result<()> {
        self.host_wait(|| Ok(()))
    }

    /// Queues kernel `name` of module `m`.
    pub(crate) fn run(
        &self,
        m: Module,
        name: &'static str,
        grid: Grid,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_fn(&self.kernels.func(m, name)?, grid, args)
    }

    /// The right to upload index arrays (`upload_idx`) until the kernels reading them are
    /// queued: hold it from the first upload to the last launch, and drop it before any read.
    pub(crate) fn uploads(&self) -> Result<Uploads<'_>> {
        self.uploads
            .lock()
            .map(|g| Uploads { _guard: g })
            .map_err(|_| Error::Invalid("CUDA upload lock poisoned".into()))
    }

    /// Copies `v` into the step's index arena; returns its device address, valid until the
    /// step's host wait.
    pub(crate) fn upload_idx(&self, _held: &Uploads<'_>, v: &[u32]) -> Result<u64> {
        self.queue.bump();
        self.steps.lock()?.upload(v)
    }

    /// Queues GEMV launches for `n` token rows (≤ GEMV_MAX_ROWS per launch); with
    /// `mul = Some((m, stride))` each result becomes `gelu_tanh(result) · m[t·stride + r]`.
    fn gemv(
        &self,
        x: u64,
        n: usize,
        w: &CudaMatrix,
        out: u64,
        mul: Option<(u64, usize)>,
    ) -> Result<()> {
        let (rows, k) = (int("rows", w.rows)?, int("cols", w.cols)?);
        let (mul, mul_stride) = mul.unwrap_or((0, 0));
        let mut s = self.scratch()?;
        let tiles = self.gemv_q4k_tiles(&mut s, x, n, w);
        let halves = gemv_takes_16_bit_activations(w.ty, w.cols)
            && n == 1
            && mul == 0
            && w.rows >= HALVES_WALK_MIN_ROWS
            && w.rows.is_multiple_of(2);
        if halves {
            return self.gemv_halves_walk(x, w, out, tiles);
        }
        let split = gemv_split(w, n, self.dev.multiprocessors() as usize);
        let warps = gemv_block_warps(w.ty, split);
        for (t0, nt, variant) in gemv_launches(n) {
            let f = self.kernels.func_for(Module::Gemv, "gemv", w.ty, variant)?;
            self.launch_fn(
                &f,
                Grid::new((blocks(w.rows * split, warps), 1), 32 * warps as u32),
                &[
                    Arg::U64(w.ptr),
                    Arg::U64(w.row_bytes as u64),
                    Arg::I32(rows),
                    Arg::I32(k),
                    Arg::U64(x + 4 * (t0 * w.cols) as u64),
                    Arg::I32(nt as i32),
                    Arg::U64(out + 4 * (t0 * w.rows) as u64),
                    Arg::I32(split as i32),
                    Arg::U64(if mul == 0 {
                        0
                    } else {
                        mul + 4 * (t0 * mul_stride) as u64
                    }),
                    Arg::U64(mul_stride as u64),
                    Arg::U64(tiles),
                ],
            )?;
        }
        Ok(())
    }

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
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn_grouped(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate_up: &CudaMatrix,
        down: &CudaMatrix,
        n_experts: usize,
        top_k: usize,
        tensor_cores: bool,
        weights: &CudaBuffer,
        ids: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (d, f, pairs) = (gate_up.cols, down.cols, n * top_k);
        let most_tiles = moe_most_tiles(pairs, n_experts);
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

    /// The `len` activations at `x` rounded for a tensor-core product that reads them in
    /// `form` (bf16 for `Rounded(Bf16)`, else f16) into the float scratch (`len` even: they
    /// take len / 2 float slots); returns their address.
    pub(crate) fn round_inputs(
        &self,
        s: &mut Scratch,
        form: CopyForm,
        x: u64,
        len: usize,
    ) -> Result<u64> {
        if let Some(at) = s.rounded.take(x, len, form, &self.queue) {
            return Ok(at);
        }
        let kernel = match form {
            CopyForm::Rounded(ProductInputs::Bf16) => "f32_to_bf16",
            _ => "f32_to_f16",
        };
        let xh = s.floats.get(&self.dev.stream, len / 2)?;
        self.run(
            Module::Ops,
            kernel,
            Grid::new((blocks(len, 256), 1), 256),
            &[Arg::U64(x), Arg::U64(xh), Arg::U64(len as u64)],
        )?;
        Ok(xh)
    }

    /// Products of one activation block with several matrices of one format and width (all
    /// checked by the caller): one `gemv_many` launch per ≤ 8 token rows where GEMVs suit,
    /// else one bf16 rounding shared by the tensor-core products (two bf16 matrices of one
    /// shape in a row, such as k and v, in one batched call); `false` where neither
    /// applies (the caller runs them one by one).
    fn matmul_shared(&self, x: u64, n: usize, products: &[(&CudaMatrix, u64)]) -> Result<bool> {
        let w0 = products[0].0;
        let k = w0.cols;
        match &self.blas {
            Some(blas) if !gemv_suits(n, w0.ty, w0.cols) => {
                let inputs = product_inputs(w0.ty, k, n);
                if inputs == ProductInputs::F32 {
                    return Ok(false);
                }
                let mut s = self.scratch()?;
                let xh =
                    self.round_inputs(&mut s, rounded_form(w0.ty, w0.cols, n, inputs), x, n * k)?;
                if self.mmq(&mut s, xh, n, Job::Products(products))? {
                    return Ok(true);
                }
                let mut rest = products;
                while let Some((&(w, out), after)) = rest.split_first() {
                    rest = after;
                    // Two bf16 matrices of one shape in a row (k and v) as one batched call.
                    if let Some(&(w2, out2)) = after.first().filter(|(w2, _)| {
                        w.ty == GgmlType::BF16 && (w2.ty, w2.rows) == (w.ty, w.rows)
                    }) {
                        let bf16 = (GemmInput::Bf16, GemmOutput::F32);
                        // SAFETY: `xh` holds n·k bf16 values, both matrices rows·k, both
                        // outputs room for n·rows floats (checked by the caller).
                        let pair = unsafe {
                            blas.gemm_rows_pair(
                                bf16,
                                [w.ptr, w2.ptr],
                                w.rows,
                                k,
                                xh,
                                n,
                                [out, out2],
                                w.rows,
                            )?
                        };
                        if let Some(call) = pair {
                            self.queue_gemm(Ok(call))?;
                            rest = &after[1..];
                            continue;
                        }
                    }
                    self.gemm_half(blas, &mut s, xh, n, w, out)?;
                }
                Ok(true)
            }
            _ => {
                let mut args = ProductArgs {
                    count: products.len() as i32,
                    ..ProductArgs::default()
                };
                for (i, (w, _)) in products.iter().enumerate() {
                    args.w[i] = w.ptr;
                    args.rows[i] = int("rows", w.rows)?;
                }
                let total: usize = products.iter().map(|(w, _)| w.rows).sum();
                let mut s = self.scratch()?;
                let tiles = self.gemv_q4k_tiles(&mut s, x, n, w0);
                for (t0, nt, variant) in gemv_launches(n) {
                    for (i, &(w, out)) in products.iter().enumerate() {
                        args.out[i] = out + 4 * (t0 * w.rows) as u64;
                    }
                    let f = self
                        .kernels
                        .func_for(Module::Gemv, "gemv_many", w0.ty, variant)?;
                    let warps = gemv_block_warps(w0.ty, 1);
                    self.launch_fn(
                        &f,
                        Grid::new((blocks(total, warps), 1), 32 * warps as u32),
                        &[
                            Arg::Products(args),
                            Arg::U64(w0.row_bytes as u64),
                            Arg::I32(int("cols", k)?),
                            Arg::U64(x + 4 * (t0 * k) as u64),
                            Arg::I32(nt as i32),
                            Arg::U64(tiles),
                        ],
                    )?;
                }
                Ok(true)
            }
        }
    }

    /// Prefill-sized product through cuBLAS, inputs per `product_inputs`: f32 weights directly;
    /// bf16 and quantized weights on the tensor cores (`gemm_half`); f16 weights (and odd
    /// widths) dequantized tile by tile into f32 scratch.
    fn gemm(&self, blas: &Blas, x: u64, n: usize, w: &CudaMatrix, out: u64) -> Result<()> {
        let k = w.cols;
        if w.ty == GgmlType::F32 {
            // SAFETY: sizes checked by the caller.
            return self.queue_gemm(unsafe {
                blas.gemm_rows(
                    (GemmInput::F32, GemmOutput::F32),
                    w.ptr,
                    w.rows,
                    k,
                    x,
                    n,
                    out,
                    w.rows,
                )
            });
        }
        let mut s = self.scratch()?;
        let inputs = product_inputs(w.ty, k, n);
        if inputs != ProductInputs::F32 {
            let xh = self.round_inputs(&mut s, rounded_form(w.ty, w.cols, n, inputs), x, n * k)?;
            return self.gemm_half(blas, &mut s, xh, n, w, out);
        }
        let tile = tile_rows(DEQUANT_TILE, w);
        let deq = s.floats.get(&self.dev.stream, tile * k)?;
        self.gemm_dequantized(blas, GemmInput::F32, deq, tile, w, x, n, out)
    }

    /// `out = x · wᵀ` on the tensor cores from `xh`, the `n` activation rows already rounded
    /// as `product_inputs` says: bf16 weights as stored, those of `mma_suits` (Q4_K, Q5_K, Q6_K,
    /// Q8_0, Q4_0, Q5_0) of 2–64 token rows by `mmq` where it takes them, other quantized ones
    /// dequantized to f16 a tile of rows at a time (sizes checked by the caller).
    pub(crate) fn gemm_half(
        &self,
        blas: &Blas,
        s: &mut Scratch,
        xh: u64,
        n: usize,
        w: &CudaMatrix,
        out: u64,
    ) -> Result<()> {
        let k = w.cols;
        if self.mmq(s, xh, n, Job::Products(&[(w, out)]))? {
            return Ok(());
        }
        if w.ty == GgmlType::BF16 {
            // SAFETY: `xh` holds n·k bf16 values, `w` rows·k; `out` rows·n.
            return self.queue_gemm(unsafe {
                blas.gemm_rows(
                    (GemmInput::Bf16, GemmOutput::F32),
                    w.ptr,
                    w.rows,
                    k,
                    xh,
                    n,
                    out,
                    w.rows,
                )
            });
        }
        let tile = tile_rows(HALF_TILE, w);
        let deq = s.tiles.get(&self.dev.stream, tile * k)?;
        self.gemm_dequantized(blas, GemmInput::F16, deq, tile, w, xh, n, out)
    }

    /// `out = x · wᵀ` with `w` dequantized into `deq` (f32 or f16, as `input`; `x` holds the
    /// activations in that type) `tile` rows at a time, one product per tile (sizes checked
    /// by the caller; `deq` holds a tile).
    #[allow(clippy::too_many_arguments)]
    fn gemm_dequantized(
        &self,
        blas: &Blas,
        input: GemmInput,
        deq: u64,
        tile: usize,
        w: &CudaMatrix,
        x: u64,
        n: usize,
        out: u64,
    ) -> Result<()> {
        let kernel = match input {
            GemmInput::F16 => "dequant_f16",
            _ => "dequant",
        };
        let f = self.kernels.func_for(Module::Ops, kernel, w.ty, 0)?;
        let mut r0 = 0;
        while r0 < w.rows {
            let rt = tile.min(w.rows - r0);
            self.launch_fn(
                &f,
                Grid::new(
                    (blocks(w.cols.div_ceil(32), DEQUANT_THREADS), rt as u32),
                    DEQUANT_THREADS as u32,
                ),
                &[
                    Arg::U64(w.ptr),
                    Arg::U64(w.row_bytes as u64),
                    Arg::I32(int("row", r0)?),
                    Arg::I32(int("cols", w.cols)?),
                    Arg::U64(deq),
                ],
            )?;
            // SAFETY: `deq` holds rt·k values, `x` n·k; `out` rows·n.
            self.queue_gemm(unsafe {
                blas.gemm_rows(
                    (input, GemmOutput::F32),
                    deq,
                    rt,
                    w.cols,
                    x,
                    n,
                    out + 4 * r0 as u64,
                    w.rows,
                )
            })?;
            r0 += rt;
        }
        Ok(())
    }

    /// Raises any error a kernel flagged since the last check (after a synchronisation).
    fn take_kernel_error(&self, flag: u32) -> Result<()> {
        if flag == 0 {
            return Ok(());
        }
        // SAFETY: the error word is a live 4-byte device allocation.
        self.foreign(|| {
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    self.err.ptr,
                    0,
                    4,
                    self.dev.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("error word reset", e))
        })?;
        Err(Error::Invalid(if flag & 1 != 0 {
            "cuda moe_ffn: an expert id was not a whole number below the expert count".into()
        } else {
            format!("cuda kernel error flag {flag:#x}")
        }))
    }

    /// [`Backend::attention`], or with `fused` the split-K kernel's variant that norms and
    /// turns the raw queries (and the new keys, which it also stores) itself: the fused
    /// [`Backend::rope_attention`] of a step that [`CudaBackend::fuses_rope_attention`] accepts.
    #[allow(clippy::too_many_arguments)]
    fn attention_checked(
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
    fn rope_table(&self, rope: &Rope, head_dim: usize) -> Result<u64> {
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

    /// Blocks of `threads` threads of `f` (kernel `key`: name prefix, format, variant, and the
    /// dynamic shared bytes of a block) the whole device holds at once: the grid of a kernel
    /// whose warps walk its rows grid-stride.
    pub(crate) fn resident_blocks(
        &self,
        key: ResidentKey,
        f: &CudaFunction,
        threads: u32,
    ) -> Result<u32> {
        let mut cache = self
            .resident
            .lock()
            .map_err(|_| Error::Invalid("CUDA occupancy table poisoned".into()))?;
        if let Some(&b) = cache.get(&key) {
            return Ok(b);
        }
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, key.3 as usize, None)
            .map_err(|e| driver_err(&format!("occupancy of {}", key.0), e))?;
        let b = per_sm.max(1) * self.dev.multiprocessors().max(1) as u32;
        cache.insert(key, b);
        Ok(b)
    }

    /// Where a producer of `n` token rows of `dim` values writes their copy for the next
    /// product (see `rounded`); `tiles`: the producer can write Q4_K tiles.
    pub(crate) fn round_target(
        &self,
        s: &mut Scratch,
        (n, dim): (usize, usize),
        tiles: bool,
    ) -> Result<RoundTarget> {
        s.rounded
            .target(&self.dev.stream, (n, dim), tiles, reads_copy)
    }

    /// For a product of `n` token rows with `w` about to read its activations at `x`: the
    /// address of their Q4_K tiles where a producer just wrote them and the product is a
    /// one-token GEMV on 16-bit activations (which then reads them instead of staging its
    /// activations), else 0. The caller holds `s` until the product is queued.
    fn gemv_q4k_tiles(&self, s: &mut Scratch, x: u64, n: usize, w: &CudaMatrix) -> u64 {
        if !gemv_takes_16_bit_activations(w.ty, w.cols) || n != 1 {
            return 0;
        }
        s.rounded
            .take(x, w.cols, CopyForm::Q4kTiles, &self.queue)
            .unwrap_or(0)
    }

    /// `gate[t, r] = gelu_tanh(gate[t, r]) · up[up_rows.at(t) + r]` for `n` rows of `rows`
    /// values, with the rounded copy for the next product.
    fn gelu_mul_rows(
        &self,
        gate: &mut CudaBuffer,
        up: &CudaBuffer,
        up_rows: Strided,
        n: usize,
        rows: usize,
    ) -> Result<()> {
        need("gelu_tanh_mul", gate.len(), n * rows)?;
        if n > 0 {
            need("gelu_tanh_mul", up.len(), up_rows.at(n - 1) + rows)?;
        }
        let mut s = self.scratch()?;
        let round = self.round_target(&mut s, (n, rows), false)?;
        self.gelu_mul_launch(gate, up, up_rows, n * rows, rows, round)?;
        s.rounded.hold(round, gate.ptr, n * rows, &self.queue);
        Ok(())
    }

    /// Queues `gelu_tanh_mul` over `len` values in rows of `rows` (sizes checked by the
    /// caller).
    fn gelu_mul_launch(
        &self,
        gate: &mut CudaBuffer,
        up: &CudaBuffer,
        up_rows: Strided,
        len: usize,
        rows: usize,
        round: RoundTarget,
    ) -> Result<()> {
        let aligned = [gate.ptr, up.ptr + 4 * up_rows.offset as u64, round.at]
            .iter()
            .all(|p| p % 16 == 0);
        if up_rows.stride == rows && len.is_multiple_of(4) && aligned {
            return self.elementwise(
                "gelu_tanh_mul4",
                &[
                    Arg::U64(gate.ptr),
                    Arg::U64(up.ptr + 4 * up_rows.offset as u64),
                    Arg::U64(len as u64 / 4),
                    Arg::U64(round.at),
                    Arg::I32(round.kind),
                ],
                len / 4,
            );
        }
        self.elementwise(
            "gelu_tanh_mul",
            &[
                Arg::U64(gate.ptr),
                Arg::U64(up.ptr + 4 * up_rows.offset as u64),
                Arg::U64(len as u64),
                Arg::U64(rows.max(1) as u64),
                Arg::U64(up_rows.stride as u64),
                Arg::U64(round.at),
                Arg::I32(round.kind),
            ],
            len,
        )
    }

    fn elementwise(&self, name: &'static str, args: &[Arg], len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.run(
            Module::Ops,
            name,
            Grid::new((blocks(len, 256), 1), 256),
            args,
        )
    }
}

impl CudaBackend {
    /// `residual_norm` (ops.cu) of `y` with up to [`EXTRA_NORMS`] `extra` norms of the new `h`
    /// (gains and outputs, beside `next`), or with `mix = Some((w_y, experts, w_experts))`
    /// `moe_residual_norm` of rms_norm(y) · w_y + rms_norm(experts) · w_experts.
    #[allow(clippy::too_many_arguments)]
    fn residual_norm_launch(
        &self,
        y: &CudaBuffer,
        mix: Option<(&CudaBuffer, &CudaBuffer, &CudaBuffer)>,
        weight: &CudaBuffer,
        eps: f32,
        (n, dim): (usize, usize),
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
        extra: &[(u64, u64)],
    ) -> Result<()> {
        need("residual_norm input", y.len(), n * dim)?;
        need("residual_norm residual", h.len(), n * dim)?;
        need("residual_norm weight", weight.len(), dim)?;
        if let Some((w2, x)) = &next {
            need("residual_norm next weight", w2.len(), dim)?;
            need("residual_norm output", x.len(), n * dim)?;
        }
        if dim > RESIDUAL_NORM_MAX_DIM {
            return Err(Error::Unsupported(format!(
                "cuda residual_norm: rows of {dim} values (at most {RESIDUAL_NORM_MAX_DIM})"
            )));
        }
        if n == 0 || dim == 0 {
            return Ok(());
        }
        // A few rows (decode): about four values a thread, the row's latency being the cost;
        // many rows (prefill): about eight, so more blocks share a multiprocessor.
        let per_thread = if n <= RESIDUAL_NORM_FEW_ROWS { 4 } else { 8 };
        let threads = (dim.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let (w2, x) = next.map_or((0, 0), |(w2, x)| (w2.ptr, x.ptr));
        let out = if w2 == 0 { h.ptr } else { x };
        let mut s = self.scratch()?;
        // Q4_K tiles only of a next norm's output (q/k/v, gate/up ahead): the product after a
        // bare residual (Gemma 4's PLE gate, 32 blocks) stages its row cheaply (docs/perf.md,
        // session 24).
        let tiles = w2 != 0 && dim <= Q4K_TILES_MAX_DIM;
        let round = self.round_target(&mut s, (n, dim), tiles)?;
        // Every variant's arguments: its inputs, then these, [its extra norms,] the copy.
        let norm = [
            Arg::U64(weight.ptr),
            Arg::F32(eps),
            Arg::I32(int("dim", dim)?),
            Arg::U64(h.ptr),
            Arg::F32(scale),
            Arg::U64(w2),
            Arg::U64(x),
        ];
        let copy = [Arg::U64(round.at), Arg::I32(round.kind)];
        let grid = norm_grid(n, threads, dim, round)?;
        let (w3, x3) = extra.first().copied().unwrap_or((0, 0));
        let (w4, x4) = extra.get(1).copied().unwrap_or((0, 0));
        let mixed = mix.map(|(w_y, e, w_e)| [y.ptr, w_y.ptr, e.ptr, w_e.ptr]);
        let (name, inputs, extras): (_, &[u64], &[u64]) = match &mixed {
            None if extra.is_empty() => ("residual_norm", &[y.ptr], &[]),
            None => ("residual_norm_extra", &[y.ptr], &[w3, x3, w4, x4]),
            Some(inputs) => ("moe_residual_norm", inputs, &[]),
        };
        let args: Vec<Arg> = (inputs.iter().copied().map(Arg::U64))
            .chain(norm)
            .chain(extras.iter().copied().map(Arg::U64))
            .chain(copy)
            .collect();
        self.run(Module::Ops, name, grid, &args)?;
        s.rounded.hold(round, out, n * dim, &self.queue);
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Matrix = CudaMatrix;
    type Vector = CudaBuffer;

    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal())
    }

    fn load_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        m.check()?;
        format_suffix(m.ty)?;
        self.foreign(|| {
            CudaMatrix::upload(
                &self.dev.stream,
                &self.steps,
                m.bytes.as_slice(),
                m.ty,
                m.rows,
                m.cols,
                &m.name,
            )
        })
    }

    fn load_vector(&self, v: &[f32]) -> Result<CudaBuffer> {
        let mut b = self.alloc(v.len())?;
        self.write(v, &mut b)?;
        Ok(b)
    }

    fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        // A new buffer may reuse the address of a freed one that a rounded copy was made of.
        self.queue.bump();
        self.foreign(|| CudaBuffer::zeroed(&self.dev.stream, &self.steps, len))
    }

    fn embed(
        &self,
        table: &CudaMatrix,
        tokens: &[u32],
        scale: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        need("embed", out.len(), tokens.len() * table.cols)?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::Invalid(format!(
                "token id {id} is outside the {} rows of '{}'",
                table.rows, table.name
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let held = self.uploads()?;
        let ids = self.upload_idx(&held, tokens)?;
        let spans = blocks(table.cols.div_ceil(32), DEQUANT_THREADS);
        self.launch_fn(
            &self.kernels.func_for(Module::Ops, "embed", table.ty, 0)?,
            Grid::new(
                (int("tokens", tokens.len())? as u32, spans),
                DEQUANT_THREADS as u32,
            ),
            &[
                Arg::U64(table.ptr),
                Arg::U64(table.row_bytes as u64),
                Arg::U64(ids),
                Arg::I32(int("cols", table.cols)?),
                Arg::F32(scale),
                Arg::U64(out.ptr),
            ],
        )
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        weight: Option<&CudaBuffer>,
        eps: f32,
        n: usize,
        dim: usize,
        out: &mut CudaBuffer,
        mode: NormOut,
    ) -> Result<()> {
        need("rms_norm input", x.len(), n * dim)?;
        need("rms_norm output", out.len(), n * dim)?;
        if let Some(w) = weight {
            need("rms_norm weight", w.len(), dim)?;
        }
        if n == 0 || dim == 0 {
            return Ok(());
        }
        // One value (or float4) per thread where the row allows, up to 1024 threads.
        let per_thread = if dim.is_multiple_of(4) { 4 } else { 1 };
        let threads = (dim.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        // A copy for the next product only of values written, not added; none beside the
        // kernel ahead, which may read the copy that kernel's producer made.
        let beside = self.take_beside();
        let mut s = self.scratch()?;
        let round = match mode {
            NormOut::Write if !beside => {
                self.round_target(&mut s, (n, dim), dim <= Q4K_TILES_MAX_DIM)?
            }
            _ => RoundTarget::NONE,
        };
        self.run(
            Module::Ops,
            "rms_norm",
            norm_grid(n, threads, dim, round)?,
            &[
                Arg::U64(x.ptr),
                Arg::U64(weight.map_or(0, |w| w.ptr)),
                Arg::F32(eps),
                Arg::I32(int("dim", dim)?),
                Arg::U64(out.ptr),
                Arg::I32((mode == NormOut::AddTo) as i32),
                Arg::U64(round.at),
                Arg::I32(round.kind),
                Arg::I32(beside as i32),
            ],
        )?;
        s.rounded.hold(round, out.ptr, n * dim, &self.queue);
        Ok(())
    }

    fn residual_norm(
        &self,
        y: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
    ) -> Result<()> {
        self.residual_norm_launch(y, None, weight, eps, (n, dim), h, scale, next, &[])
    }

    fn residual_norms(
        &self,
        y: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: (&CudaBuffer, &mut CudaBuffer),
        extra: &mut [(&CudaBuffer, &mut CudaBuffer)],
    ) -> Result<()> {
        if extra.len() > EXTRA_NORMS {
            return Err(Error::Unsupported(format!(
                "cuda residual_norms: {} extra norms (at most {EXTRA_NORMS})",
                extra.len()
            )));
        }
        for (w, x) in extra.iter() {
            need("residual_norm extra weight", w.len(), dim)?;
            need("residual_norm extra output", x.len(), n * dim)?;
        }
        let ptrs: Vec<(u64, u64)> = extra.iter().map(|(w, x)| (w.ptr, x.ptr)).collect();
        self.residual_norm_launch(y, None, weight, eps, (n, dim), h, scale, Some(next), &ptrs)
    }

    fn next_beside_previous(&self) {
        if let Ok(mut b) = self.beside.lock() {
            *b = Some(std::thread::current().id());
        }
    }

    fn moe_residual_norm(
        &self,
        (dense, w_dense): (&CudaBuffer, &CudaBuffer),
        (experts, w_experts): (&CudaBuffer, &CudaBuffer),
        _mix: &mut CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
    ) -> Result<()> {
        need("moe_residual_norm experts", experts.len(), n * dim)?;
        need("moe_residual_norm dense weight", w_dense.len(), dim)?;
        need("moe_residual_norm experts weight", w_experts.len(), dim)?;
        let mix = Some((w_dense, experts, w_experts));
        self.residual_norm_launch(dense, mix, weight, eps, (n, dim), h, scale, next, &[])
    }

    fn matmul(&self, x: &CudaBuffer, n: usize, w: &CudaMatrix, out: &mut CudaBuffer) -> Result<()> {
        need("matmul input", x.len(), n * w.cols)?;
        need("matmul output", out.len(), n * w.rows)?;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        match &self.blas {
            Some(blas) if !gemv_suits(n, w.ty, w.cols) => self.gemm(blas, x.ptr, n, w, out.ptr),
            _ => self.gemv(x.ptr, n, w, out.ptr, None),
        }
    }

    fn matmul_many(
        &self,
        x: &CudaBuffer,
        n: usize,
        products: &mut [(&CudaMatrix, &mut CudaBuffer)],
    ) -> Result<()> {
        for (w, out) in products.iter() {
            need("matmul input", x.len(), n * w.cols)?;
            need("matmul output", out.len(), n * w.rows)?;
        }
        // Matrices of one storage (format and row bytes) share a launch, up to MAX_PRODUCTS
        // of them, in order of their first member (llama.cpp's Q4_K_M keeps some layers' v in
        // Q6_K beside Q4_K q and k: two launches there, not three).
        let key = |w: &CudaMatrix| (w.ty, w.cols, w.row_bytes);
        let mut done = vec![false; products.len()];
        for i in 0..products.len() {
            if done[i] {
                continue;
            }
            let group: Vec<usize> = (i..products.len())
                .filter(|&j| !done[j] && key(products[j].0) == key(products[i].0))
                .take(MAX_PRODUCTS)
                .collect();
            group.iter().for_each(|&j| done[j] = true);
            if n > 0 && group.len() > 1 {
                let ptrs: Vec<(&CudaMatrix, u64)> = group
                    .iter()
                    .map(|&j| (products[j].0, products[j].1.ptr))
                    .collect();
                if self.matmul_shared(x.ptr, n, &ptrs)? {
                    continue;
                }
            }
            for &j in &group {
                let (w, out) = &mut products[j];
                self.matmul(x, n, w, out)?;
            }
        }
        Ok(())
    }

    fn gated_ffn(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        down: &CudaMatrix,
        ff: usize,
        gate_out: &mut CudaBuffer,
        up_out: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if self.gated_ffn_mma(x, n, (gate, up, down), ff, gate_out, out)? {
            return Ok(());
        }
        if let Some(blas) = &self.blas {
            let bf16 = [gate.ty, up.ty, down.ty]
                .iter()
                .all(|&t| t == GgmlType::BF16);
            let tensor_cores = [gate.cols, ff]
                .iter()
                .all(|&k| product_inputs(GgmlType::BF16, k, n) == ProductInputs::Bf16);
            if bf16 && tensor_cores && (n * ff).is_multiple_of(8) {
                let mats = (gate, up, down);
                return self.gated_ffn_bf16(blas, x, n, mats, ff, gate_out, up_out, out);
            }
        }
        self.gelu_gated_matmul(x, n, gate, up, ff, gate_out, up_out)?;
        self.matmul(gate_out, n, down, out)
    }

    fn gelu_gated_matmul(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        ff: usize,
        gate_out: &mut CudaBuffer,
        up_out: &mut CudaBuffer,
    ) -> Result<()> {
        if (gate.rows, gate.cols, gate.ty) != (ff, up.cols, up.ty) || up.rows != ff {
            return Err(Error::Invalid(format!(
                "cuda gated matmul: gate [{}, {}] {} and up [{}, {}] {} for {ff} outputs",
                gate.rows, gate.cols, gate.ty, up.rows, up.cols, up.ty
            )));
        }
        if self.blas.is_some() && !gemv_suits(n, gate.ty, gate.cols) {
            self.matmul_many(x, n, &mut [(gate, &mut *gate_out), (up, &mut *up_out)])?;
            let all = Strided {
                offset: 0,
                stride: ff,
            };
            return self.gelu_mul_rows(gate_out, up_out, all, n, ff);
        }
        need("gated matmul input", x.len(), n * gate.cols)?;
        need("gated matmul output", gate_out.len(), n * ff)?;
        if n == 1 && gemv_takes_16_bit_activations(gate.ty, gate.cols) {
            let mut s = self.scratch()?;
            let tiles = self.gemv_q4k_tiles(&mut s, x.ptr, n, gate);
            return self.gemv_gelu_walk(x.ptr, (gate, up), gate_out.ptr, tiles);
        }
        let (rows, k) = (int("rows", ff)?, int("cols", gate.cols)?);
        let warps = gemv_block_warps(gate.ty, 1);
        for (t0, nt, variant) in gemv_launches(n) {
            let f = self
                .kernels
                .func_for(Module::Gemv, "gemv_gelu", gate.ty, variant)?;
            self.launch_fn(
                &f,
                Grid::new((blocks(ff, warps), 1), 32 * warps as u32),
                &[
                    Arg::U64(gate.ptr),
                    Arg::U64(up.ptr),
                    Arg::U64(gate.row_bytes as u64),
                    Arg::I32(rows),
                    Arg::I32(k),
                    Arg::U64(x.ptr + 4 * (t0 * gate.cols) as u64),
                    Arg::I32(nt as i32),
                    Arg::U64(gate_out.ptr + 4 * (t0 * ff) as u64),
                ],
            )?;
        }
        Ok(())
    }

    fn gelu_matmul_mul(
        &self,
        x: &CudaBuffer,
        n: usize,
        w: &CudaMatrix,
        rows: usize,
        other: &CudaBuffer,
        from: Strided,
        out: &mut CudaBuffer,
        _scratch: &mut CudaBuffer,
    ) -> Result<()> {
        if rows != w.rows {
            return Err(Error::Invalid(format!(
                "cuda gated matmul: '{}' has {} rows, not {rows}",
                w.name, w.rows
            )));
        }
        need("gated matmul input", x.len(), n * w.cols)?;
        need("gated matmul output", out.len(), n * rows)?;
        if n > 0 {
            need("gated matmul gate", other.len(), from.at(n - 1) + rows)?;
        }
        if self.blas.is_some() && !gemv_suits(n, w.ty, w.cols) {
            // The product, then the gate read in place, rounded for the next product.
            self.matmul(x, n, w, out)?;
            return self.gelu_mul_rows(out, other, from, n, rows);
        }
        let mul = other.ptr + 4 * from.offset as u64;
        self.gemv(x.ptr, n, w, out.ptr, Some((mul, from.stride)))
    }

    fn head_norm_rope(
        &self,
        x: &mut CudaBuffer,
        n_heads: usize,
        head_dim: usize,
        norm: Option<(&CudaBuffer, f32)>,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()> {
        check_rope(rope, head_dim)?;
        let heads = positions.len() * n_heads;
        need("rope", x.len(), heads * head_dim)?;
        if let Some((w, _)) = norm {
            need("head norm weight", w.len(), head_dim)?;
        }
        if heads == 0 {
            return Ok(());
        }
        let freqs = self.rope_table(rope, head_dim)?;
        let held = self.uploads()?;
        let pos = self.upload_idx(&held, positions)?;
        let mut grid = Grid::new((int("heads", heads)? as u32, 1), 32);
        grid.shared = (head_dim * 4) as u32;
        self.run(
            Module::Ops,
            "head_norm_rope",
            grid,
            &[
                Arg::U64(x.ptr),
                Arg::I32(n_heads as i32),
                Arg::I32(head_dim as i32),
                Arg::U64(norm.map_or(0, |(w, _)| w.ptr)),
                Arg::F32(norm.map_or(0.0, |(_, e)| e)),
                Arg::U64(freqs),
                Arg::I32(rope.rotated_pairs as i32),
                Arg::U64(pos),
            ],
        )
    }

    fn rope_write_kv(
        &self,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: ValueRows<'_, CudaBuffer>,
        spec: &AttnSpec,
        norms: (&CudaBuffer, &CudaBuffer, f32),
        rope: &Rope,
        positions: &[u32],
        slots: &[u32],
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<()> {
        let (q_norm, k_norm, eps) = norms;
        let (v, v_norm) = value_rows(v);
        let (hd, kvh, n) = (spec.head_dim, spec.n_kv_heads, positions.len());
        check_rope(rope, hd)?;
        need("rope_write_kv queries", q.len(), n * spec.n_heads * hd)?;
        need("rope_write_kv keys", k.len().min(v.len()), n * kvh * hd)?;
        need(
            "rope_write_kv norm weights",
            q_norm.len().min(k_norm.len()),
            hd,
        )?;
        if slots.len() != n {
            return Err(Error::Invalid(format!(
                "rope_write_kv: {} cache slots for {n} tokens",
                slots.len()
            )));
        }
        check_slots(slots, kvh * hd, k_cache, v_cache)?;
        let heads = n * (spec.n_heads + kvh);
        if heads == 0 {
            return Ok(());
        }
        let freqs = self.rope_table(rope, hd)?;
        let held = self.uploads()?;
        let pos = self.upload_idx(&held, positions)?;
        let sl = self.upload_idx(&held, slots)?;
        let mut grid = Grid::new((int("heads", heads)? as u32, 1), 32);
        grid.shared = (hd * 4) as u32;
        self.run(
            Module::Ops,
            "rope_write_kv",
            grid,
            &[
                Arg::U64(q.ptr),
                Arg::U64(k.ptr),
                Arg::U64(v.ptr),
                Arg::I32(spec.n_heads as i32),
                Arg::I32(kvh as i32),
                Arg::I32(hd as i32),
                Arg::U64(q_norm.ptr),
                Arg::U64(k_norm.ptr),
                Arg::F32(eps),
                Arg::U64(freqs),
                Arg::I32(rope.rotated_pairs as i32),
                Arg::U64(pos),
                Arg::U64(sl),
                Arg::U64(k_cache.ptr),
                Arg::U64(v_cache.ptr),
                Arg::I32(v_norm),
            ],
        )
    }

    fn write_kv(
        &self,
        k: &CudaBuffer,
        v: &CudaBuffer,
        row: usize,
        slots: &[u32],
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<()> {
        need("write_kv input", k.len().min(v.len()), slots.len() * row)?;
        check_slots(slots, row, k_cache, v_cache)?;
        if slots.is_empty() || row == 0 {
            return Ok(());
        }
        let held = self.uploads()?;
        let sl = self.upload_idx(&held, slots)?;
        self.run(
            Module::Ops,
            "write_kv",
            Grid::new((blocks(row, 256), int("tokens", slots.len())? as u32), 256),
            &[
                Arg::U64(k.ptr),
                Arg::U64(v.ptr),
                Arg::I32(int("row", row)?),
                Arg::U64(sl),
                Arg::U64(k_cache.ptr),
                Arg::U64(v_cache.ptr),
            ],
        )
    }

    fn rope_attention(
        &self,
        q: &mut CudaBuffer,
        q_norm: &CudaBuffer,
        eps: f32,
        new_kv: Option<NewKv<'_, Self>>,
        rope: &Rope,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if !self.fuses_rope_attention(spec, rope, layout, new_kv.as_ref().map(|kv| kv.slots)) {
            return rope_attention_in_steps(
                self, q, q_norm, eps, new_kv, rope, spec, layout, k_cache, v_cache, out,
            );
        }
        let (hd, kvh, n) = (spec.head_dim, spec.n_kv_heads, layout.positions.len());
        need("rope_attention query norm", q_norm.len(), hd)?;
        let new = match new_kv {
            Some(NewKv {
                k,
                v,
                k_norm,
                slots,
            }) => {
                let (v, v_norm) = value_rows(v);
                need("rope_attention keys", k.len().min(v.len()), n * kvh * hd)?;
                need("rope_attention key norm", k_norm.len(), hd)?;
                check_slots(slots, kvh * hd, k_cache, v_cache)?;
                Some(NewRows {
                    k: k.ptr,
                    v: v.ptr,
                    k_norm: k_norm.ptr,
                    v_norm,
                    slots,
                })
            }
            None => None,
        };
        let fused = FusedRope {
            q_norm: q_norm.ptr,
            eps,
            freqs: self.rope_table(rope, hd)?,
            pairs: rope.rotated_pairs as i32,
            new,
        };
        self.attention_checked(q, k_cache, v_cache, spec, layout, out, Some(fused))
    }

    fn attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.attention_checked(q, k_cache, v_cache, spec, layout, out, None)
    }

    fn moe_route(
        &self,
        logits: &CudaBuffer,
        n: usize,
        n_experts: usize,
        top_k: usize,
        expert_scale: &CudaBuffer,
        weights: &mut CudaBuffer,
        ids: &mut CudaBuffer,
    ) -> Result<()> {
        if top_k == 0 || top_k > n_experts || n_experts > MAX_EXPERTS || top_k > MAX_TOP_K {
            return Err(Error::Invalid(format!(
                "cuda moe_route: top {top_k} of {n_experts} experts (at most top {MAX_TOP_K} of \
                 {MAX_EXPERTS})"
            )));
        }
        need("moe_route logits", logits.len(), n * n_experts)?;
        need("moe_route expert scales", expert_scale.len(), n_experts)?;
        need("moe_route weights", weights.len(), n * top_k)?;
        need("moe_route ids", ids.len(), n * top_k)?;
        if n == 0 {
            return Ok(());
        }
        self.run(
            Module::Moe,
            "moe_route",
            Grid::new((blocks(n, 4), 1), 128),
            &[
                Arg::U64(logits.ptr),
                Arg::I32(int("tokens", n)?),
                Arg::I32(n_experts as i32),
                Arg::I32(top_k as i32),
                Arg::U64(expert_scale.ptr),
                Arg::U64(weights.ptr),
                Arg::U64(ids.ptr),
            ],
        )
    }

    fn moe_ffn(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate_up: &CudaMatrix,
        down: &CudaMatrix,
        n_experts: usize,
        top_k: usize,
        weights: &CudaBuffer,
        ids: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let d = gate_up.cols;
        let f = down.cols;
        if n_experts == 0 || gate_up.rows != n_experts * 2 * f || down.rows != n_experts * d {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: '{}' [{}, {}] and '{}' [{}, {}] do not stack {n_experts} experts",
                gate_up.name, gate_up.rows, gate_up.cols, down.name, down.rows, down.cols
            )));
        }
        need("moe_ffn input", x.len(), n * d)?;
        need("moe_ffn output", out.len(), n * d)?;
        need("moe_ffn weights", weights.len().min(ids.len()), n * top_k)?;
        let pairs = n * top_k;
        if pairs == 0 {
            return Ok(());
        }
        if n > MAX_GRID_Y {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: {n} tokens in one call (at most {MAX_GRID_Y}: a grid row each)"
            )));
        }
        let tensor_cores =
            self.dev.capability().0 >= 8 && moe_on_tensor_cores(gate_up.ty, down.ty, d, f);
        if moe_groups_pairs(n, n_experts, gate_up.ty, (d, f), tensor_cores) {
            return self.moe_ffn_grouped(
                x,
                n,
                gate_up,
                down,
                n_experts,
                top_k,
                tensor_cores,
                weights,
                ids,
                out,
            );
        }
        // Per pair: the gated activations [pairs, F] (16-bit where the down product runs on
        // the tensor cores), then its expert's outputs [pairs, D].
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

    fn copy(
        &self,
        src: &CudaBuffer,
        src_off: usize,
        dst: &mut CudaBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        need("copy source", src.len(), src_off + len)?;
        need("copy destination", dst.len(), dst_off + len)?;
        if len == 0 {
            return Ok(());
        }
        const F32: usize = std::mem::size_of::<f32>();
        self.queue_copy(DeviceCopy {
            src: src.ptr + (src_off * F32) as u64,
            dst: dst.ptr + (dst_off * F32) as u64,
            src_pitch: len * F32,
            dst_pitch: len * F32,
            width: len * F32,
            height: 1,
        })
    }

    fn copy_rows(
        &self,
        src: &CudaBuffer,
        from: Strided,
        dst: &mut CudaBuffer,
        to: Strided,
        rows: usize,
        len: usize,
    ) -> Result<()> {
        if rows == 0 || len == 0 {
            return Ok(());
        }
        if from.stride < len || to.stride < len {
            return Err(Error::Invalid(format!(
                "cuda copy_rows: rows of {len} values {} and {} apart overlap",
                from.stride, to.stride
            )));
        }
        need("copy_rows source", src.len(), from.at(rows - 1) + len)?;
        need("copy_rows destination", dst.len(), to.at(rows - 1) + len)?;
        const F32: usize = std::mem::size_of::<f32>();
        self.queue_copy(DeviceCopy {
            src: src.ptr + (from.offset * F32) as u64,
            dst: dst.ptr + (to.offset * F32) as u64,
            src_pitch: from.stride * F32,
            dst_pitch: to.stride * F32,
            width: len * F32,
            height: rows,
        })
    }

    fn gelu_tanh_mul(&self, gate: &mut CudaBuffer, up: &CudaBuffer, len: usize) -> Result<()> {
        need("gelu_tanh_mul", gate.len().min(up.len()), len)?;
        let all = Strided {
            offset: 0,
            stride: len,
        };
        self.gelu_mul_launch(gate, up, all, len, len, RoundTarget::NONE)
    }

    fn add(&self, x: &mut CudaBuffer, y: &CudaBuffer, len: usize) -> Result<()> {
        need("add", x.len().min(y.len()), len)?;
        self.elementwise(
            "add",
            &[Arg::U64(x.ptr), Arg::U64(y.ptr), Arg::U64(len as u64)],
            len,
        )
    }

    fn scale(&self, x: &mut CudaBuffer, s: f32, len: usize) -> Result<()> {
        need("scale", x.len(), len)?;
        self.elementwise(
            "scale",
            &[Arg::U64(x.ptr), Arg::F32(s), Arg::U64(len as u64)],
            len,
        )
    }

    fn softcap(&self, x: &mut CudaBuffer, cap: f32, len: usize) -> Result<()> {
        need("softcap", x.len(), len)?;
        self.elementwise(
            "softcap",
            &[Arg::U64(x.ptr), Arg::F32(cap), Arg::U64(len as u64)],
            len,
        )
    }

    fn write(&self, src: &[f32], dst: &mut CudaBuffer) -> Result<()> {
        need("write", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut to = dst.mem.slice_mut(0..src.len());
        self.queue.bump();
        self.foreign(|| {
            self.dev
                .stream
                .memcpy_htod(src, &mut to)
                .map_err(|e| driver_err("host-to-device copy", e))
        })
    }

    fn argmax(&self, x: &CudaBuffer, rows: usize, n: usize) -> Result<Vec<u32>> {
        self.argmax_rows(x, rows, n)
    }

    fn read(&self, x: &CudaBuffer, dst: &mut [f32]) -> Result<()> {
        need("read", x.len(), dst.len())?;
        self.host_wait(|| {
            if !dst.is_empty() {
                let from = x.mem.slice(0..dst.len());
                self.dev
                    .stream
                    .memcpy_dtoh(&from, dst)
                    .map_err(|e| driver_err("device-to-host copy", e))?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_launches_cover_every_row_once_with_a_kernel_that_holds_them() {
        assert_eq!(gemv_launches(0).count(), 0);
        for n in 1..=40 {
            let mut next = 0;
            for (t0, nt, variant) in gemv_launches(n) {
                assert_eq!(t0, next, "n = {n}");
                assert!((1..=GEMV_MAX_ROWS).contains(&nt));
                assert!(nt <= variant as usize && variant as usize <= 2 * nt.max(1));
                next = t0 + nt;
            }
            assert_eq!(next, n);
        }
    }

    #[test]
    fn q4k_tiles_fit_static_shared_memory_and_whole_warp_passes() {
        for variant in [1, 2, 4, 8] {
            let tile = q4k_tile(variant);
            // 640 bytes a super-block and token row (quant.cuh, `q4k_i16_tile`).
            assert!(
                variant as usize * tile * 640 <= 48 << 10,
                "variant {variant}"
            );
            assert!(tile.is_multiple_of(8), "variant {variant}");
        }
        assert_eq!(q4k_tile(1), 48);
    }

    #[test]
    fn moe_most_tiles_is_the_most_any_split_of_the_pairs_needs() {
        // most[e][p]: the most tiles p pairs (some perhaps left out: bad ids) over e experts
        // can take, each expert cutting its pairs into tiles of MOE_TILE.
        let (max_pairs, max_experts) = (40, 6);
        let mut most = vec![vec![0usize; max_pairs + 1]; max_experts + 1];
        for e in 1..=max_experts {
            for p in 0..=max_pairs {
                most[e][p] = (0..=p)
                    .map(|c| c.div_ceil(MOE_TILE) + most[e - 1][p - c])
                    .max()
                    .unwrap();
            }
        }
        for (e, row) in most.iter().enumerate().skip(1) {
            for (p, &m) in row.iter().enumerate() {
                assert_eq!(moe_most_tiles(p, e), m, "{p} pairs over {e} experts");
            }
        }
    }
}
