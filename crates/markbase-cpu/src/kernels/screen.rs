//! The LM head's screening kernel: Q4_0 weight rows times 8-bit activations ([`ByteRow`]), for
//! one or several tokens at a time, with an AVX2 path chosen at run time and a portable twin.
//!
//! A Q4_0 block stores 32 nibbles `u` and a scale `d`; its weights are `d · (u − 8)`. Against
//! an activation block `x = d_x · q` the product is `d · d_x · (Σ u·q − 8 · Σq)`: the unsigned
//! nibbles multiply the signed bytes directly (`vpmaddubsw`, whose 16-bit pair sums cannot
//! overflow: 2 · 15 · 127 < 2^15) and the offset comes from the activations' integer block
//! sums. Integer sums are exact; the scales are applied once per block in f32.
//!
//! [`ByteRow`]: super::act8::ByteRow

use super::act8::ByteRow;
use super::Isa;

/// Bytes of one Q4_0 block: an f16 scale and 16 bytes of nibbles.
const BLOCK_BYTES: usize = 18;

/// `outs[t][i] = xs[t] · (dequantized Q4_0 row i)` for the `outs[t].len()` rows at the start of
/// `rows` (each `xs[t].len() / 32` blocks long), with the best kernels for this CPU.
///
/// # Panics
/// If `xs` and `outs` differ in length, the rows of `xs` or the slices of `outs` differ in
/// length, or `rows` holds fewer rows (caller bugs: shapes are checked at load).
pub fn q4_0_tokens(rows: &[u8], xs: &[ByteRow], outs: &mut [&mut [f32]]) {
    q4_0_tokens_with(Isa::detect(), rows, xs, outs)
}

/// [`q4_0_tokens`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// As [`q4_0_tokens`].
pub fn q4_0_tokens_with(isa: Isa, rows: &[u8], xs: &[ByteRow], outs: &mut [&mut [f32]]) {
    assert_eq!(
        xs.len(),
        outs.len(),
        "screen: activations and outputs differ"
    );
    let (Some(x0), Some(o0)) = (xs.first(), outs.first()) else {
        return;
    };
    let (nb, nrows) = (x0.d.len(), o0.len());
    assert!(
        xs.iter()
            .all(|x| x.d.len() == nb && x.sum.len() == nb && x.q.len() == 32 * nb)
            && outs.iter().all(|o| o.len() == nrows),
        "screen: activation rows or outputs of different lengths"
    );
    let rb = nb * BLOCK_BYTES;
    assert!(
        rows.len() >= rb * nrows,
        "screen: {} bytes hold fewer than {nrows} Q4_0 rows of {} weights",
        rows.len(),
        32 * nb
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if Isa::detect() == Isa::Avx2 => {
            // SAFETY: AVX2, FMA and F16C were detected; sizes were checked above.
            unsafe { avx2::q4_0_tokens(rows, rb, xs, outs) }
        }
        _ => {
            for (x, out) in xs.iter().zip(outs.iter_mut()) {
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(rb)) {
                    *o = portable_dot(row, x);
                }
            }
        }
    }
}

