//! Quantized-weight kernels, each with an AVX2+FMA path chosen at run time and a portable
//! twin: dot products of stored weight rows (any [`GgmlType`]) with f32 activations ([`dot`])
//! or with 16-bit quantized activations ([`act`], [`qdot`]), and the LM head's screening pass:
//! a 4-bit row-scaled copy ([`screen_copy`]) against byte activations ([`screen`]).
//!
//! [`GgmlType`]: markbase_core::quant::GgmlType

/// Runs `$body` with the constant `$N` equal to the run-time token-group size `$n`, one of the
/// listed sizes: the one place where a group size becomes a kernel's const generic.
#[cfg(target_arch = "x86_64")]
macro_rules! for_group_size {
    ($n:expr; $($k:literal),+; $N:ident => $body:expr) => {
        match $n {
            $($k => {
                const $N: usize = $k;
                $body
            })+
            n => unreachable!("no kernel for a group of {n} tokens"),
        }
    };
}

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod dot;
pub mod gemm;
mod portable;
pub mod qdot;
#[cfg(target_arch = "x86_64")]
mod qdot_avx2;
mod qdot_portable;
pub mod screen;
pub mod screen_copy;
pub mod vmath;

use qdot_portable::{qdot_gather as portable_gather, qdot_rows as portable_rows};

use std::ops::Range;
use std::sync::OnceLock;

use markbase_core::quant::{dequantize_row, GgmlType};

/// The instruction sets the kernels are written for, each a superset of the ones before it.
/// A kernel without code for a set runs the code of the largest set below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// [`Isa::Avx2`] plus AVX-512 F (32 registers of 512 bits).
    Avx512,
}

impl Isa {
    /// The best instruction set of this CPU (detected once, then cached).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            [Isa::Avx512, Isa::Avx2]
                .into_iter()
                .find(|isa| isa.available())
                .unwrap_or(Isa::Portable)
        })
    }

    /// Whether this CPU can run kernels written for `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2.available() && is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// Whether kernels asked to use `self` run their AVX2 code here: `self` includes AVX2 and
    /// this CPU has it.
    pub fn runs_avx2(self) -> bool {
        self >= Isa::Avx2 && Isa::Avx2.available()
    }

    /// Whether kernels asked to use `self` run their AVX-512 code here.
    pub fn runs_avx512(self) -> bool {
        self >= Isa::Avx512 && Isa::Avx512.available()
    }
}

/// Weights handled per step by the chunked kernels: a multiple of every block size.
const CHUNK: usize = 256;

/// The chunks of a row of `k` weights of `ty`: (first weight, weight count, byte range).
fn chunks(ty: GgmlType, k: usize) -> impl Iterator<Item = (usize, usize, Range<usize>)> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    (0..k).step_by(CHUNK).map(move |start| {
        let m = (k - start).min(CHUNK);
        (start, m, start / bs * ts..(start + m) / bs * ts)
    })
}

/// Reference dequantization of a chunk whose sizes this module computed (whole blocks).
fn dequantize_chunk(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    dequantize_row(ty, src, dst).expect("chunks are whole blocks of matching size");
}

/// f32 value of every IEEE half bit pattern (256 KiB, built on first use): converting a block
/// scale becomes one load in the integer dot kernels.
fn f16_table() -> &'static [f32] {
    static TABLE: OnceLock<Box<[f32]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect()
    })
}

/// Dequantizes the whole blocks of `ty` in `src` into `dst` (matching sizes, checked by the
/// caller), bit-identical to the reference, with the AVX2 block decoders where this CPU has
/// them.
fn dequantize_row_fast(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().runs_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected; the caller matched the sizes.
        unsafe { avx2::dequantize(ty, src, dst) };
        return;
    }
    dequantize_chunk(ty, src, dst);
}
