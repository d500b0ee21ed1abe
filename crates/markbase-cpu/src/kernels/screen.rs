//! The LM head's screening kernel: rows of a [`ScreenCopy`] times activations quantized to
//! unsigned bytes with one scale per token ([`ScreenAct`]), for one or several tokens at a
//! time, with an AVX2 path chosen at run time and a portable twin.
//!
//! A token's activations `x` are multiplied by the copy's column magnitudes `β`, then
//! `β·x ≈ t · p` with `p ∈ −127..=127` and one scale `t`, stored as `a = p + 128`. Against a
//! row (codes `q`, chunk scales `s`, row scale `d`, offset `o = 128 · Σ_c s_c · Σq`) the
//! product is `d · t · (Σ_c s_c · Σ a·q − o) + x·μ`. All of `Σ_c s_c · Σ a·q` is integer:
//! `vpmaddubsw` of the bytes and codes (pair sums ≤ 2·255·8 = 4 080), a chunk's two halves
//! added in 16 bits (≤ 8 160), then `vpmaddwd` by the chunk scale (≤ 63) into 32 bits. Per 32
//! products and token that is 1.5 multiplies and no float work, against two multiplies and a
//! float FMA for Q4_0 blocks.
//!
//! [`ScreenCopy`]: super::screen_copy::ScreenCopy

use super::act::{grow, ROUND};
use super::screen_copy::{code, ScreenCopy, CHUNK};
use super::Isa;

/// `n` tokens' activations for [`ScreenCopy`] rows; storage is reused between calls.
#[derive(Default)]
pub struct ScreenAct {
    k: usize,
    n: usize,
    a: Vec<u8>,
    scale: Vec<f32>,
    shift: Vec<f32>,
}

/// One token's screening activations, as the kernels read them.
#[derive(Clone, Copy)]
pub struct ScreenRow<'a> {
    /// `k` unsigned bytes `a = q + 128`, natural order.
    pub a: &'a [u8],
    /// The token's scale `t`.
    pub scale: f32,
    /// `x · μ`, added to every logit.
    pub shift: f32,
}

impl ScreenAct {
    /// Empty storage.
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes the `n` rows of `copy.cols` values at the start of `x` for `copy`; storage
    /// only grows (steady-state calls allocate nothing).
    ///
    /// # Panics
    /// If `x` is shorter than `n · copy.cols` (a caller bug: shapes are checked at load).
    pub fn quantize(&mut self, x: &[f32], n: usize, copy: &ScreenCopy) {
        let (k, beta) = (copy.cols, &copy.beta);
        assert!(
            x.len() >= n * k,
            "screen: {} values, need {n} × {k}",
            x.len()
        );
        (self.k, self.n) = (k, n);
        grow(&mut self.a, n * k, 0);
        grow(&mut self.scale, n, 0.0);
        grow(&mut self.shift, n, 0.0);
        for t in 0..n {
            let xt = &x[t * k..(t + 1) * k];
            let max = xt
                .iter()
                .zip(beta)
                .fold(0f32, |m, (v, b)| m.max((v * b).abs()));
            let s = if max > 0.0 && max.is_finite() {
                max / 127.0
            } else {
                0.0
            };
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            for ((a, v), b) in self.a[t * k..(t + 1) * k].iter_mut().zip(xt).zip(beta) {
                // round to nearest (ties to even) inline, see `act::ROUND`
                *a = (((v * b * inv + ROUND) - ROUND).clamp(-127.0, 127.0) as i32 + 128) as u8;
            }
            self.scale[t] = s;
            self.shift[t] = xt.iter().zip(&copy.mean).map(|(v, m)| v * m).sum();
        }
    }

    /// Token `t` of the last [`ScreenAct::quantize`].
    ///
    /// # Panics
    /// If `t` is not below the number of tokens quantized.
    pub fn row(&self, t: usize) -> ScreenRow<'_> {
        assert!(t < self.n, "token {t} of {} quantized", self.n);
        ScreenRow {
            a: &self.a[t * self.k..(t + 1) * self.k],
            scale: self.scale[t],
            shift: self.shift[t],
        }
    }
}

impl ScreenRow<'_> {
    /// The bytes as the kernels see them, `t · p` (divided by `β` this is the token).
    pub fn dequantize(&self) -> Vec<f64> {
        self.a
            .iter()
            .map(|&a| f64::from(self.scale) * (f64::from(a) - 128.0))
            .collect()
    }
}

/// `outs[t][i] = xs[t] · (row r0 + i of copy)` for the `outs[t].len()` rows from `r0`, with
/// the best kernels for this CPU.
///
/// # Panics
/// If `xs` and `outs` differ in length, a token is not `copy.cols` long, the slices of `outs`
/// differ in length or reach past the copy's rows (caller bugs: shapes are checked at load).
pub fn screen_tokens(copy: &ScreenCopy, r0: usize, xs: &[ScreenRow], outs: &mut [&mut [f32]]) {
    screen_tokens_with(Isa::detect(), copy, r0, xs, outs)
}

