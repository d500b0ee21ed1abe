//! Activation × stored-weight products, parallel over output rows, weights read in place.

use markbase_core::backend::HostMatrix;
use rayon::prelude::*;

use crate::kernels::dot::{dot_row, dot_rows};

/// Tokens handled together per weight row in prefill (bounds a stack buffer).
const TOKEN_TILE: usize = 64;

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint indices (each owns a set of output columns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[n, w.rows] = x[n, w.cols] · wᵀ` on the current rayon pool. Sizes are checked by the
/// caller (`out.len() >= n * w.rows`, `x.len() >= n * w.cols`).
pub fn matmul(x: &[f32], n: usize, w: &HostMatrix, out: &mut [f32]) {
    let (rows, k) = (w.rows, w.cols);
    let rb = w.row_bytes();
    let bytes = w.bytes.as_slice();
    let threads = rayon::current_num_threads().max(1);
    let grain = (rows / (threads * 8)).clamp(1, 256);
    if n == 1 {
        out[..rows]
            .par_chunks_mut(grain)
            .enumerate()
            .for_each(|(c, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    let r = c * grain + i;
                    *v = dot_row(w.ty, &bytes[r * rb..(r + 1) * rb], &x[..k]);
                }
            });
        return;
    }
    let ptr = OutPtr(out.as_mut_ptr());
    (0..rows.div_ceil(grain)).into_par_iter().for_each(|c| {
        let p = ptr;
        let mut tile = [0f32; TOKEN_TILE];
        for r in c * grain..((c + 1) * grain).min(rows) {
            let row = &bytes[r * rb..(r + 1) * rb];
            for t0 in (0..n).step_by(TOKEN_TILE) {
                let nt = TOKEN_TILE.min(n - t0);
                dot_rows(w.ty, row, &x[t0 * k..(t0 + nt) * k], k, &mut tile[..nt]);
                for (i, v) in tile[..nt].iter().enumerate() {
                    // SAFETY: (t0 + i) < n and r < rows, so the index is inside `out`
                    // (checked by the caller); column r belongs to this task only.
                    unsafe { *p.0.add((t0 + i) * rows + r) = *v };
                }
            }
        }
    });
}
