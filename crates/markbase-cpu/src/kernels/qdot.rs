//! Integer dot products of stored weight rows with 16-bit quantized activations
//! ([`QuantAct`]), for every quantized format, with an AVX2 path chosen at run time and a
//! portable twin. F32, F16 and BF16 weights are not handled here: they keep f32 activations
//! ([`super::dot`]).
//!
//! Results equal the reference — `dequantize_row` of the weights times the dequantized
//! activations `d · q`, summed exactly — up to f32 rounding: the products of integers are exact,
//! the scales are applied once per block in f32.
//!
//! [`QuantAct`]: super::act::QuantAct

use markbase_core::quant::GgmlType;

use super::act::ActRow;
use super::{portable_rows, Isa};

/// Whether [`qdot_rows`] handles `ty` (every block-quantized format).
pub fn supports(ty: GgmlType) -> bool {
    ty.block_size() > 1
}

/// `out[i] = x · (dequantized row i)` for the `out.len()` rows of `ty` at the start of `rows`,
/// each `ty.bytes_for(x.len())` bytes long, with the best kernels for this CPU.
///
/// # Panics
/// If `ty` is a float format, or `rows` is shorter than `out.len()` rows of `x.len()` weights
/// (caller bugs: model loading checks tensor shapes before any kernel runs).
pub fn qdot_rows(ty: GgmlType, rows: &[u8], x: ActRow, out: &mut [f32]) {
    qdot_rows_with(Isa::detect(), ty, rows, x, out)
}

/// [`qdot_rows`] with the kernels written for `isa` (portable ones if this CPU lacks `isa`);
/// for tests and benchmarks that compare the paths.
///
/// # Panics
/// As [`qdot_rows`].
pub fn qdot_rows_with(isa: Isa, ty: GgmlType, rows: &[u8], x: ActRow, out: &mut [f32]) {
    assert!(supports(ty), "qdot: {ty} is not a block-quantized format");
    let rb = match ty.bytes_for(x.len()) {
        Ok(rb) => rb,
        Err(e) => panic!("qdot: {e}"),
    };
    assert!(
        rows.len() >= rb * out.len(),
        "qdot: {} bytes hold fewer than {} {ty} rows of {} weights",
        rows.len(),
        out.len(),
        x.len()
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if Isa::detect() == Isa::Avx2 => {
            // SAFETY: AVX2, FMA and F16C were detected; sizes were checked above.
            unsafe { super::qdot_avx2::qdot_rows(ty, rows, rb, x, out) }
        }
        _ => portable_rows(ty, rows, rb, x, out),
    }
}
