//! Blocked f32 matrix product for prefill: many tokens per weight load.
//!
//! The activations of a call are packed once into *token tiles* of [`NT`] tokens stored
//! `k`-major (`tile[kk * NT + t]`), so one 256-bit load holds eight tokens' activations at the
//! same `k`. Weight rows are dequantized once per call into plain f32 rows (bit-identical to
//! the reference dequantization). The micro-kernel keeps [`MR`] rows × `NT` tokens of sums in
//! twelve registers and, per `k`, loads two activation vectors, broadcasts six weights and
//! issues twelve FMAs: each weight is used for sixteen tokens and each activation for six rows
//! straight from registers. Where the CPU has AVX-512, a 512-bit micro-kernel takes its place
//! (12 rows × two token tiles in 24 of its 32 registers: each broadcast weight feeds 32
//! tokens), twice the FMA width per instruction.
//!
//! Products are f32 activations × f32 weights summed in f32, so results equal the reference
//! up to f32 rounding of the sums (no activation quantization on this path).

use markbase_core::quant::GgmlType;

use super::Isa;

/// Weight rows per micro-kernel tile.
pub const MR: usize = 6;
/// Tokens per token tile.
pub const NT: usize = 16;

/// Values [`pack_tokens`] writes for `n` tokens of `k` activations.
pub fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(NT) * NT * k
}

/// Packs the `n` row-major activation rows of `x` (`k` each) into token tiles (zero-padded to
/// a whole tile) at the start of `xt`, which holds at least [`packed_len`] values, with the
/// best kernels for this CPU.
///
/// # Panics
/// If the sizes disagree (caller bugs).
pub fn pack_tokens(x: &[f32], n: usize, k: usize, xt: &mut [f32]) {
    pack_tokens_with(Isa::detect(), x, n, k, xt)
}

/// [`pack_tokens`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// As [`pack_tokens`].
pub fn pack_tokens_with(isa: Isa, x: &[f32], n: usize, k: usize, xt: &mut [f32]) {
    assert!(x.len() >= n * k && xt.len() >= packed_len(n, k));
    for (tile, dst) in xt[..packed_len(n, k)].chunks_exact_mut(NT * k).enumerate() {
        let t0 = tile * NT;
        let nt = NT.min(n - t0);
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if isa.runs_avx2() && nt == NT {
            // SAFETY: AVX2 is available; the tile's rows and `dst` hold NT · k values.
            done = unsafe { avx2::pack_tile(&x[t0 * k..(t0 + NT) * k], k, dst) };
        }
        for t in 0..NT {
            for kk in done..k {
                dst[kk * NT + t] = if t < nt { x[(t0 + t) * k + kk] } else { 0.0 };
            }
        }
    }
}

/// Dequantizes the `w.len() / k` weight rows of `ty` at the start of `rows` (`rb` bytes each)
/// into `w`, bit-identical to the reference.
///
/// # Panics
/// If `rows` holds fewer rows (a caller bug).
pub fn unpack_rows(ty: GgmlType, rows: &[u8], rb: usize, k: usize, w: &mut [f32]) {
    for (r, dst) in w.chunks_exact_mut(k).enumerate() {
        super::dequantize_row_fast(ty, &rows[r * rb..(r + 1) * rb], dst);
    }
}

/// `out[t * ldo + r] = Σ_kk w[r * k + kk] · x[t, kk]` for the `nr = w.len() / k` rows of `w`
/// and the `n` tokens packed in `xt`, with the best kernels for this CPU.
///
/// # Panics
/// If the sizes disagree (caller bugs).
pub fn rows_matmul(w: &[f32], k: usize, xt: &[f32], n: usize, out: &mut [f32], ldo: usize) {
    rows_matmul_with(Isa::detect(), w, k, xt, n, out, ldo)
}

