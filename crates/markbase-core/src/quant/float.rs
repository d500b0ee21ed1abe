//! Plain float formats: F32, F16 and BF16, one weight per "block", little-endian.

use half::{bf16, f16};

/// Little-endian f32 values (any number of them).
pub(super) fn f32_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Little-endian IEEE half values (any number of them).
pub(super) fn f16_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

/// Little-endian bfloat16 values, the top half of an f32 (any number of them).
pub(super) fn bf16_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

/// The IEEE half stored little-endian at `b[i..i + 2]`, as f32.
pub(super) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}
