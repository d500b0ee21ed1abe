//! The 256-weight "K" super-block formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K, laid out as in
//! ggml. Within a super-block, sub-blocks of 16 or 32 weights have their own small scales.

use super::float::f16_at;

/// The 6-bit (scale, min) pair of sub-block `j` (0..8) of a Q4_K/Q5_K super-block, unpacked from
/// its 12 packed scale bytes: sub-blocks 0..4 keep both in the low 6 bits of bytes `j` and
/// `j + 4`; sub-blocks 4..8 take low nibbles from byte `j + 4` and their top 2 bits from the
/// spare top bits of bytes `j - 4` (scale) and `j` (min).
#[inline]
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// The sixteen signed 6-bit scales of a Q3_K super-block, from its 12 packed bytes: scale `j`
/// has low 4 bits from byte `j % 8` (low nibble for `j < 8`, high nibble after) and high 2 bits
/// from byte `8 + j % 4` at bit `2 * (j / 4)`, stored with an offset of 32.
pub fn q3_k_scales(scales: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, s) in out.iter_mut().enumerate() {
        let low = if j < 8 {
            scales[j] & 0x0F
        } else {
            scales[j - 8] >> 4
        };
        let high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q2_K block (84 bytes): `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`.
/// Sub-block `s` of 16: `w = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4)`.
/// Weights `128 n + 32 k + l` (`l < 32`) are bits `2k..2k+2` of `qs[32 n + l]`.
pub(super) fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (s, (out, &sc)) in y.chunks_exact_mut(16).zip(scales).enumerate() {
        let (n, k, half) = (s / 8, (s % 8) / 2, s % 2);
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let q = &qs[32 * n + 16 * half..][..16];
        for (w, &q) in out.iter_mut().zip(q) {
            *w = dl * ((q >> (2 * k)) & 3) as f32 - ml;
        }
    }
}

/// Q3_K block (110 bytes): `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`.
/// Weight `i = 128 n + 32 k + l` has low bits `2k..2k+2` of `qs[32 n + l]`; 4 is subtracted
/// unless bit `i / 32` of `hmask[l]` is set; sub-block of 16: `w = d * scale * q`.
pub(super) fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (s, (out, &sc)) in y.chunks_exact_mut(16).zip(&scales).enumerate() {
        let (n, k, half) = (s / 8, (s % 8) / 2, s % 2);
        let dl = d * sc as f32;
        let low = &qs[32 * n + 16 * half..][..16];
        let high = &hmask[16 * half..][..16];
        for ((w, &q), &h) in out.iter_mut().zip(low).zip(high) {
            let q = ((q >> (2 * k)) & 3) as i8;
            let q = if h & (1 << (s / 2)) != 0 { q } else { q - 4 };
            *w = dl * q as f32;
        }
    }
}

/// Q4_K block (144 bytes): `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`.
/// Weight `i = 64 n + 32 h + l` is nibble `h` of `qs[32 n + l]`; sub-block `j = i / 32`:
/// `w = d * sc[j] * q - dmin * m[j]` with `(sc, m)` from [`k_scale_min`].
pub(super) fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, out) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, j);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let q = &qs[32 * (j / 2)..][..32];
        for (w, &q) in out.iter_mut().zip(q) {
            *w = d1 * ((q >> (4 * (j % 2))) & 0x0F) as f32 - m1;
        }
    }
}

/// Q5_K block (176 bytes): `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`.
/// As Q4_K, plus a fifth bit for weight `i` in bit `i / 32` of `qh[i % 32]`.
pub(super) fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, out) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, j);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        let q = &qs[32 * (j / 2)..][..32];
        for ((w, &q), &h) in out.iter_mut().zip(q).zip(qh) {
            let q = ((q >> (4 * (j % 2))) & 0x0F) | (((h >> j) & 1) << 4);
            *w = d1 * q as f32 - m1;
        }
    }
}

/// Q6_K block (210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`.
/// Weight `i = 128 n + 32 k + l` has low nibble `k / 2` of `ql[64 n + 32 (k % 2) + l]` and high
/// bits `2k..2k+2` of `qh[32 n + l]`, offset by 32; sub-block of 16: `w = d * scale * q`.
pub(super) fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (s, (out, &sc)) in y.chunks_exact_mut(16).zip(scales).enumerate() {
        let (n, k, half) = (s / 8, (s % 8) / 2, s % 2);
        let dl = d * (sc as i8) as f32;
        let low = &ql[64 * n + 32 * (k % 2) + 16 * half..][..16];
        let high = &qh[32 * n + 16 * half..][..16];
        for ((w, &lo), &hi) in out.iter_mut().zip(low).zip(high) {
            let q = (((lo >> (4 * (k / 2))) & 0x0F) | (((hi >> (2 * k)) & 3) << 4)) as i8 - 32;
            *w = dl * q as f32;
        }
    }
}

/// Q8_K block (292 bytes): `d: f32, qs: [i8; 256], bsums: [i16; 16]`; `w = d * q` (the block
/// sums only speed up dot products and do not change the weights).
pub(super) fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (q, w) in b[4..260].iter().zip(y.iter_mut()) {
        *w = d * (*q as i8) as f32;
    }
}
