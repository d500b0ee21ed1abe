//! Activation × stored-weight products on the thread pool, weights read in place.
//!
//! Block-quantized weights with few tokens (decode) take the integer path: the activations are
//! quantized once per call to 16-bit blocks ([`QuantAct`], kept in the backend so steady-state
//! calls allocate nothing), then the weight rows are split into chunks over the pool and each
//! chunk is dotted with every token's activations at once ([`qdot_tokens`]: each weight block
//! is unpacked once for a group of tokens). Float weights with one
//! token take f32 dot products. Larger token counts (prefill) take the blocked f32 GEMM of
//! [`crate::kernels::gemm`]: each panel of weight rows is dequantized once per call and used
//! for every token.

use markbase_core::backend::HostMatrix;

use std::cell::RefCell;

use crate::kernels::act::{ActRow, QuantAct};
use crate::kernels::dot::dot_row;
use crate::kernels::gemm::{pack_tokens, packed_len, rows_matmul, unpack_rows, NT};
use crate::kernels::qdot::{qdot_tokens, supports};
use crate::pool::{Pool, SendPtr};

/// Weight rows dequantized together per prefill task (their f32 copy stays in L2).
const ROW_GROUP: usize = 24;

thread_local! {
    /// Per-thread dequantized weight rows of the prefill path (grows to the largest `k` seen,
    /// then is reused: no allocation per call).
    static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Per-backend scratch of [`matmul`], reused between calls (it only grows).
#[derive(Default)]
pub struct Scratch {
    /// Quantized activations (integer path).
    act: QuantAct,
    /// Activations packed into token tiles (prefill path).
    xt: Vec<f32>,
}
/// Token counts from which block-quantized weights take the f32 path.
pub const F32_FROM_TOKENS: usize = 16;

/// Whether `matmul` uses 16-bit quantized activations for `n` tokens of weights `ty`.
pub fn uses_quantized_activations(ty: markbase_core::quant::GgmlType, n: usize) -> bool {
    supports(ty) && n < F32_FROM_TOKENS
}

/// Weight bytes per task of the decode path: small enough that a thread descheduled in the
/// middle of one (a busy machine) holds back little work, large enough (≈ 20 µs of streaming)
/// that claiming tasks costs nothing.
const TASK_BYTES: usize = 1 << 17;

/// Rows per task: at most [`TASK_BYTES`] of weights and about eight tasks per thread, at
/// least 16 rows.
pub(crate) fn rows_per_task(rows: usize, rb: usize, threads: usize) -> usize {
    rows.div_ceil(threads * 8)
        .min(TASK_BYTES / rb.max(1))
        .max(16)
}

/// `out[n, w.rows] = x[n, w.cols] · wᵀ`. Sizes are checked by the caller
/// (`out.len() >= n * w.rows`, `x.len() >= n * w.cols`).
pub fn matmul(
    pool: &Pool,
    scratch: &mut Scratch,
    x: &[f32],
    n: usize,
    w: &HostMatrix,
    out: &mut [f32],
) {
    let (rows, k) = (w.rows, w.cols);
    let rb = w.row_bytes();
    let bytes = w.bytes.as_slice();
    let chunk = rows_per_task(rows, rb, pool.threads());
    let ptr = SendPtr(out.as_mut_ptr());
    if n == 0 {
        return;
    }
    if uses_quantized_activations(w.ty, n) {
        scratch.act.quantize(x, n, k);
        let act = &scratch.act;
        let xs: [ActRow; F32_FROM_TOKENS] = std::array::from_fn(|t| act.row(t.min(n - 1)));
        pool.run(rows.div_ceil(chunk), &|c| {
            let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(rows));
            let mut outs: [&mut [f32]; F32_FROM_TOKENS] = Default::default();
            for (t, o) in outs[..n].iter_mut().enumerate() {
                // SAFETY: (t, r0..r1) is inside `out` (checked by the caller) and belongs to
                // this task only.
                *o = unsafe {
                    std::slice::from_raw_parts_mut(ptr.get().add(t * rows + r0), r1 - r0)
                };
            }
            qdot_tokens(w.ty, &bytes[r0 * rb..r1 * rb], &xs[..n], &mut outs[..n]);
        });
        return;
    }
    if n == 1 {
        pool.par_chunks_mut(&mut out[..rows], chunk, |c, o| {
            for (i, v) in o.iter_mut().enumerate() {
                let r = c * chunk + i;
                *v = dot_row(w.ty, &bytes[r * rb..(r + 1) * rb], &x[..k]);
            }
        });
        return;
    }
    // Prefill: activations packed once into token tiles, then one task per group of
    // ROW_GROUP weight rows, dequantized once and run over every token.
    scratch
        .xt
        .resize(scratch.xt.len().max(packed_len(n, k)), 0.0);
    let tile_len = NT * k;
    pool.par_chunks_mut(
        &mut scratch.xt[..packed_len(n, k)],
        tile_len,
        |tile, dst| {
            let t0 = tile * NT;
            let nt = NT.min(n - t0);
            pack_tokens(&x[t0 * k..(t0 + nt) * k], nt, k, dst);
        },
    );
    let xt = &scratch.xt[..packed_len(n, k)];
    pool.run(rows.div_ceil(ROW_GROUP), &|c| {
        let (r0, r1) = (c * ROW_GROUP, ((c + 1) * ROW_GROUP).min(rows));
        ROWS.with(|cell| {
            let mut wbuf = cell.borrow_mut();
            if wbuf.len() < ROW_GROUP * k {
                wbuf.resize(ROW_GROUP * k, 0.0);
            }
            let wr = &mut wbuf[..(r1 - r0) * k];
            unpack_rows(w.ty, &bytes[r0 * rb..r1 * rb], rb, k, wr);
            // SAFETY: the columns r0..r1 of every token row belong to this task only, and
            // the caller checked `out.len() >= n * rows`.
            let o = unsafe {
                std::slice::from_raw_parts_mut(ptr.get().add(r0), (n - 1) * rows + (r1 - r0))
            };
            rows_matmul(wr, k, xt, n, o, rows);
        });
    });
}
