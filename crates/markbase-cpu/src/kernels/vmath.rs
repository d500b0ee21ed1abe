//! Element-wise math with an AVX2 path: a vectorised `exp` (Cephes-style range reduction and
//! degree-6 polynomial, within 2 ulp over the clamped range) and the gelu-tanh gate built on it.

use super::Isa;

/// PyTorch's `gelu_pytorch_tanh(g) · u` in place in `gate`, with the best kernels for this CPU.
///
/// The AVX2 path uses `0.5 · (1 + tanh(z)) = 1 / (1 + exp(−2z))`, one `exp` and one division
/// per value; it is more accurate than the tanh form for large negative inputs, where
/// `1 + tanh(z)` cancels.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    gelu_tanh_mul_with(Isa::detect(), gate, up)
}

/// [`gelu_tanh_mul`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// If `up` is shorter than `gate`.
pub fn gelu_tanh_mul_with(isa: Isa, gate: &mut [f32], up: &[f32]) {
    assert!(
        up.len() >= gate.len(),
        "gelu_tanh_mul: {} up values for {}",
        up.len(),
        gate.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2 and FMA were detected; `up` is long enough.
            unsafe { avx2::gelu_tanh_mul(gate, up) }
        }
        _ => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = gelu_tanh(*g) * u;
            }
        }
    }
}

/// PyTorch's `gelu_pytorch_tanh`.
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! Safety contract: the CPU has AVX2 and FMA.

    use std::arch::x86_64::*;

    /// Sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Sum of the eight 32-bit integer lanes (wrapping).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        _mm_cvtsi128_si32(s)
    }

    /// `exp` of eight lanes: inputs are clamped to [−87.3, 88.7] (results between about
    /// 1.2e-38 and 3.3e38); within 2 ulp of the true value there.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
            _mm256_set1_ps(88.7),
        );
        // x = n·ln2 + r, |r| ≤ ln2/2, with ln2 split in two for an exact product.
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_2e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(
            _mm256_mul_ps(p, r),
            r,
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let scale = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(p, _mm256_castsi256_ps(scale))
    }

    /// [`super::gelu_tanh_mul`], eight values at a time (scalar tail).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
        const C: f32 = 0.797_884_6; // sqrt(2/pi)
        let n = gate.len();
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(g.add(i));
            let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            let z = _mm256_mul_ps(
                _mm256_set1_ps(C),
                _mm256_fmadd_ps(x3, _mm256_set1_ps(0.044_715), x),
            );
            let e = exp(_mm256_mul_ps(z, _mm256_set1_ps(-2.0)));
            let y = _mm256_div_ps(x, _mm256_add_ps(e, _mm256_set1_ps(1.0)));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(y, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
        while i < n {
            *g.add(i) = super::gelu_tanh(*g.add(i)) * *u.add(i);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_gelu_paths_match_the_f64_formula() {
        let n = 20_011;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 2e-3).collect();
        let u: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        for isa in [Isa::Portable, Isa::Avx2] {
            let mut out = g.clone();
            gelu_tanh_mul_with(isa, &mut out, &u);
            for ((o, x), u) in out.iter().zip(&g).zip(&u) {
                let x = *x as f64;
                let z = 0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x);
                let want = 0.5 * x * (1.0 + z.tanh()) * *u as f64;
                // The portable tanh form loses up to an f32 ulp of |x·u| where 1 + tanh(z)
                // cancels (large negative x); elsewhere both are within a few ulp.
                let err = (*o as f64 - want).abs();
                let tol = 1e-6 * want.abs() + 1e-7 * (x * *u as f64).abs();
                assert!(err <= tol, "{isa:?} gelu({x}): {o} vs {want}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_is_within_two_ulp() {
        if !Isa::Avx2.available() {
            return;
        }
        use std::arch::x86_64::*;
        let mut x = -87.0f32;
        while x < 88.0 {
            let v: [f32; 8] = std::array::from_fn(|i| x + i as f32 * 1.1e-3);
            // SAFETY: AVX2 and FMA are available.
            let got: [f32; 8] =
                unsafe { std::mem::transmute(avx2::exp(_mm256_loadu_ps(v.as_ptr()))) };
            for (g, v) in got.iter().zip(&v) {
                let want = (*v as f64).exp();
                let ulp = (want as f32).to_bits().abs_diff(g.to_bits());
                assert!(ulp <= 2, "exp({v}) = {g}, want {want} ({ulp} ulp)");
            }
            x += 0.0137;
        }
    }
}
