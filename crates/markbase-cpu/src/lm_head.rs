//! The screened LM head ([`Backend::matmul_screened`]): logits for the whole vocabulary from a
//! low-bit copy of the head, then the leaders recomputed from the exact rows.
//!
//! A 262k-token head in Q8_0 is most of a small model's bytes, and decoding one token on a CPU
//! is bound by the bytes it reads. The coarse pass reads the copy (about half the bytes); the
//! exact pass reads `top_k` rows. Greedy choices, the likely tokens a sampler draws from and
//! their probabilities are exact; only the logits of unlikely tokens keep the copy's error.
//!
//! [`Backend::matmul_screened`]: markbase_core::backend::Backend::matmul_screened

use markbase_core::backend::HostMatrix;

use crate::kernels::dot::dot_row;
use crate::matmul;
use crate::pool::{Pool, SendPtr};

/// Every `STRIDE`-th coarse logit is sampled to place the selection threshold.
const STRIDE: usize = 16;
/// Exact rows recomputed per parallel task.
const REFINE_GRAIN: usize = 128;

/// Reused buffers of the leader selection (kept between calls: no allocation per token).
#[derive(Default)]
pub struct Scratch {
    sample: Vec<f32>,
    leaders: Vec<u32>,
}

/// `out[n, exact.rows]`: coarse logits for every row of `x`, then each row's `top_k` leaders
/// (by coarse logit) recomputed from `exact`. Sizes are checked by the caller; `coarse` and
/// `exact` have the same shape.
#[allow(clippy::too_many_arguments)]
pub fn screened(
    pool: &Pool,
    matmul_scratch: &mut matmul::Scratch,
    x: &[f32],
    n: usize,
    coarse: &HostMatrix,
    exact: &HostMatrix,
    top_k: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (rows, k) = (exact.rows, exact.cols);
    matmul::matmul(pool, matmul_scratch, x, n, coarse, out);
    let rb = exact.row_bytes();
    let bytes = exact.bytes.as_slice();
    for t in 0..n {
        let logits = &mut out[t * rows..(t + 1) * rows];
        select_leaders(logits, top_k, scratch);
        let xt = &x[t * k..(t + 1) * k];
        let ptr = SendPtr(logits.as_mut_ptr());
        let leaders = &scratch.leaders;
        pool.run(leaders.len().div_ceil(REFINE_GRAIN), &|c| {
            for &i in &leaders[c * REFINE_GRAIN..((c + 1) * REFINE_GRAIN).min(leaders.len())] {
                let i = i as usize;
                let v = dot_row(exact.ty, &bytes[i * rb..(i + 1) * rb], xt);
                // SAFETY: i < rows = logits.len() and the leader indices are distinct, so
                // tasks write disjoint logits.
                unsafe { *ptr.get().add(i) = v };
            }
        });
    }
}

