//! Causal / sliding-window attention with GQA over a slot-addressed KV cache.
//!
//! Each (token, head) pair runs on its own: keys are visited in tiles with an online softmax,
//! so the only scratch is on the stack and only the visible keys (the window, for sliding
//! layers) are touched.

use markbase_core::backend::AttnSpec;

use crate::pool::Pool;

/// Keys scored at a time.
const KEY_TILE: usize = 64;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 512;

/// Attention per [`AttnSpec`]; sizes are checked by the caller.
pub fn attention(
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    positions: &[u32],
    out: &mut [f32],
) {
    let hd = spec.head_dim;
    let kv_w = spec.n_kv_heads * hd;
    let group = spec.n_heads / spec.n_kv_heads;
    pool.par_chunks_mut(
        &mut out[..positions.len() * spec.n_heads * hd],
        hd,
        |i, o| {
            let (t, h) = (i / spec.n_heads, i % spec.n_heads);
            let p = positions[t] as usize;
            let lo = spec.window.map_or(0, |w| (p + 1).saturating_sub(w));
            let qrow = &q[i * hd..(i + 1) * hd];
            let koff = (h / group) * hd;
            let mut acc = [0f32; MAX_HEAD_DIM];
            let acc = &mut acc[..hd];
            let mut scores = [0f32; KEY_TILE];
            let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
            for j0 in (lo..=p).step_by(KEY_TILE) {
                let nk = KEY_TILE.min(p + 1 - j0);
                let mut tile_max = f32::NEG_INFINITY;
                for (jj, s) in scores[..nk].iter_mut().enumerate() {
                    let slot = (j0 + jj) % spec.ring;
                    let krow = &k_cache[slot * kv_w + koff..][..hd];
                    let mut v = dot(qrow, krow) * spec.scale;
                    if let Some(cap) = spec.softcap {
                        v = cap * (v / cap).tanh();
                    }
                    *s = v;
                    tile_max = tile_max.max(v);
                }
                if tile_max > max {
                    let r = (max - tile_max).exp();
                    sum *= r;
                    acc.iter_mut().for_each(|a| *a *= r);
                    max = tile_max;
                }
                for (jj, s) in scores[..nk].iter().enumerate() {
                    let e = (s - max).exp();
                    sum += e;
                    let slot = (j0 + jj) % spec.ring;
                    let vrow = &v_cache[slot * kv_w + koff..][..hd];
                    acc.iter_mut().zip(vrow).for_each(|(a, v)| *a += e * v);
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = a * inv);
        },
    );
}

/// Plain f32 dot product (the compiler vectorises it).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    s.iter().sum::<f32>() + tail
}
