//! Activations quantized to 8 bits per value ([`ByteAct`]), for the LM head's screening pass.
//!
//! Each row of `k` f32 activations (k a multiple of 32) is cut into blocks of 32; block `j`
//! keeps an f32 scale `d[j] = max|x| / 127`, 32 signed bytes `q` with `x ≈ d[j] · q` (round to
//! nearest, natural order) and the integer block sum `sum[j] = Σq`. Bytes let AVX2 multiply 32
//! weight-activation pairs per instruction (`vpmaddubsw`), twice the 16-bit path's rate, at
//! 1/127 relative precision per block: too coarse for the layers (greedy continuations of the
//! default model changed, docs/perf.md), fine for a pass that only ranks the vocabulary.

use super::act::{check_rows, grow, quantize_block};

/// Activations per quantization block.
pub const BYTE_BLOCK: usize = 32;

/// `n` rows of `k` activations in 8-bit blocks; storage is reused between calls.
#[derive(Default)]
pub struct ByteAct {
    k: usize,
    n: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<i32>,
}

/// One 8-bit quantized row, as the kernels read it.
#[derive(Clone, Copy)]
pub struct ByteRow<'a> {
    /// `k` quantized values in natural order.
    pub q: &'a [i8],
    /// `k / 32` block scales.
    pub d: &'a [f32],
    /// `k / 32` block sums `Σq`.
    pub sum: &'a [i32],
}

impl ByteAct {
    /// Empty storage.
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes the `n` rows of `k` values at the start of `x`, reusing storage (it only
    /// grows, so steady-state calls allocate nothing).
    ///
    /// # Panics
    /// If `k` is not a multiple of 32 or `x` is shorter than `n * k` (caller bugs: weight
    /// shapes are checked at load).
    pub fn quantize(&mut self, x: &[f32], n: usize, k: usize) {
        check_rows(x, n, k);
        let blocks = n * k / BYTE_BLOCK;
        (self.k, self.n) = (k, n);
        grow(&mut self.q, n * k, 0);
        grow(&mut self.d, blocks, 0.0);
        grow(&mut self.sum, blocks, 0);
        let mut levels = [0f32; BYTE_BLOCK];
        for (b, (xb, qb)) in x[..n * k]
            .chunks_exact(BYTE_BLOCK)
            .zip(self.q.chunks_exact_mut(BYTE_BLOCK))
            .enumerate()
        {
            self.d[b] = quantize_block(xb, 127.0, &mut levels);
            for (q, v) in qb.iter_mut().zip(levels) {
                *q = v as i8;
            }
            self.sum[b] = qb.iter().map(|&q| i32::from(q)).sum();
        }
    }

    /// Rows quantized by the last [`ByteAct::quantize`].
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Row `t` of the last [`ByteAct::quantize`].
    ///
    /// # Panics
    /// If `t` is not below [`ByteAct::rows`].
    pub fn row(&self, t: usize) -> ByteRow<'_> {
        assert!(t < self.n, "row {t} of {} quantized rows", self.n);
        let (k, kb) = (self.k, self.k / BYTE_BLOCK);
        ByteRow {
            q: &self.q[t * k..(t + 1) * k],
            d: &self.d[t * kb..(t + 1) * kb],
            sum: &self.sum[t * kb..(t + 1) * kb],
        }
    }
}

impl ByteRow<'_> {
    /// Activations in the row.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Whether the row is empty.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// The values the row stands for, `d · q`, in f64 (for reference checks).
    pub fn dequantize(&self) -> Vec<f64> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| f64::from(self.d[i / BYTE_BLOCK]) * f64::from(q))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Every value is within half a step of its block's grid, the sums match the bytes, and
    /// all-zero blocks stay zero.
    #[test]
    fn values_round_to_the_block_grid() {
        let mut rng = rand::rng();
        let (n, k) = (3, 96);
        let mut x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-5.0..5.0)).collect();
        x[32..64].fill(0.0);
        let mut act = ByteAct::new();
        act.quantize(&x, n, k);
        for t in 0..n {
            let row = act.row(t);
            let deq = row.dequantize();
            for (i, v) in x[t * k..(t + 1) * k].iter().enumerate() {
                let d = f64::from(row.d[i / 32]);
                assert!(
                    (deq[i] - f64::from(*v)).abs() <= 0.5 * d + 1e-6,
                    "value {i}"
                );
            }
            for (j, qb) in row.q.chunks(32).enumerate() {
                let sum: i32 = qb.iter().map(|&q| i32::from(q)).sum();
                assert_eq!(row.sum[j], sum);
                assert!(qb.iter().any(|&q| q.abs() == 127) || row.d[j] == 0.0);
            }
        }
        assert!(act.row(0).q[32..64].iter().all(|&q| q == 0));
    }
}
