//! The 32-weight legacy formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, laid out as in ggml.
//!
//! Each block starts with an f16 scale `d` (and, for `_1` formats, an f16 offset `m`).
//! 4-bit values are packed two to a byte: byte `j` holds weight `j` in its low nibble and weight
//! `j + 16` in its high nibble. 5-bit formats keep the fifth bits in a little-endian u32 `qh`
//! whose bit `j` belongs to weight `j`.

use super::float::f16_at;

/// Q4_0 block (18 bytes): `d: f16, qs: [u8; 16]`; `w = (q - 8) * d`.
pub(super) fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for ((q, y0), y1) in b[2..18].iter().zip(lo).zip(hi) {
        *y0 = ((q & 0x0F) as i32 - 8) as f32 * d;
        *y1 = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1 block (20 bytes): `d: f16, m: f16, qs: [u8; 16]`; `w = q * d + m`.
pub(super) fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let (lo, hi) = y.split_at_mut(16);
    for ((q, y0), y1) in b[4..20].iter().zip(lo).zip(hi) {
        *y0 = (q & 0x0F) as f32 * d + m;
        *y1 = (q >> 4) as f32 * d + m;
    }
}

/// Q5_0 block (22 bytes): `d: f16, qh: u32, qs: [u8; 16]`; `w = (q - 16) * d`.
pub(super) fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let (lo, hi) = y.split_at_mut(16);
    for (j, ((q, y0), y1)) in b[6..22].iter().zip(lo).zip(hi).enumerate() {
        let (q0, q1) = five_bit_pair(*q, qh, j);
        *y0 = (q0 as i32 - 16) as f32 * d;
        *y1 = (q1 as i32 - 16) as f32 * d;
    }
}

/// Q5_1 block (24 bytes): `d: f16, m: f16, qh: u32, qs: [u8; 16]`; `w = q * d + m`.
pub(super) fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let (lo, hi) = y.split_at_mut(16);
    for (j, ((q, y0), y1)) in b[8..24].iter().zip(lo).zip(hi).enumerate() {
        let (q0, q1) = five_bit_pair(*q, qh, j);
        *y0 = q0 as f32 * d + m;
        *y1 = q1 as f32 * d + m;
    }
}

/// Q8_0 block (34 bytes): `d: f16, qs: [i8; 32]`; `w = q * d`.
pub(super) fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (q, w) in b[2..34].iter().zip(y.iter_mut()) {
        *w = (*q as i8) as f32 * d;
    }
}

/// The 5-bit values of weights `j` and `j + 16` from packed byte `q` and high bits `qh`.
fn five_bit_pair(q: u8, qh: u32, j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) & 1) as u8;
    let h1 = ((qh >> (j + 16)) & 1) as u8;
    ((q & 0x0F) | (h0 << 4), (q >> 4) | (h1 << 4))
}