/// The portable twin: one Q4_0 row times one byte row, block by block.
fn portable_dot(row: &[u8], x: &ByteRow) -> f32 {
    let mut sum = 0f32;
    for (j, b) in row.chunks_exact(BLOCK_BYTES).enumerate() {
        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        let q = &x.q[32 * j..32 * j + 32];
        let p: i32 = b[2..]
            .iter()
            .enumerate()
            .map(|(l, &v)| {
                i32::from(v & 15) * i32::from(q[l]) + i32::from(v >> 4) * i32::from(q[l + 16])
            })
            .sum();
        sum += d * x.d[j] * (p - 8 * x.sum[j]) as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernel. Safety contract: the CPU has AVX2, FMA and F16C, and the sizes were
    //! checked by [`super::q4_0_tokens_with`].

    use std::arch::x86_64::*;

    use super::super::act8::ByteRow;
    use super::super::f16_table;
    use super::super::vmath::avx2::hsum;
    use super::BLOCK_BYTES;

    /// Tokens that share one unpacking of each weight block.
    const GROUP: usize = 4;

    /// Rows ahead of the current one whose bytes are prefetched.
    const PREFETCH_ROWS: usize = 4;

    /// [`super::q4_0_tokens`]: tokens in groups of up to [`GROUP`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q4_0_tokens(
        rows: &[u8],
        rb: usize,
        xs: &[ByteRow],
        outs: &mut [&mut [f32]],
    ) {
        let mut t0 = 0;
        while t0 < xs.len() {
            let g = (xs.len() - t0).min(GROUP);
            let (x, o) = (&xs[t0..t0 + g], &mut outs[t0..t0 + g]);
            match g {
                1 => group::<1>(rows, rb, x, o),
                2 => group::<2>(rows, rb, x, o),
                3 => group::<3>(rows, rb, x, o),
                _ => group::<4>(rows, rb, x, o),
            }
            t0 += g;
        }
    }

    /// Every row against `N` tokens. Rows are walked one after the other (one address stream
    /// for the prefetcher); each block's nibbles are unpacked once for all `N` tokens, whose
    /// two float accumulators (even and odd blocks) stay in registers. The offset `8 · Σq`
    /// is taken from the integer lanes (`Σq` from each of the eight), so it costs one
    /// subtraction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const N: usize>(
        rows: &[u8],
        rb: usize,
        xs: &[ByteRow],
        outs: &mut [&mut [f32]],
    ) {
        let table = f16_table().as_ptr();
        let nb = rb / BLOCK_BYTES;
        let q: [*const i8; N] = std::array::from_fn(|t| xs[t].q.as_ptr());
        let d: [*const f32; N] = std::array::from_fn(|t| xs[t].d.as_ptr());
        let sums: [*const i32; N] = std::array::from_fn(|t| xs[t].sum.as_ptr());
        let (m4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
        for i in 0..outs[0].len() {
            let row = rows.as_ptr().add(i * rb);
            // Ask for the row PREFETCH_ROWS ahead (the hardware prefetcher alone leaves
            // bandwidth unused on a single stream).
            if i + PREFETCH_ROWS < outs[0].len() {
                let ahead = row.add(PREFETCH_ROWS * rb);
                for line in (0..rb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(line).cast());
                }
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            // Block j into accumulator `slot` (even and odd blocks alternate, so consecutive
            // blocks do not wait on each other's FMA).
            let mut block = |j: usize, slot: usize| {
                let b = row.add(j * BLOCK_BYTES);
                let dw = table.add(usize::from(u16::from_le_bytes([*b, *b.add(1)])));
                let qs = _mm_loadu_si128(b.add(2).cast());
                // low nibbles are weights 0..16, high nibbles 16..32
                let u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
                let w = _mm256_broadcast_ss(&*dw);
                for t in 0..N {
                    let x = _mm256_loadu_si256(q[t].add(32 * j).cast());
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
                    let p = _mm256_sub_epi32(p, _mm256_set1_epi32(*sums[t].add(j)));
                    let sc = _mm256_mul_ps(w, _mm256_broadcast_ss(&*d[t].add(j)));
                    acc[t][slot] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[t][slot]);
                }
            };
            let mut j = 0;
            while j + 2 <= nb {
                block(j, 0);
                block(j + 1, 1);
                j += 2;
            }
            if j < nb {
                block(j, 0);
            }
            for t in 0..N {
                outs[t][i] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::act8::ByteAct;
    use markbase_core::quant::{dequantize_row, quantize_row, GgmlType};
    use rand::Rng;

    /// Both kernel sets against the reference (dequantized Q4_0 rows times the dequantized
    /// byte activations, in f64) on fresh random inputs, 1–9 tokens, several lengths. The
    /// only rounding is f32 scaling and summing of exact block sums: relative to Σ|w|·|x|
    /// it stays far below 1e-5, while one wrong nibble moves a result by ~1/k of it.
    #[test]
    fn matches_reference_for_any_token_count() {
        let mut rng = rand::rng();
        let mut sets = vec![Isa::Portable];
        if Isa::Avx2.available() {
            sets.push(Isa::Avx2);
        }
        for &(k, nrows, n) in &[
            (32, 1, 1),
            (64, 5, 2),
            (640, 7, 3),
            (640, 3, 4),
            (2080, 4, 9),
        ] {
            let w: Vec<f32> = (0..nrows * k)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut rows = vec![0u8; nrows * GgmlType::Q4_0.bytes_for(k).unwrap()];
            quantize_row(GgmlType::Q4_0, &w, &mut rows).unwrap();
            let mut wd = vec![0f32; nrows * k];
            dequantize_row(GgmlType::Q4_0, &rows, &mut wd).unwrap();
            let x: Vec<f32> = (0..n * k)
                .map(|i| rng.random_range(-1.0..1.0) * if i % 96 < 32 { 40.0 } else { 1.0 })
                .collect();
            let mut act = ByteAct::new();
            act.quantize(&x, n, k);
            let xs: Vec<ByteRow> = (0..n).map(|t| act.row(t)).collect();
            for &isa in &sets {
                let mut out = vec![0f32; n * nrows];
                let mut outs: Vec<&mut [f32]> = out.chunks_mut(nrows).collect();
                q4_0_tokens_with(isa, &rows, &xs, &mut outs);
                for t in 0..n {
                    let xd = xs[t].dequantize();
                    for r in 0..nrows {
                        let wr = &wd[r * k..(r + 1) * k];
                        let want: f64 = wr.iter().zip(&xd).map(|(a, b)| f64::from(*a) * b).sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(&xd)
                            .map(|(a, b)| f64::from(a.abs()) * b.abs())
                            .sum();
                        let got = f64::from(out[t * nrows + r]);
                        assert!(
                            (got - want).abs() <= 1e-5 * mag,
                            "{isa:?} k {k} token {t} row {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