/// [`screen_tokens`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// As [`screen_tokens`].
pub fn screen_tokens_with(
    isa: Isa,
    copy: &ScreenCopy,
    r0: usize,
    xs: &[ScreenRow],
    outs: &mut [&mut [f32]],
) {
    assert_eq!(
        xs.len(),
        outs.len(),
        "screen: activations and outputs differ"
    );
    let Some(o0) = outs.first() else {
        return;
    };
    let nrows = o0.len();
    assert!(
        xs.iter().all(|x| x.a.len() == copy.cols) && outs.iter().all(|o| o.len() == nrows),
        "screen: activation rows or outputs of different lengths"
    );
    assert!(
        r0 + nrows <= copy.rows,
        "screen: rows {r0}..{} of '{}' ({} rows)",
        r0 + nrows,
        copy.name,
        copy.rows
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2 was detected; sizes were checked above.
            unsafe { avx2::screen_tokens(copy, r0, xs, outs) }
        }
        _ => {
            for (x, out) in xs.iter().zip(outs.iter_mut()) {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = portable_dot(copy, r0 + i, x);
                }
            }
        }
    }
}

/// The portable twin: one row times one token, weight by weight.
fn portable_dot(copy: &ScreenCopy, r: usize, x: &ScreenRow) -> f32 {
    let (rb, chunks) = (copy.row_bytes(), copy.cols / CHUNK);
    let row = &copy.codes[r * rb..(r + 1) * rb];
    let sum: i32 =
        x.a.iter()
            .enumerate()
            .map(|(i, &a)| {
                let s = copy.scales[r * chunks + i / CHUNK];
                i32::from(s) * i32::from(a) * i32::from(code(row, i))
            })
            .sum();
    copy.steps[r] * x.scale * (sum - copy.offsets[r]) as f32 + x.shift
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernel. Safety contract: the CPU has AVX2 and the sizes were checked by
    //! [`super::screen_tokens_with`].

    use std::arch::x86_64::*;

    use super::{ScreenCopy, ScreenRow, CHUNK};
    use crate::kernels::vmath::avx2::hsum_i32;

    /// Tokens that share one unpacking of each chunk of codes (one accumulator each, in
    /// registers).
    const GROUP: usize = 8;
    /// Rows ahead of the current one whose bytes are prefetched.
    const PREFETCH_ROWS: usize = 4;

    /// [`super::screen_tokens`]: tokens in groups of up to [`GROUP`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn screen_tokens(
        copy: &ScreenCopy,
        r0: usize,
        xs: &[ScreenRow],
        outs: &mut [&mut [f32]],
    ) {
        let mut t0 = 0;
        while t0 < xs.len() {
            let g = (xs.len() - t0).min(GROUP);
            let (x, o) = (&xs[t0..t0 + g], &mut outs[t0..t0 + g]);
            for_group_size!(g; 1, 2, 3, 4, 5, 6, 7, 8; N => group::<N>(copy, r0, x, o));
            t0 += g;
        }
    }

    /// Every row against `N` tokens, rows walked in order (one address stream for the
    /// prefetcher). Each 32-byte chunk of codes is split into its two signed nibble halves
    /// and its scale broadcast once for all `N` tokens.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn group<const N: usize>(
        copy: &ScreenCopy,
        r0: usize,
        xs: &[ScreenRow],
        outs: &mut [&mut [f32]],
    ) {
        let (rb, chunks) = (copy.row_bytes(), copy.cols / CHUNK);
        let a: [*const u8; N] = std::array::from_fn(|t| xs[t].a.as_ptr());
        let (m4, eight) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(8));
        let codes = copy.codes.as_ptr().add(r0 * rb);
        let scales = copy.scales.as_ptr().add(r0 * chunks);
        let end = copy.codes.as_ptr().add(copy.rows * rb);
        for i in 0..outs[0].len() {
            let row = codes.add(i * rb);
            let ahead = row.add(PREFETCH_ROWS * rb);
            if ahead < end {
                for line in (0..rb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(line).cast());
                }
            }
            let mut acc = [_mm256_setzero_si256(); N];
            for c in 0..chunks {
                let v = _mm256_loadu_si256(row.add(32 * c).cast());
                let lo = _mm256_sub_epi8(_mm256_and_si256(v, m4), eight);
                let hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), eight);
                let s = _mm256_set1_epi16(i16::from(*scales.add(i * chunks + c)));
                for t in 0..N {
                    let x = a[t].add(CHUNK * c);
                    let pairs = _mm256_add_epi16(
                        _mm256_maddubs_epi16(_mm256_loadu_si256(x.cast()), lo),
                        _mm256_maddubs_epi16(_mm256_loadu_si256(x.add(32).cast()), hi),
                    );
                    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(pairs, s));
                }
            }
            let r = r0 + i;
            let (d, offset) = (*copy.steps.get_unchecked(r), *copy.offsets.get_unchecked(r));
            for t in 0..N {
                let sum = hsum_i32(acc[t]) - offset;
                outs[t][i] = d * xs[t].scale * sum as f32 + xs[t].shift;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::screen_copy::f32_matrix;
    use rand::Rng;

    fn random_copy(rows: usize, cols: usize) -> ScreenCopy {
        let mut rng = rand::rng();
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0..1.0) * if i % 7 == 0 { 9.0 } else { 1.0 })
            .collect();
        ScreenCopy::build(&f32_matrix("w", rows, cols, &w)).unwrap()
    }

    /// Both kernel sets against the reference (`reference::matmul_screen_copy`: the copy's
    /// dequantized rows times the dequantized activations divided by β) on fresh random inputs,
    /// 1–14 tokens, several lengths and row offsets. Integer sums are exact; only the final f32
    /// scaling rounds, far below 1e-5 of Σ|w|·|x|, while one wrong code moves a result by ~1/k of
    /// it.
    #[test]
    fn matches_reference_for_any_token_count() {
        let mut rng = rand::rng();
        let mut sets = vec![Isa::Portable];
        if Isa::Avx2.available() {
            sets.push(Isa::Avx2);
        }
        for &(k, nrows, r0, n) in &[
            (64, 1, 0, 1),
            (128, 5, 2, 2),
            (640, 9, 3, 3),
            (640, 3, 0, 4),
            (2112, 4, 1, 9),
            (640, 6, 2, 8),
            (256, 7, 0, 14),
        ] {
            let copy = random_copy(nrows + r0, k);
            let x: Vec<f32> = (0..n * k)
                .map(|i| rng.random_range(-1.0..1.0) * if i % 96 < 32 { 40.0 } else { 1.0 })
                .collect();
            let mut act = ScreenAct::new();
            act.quantize(&x, n, &copy);
            let xs: Vec<ScreenRow> = (0..n).map(|t| act.row(t)).collect();
            let want = crate::reference::matmul_screen_copy(&x, n, &copy);
            for &isa in &sets {
                let mut out = vec![0f32; n * nrows];
                let mut outs: Vec<&mut [f32]> = out.chunks_mut(nrows).collect();
                screen_tokens_with(isa, &copy, r0, &xs, &mut outs);
                for t in 0..n {
                    let xd = xs[t].dequantize();
                    for r in 0..nrows {
                        let wr = copy.dequantize_row(r0 + r);
                        let mag: f64 = wr
                            .iter()
                            .zip(&xd)
                            .zip(&copy.beta)
                            .map(|((a, b), c)| f64::from(a.abs()) * b.abs() / f64::from(*c))
                            .chain(
                                copy.mean
                                    .iter()
                                    .zip(&x[t * k..(t + 1) * k])
                                    .map(|(m, v)| f64::from((m * v).abs())),
                            )
                            .sum();
                        let (got, want) = (out[t * nrows + r], want[t * (nrows + r0) + r0 + r]);
                        assert!(
                            (f64::from(got) - f64::from(want)).abs() <= 1e-5 * mag,
                            "{isa:?} k {k} token {t} row {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The bytes stay within half a step of `β·x`, the shift is `x·μ`, and an all-zero token
    /// gives zero logits rather than NaN.
    #[test]
    fn activations_round_to_nearest_and_zero_is_safe() {
        let mut rng = rand::rng();
        let k = 192;
        let copy = random_copy(3, k);
        let mut x: Vec<f32> = (0..k).map(|_| rng.random_range(-3.0..3.0)).collect();
        x.extend(std::iter::repeat_n(0.0, k));
        let mut act = ScreenAct::new();
        act.quantize(&x, 2, &copy);
        let r = act.row(0);
        for ((q, v), b) in r.dequantize().iter().zip(&x).zip(&copy.beta) {
            let want = f64::from(v * b);
            assert!(
                (q - want).abs() <= 0.5001 * f64::from(r.scale),
                "{q} vs {want}"
            );
        }
        let shift: f32 = x[..k].iter().zip(&copy.mean).map(|(v, m)| v * m).sum();
        assert!((r.shift - shift).abs() <= 1e-4 * shift.abs().max(1.0));
        let zero = act.row(1);
        assert_eq!((zero.scale, zero.shift), (0.0, 0.0));
        let mut out = vec![f32::NAN; 3];
        screen_tokens(&copy, 0, &[zero], &mut [&mut out[..]]);
        assert_eq!(out, [0.0; 3]);
    }
}
