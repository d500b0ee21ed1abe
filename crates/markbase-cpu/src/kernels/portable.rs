//! Portable kernels: dequantize a chunk of the row with the reference code into a stack
//! buffer, then take plain f32 dot products (eight running sums, which compilers vectorise).

use markbase_core::quant::GgmlType;

use super::{chunks, dequantize_chunk, CHUNK};

/// x · row. The caller has checked that `row` holds exactly `x.len()` weights of `ty`.
pub(super) fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let mut buf = [0f32; CHUNK];
    let mut sum = 0f32;
    for (start, m, bytes) in chunks(ty, x.len()) {
        dequantize_chunk(ty, &row[bytes], &mut buf[..m]);
        sum += dot_f32(&buf[..m], &x[start..start + m]);
    }
    sum
}

/// `out[i] = xs[i*k..(i+1)*k] · row`, dequantizing each chunk of the row once.
/// The caller has checked the sizes.
pub(super) fn dot_rows(ty: GgmlType, row: &[u8], xs: &[f32], k: usize, out: &mut [f32]) {
    let mut buf = [0f32; CHUNK];
    out.fill(0.0);
    for (start, m, bytes) in chunks(ty, k) {
        dequantize_chunk(ty, &row[bytes], &mut buf[..m]);
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(k)) {
            *o += dot_f32(&buf[..m], &x[start..start + m]);
        }
    }
}

/// a · b over equal-length slices, with eight independent running sums.
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(p, q)| p * q)
        .sum();
    for (p, q) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += p[i] * q[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
