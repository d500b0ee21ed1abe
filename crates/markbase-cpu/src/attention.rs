//! Causal / sliding-window attention with GQA over a paged KV cache.
//!
//! Each (query row, head) pair runs on its own: keys are visited in tiles with an online
//! softmax, so the only scratch is on the stack and only the visible keys (the window, for
//! sliding layers) are touched. A row finds its sequence's block table through the layout.

use markbase_core::backend::{AttnSpec, KvLayout};
use rayon::prelude::*;

/// Keys scored at a time.
const KEY_TILE: usize = 64;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 512;

/// Attention per [`AttnSpec`] and [`KvLayout`]; sizes and block ids are checked by the caller.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    out: &mut [f32],
) {
    let hd = spec.head_dim;
    let kv_w = spec.n_kv_heads * hd;
    let group = spec.n_heads / spec.n_kv_heads;
    let bs = layout.block_size;
    let positions = layout.positions;
    out[..positions.len() * spec.n_heads * hd]
        .par_chunks_mut(hd)
        .enumerate()
        .for_each(|(i, o)| {
            let (t, h) = (i / spec.n_heads, i % spec.n_heads);
            // The sequence of row t: the last s with seq_start[s] <= t.
            let s = layout.seq_start.partition_point(|&st| st as usize <= t) - 1;
            let table = &layout.block_tables[s * layout.table_width..][..layout.table_width];
            let slot = |j: usize| table[j / bs] as usize * bs + j % bs;
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
                    let krow = &k_cache[slot(j0 + jj) * kv_w + koff..][..hd];
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
                    let vrow = &v_cache[slot(j0 + jj) * kv_w + koff..][..hd];
                    acc.iter_mut().zip(vrow).for_each(|(a, v)| *a += e * v);
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = a * inv);
        });
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
