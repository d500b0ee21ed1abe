//! Activation × stored-weight products on the thread pool, weights read in place.
//!
//! Block-quantized weights with few tokens (decode) take the integer path: the activations are
//! quantized once per call to 16-bit blocks ([`QuantAct`], kept in the backend so steady-state
//! calls allocate nothing), then the weight rows are split into chunks over the pool and each
//! chunk is dotted with every token's activations while it is in cache. Float weights and
//! larger token counts take the f32 path.

use markbase_core::backend::HostMatrix;

use crate::kernels::act::QuantAct;
use crate::kernels::dot::{dot_row, dot_rows};
use crate::kernels::qdot::{qdot_rows, supports};
use crate::pool::{Pool, SendPtr};

/// Tokens handled together per weight row on the f32 path (bounds a stack buffer).
const TOKEN_TILE: usize = 64;
/// Token counts from which block-quantized weights take the f32 path.
pub const F32_FROM_TOKENS: usize = 16;

/// Whether [`matmul`] uses 16-bit quantized activations for `n` tokens of weights `ty`.
pub fn uses_quantized_activations(ty: markbase_core::quant::GgmlType, n: usize) -> bool {
    supports(ty) && n < F32_FROM_TOKENS
}

/// Rows per task: about eight tasks per thread for balance, at least 16 rows each.
fn rows_per_task(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads * 8).max(16)
}

/// `out[n, w.rows] = x[n, w.cols] · wᵀ`. Sizes are checked by the caller
/// (`out.len() >= n * w.rows`, `x.len() >= n * w.cols`).
pub fn matmul(
    pool: &Pool,
    act: &mut QuantAct,
    x: &[f32],
    n: usize,
    w: &HostMatrix,
    out: &mut [f32],
) {
    let (rows, k) = (w.rows, w.cols);
    let rb = w.row_bytes();
    let bytes = w.bytes.as_slice();
    let chunk = rows_per_task(rows, pool.threads());
    let ptr = SendPtr(out.as_mut_ptr());
    if uses_quantized_activations(w.ty, n) {
        act.quantize(x, n, k);
        let act = &*act;
        pool.run(rows.div_ceil(chunk), &|c| {
            let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(rows));
            for t in 0..n {
                // SAFETY: (t, r0..r1) is inside `out` (checked by the caller) and belongs to
                // this task only.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(ptr.get().add(t * rows + r0), r1 - r0)
                };
                qdot_rows(w.ty, &bytes[r0 * rb..r1 * rb], act.row(t), o);
            }
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
    pool.run(rows.div_ceil(chunk), &|c| {
        let mut tile = [0f32; TOKEN_TILE];
        for r in c * chunk..((c + 1) * chunk).min(rows) {
            let row = &bytes[r * rb..(r + 1) * rb];
            for t0 in (0..n).step_by(TOKEN_TILE) {
                let nt = TOKEN_TILE.min(n - t0);
                dot_rows(w.ty, row, &x[t0 * k..(t0 + nt) * k], k, &mut tile[..nt]);
                for (i, v) in tile[..nt].iter().enumerate() {
                    // SAFETY: (t0 + i) < n and r < rows, so the index is inside `out`
                    // (checked by the caller); column r belongs to this task only.
                    unsafe { *ptr.get().add((t0 + i) * rows + r) = *v };
                }
            }
        }
    });
}
