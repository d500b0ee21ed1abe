//! Reference quantization of f32 weights into the 32-weight legacy formats (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0), bit-identical to ggml's reference quantizers (and gguf-py's): the same f32
//! operations in the same order, no fused multiply-adds.
//!
//! Used at load time to repack a matrix into a smaller format (e.g. a large LM head).

use half::f16;

use super::GgmlType;
use crate::{Error, Result};

/// Formats [`quantize_row`] can produce.
pub const QUANTIZABLE: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

/// Quantizes `src` (a whole number of 32-weight blocks) into `dst` as `ty`.
///
/// `dst.len()` must be exactly `ty.bytes_for(src.len())`; formats other than
/// [`QUANTIZABLE`] give [`Error::Unsupported`].
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let block: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        _ => return Err(Error::Unsupported(format!("quantizing to {ty}"))),
    };
    let need = ty.bytes_for(src.len())?;
    if dst.len() != need {
        return Err(Error::Format(format!(
            "{ty} data for {} weights must be {need} bytes, got {} bytes",
            src.len(),
            dst.len()
        )));
    }
    for (x, b) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(ty.type_size()))
    {
        block(x, b);
    }
    Ok(())
}

/// The value of largest magnitude (the first one on ties), sign kept.
fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// `1 / d`, or 0 for a zero scale.
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Stores an f16 at `b[at..at + 2]`.
fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Packs 32 values < 16 two per byte: weight `j` low nibble, weight `j + 16` high nibble.
fn pack_nibbles(q: &[u8; 32], out: &mut [u8]) {
    for j in 0..16 {
        out[j] = (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4);
    }
}

/// The fifth bits of 32 values < 32 as a little-endian u32 (bit `j` = weight `j`).
fn fifth_bits(q: &[u8; 32]) -> [u8; 4] {
    let qh = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (j, &v)| h | (u32::from(v >> 4) << j));
    qh.to_le_bytes()
}

/// Symmetric levels: `q = min(top, trunc(x / d + offset + 0.5))` with `d = max / -offset`.
fn symmetric(x: &[f32], offset: f32, top: u8) -> (f32, [u8; 32]) {
    let d = signed_absmax(x) / -offset;
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id + (offset + 0.5)).trunc().clamp(0.0, top as f32) as u8;
    }
    (d, q)
}

/// Asymmetric levels: `q = min(top, trunc((x − min) / d + 0.5))` with `d = (max − min) / top`.
fn asymmetric(x: &[f32], top: u8) -> (f32, f32, [u8; 32]) {
    let min = x.iter().copied().fold(f32::INFINITY, f32::min);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / top as f32;
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((v - min) * id + 0.5).trunc().clamp(0.0, top as f32) as u8;
    }
    (d, min, q)
}

/// Q4_0: `d: f16, qs: [u8; 16]`.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let (d, q) = symmetric(x, 8.0, 15);
    put_f16(b, 0, d);
    pack_nibbles(&q, &mut b[2..18]);
}

/// Q4_1: `d: f16, m: f16, qs: [u8; 16]`.
fn q4_1(x: &[f32], b: &mut [u8]) {
    let (d, m, q) = asymmetric(x, 15);
    put_f16(b, 0, d);
    put_f16(b, 2, m);
    pack_nibbles(&q, &mut b[4..20]);
}

/// Q5_0: `d: f16, qh: u32, qs: [u8; 16]`.
fn q5_0(x: &[f32], b: &mut [u8]) {
    let (d, q) = symmetric(x, 16.0, 31);
    put_f16(b, 0, d);
    b[2..6].copy_from_slice(&fifth_bits(&q));
    pack_nibbles(&q, &mut b[6..22]);
}

/// Q5_1: `d: f16, m: f16, qh: u32, qs: [u8; 16]`.
fn q5_1(x: &[f32], b: &mut [u8]) {
    let (d, m, q) = asymmetric(x, 31);
    put_f16(b, 0, d);
    put_f16(b, 2, m);
    b[4..8].copy_from_slice(&fifth_bits(&q));
    pack_nibbles(&q, &mut b[8..24]);
}

/// Q8_0: `d: f16, qs: [i8; 32]`, rounding half away from zero.
fn q8_0(x: &[f32], b: &mut [u8]) {
    let d = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
    let id = inverse(d);
    put_f16(b, 0, d);
    for (o, &v) in b[2..34].iter_mut().zip(x) {
        *o = ((v * id).round() as i8) as u8;
    }
}
