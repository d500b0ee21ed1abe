//! Which kernel runs a product of token rows with a weight matrix, and the product launches:
//! warp-per-row GEMVs for a few token rows, the tensor cores (our `mmq` kernels, or cuBLAS on
//! bf16 weights and on quantized ones' f16 copies past 64 token rows, f16_copies.rs, or
//! dequantized to f16 a tile at a time) for more, each product's activations rounded as its
//! kernel reads them.

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::{blocks, int, CudaBackend, Scratch, DEQUANT_THREADS};
use crate::blas::{Blas, GemmInput, GemmOutput};
use crate::buffer::CudaMatrix;
use crate::gemv_walk::HALVES_WALK_MIN_ROWS;
use crate::kernels::{Arg, Grid, ProductArgs};
use crate::mmq::{mma_suits, mmq_rows, Job};
use crate::rounded::CopyForm;
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
pub(crate) fn gemv_suits(n: usize, ty: GgmlType, cols: usize) -> bool {
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
pub(crate) fn reads_copy(form: CopyForm, n: usize) -> bool {
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

impl CudaBackend {
    /// Queues GEMV launches for `n` token rows (≤ GEMV_MAX_ROWS per launch); with
    /// `mul = Some((m, stride))` each result becomes `gelu_tanh(result) · m[t·stride + r]`.
    pub(crate) fn gemv(
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
    pub(crate) fn matmul_shared(
        &self,
        x: u64,
        n: usize,
        products: &[(&CudaMatrix, u64)],
    ) -> Result<bool> {
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
                if !self.f16_copy_applies(w0.ty, n)
                    && self.mmq(&mut s, xh, n, Job::Products(products))?
                {
                    s.rounded.renew(&self.queue);
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
    pub(crate) fn gemm(
        &self,
        blas: &Blas,
        x: u64,
        n: usize,
        w: &CudaMatrix,
        out: u64,
    ) -> Result<()> {
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
    /// Q8_0, Q4_0, Q5_0) of 2–128 token rows by `mmq` where it takes them, other quantized ones
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
        if let Some(copy) = self.f16_copy(w, n)? {
            // SAFETY: `xh` holds n·k f16 values, the copy rows·k; `out` rows·n.
            return self.queue_gemm(unsafe {
                blas.gemm_rows(
                    (GemmInput::F16, GemmOutput::F32),
                    copy,
                    w.rows,
                    k,
                    xh,
                    n,
                    out,
                    w.rows,
                )
            });
        }
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
    pub(crate) fn gemm_dequantized(
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
        let mut r0 = 0;
        while r0 < w.rows {
            let rt = tile.min(w.rows - r0);
            self.queue_dequant(kernel, w, r0, rt, deq)?;
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

    /// Queues `kernel` (`dequant`: f32, `dequant_f16`: f16) writing rows `r0 .. r0 + rows` of
    /// `w` (at most 65 535) dequantized to `dst`, row-major.
    pub(crate) fn queue_dequant(
        &self,
        kernel: &'static str,
        w: &CudaMatrix,
        r0: usize,
        rows: usize,
        dst: u64,
    ) -> Result<()> {
        let f = self.kernels.func_for(Module::Ops, kernel, w.ty, 0)?;
        self.launch_fn(
            &f,
            Grid::new(
                (blocks(w.cols.div_ceil(32), DEQUANT_THREADS), rows as u32),
                DEQUANT_THREADS as u32,
            ),
            &[
                Arg::U64(w.ptr),
                Arg::U64(w.row_bytes as u64),
                Arg::I32(int("row", r0)?),
                Arg::I32(int("cols", w.cols)?),
                Arg::U64(dst),
            ],
        )
    }

    /// For a product of `n` token rows with `w` about to read its activations at `x`: the
    /// address of their Q4_K tiles where a producer just wrote them and the product is a
    /// one-token GEMV on 16-bit activations (which then reads them instead of staging its
    /// activations), else 0. The caller holds `s` until the product is queued.
    pub(crate) fn gemv_q4k_tiles(&self, s: &mut Scratch, x: u64, n: usize, w: &CudaMatrix) -> u64 {
        if !gemv_takes_16_bit_activations(w.ty, w.cols) || n != 1 {
            return 0;
        }
        s.rounded
            .take(x, w.cols, CopyForm::Q4kTiles, &self.queue)
            .unwrap_or(0)
    }

    /// Queues the gated GEMV of `n` token rows (sizes checked by the caller): `out[t, r] =
    /// gelu_tanh(gate_r · x_t) · (up_r · x_t)`, one token row on 16-bit activations as the
    /// walk of gemv_walk.rs, otherwise launches of up to `GEMV_MAX_ROWS` token rows.
    pub(crate) fn gemv_gelu(
        &self,
        x: u64,
        n: usize,
        (gate, up): (&CudaMatrix, &CudaMatrix),
        out: u64,
    ) -> Result<()> {
        let ff = gate.rows;
        if n == 1 && gemv_takes_16_bit_activations(gate.ty, gate.cols) {
            let mut s = self.scratch()?;
            let tiles = self.gemv_q4k_tiles(&mut s, x, n, gate);
            return self.gemv_gelu_walk(x, (gate, up), out, tiles);
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
                    Arg::U64(x + 4 * (t0 * gate.cols) as u64),
                    Arg::I32(nt as i32),
                    Arg::U64(out + 4 * (t0 * ff) as u64),
                ],
            )?;
        }
        Ok(())
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
}
