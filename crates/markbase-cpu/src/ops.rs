//! Row-wise and element-wise CPU operations (norms, RoPE, activations).

use markbase_core::backend::Rope;

use crate::kernels::vmath;
use crate::pool::{Pool, SendPtr};

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

/// The cos and sin of every rotation angle of one RoPE configuration at a list of positions.
struct RopeTable {
    /// θ and linear factor (as bits), rotated pairs and head dimension.
    key: (u32, u32, usize, usize),
    positions: Vec<u32>,
    /// Per position: `pairs` cosines, then `pairs` sines.
    cos_sin: Vec<f32>,
}

/// The last two [`RopeTable`]s built, so the query and key calls of every layer (and the
/// layers sharing a configuration: Gemma alternates a local and a global θ) reuse one table
/// per chunk instead of evaluating `sin_cos` again for each.
#[derive(Default)]
pub struct RopeCache {
    tables: [Option<RopeTable>; 2],
    /// The slot the next new table replaces.
    next: usize,
}

impl RopeCache {
    /// The table of `rope` at `positions` for heads of `head_dim`, built (on the pool) when not
    /// cached.
    fn table(
        &mut self,
        pool: &Pool,
        rope: &Rope,
        head_dim: usize,
        positions: &[u32],
    ) -> &RopeTable {
        let pairs = rope.rotated_pairs;
        let key = (
            rope.theta.to_bits(),
            rope.linear_factor.to_bits(),
            pairs,
            head_dim,
        );
        let hit = self.tables.iter().position(|t| {
            t.as_ref()
                .is_some_and(|t| t.key == key && t.positions == positions)
        });
        let slot = match hit {
            Some(i) => i,
            None => {
                let i = self.next;
                self.next = (i + 1) % self.tables.len();
                let t = self.tables[i].get_or_insert_with(|| RopeTable {
                    key,
                    positions: Vec::new(),
                    cos_sin: Vec::new(),
                });
                // Key and positions are set once the values are in, so a table left half
                // built by a panic never matches.
                t.positions.clear();
                t.cos_sin.resize(positions.len() * 2 * pairs, 0.0);
                fill_cos_sin(pool, rope, head_dim, positions, &mut t.cos_sin);
                t.key = key;
                t.positions.extend_from_slice(positions);
                i
            }
        };
        self.tables[slot].as_ref().expect("filled above")
    }
}

/// `cos_sin[t]` = the cosines then the sines of position `positions[t]`'s angles.
fn fill_cos_sin(pool: &Pool, rope: &Rope, head_dim: usize, positions: &[u32], cos_sin: &mut [f32]) {
    let pairs = rope.rotated_pairs;
    // Per-pair frequencies, once per table.
    let mut freq = [0f32; 256];
    for (i, f) in freq[..pairs].iter_mut().enumerate() {
        let inv = 1.0 / rope.theta.powf((2 * i) as f32 / head_dim as f32);
        *f = inv / rope.linear_factor;
    }
    pool.par_chunks_mut(cos_sin, 2 * pairs * ROW_GRAIN, |c, rows| {
        for (t, row) in rows.chunks_mut(2 * pairs).enumerate() {
            let p = positions[c * ROW_GRAIN + t] as f32;
            let (cos, sin) = row.split_at_mut(pairs);
            for i in 0..pairs {
                let (s, c) = ((p * freq[i]) as f64).sin_cos();
                cos[i] = c as f32;
                sin[i] = s as f32;
            }
        }
    });
}

/// In-place per-head RMSNorm (optional) and RoPE; `x` holds `positions.len()` tokens. The
/// rotation angles come from `cache`.
#[allow(clippy::too_many_arguments)]
pub fn head_norm_rope(
    pool: &Pool,
    cache: &mut RopeCache,
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    norm: Option<(&[f32], f32)>,
    rope: &Rope,
    positions: &[u32],
) {
    let half = head_dim / 2;
    let pairs = rope.rotated_pairs;
    let table = cache.table(pool, rope, head_dim, positions);
    pool.par_chunks_mut(x, n_heads * head_dim, |t, tok| {
        let (cos, sin) = table.cos_sin[t * 2 * pairs..(t + 1) * 2 * pairs].split_at(pairs);
        for head in tok.chunks_mut(head_dim) {
            if let Some((w, eps)) = norm {
                let ms = head.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                head.iter_mut().zip(w).for_each(|(v, w)| *v *= inv * w);
            }
            let (a, b) = head.split_at_mut(half);
            for i in 0..pairs {
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

/// Values of one row scanned per task of [`argmax_rows`].
const ARGMAX_GRAIN: usize = 1 << 15;

/// The index of the largest value of each of the `rows` rows of `n` values at the start of
/// `x` (ties: the lowest index; NaN never wins; a row without a number gives 0). Long rows are
/// split into parts scanned in parallel. Sizes are checked by the caller.
pub fn argmax_rows(pool: &Pool, x: &[f32], rows: usize, n: usize) -> Vec<u32> {
    let parts = n.div_ceil(ARGMAX_GRAIN).max(1);
    let mut best = vec![(f32::NEG_INFINITY, 0u32); rows * parts];
    let out = SendPtr(best.as_mut_ptr());
    pool.run(rows * parts, &|task| {
        let (r, p) = (task / parts, task % parts);
        let lo = p * ARGMAX_GRAIN;
        let part = &x[r * n + lo..r * n + n.min(lo + ARGMAX_GRAIN)];
        let (mut value, mut index) = (f32::NEG_INFINITY, lo as u32);
        for (i, &v) in part.iter().enumerate() {
            if v > value {
                (value, index) = (v, (lo + i) as u32);
            }
        }
        // SAFETY: task `task` alone writes slot `task`, inside `best`.
        unsafe { *out.get().add(task) = (value, index) };
    });
    best.chunks(parts)
        .map(|row| {
            // Parts in order, a later one only on a strictly larger value: the lowest index wins.
            let mut pick = (f32::NEG_INFINITY, 0u32);
            for &(v, i) in row {
                if v > pick.0 {
                    pick = (v, i);
                }
            }
            pick.1
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Against a plain scan on fresh random rows (short and several parts long), with ties,
    /// NaN and rows of nothing but -inf.
    #[test]
    fn argmax_matches_a_plain_scan() {
        let mut rng = rand::rng();
        let pool = Pool::new(2).unwrap();
        for &(rows, n) in &[
            (1usize, 7usize),
            (3, 1000),
            (2, 3 * ARGMAX_GRAIN + 5),
            (5, 70_000),
        ] {
            let mut x: Vec<f32> = (0..rows * n)
                .map(|_| (rng.random_range(-50..50) as f32) * 0.5)
                .collect();
            x[n / 2] = f32::NAN;
            if rows > 1 {
                x[n..2 * n].fill(f32::NEG_INFINITY);
            }
            let want: Vec<u32> = x
                .chunks(n)
                .map(|row| {
                    let mut best = 0;
                    for (i, &v) in row.iter().enumerate() {
                        if v > row[best] || (row[best].is_nan() && !v.is_nan()) {
                            best = i;
                        }
                    }
                    best as u32
                })
                .collect();
            assert_eq!(argmax_rows(&pool, &x, rows, n), want, "{rows} rows of {n}");
        }
    }
}
