//! Row-wise and element-wise CPU operations (norms, RoPE, activations).

use markbase_core::backend::Rope;

use crate::kernels::vmath;
use crate::pool::Pool;

/// Rows processed per parallel task in row-wise ops.
const ROW_GRAIN: usize = 16;

/// RMSNorm of one row into `out` (or added into it).
#[inline]
fn norm_row(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32], add: bool) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    match (w, add) {
        (Some(w), false) => out
            .iter_mut()
            .zip(x.iter().zip(w))
            .for_each(|(o, (v, w))| *o = v * inv * w),
        (Some(w), true) => out
            .iter_mut()
            .zip(x.iter().zip(w))
            .for_each(|(o, (v, w))| *o += v * inv * w),
        (None, false) => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * inv),
        (None, true) => out.iter_mut().zip(x).for_each(|(o, v)| *o += v * inv),
    }
}

/// RMSNorm of `n` rows of `dim` (sizes checked by the caller).
pub fn rms_norm(
    pool: &Pool,
    x: &[f32],
    w: Option<&[f32]>,
    eps: f32,
    dim: usize,
    out: &mut [f32],
    add: bool,
) {
    let grain = dim * ROW_GRAIN;
    pool.par_chunks_mut(out, grain, |c, o| {
        for (o, x) in o.chunks_mut(dim).zip(x[c * grain..].chunks(dim)) {
            norm_row(x, w, eps, o, add);
        }
    });
}

/// In-place per-head RMSNorm (optional) and RoPE; `x` holds `positions.len()` tokens.
pub fn head_norm_rope(
    pool: &Pool,
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    norm: Option<(&[f32], f32)>,
    rope: &Rope,
    positions: &[u32],
) {
    let half = head_dim / 2;
    // Per-pair frequencies, once per call.
    let mut freq = [0f32; 256];
    for (i, f) in freq[..rope.rotated_pairs].iter_mut().enumerate() {
        let inv = 1.0 / rope.theta.powf((2 * i) as f32 / head_dim as f32);
        *f = inv / rope.linear_factor;
    }
    pool.par_chunks_mut(x, n_heads * head_dim, |t, tok| {
        let p = positions[t];
        let mut cos = [0f32; 256];
        let mut sin = [0f32; 256];
        for i in 0..rope.rotated_pairs {
            let angle = (p as f32) * freq[i];
            let (s, c) = (angle as f64).sin_cos();
            cos[i] = c as f32;
            sin[i] = s as f32;
        }
        for head in tok.chunks_mut(head_dim) {
            if let Some((w, eps)) = norm {
                let ms = head.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                head.iter_mut().zip(w).for_each(|(v, w)| *v *= inv * w);
            }
            let (a, b) = head.split_at_mut(half);
            for i in 0..rope.rotated_pairs {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x1 * cos[i] + x0 * sin[i];
            }
        }
    });
}

/// `gelu_tanh(gate) · up` in place in `gate`.
pub fn gelu_tanh_mul(pool: &Pool, gate: &mut [f32], up: &[f32]) {
    const GRAIN: usize = 4096;
    pool.par_chunks_mut(gate, GRAIN, |c, g| {
        vmath::gelu_tanh_mul(g, &up[c * GRAIN..]);
    });
}