/// Puts into `scratch.leaders` the indices of the `top_k` largest `logits` (all of them if
/// there are fewer), in no particular order.
///
/// A strided sample sets a threshold that about `2 · top_k` values pass; the passing indices
/// are then cut to the exact `top_k`. If too few pass (an unlucky sample), every index is a
/// candidate, so the result is always the true top `top_k`.
pub fn select_leaders(logits: &[f32], top_k: usize, scratch: &mut Scratch) {
    let k = top_k.min(logits.len());
    let cands = &mut scratch.leaders;
    cands.clear();
    if k == 0 {
        return;
    }
    let sample = &mut scratch.sample;
    sample.clear();
    sample.extend(logits.iter().step_by(STRIDE));
    let rank = ((2 * k).div_ceil(STRIDE)).min(sample.len()) - 1;
    let (_, &mut tau, _) = sample.select_nth_unstable_by(rank, |a, b| b.total_cmp(a));
    cands.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.total_cmp(&tau).is_ge())
            .map(|(i, _)| i as u32),
    );
    if cands.len() < k {
        cands.clear();
        cands.extend(0..logits.len() as u32);
    }
    if cands.len() > k {
        cands.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        cands.truncate(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markbase_core::backend::HostBytes;
    use markbase_core::quant::{dequantize_row, quantize_row, GgmlType};
    use rand::Rng;

    fn matrix(ty: GgmlType, rows: usize, cols: usize, w: &[f32]) -> HostMatrix {
        let mut bytes = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
        quantize_row(ty, w, &mut bytes).unwrap();
        HostMatrix {
            name: format!("{ty} head"),
            ty,
            rows,
            cols,
            bytes: HostBytes::Owned(bytes.into()),
        }
    }

    /// Leaders carry the exact logits (the reference: dequantized exact rows, f64 dot), every
    /// other logit the coarse one, and the leaders are the coarse top k.
    #[test]
    fn leaders_are_exact_and_the_rest_coarse() {
        let mut rng = rand::rng();
        let (rows, cols, n, top_k) = (3000, 96, 3, 200);
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let exact = matrix(GgmlType::Q8_0, rows, cols, &w);
        let coarse = matrix(GgmlType::Q4_0, rows, cols, &w);
        let reference = |m: &HostMatrix| -> Vec<f64> {
            let mut deq = vec![0f32; rows * cols];
            dequantize_row(m.ty, m.bytes.as_slice(), &mut deq).unwrap();
            (0..n * rows)
                .map(|i| {
                    let (t, r) = (i / rows, i % rows);
                    (0..cols)
                        .map(|j| x[t * cols + j] as f64 * deq[r * cols + j] as f64)
                        .sum()
                })
                .collect()
        };
        let want_exact = reference(&exact);
        // The coarse pass sees the activations as the backend's matmul does.
        let want_coarse: Vec<f64> = if matmul::uses_quantized_activations(coarse.ty, n) {
            crate::reference::matmul_quantized(&x, n, &coarse)
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect()
        } else {
            reference(&coarse)
        };
        let mut out = vec![0f32; n * rows];
        let pool = Pool::new(2).unwrap();
        let (mut scratch, mut mm) = (Scratch::default(), matmul::Scratch::default());
        screened(
            &pool,
            &mut mm,
            &x,
            n,
            &coarse,
            &exact,
            top_k,
            &mut scratch,
            &mut out,
        );
        for t in 0..n {
            let row = |v: &[f64]| v[t * rows..(t + 1) * rows].to_vec();
            let (e, c) = (row(&want_exact), row(&want_coarse));
            let mut order: Vec<usize> = (0..rows).collect();
            order.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
            let mut is_leader = vec![false; rows];
            // ranks near the cut may swap on f32 rounding of the coarse sums: skip them
            for &i in &order[..top_k - 2] {
                is_leader[i] = true;
            }
            for i in 0..rows {
                let got = out[t * rows + i] as f64;
                if is_leader[i] {
                    assert!(
                        (got - e[i]).abs() < 1e-4,
                        "row {t} leader {i}: {got} vs exact {}",
                        e[i]
                    );
                } else if !order[top_k - 2..top_k + 2].contains(&i) {
                    assert!(
                        (got - c[i]).abs() < 1e-4,
                        "row {t} tail {i}: {got} vs coarse {}",
                        c[i]
                    );
                }
            }
        }
    }

    /// The selection equals a full sort's top k on random rows with ties and odd sizes.
    #[test]
    fn leaders_are_the_true_top_k() {
        let mut rng = rand::rng();
        let mut scratch = Scratch::default();
        for &(len, k) in &[
            (1usize, 1usize),
            (7, 3),
            (1000, 1),
            (5000, 64),
            (70000, 4096),
            (300, 500),
        ] {
            // coarse values on a grid, so ties are common
            let v: Vec<f32> = (0..len)
                .map(|_| (rng.random_range(-400..400) as f32) * 0.25)
                .collect();
            select_leaders(&v, k, &mut scratch);
            let mut got: Vec<f32> = scratch.leaders.iter().map(|&i| v[i as usize]).collect();
            let mut all = v.clone();
            all.sort_by(|a, b| b.total_cmp(a));
            got.sort_by(|a, b| b.total_cmp(a));
            assert_eq!(got.len(), k.min(len), "len {len} k {k}");
            assert_eq!(got, all[..k.min(len)], "len {len} k {k}");
            let mut ids = scratch.leaders.clone();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), k.min(len), "indices must be distinct");
        }
    }
}
