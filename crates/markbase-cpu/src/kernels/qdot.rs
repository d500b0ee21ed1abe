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
use super::{portable_gather, portable_rows, Isa};

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
    qdot_tokens(ty, rows, &[x], &mut [out])
}

/// [`qdot_rows`] with the kernels written for `isa` (portable ones if this CPU lacks `isa`);
/// for tests and benchmarks that compare the paths.
///
/// # Panics
/// As [`qdot_rows`].
pub fn qdot_rows_with(isa: Isa, ty: GgmlType, rows: &[u8], x: ActRow, out: &mut [f32]) {
    qdot_tokens_with(isa, ty, rows, &[x], &mut [out])
}

/// `outs[t][i] = xs[t] · (dequantized row i)` for several tokens at once: each weight block
/// is unpacked once for a group of tokens, so `n` tokens cost far less than `n` calls of
/// [`qdot_rows`]. Every token's result equals what [`qdot_rows`] gives it alone (bit for bit:
/// the same operations in the same order). All `outs` have the same length, the row count.
///
/// # Panics
/// As [`qdot_rows`], or if `xs` and `outs` differ in length, the rows of `xs` in length, or
/// the slices of `outs` in length.
pub fn qdot_tokens(ty: GgmlType, rows: &[u8], xs: &[ActRow], outs: &mut [&mut [f32]]) {
    qdot_tokens_with(Isa::detect(), ty, rows, xs, outs)
}

/// [`qdot_tokens`] with the kernels written for `isa` (portable ones if this CPU lacks
/// `isa`).
///
/// # Panics
/// As [`qdot_tokens`].
pub fn qdot_tokens_with(
    isa: Isa,
    ty: GgmlType,
    rows: &[u8],
    xs: &[ActRow],
    outs: &mut [&mut [f32]],
) {
    assert!(supports(ty), "qdot: {ty} is not a block-quantized format");
    assert_eq!(
        xs.len(),
        outs.len(),
        "qdot: activation rows and outputs differ"
    );
    let (Some(x0), Some(o0)) = (xs.first(), outs.first()) else {
        return;
    };
    let (k, nrows) = (x0.len(), o0.len());
    assert!(
        xs.iter().all(|x| x.len() == k) && outs.iter().all(|o| o.len() == nrows),
        "qdot: activation rows or outputs of different lengths"
    );
    let rb = match ty.bytes_for(k) {
        Ok(rb) => rb,
        Err(e) => panic!("qdot: {e}"),
    };
    assert!(
        rows.len() >= rb * nrows,
        "qdot: {} bytes hold fewer than {nrows} {ty} rows of {k} weights",
        rows.len(),
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2, FMA and F16C were detected; sizes were checked above.
            unsafe { super::qdot_avx2::qdot_rows(ty, rows, rb, xs, outs) }
        }
        _ => {
            for (x, out) in xs.iter().zip(outs.iter_mut()) {
                portable_rows(ty, rows, rb, *x, out)
            }
        }
    }
}

/// `out[j] = x · (dequantized row index[j])` for rows of `ty` stored one after the other in
/// `rows` (each `ty.bytes_for(x.len())` bytes), with the best kernels for this CPU: a few
/// scattered rows (the LM head's leaders) without a call per row. Each result equals what
/// [`qdot_rows`] gives that row (the same operations in the same order).
///
/// # Panics
/// If `ty` is a float format, `index` and `out` differ in length, or an index is not a row of
/// `rows` (caller bugs).
pub fn qdot_gather(ty: GgmlType, rows: &[u8], index: &[u32], x: ActRow, out: &mut [f32]) {
    qdot_gather_with(Isa::detect(), ty, rows, index, x, out)
}

/// [`qdot_gather`] with the kernels written for `isa` (portable ones if this CPU lacks it).
///
/// # Panics
/// As [`qdot_gather`].
pub fn qdot_gather_with(
    isa: Isa,
    ty: GgmlType,
    rows: &[u8],
    index: &[u32],
    x: ActRow,
    out: &mut [f32],
) {
    assert!(supports(ty), "qdot: {ty} is not a block-quantized format");
    assert_eq!(
        index.len(),
        out.len(),
        "qdot: row indices and outputs differ"
    );
    let rb = match ty.bytes_for(x.len()) {
        Ok(rb) => rb,
        Err(e) => panic!("qdot: {e}"),
    };
    let stored = rows.len() / rb.max(1);
    assert!(
        index.iter().all(|&r| (r as usize) < stored),
        "qdot: a row index is not below the {stored} stored rows"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        _ if isa.runs_avx2() => {
            // SAFETY: AVX2, FMA and F16C were detected; every index was checked above.
            unsafe { super::qdot_avx2::qdot_gather(ty, rows, rb, index, x, out) }
        }
        _ => portable_gather(ty, rows, rb, index, x, out),
    }
}
