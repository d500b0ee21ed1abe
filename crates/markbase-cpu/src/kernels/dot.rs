//! Dot products of one stored weight row with f32 activations: [`dot_row`] for decoding (one
//! activation row), [`dot_rows`] for prefill (several activation rows, each block of the
//! weights dequantized once). Neither allocates.
//!
//! Results equal the reference — [`dequantize_row`] then an exact dot product — up to f32
//! rounding of the sums: the fast paths factor block scales out of sums and add in a different
//! order, so the last bits may differ.
//!
//! [`dequantize_row`]: markbase_core::quant::dequantize_row

use markbase_core::quant::GgmlType;

use super::{portable, Isa};

/// x · (dequantized `row`), with the best kernels for this CPU.
///
/// # Panics
/// If `row` does not hold exactly `x.len()` weights of type `ty` (a caller bug: model loading
/// checks tensor shapes before any kernel runs).
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    dot_row_with(Isa::detect(), ty, row, x)
}

/// [`dot_row`] with the kernels written for `isa` (portable ones if this CPU lacks `isa`);
/// for tests and benchmarks that compare the paths.
///
/// # Panics
/// As [`dot_row`].
pub fn dot_row_with(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    check_row(ty, row, x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2, FMA and F16C were detected; sizes were checked above.
            unsafe { super::avx2::dot_row(ty, row, x) }
        }
        _ => portable::dot_row(ty, row, x),
    }
}

/// `out[i] = xs[i*k..(i+1)*k] · (dequantized row)` for the `n = out.len()` row-major
/// activation rows of `xs`, with the best kernels for this CPU; each block is dequantized once.
///
/// # Panics
/// If `xs.len() != out.len() * k` or `row` does not hold exactly `k` weights of type `ty`.
pub fn dot_rows(ty: GgmlType, row: &[u8], xs: &[f32], k: usize, out: &mut [f32]) {
    dot_rows_with(Isa::detect(), ty, row, xs, k, out)
}

/// [`dot_rows`] with the kernels written for `isa` (portable ones if this CPU lacks `isa`).
///
/// # Panics
/// As [`dot_rows`].
pub fn dot_rows_with(isa: Isa, ty: GgmlType, row: &[u8], xs: &[f32], k: usize, out: &mut [f32]) {
    check_row(ty, row, k);
    assert!(
        xs.len() == out.len() * k,
        "dot_rows: {} activations are not {} rows of {k}",
        xs.len(),
        out.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2, FMA and F16C were detected; sizes were checked above.
            unsafe { super::avx2::dot_rows(ty, row, xs, k, out) }
        }
        _ => portable::dot_rows(ty, row, xs, k, out),
    }
}

/// Panics unless `row` holds exactly `k` weights of `ty`.
fn check_row(ty: GgmlType, row: &[u8], k: usize) {
    match ty.bytes_for(k) {
        Ok(need) if need == row.len() => {}
        Ok(need) => panic!(
            "dot: a {ty} row of {k} weights is {need} bytes, got {} bytes",
            row.len()
        ),
        Err(e) => panic!("dot: {e}"),
    }
}
