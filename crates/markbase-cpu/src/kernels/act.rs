//! Activations quantized for integer dot products ([`QuantAct`]).
//!
//! Each row of `k` f32 activations (k a multiple of 32) is cut into blocks of 32; block `j`
//! keeps an f32 scale `d[j] = max|x| / 32767` and 32 signed 16-bit values `q` with
//! `x ≈ d[j] · q` (round to nearest), plus the block sums `d · Σq` over each 32 (`s32`) and
//! each 16 (`s16`) values, which formats with a per-block minimum need.
//!
//! Within a block the values are stored in the order `0..8, 16..24, 8..16, 24..32`: the order
//! in which AVX2's byte unpacking (`vpunpcklbw` / `vpunpckhbw`) widens 32 weight bytes to two
//! vectors of 16-bit lanes, so weights need no cross-lane shuffle (see [`ActRow::at`]).
//!
//! 16 bits, not 8: with 8-bit activations the default model's logits moved by 9.6e-3 (relative)
//! from the float path and greedy continuations changed on 5 of 8 test prompts; with 16 bits the
//! error is 1.8e-4, inside the 1e-3 of the parity test (docs/perf.md). The integer products are
//! taken with `vpmaddwd` (16 × 16 → 32 bits), exact.

use super::Isa;

/// Activations per quantization block.
pub const ACT_BLOCK: usize = 32;

/// 1.5 · 2^23: adding it to an f32 of magnitude below 2^22 rounds to an integer.
pub(super) const ROUND: f32 = 12_582_912.0;

/// `n` rows of `k` activations in 16-bit blocks; storage is reused between calls.
#[derive(Default)]
pub struct QuantAct {
    k: usize,
    n: usize,
    q: Vec<i16>,
    d: Vec<f32>,
    s32: Vec<f32>,
    s16: Vec<f32>,
}

/// One quantized row, as the dot kernels read it.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    /// `k` quantized values, each block in the unpack order (use [`ActRow::at`] for value `i`).
    pub q: &'a [i16],
    /// `k / 32` block scales.
    pub d: &'a [f32],
    /// `k / 32` block sums `d · Σq`.
    pub s32: &'a [f32],
    /// `k / 16` half-block sums `d · Σq`.
    pub s16: &'a [f32],
}

impl QuantAct {
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
        self.quantize_with(Isa::detect(), x, n, k)
    }

    /// [`QuantAct::quantize`] with the code written for `isa` (portable code if this CPU lacks
    /// it); every path gives the same bits.
    ///
    /// # Panics
    /// As [`QuantAct::quantize`].
    pub fn quantize_with(&mut self, isa: Isa, x: &[f32], n: usize, k: usize) {
        check_rows(x, n, k);
        let blocks = n * k / ACT_BLOCK;
        self.k = k;
        self.n = n;
        grow(&mut self.q, n * k, 0);
        grow(&mut self.d, blocks, 0.0);
        grow(&mut self.s32, blocks, 0.0);
        grow(&mut self.s16, 2 * blocks, 0.0);
        let x = &x[..n * k];
        for (b, (xb, qb)) in x
            .chunks_exact(ACT_BLOCK)
            .zip(self.q.chunks_exact_mut(ACT_BLOCK))
            .enumerate()
        {
            let (d, lo, hi) = match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 was detected; both blocks hold 32 values.
                _ if isa.runs_avx2() => unsafe { avx2::quantize_block(xb, qb) },
                _ => portable_block(xb, qb),
            };
            self.d[b] = d;
            self.s16[2 * b] = d * lo as f32;
            self.s16[2 * b + 1] = d * hi as f32;
            self.s32[b] = d * (lo + hi) as f32;
        }
    }

    /// Rows quantized by the last [`QuantAct::quantize`].
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Row `t` of the last [`QuantAct::quantize`].
    ///
    /// # Panics
    /// If `t` is not below [`QuantAct::rows`].
    pub fn row(&self, t: usize) -> ActRow<'_> {
        assert!(t < self.n, "row {t} of {} quantized rows", self.n);
        let (k, kb) = (self.k, self.k / ACT_BLOCK);
        ActRow {
            q: &self.q[t * k..(t + 1) * k],
            d: &self.d[t * kb..(t + 1) * kb],
            s32: &self.s32[t * kb..(t + 1) * kb],
            s16: &self.s16[2 * t * kb..2 * (t + 1) * kb],
        }
    }
}

impl ActRow<'_> {
    /// Quantized value `i` of the row (natural order).
    #[inline]
    pub fn at(&self, i: usize) -> i16 {
        self.q[(i & !(ACT_BLOCK - 1)) | slot(i % ACT_BLOCK)]
    }

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
            .map(|(i, _)| f64::from(self.d[i / ACT_BLOCK]) * f64::from(self.at(i)))
            .collect()
    }
}

