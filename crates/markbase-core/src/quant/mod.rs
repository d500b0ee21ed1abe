//! Weight storage formats: the ggml type ids, their block layouts, and reference dequantization.
//!
//! Every format is a sequence of blocks; a block holds `block_size()` weights in `type_size()`
//! bytes. Rows of a matrix are whole numbers of blocks.

use crate::{Error, Result};

mod float;
mod kquants;
mod legacy;
mod quantize;

pub use kquants::{k_scale_min, q3_k_scales};
pub use quantize::{quantize_row, QUANTIZABLE};

/// A ggml tensor type, numbered as in the GGUF file format.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 weights: f16 scale + 4-bit values.
    Q4_0,
    /// 32 weights: f16 scale and min + 4-bit values.
    Q4_1,
    /// 32 weights: f16 scale + 5-bit values.
    Q5_0,
    /// 32 weights: f16 scale and min + 5-bit values.
    Q5_1,
    /// 32 weights: f16 scale + 8-bit values.
    Q8_0,
    /// 256-weight super-block, 2-bit.
    Q2_K,
    /// 256-weight super-block, 3-bit.
    Q3_K,
    /// 256-weight super-block, 4-bit.
    Q4_K,
    /// 256-weight super-block, 5-bit.
    Q5_K,
    /// 256-weight super-block, 6-bit.
    Q6_K,
    /// 256-weight super-block, 8-bit (used for activations).
    Q8_K,
}

impl GgmlType {
    /// All types MarkBase can read as weights.
    pub const SUPPORTED: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// Every type with a block layout here: the weight types plus Q8_K (activations).
    pub const ALL: [GgmlType; 14] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];

    /// The type with GGUF id `id`, or an error naming the id (and ggml's name for it, if known).
    pub fn from_id(id: u32) -> Result<Self> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            other => {
                let name = match other {
                    9 => "Q8_1",
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    20 => "IQ4_NL",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    23 => "IQ4_XS",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => "unknown",
                };
                return Err(Error::Unsupported(format!(
                    "tensor type {name} (ggml type id {other})"
                )));
            }
        })
    }

    /// The GGUF id of this type.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// ggml's name for the type (e.g. `Q4_K`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
        }
    }

    /// Bytes taken by `n` consecutive weights (`n` must be a multiple of the block size).
    pub fn bytes_for(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(Error::Format(format!(
                "{n} weights is not a whole number of {} blocks of {}",
                self.name(),
                self.block_size()
            )));
        }
        Ok(n / self.block_size() * self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reference dequantization of `dst.len()` consecutive weights stored as `ty` in `src`.
///
/// Plain scalar code that follows ggml's block layouts and its order of float operations, so
/// results are bit-identical to ggml's (and gguf-py's) dequantization. `src.len()` must be
/// exactly `ty.bytes_for(dst.len())`; otherwise a [`Error::Format`] names both sizes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = ty.bytes_for(dst.len())?;
    if src.len() != need {
        return Err(Error::Format(format!(
            "{ty} data for {} weights must be {need} bytes, got {} bytes",
            dst.len(),
            src.len()
        )));
    }
    let convert = converter(ty);
    if ty.block_size() == 1 {
        convert(src, dst);
    } else {
        let blocks = src.chunks_exact(ty.type_size());
        for (block, out) in blocks.zip(dst.chunks_exact_mut(ty.block_size())) {
            convert(block, out);
        }
    }
    Ok(())
}

/// The reference converter of `ty`: for a block format it dequantizes one block
/// (`ty.type_size()` bytes in, `ty.block_size()` weights out); for a float format it converts
/// any number of values.
fn converter(ty: GgmlType) -> fn(&[u8], &mut [f32]) {
    match ty {
        GgmlType::F32 => float::f32_row,
        GgmlType::F16 => float::f16_row,
        GgmlType::BF16 => float::bf16_row,
        GgmlType::Q4_0 => legacy::q4_0,
        GgmlType::Q4_1 => legacy::q4_1,
        GgmlType::Q5_0 => legacy::q5_0,
        GgmlType::Q5_1 => legacy::q5_1,
        GgmlType::Q8_0 => legacy::q8_0,
        GgmlType::Q2_K => kquants::q2_k,
        GgmlType::Q3_K => kquants::q3_k,
        GgmlType::Q4_K => kquants::q4_k,
        GgmlType::Q5_K => kquants::q5_k,
        GgmlType::Q6_K => kquants::q6_k,
        GgmlType::Q8_K => kquants::q8_k,
    }
}