/// [`rows_matmul`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// As [`rows_matmul`].
pub fn rows_matmul_with(
    isa: Isa,
    w: &[f32],
    k: usize,
    xt: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let nr = w.len() / k.max(1);
    assert!(nr <= ldo && xt.len() >= packed_len(n, k));
    assert!(n == 0 || out.len() >= (n - 1) * ldo + nr);
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx512() => {
            // SAFETY: AVX-512 F was detected; sizes were checked above.
            unsafe { avx512::rows_matmul(w, nr, k, xt, n, out, ldo) }
        }
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2 and FMA were detected; sizes were checked above.
            unsafe { avx2::rows_matmul(w, nr, k, xt, n, out, ldo) }
        }
        _ => portable_rows_matmul(w, nr, k, xt, n, out, ldo),
    }
}

/// The portable twin: plain loops over the packed tiles.
fn portable_rows_matmul(
    w: &[f32],
    nr: usize,
    k: usize,
    xt: &[f32],
    n: usize,
    out: &mut [f32],
    ldo: usize,
) {
    for (tile, x) in xt[..packed_len(n, k)].chunks_exact(NT * k).enumerate() {
        let nt = NT.min(n - tile * NT);
        for r in 0..nr {
            let mut acc = [0f32; NT];
            for (kk, wv) in w[r * k..(r + 1) * k].iter().enumerate() {
                for (a, xv) in acc.iter_mut().zip(&x[kk * NT..(kk + 1) * NT]) {
                    *a += wv * xv;
                }
            }
            for (t, a) in acc[..nt].iter().enumerate() {
                out[(tile * NT + t) * ldo + r] = *a;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 + FMA micro-kernel. Safety contract: the CPU has AVX2 and FMA, and the sizes
    //! were checked by [`super::rows_matmul_with`].

    use std::arch::x86_64::*;

    use super::{MR, NT};

    /// Packs the first `k / 8 · 8` columns of a full tile of NT rows (row-major, `k` apart)
    /// with 8 × 8 register transposes; returns the columns done.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn pack_tile(x: &[f32], k: usize, dst: &mut [f32]) -> usize {
        let (xp, dp) = (x.as_ptr(), dst.as_mut_ptr());
        let whole = k / 8 * 8;
        for kk in (0..whole).step_by(8) {
            for half in 0..2 {
                let r: [__m256; 8] =
                    std::array::from_fn(|t| _mm256_loadu_ps(xp.add((8 * half + t) * k + kk)));
                let c = transpose8(r);
                for (i, c) in c.iter().enumerate() {
                    _mm256_storeu_ps(dp.add((kk + i) * NT + 8 * half), *c);
                }
            }
        }
        whole
    }

    /// Transpose of an 8 × 8 block held as eight row vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }

    /// [`super::rows_matmul`]: per token tile, full groups of `MR` rows, then one group of the
    /// rest.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_matmul(
        w: &[f32],
        nr: usize,
        k: usize,
        xt: &[f32],
        n: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
        for tile in 0..n.div_ceil(NT) {
            let x = xt.as_ptr().add(tile * NT * k);
            let nt = NT.min(n - tile * NT);
            let o = op.add(tile * NT * ldo);
            let mut r = 0;
            while r + MR <= nr {
                micro::<MR>(wp.add(r * k), k, x, o.add(r), ldo, nt);
                r += MR;
            }
            let (wr, or) = (wp.add(r * k), o.add(r));
            match nr - r {
                0 => {}
                1 => micro::<1>(wr, k, x, or, ldo, nt),
                2 => micro::<2>(wr, k, x, or, ldo, nt),
                3 => micro::<3>(wr, k, x, or, ldo, nt),
                4 => micro::<4>(wr, k, x, or, ldo, nt),
                _ => micro::<5>(wr, k, x, or, ldo, nt),
            }
        }
    }

    /// `M` weight rows (`k` apart at `w`) × one token tile at `x`, written to `out[t * ldo + m]`
    /// for the first `nt` tokens.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn micro<const M: usize>(
        w: *const f32,
        k: usize,
        x: *const f32,
        out: *mut f32,
        ldo: usize,
        nt: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        for kk in 0..k {
            let x0 = _mm256_loadu_ps(x.add(kk * NT));
            let x1 = _mm256_loadu_ps(x.add(kk * NT + 8));
            for (m, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_broadcast_ss(&*w.add(m * k + kk));
                a[0] = _mm256_fmadd_ps(wv, x0, a[0]);
                a[1] = _mm256_fmadd_ps(wv, x1, a[1]);
            }
        }
        let mut tile = [[0f32; NT]; M];
        for (t, a) in tile.iter_mut().zip(&acc) {
            _mm256_storeu_ps(t.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(t.as_mut_ptr().add(8), a[1]);
        }
        for t in 0..nt {
            let o = out.add(t * ldo);
            for (m, row) in tile.iter().enumerate() {
                *o.add(m) = row[t];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512 micro-kernel: one 512-bit register holds a token tile's sixteen activations
    //! at one `k`, and two tiles are run together, so each broadcast weight feeds two FMAs and
    //! [`MR512`] rows × 32 tokens of sums stay in 24 of the 32 registers. Safety contract: the
    //! CPU has AVX-512 F, and the sizes were checked by [`super::rows_matmul_with`].

    use std::arch::x86_64::*;

    use super::NT;

    /// Weight rows per micro-kernel tile.
    const MR512: usize = 12;

    /// [`super::rows_matmul`]: per pair of token tiles (then a last single one), full groups
    /// of [`MR512`] rows, then groups of four and single rows for the rest.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows_matmul(
        w: &[f32],
        nr: usize,
        k: usize,
        xt: &[f32],
        n: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
        let tiles = n.div_ceil(NT);
        let mut tile = 0;
        while tile < tiles {
            let x = xt.as_ptr().add(tile * NT * k);
            let o = op.add(tile * NT * ldo);
            let nt = n - tile * NT;
            if tile + 1 < tiles {
                rows::<2>(wp, nr, k, x, o, ldo, nt);
                tile += 2;
            } else {
                rows::<1>(wp, nr, k, x, o, ldo, nt);
                tile += 1;
            }
        }
    }

    /// Every row of `w` times the `T` token tiles at `x` (the first `nt` tokens written).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const T: usize>(
        w: *const f32,
        nr: usize,
        k: usize,
        x: *const f32,
        out: *mut f32,
        ldo: usize,
        nt: usize,
    ) {
        let mut r = 0;
        while r + MR512 <= nr {
            micro::<MR512, T>(w.add(r * k), k, x, out.add(r), ldo, nt);
            r += MR512;
        }
        while r + 4 <= nr {
            micro::<4, T>(w.add(r * k), k, x, out.add(r), ldo, nt);
            r += 4;
        }
        while r < nr {
            micro::<1, T>(w.add(r * k), k, x, out.add(r), ldo, nt);
            r += 1;
        }
    }

    /// `M` weight rows (`k` apart at `w`) × `T` token tiles at `x`, written to
    /// `out[t * ldo + m]` for the first `nt` tokens.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro<const M: usize, const T: usize>(
        w: *const f32,
        k: usize,
        x: *const f32,
        out: *mut f32,
        ldo: usize,
        nt: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); T]; M];
        for kk in 0..k {
            let xs: [__m512; T] =
                std::array::from_fn(|j| _mm512_loadu_ps(x.add(j * NT * k + kk * NT)));
            for (m, a) in acc.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*w.add(m * k + kk));
                for (a, xv) in a.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(wv, *xv, *a);
                }
            }
        }
        let mut tile = [[0f32; NT]; M];
        for (j, tj) in (0..T).map(|j| (j, nt.saturating_sub(j * NT).min(NT))) {
            for (t, a) in tile.iter_mut().zip(&acc) {
                _mm512_storeu_ps(t.as_mut_ptr(), a[j]);
            }
            for t in 0..tj {
                let o = out.add((j * NT + t) * ldo);
                for (m, row) in tile.iter().enumerate() {
                    *o.add(m) = row[t];
                }
            }
        }
    }
}