/// Quantizes block `xb` to 16 bits into `qb` (unpack order); returns the scale and the sums of
/// the first and last 16 integers.
fn portable_block(xb: &[f32], qb: &mut [i16]) -> (f32, i32, i32) {
    let mut levels = [0f32; ACT_BLOCK];
    let d = quantize_block(xb, 32767.0, &mut levels);
    let nat = levels.map(|v| v as i16);
    for (i, q) in nat.iter().enumerate() {
        qb[slot(i)] = *q;
    }
    let lo: i32 = nat[..16].iter().map(|&q| i32::from(q)).sum();
    let hi: i32 = nat[16..].iter().map(|&q| i32::from(q)).sum();
    (d, lo, hi)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 block quantizer (safety contract: the CPU has AVX2).

    use std::arch::x86_64::*;

    use crate::kernels::vmath::avx2::hsum_i32;

    /// [`super::portable_block`] in eight-lane steps, bit for bit: the same scale, the
    /// product `x · (32767 / max|x|)` rounded to nearest-even (`vcvtps2dq` in the default
    /// rounding mode, as the portable `ROUND` trick), clamped to ±32767; NaN values give 0
    /// (the portable `max` skips them and `NaN as i16` is 0).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(xb: &[f32], qb: &mut [i16]) -> (f32, i32, i32) {
        debug_assert!(xb.len() == 32 && qb.len() == 32);
        let p = xb.as_ptr();
        let v: [__m256; 4] = std::array::from_fn(|g| _mm256_loadu_ps(p.add(8 * g)));
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        // max_ps(a, m) returns m where a is NaN: NaN never wins, as in the portable fold.
        let mut m = _mm256_setzero_ps();
        for g in v {
            m = _mm256_max_ps(_mm256_and_ps(g, abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let (d, id) = if amax > 0.0 {
            (amax / 32767.0, 32767.0 / amax)
        } else {
            (0.0, 0.0)
        };
        let (idv, hi, lo) = (
            _mm256_set1_ps(id),
            _mm256_set1_epi32(32767),
            _mm256_set1_epi32(-32767),
        );
        let q: [__m256i; 4] = v.map(|g| {
            let y = _mm256_mul_ps(g, idv);
            let n = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(y), lo), hi);
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
            _mm256_andnot_si256(nan, n)
        });
        // packs interleaves 128-bit lanes: [a0..4 b0..4 | a4..8 b4..8]; the permute puts
        // the groups in the unpack order 0, 2 | 1, 3.
        let first = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(q[0], q[2]));
        let second = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(q[1], q[3]));
        let out = qb.as_mut_ptr();
        _mm256_storeu_si256(out.cast(), first);
        _mm256_storeu_si256(out.add(16).cast(), second);
        (
            d,
            hsum_i32(_mm256_add_epi32(q[0], q[1])),
            hsum_i32(_mm256_add_epi32(q[2], q[3])),
        )
    }
}

/// Where value `i` of a block is stored: the middle two groups of eight swap places.
#[inline]
fn slot(i: usize) -> usize {
    match i / 8 {
        1 => i + 8,
        2 => i - 8,
        _ => i,
    }
}

/// Checks that `x` holds `n` rows of `k` activations cut into whole blocks of 32.
///
/// # Panics
/// If not (caller bugs: weight shapes are checked at load).
fn check_rows(x: &[f32], n: usize, k: usize) {
    assert!(
        k.is_multiple_of(ACT_BLOCK),
        "activation rows of {k} are not whole blocks of 32"
    );
    assert!(
        x.len() >= n * k,
        "{} activations for {n} rows of {k}",
        x.len()
    );
}

/// Quantizes one block `xb` of 32 values to the integers `-levels..=levels` (as f32, in
/// `q`) and returns the scale `d = max|x| / levels` with `x ≈ d · q` (0 for an all-zero
/// block).
#[inline]
fn quantize_block(xb: &[f32], levels: f32, q: &mut [f32; ACT_BLOCK]) -> f32 {
    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, id) = if amax > 0.0 {
        (amax / levels, levels / amax)
    } else {
        (0.0, 0.0)
    };
    for (q, v) in q.iter_mut().zip(xb) {
        // Round to nearest (ties to even) by adding and removing 1.5 · 2^23, which vectorises
        // on any x86-64; |v · id| ≤ levels up to one rounding, and the clamp guards that ulp.
        *q = ((v * id + ROUND) - ROUND).clamp(-levels, levels);
    }
    d
}

/// Makes `v` at least `len` long (never shrinks).
pub(super) fn grow<T: Copy>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() < len {
        v.resize(len, fill);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Every path gives the bits of the portable one, on fresh random rows whose blocks span
    /// many magnitudes, plus all-zero, NaN, infinite and tie-rounding blocks.
    #[test]
    fn every_path_quantizes_like_the_portable_one() {
        if !Isa::Avx2.available() {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        let mut rng = rand::rng();
        let (n, k) = (5, 640);
        let mut x: Vec<f32> = (0..n * k)
            .map(|i| {
                let scale = 10f32.powi((i / 32 % 9) as i32 - 4);
                rng.random_range(-1.0f32..1.0) * scale
            })
            .collect();
        x[..32].fill(0.0);
        x[40] = f32::NAN;
        x[70] = f32::INFINITY;
        // Values landing exactly on .5 after scaling by 32767 / 2: ties to even.
        for (i, v) in x[96..128].iter_mut().enumerate() {
            *v = (i as f32 + 0.5) * 2.0 / 32767.0;
        }
        x[127] = 2.0;
        let (mut a, mut b) = (QuantAct::new(), QuantAct::new());
        a.quantize_with(Isa::Portable, &x, n, k);
        b.quantize_with(Isa::Avx2, &x, n, k);
        for t in 0..n {
            let (ra, rb) = (a.row(t), b.row(t));
            assert_eq!(ra.q, rb.q, "row {t}: integers");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(ra.d), bits(rb.d), "row {t}: scales");
            assert_eq!(bits(ra.s32), bits(rb.s32), "row {t}: block sums");
            assert_eq!(bits(ra.s16), bits(rb.s16), "row {t}: half sums");
        }
    }
}
