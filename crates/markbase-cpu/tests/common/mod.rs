//! Helpers shared by the kernel tests: random weight rows of every format with widely spread
//! scales, and the kernel sets this CPU can run (seeds, uniform activations and the scale
//! fields' offsets come from markbase-test-support).
#![allow(dead_code)]

use markbase_core::quant::GgmlType;
use markbase_cpu::kernels::Isa;
use markbase_test_support::scale_offsets;
use rand::rngs::StdRng;
use rand::Rng;

/// A finite f16 of random sign and magnitude 2^-14 … 2^3, as bits.
pub fn moderate_f16(rng: &mut StdRng) -> [u8; 2] {
    let sign = rng.random_range(0..2u16) << 15;
    let exp = rng.random_range(1..=18u16) << 10;
    (sign | exp | rng.random_range(0..1024u16)).to_le_bytes()
}

/// A random row of `k` weights: random bytes with finite, moderate scales.
pub fn random_row(ty: GgmlType, k: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut row = vec![0u8; ty.bytes_for(k).unwrap()];
    match ty {
        GgmlType::F32 => {
            for b in row.chunks_exact_mut(4) {
                b.copy_from_slice(&rng.random_range(-4.0f32..4.0).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for b in row.chunks_exact_mut(2) {
                b.copy_from_slice(&moderate_f16(rng));
            }
        }
        GgmlType::BF16 => {
            for b in row.chunks_exact_mut(2) {
                let exp = rng.random_range(117..=130u16) << 7;
                let bits = (rng.random_range(0..2u16) << 15) | exp | rng.random_range(0..128u16);
                b.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut row[..]);
            for block in row.chunks_exact_mut(ty.type_size()) {
                for &off in scale_offsets(ty) {
                    block[off..off + 2].copy_from_slice(&moderate_f16(rng));
                }
                if ty == GgmlType::Q8_K {
                    block[..4].copy_from_slice(&rng.random_range(-0.1f32..0.1).to_le_bytes());
                }
            }
        }
    }
    row
}

/// The kernel sets to test: portable always, AVX2 and AVX-512 where this CPU has them.
pub fn kernel_sets() -> Vec<Isa> {
    let sets: Vec<Isa> = [Isa::Portable, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|isa| isa.available())
        .collect();
    if sets.len() < 3 {
        eprintln!("this CPU runs only {sets:?}: the other kernel sets are not tested");
    }
    sets
}
