//! Random weight matrices and activations, the weights as a kernel dequantizes them, and the
//! comparisons of results: shared by the GPU tests (gpu_ops) and the kernel tests on the CPU
//! emulator (emu_kernels). Each binary uses its part. The random inputs and the comparisons
//! come from markbase-test-support (re-exported here); the models of the kernels' roundings
//! are this crate's own.
#![allow(dead_code)]

use std::sync::Arc;

use half::{bf16, f16};
use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use markbase_core::sampling::{distribution, pick, Draw};
use markbase_cpu::reference;
// Each binary uses only some of these, as with the functions below (`dead_code` above).
#[allow(unused_imports)]
pub use markbase_test_support::{
    assert_close, random_matrix, rel_err, rng, scale_offsets, uniform,
};

/// `v` rounded once to the nearest f16, ties to even, as an f16 `fma` rounds: `f16::from_f64`
/// may round through f32 first, and a value a hair above a tie between two f16s then lands on
/// the tie and goes to the even one (Q4_K's 13 · 2.4726563 − 0.0039043427 = 32.1406269… gave
/// 32.125, the kernel's fma 32.15625, found by the CPU emulator).
pub fn f16_nearest(v: f64) -> f16 {
    let c = f16::from_f64(v);
    if !c.is_finite() || v.is_nan() {
        return c;
    }
    let mut best = c;
    for bits in [c.to_bits().wrapping_sub(1), c.to_bits().wrapping_add(1)] {
        let n = f16::from_bits(bits);
        if !n.is_finite() {
            continue;
        }
        let (dn, db) = ((n.to_f64() - v).abs(), (best.to_f64() - v).abs());
        if dn < db || (dn == db && bits & 1 == 0) {
            best = n;
        }
    }
    best
}

/// A Q4_K or Q5_K matrix as the tensor-core kernels (mmq.cu, moe_mma.cu) dequantize it to f16:
/// each weight fma(q, S, −M) rounded once, S = f16(d · scale) and M = f16(dmin · min) each
/// rounded once (saturating at ±65 504). Checked against the reference's dequantization to
/// within those roundings.
pub fn k_quant_as_f16_fma(m: &HostMatrix) -> HostMatrix {
    let f16_sat = |v: f32| f16::from_f32(v.clamp(-65_504.0, 65_504.0));
    // Q5_K: 32 bytes of fifth bits (value l of chunk j at bit j of byte l) after the header.
    let (block, quants, top) = match m.ty {
        GgmlType::Q4_K => (144, 16, 15.0),
        GgmlType::Q5_K => (176, 48, 31.0),
        ty => panic!("{ty} is not Q4_K or Q5_K"),
    };
    let mut w = Vec::with_capacity(m.rows * m.cols);
    for b in m.bytes.as_slice().chunks_exact(block) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
        let sc = &b[4..16];
        for p in 0..256 {
            let (j, l) = (p / 64, p % 64);
            let chunk = 2 * j + l / 32;
            let (s, mn) = if chunk < 4 {
                (sc[chunk] & 63, sc[chunk + 4] & 63)
            } else {
                (
                    (sc[chunk + 4] & 15) | ((sc[chunk - 4] >> 6) << 4),
                    (sc[chunk + 4] >> 4) | ((sc[chunk] >> 6) << 4),
                )
            };
            let byte = b[quants + 32 * j + l % 32];
            let mut q = if l < 32 { byte & 15 } else { byte >> 4 };
            if m.ty == GgmlType::Q5_K {
                q |= ((b[16 + l % 32] >> chunk) & 1) << 4;
            }
            let s16 = f16_sat(d * f32::from(s)).to_f64();
            let m16 = f16_sat(dmin * f32::from(mn)).to_f64();
            w.push(f16_nearest(f64::from(q) * s16 - m16));
        }
    }
    let exact = reference::dequantize_matrix(m).unwrap();
    for (i, (a, e)) in w.iter().zip(&exact).enumerate() {
        let b = &m.bytes.as_slice()[block * (i / 256)..];
        let scale = f16::from_le_bytes([b[0], b[1]]).to_f32().abs() * 63.0 * top
            + f16::from_le_bytes([b[2], b[3]]).to_f32().abs() * 63.0;
        let err = (a.to_f32() - e).abs();
        assert!(
            err <= scale / 1024.0,
            "weight {i}: {a} as the kernel's f16, {e} dequantized"
        );
    }
    f16_like(m, "the tensor cores' f16", &w)
}

/// A Q6_K matrix as the tensor-core kernel (mmq.cu, `MmqQ6k`) dequantizes it to f16: each
/// weight (q − 32) · S rounded once, S = f16(d · scale) rounded once (saturating at ±65 504).
/// Checked against the reference's dequantization to within those roundings.
pub fn q6k_as_f16(m: &HostMatrix) -> HostMatrix {
    let mut w = Vec::with_capacity(m.rows * m.cols);
    for b in m.bytes.as_slice().chunks_exact(210) {
        let d = f16::from_le_bytes([b[208], b[209]]).to_f32();
        for i in 0..256 {
            let (n, k, l) = (i / 128, (i % 128) / 32, i % 32);
            let lo = (b[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            let hi = (b[128 + 32 * n + l] >> (2 * k)) & 3;
            let q = i32::from(lo | (hi << 4)) - 32;
            let scale = f32::from(b[192 + i / 16] as i8);
            let s = f16::from_f32((d * scale).clamp(-65_504.0, 65_504.0)).to_f64();
            w.push(f16::from_f64(f64::from(q) * s));
        }
    }
    let exact = reference::dequantize_matrix(m).unwrap();
    for (i, (a, e)) in w.iter().zip(&exact).enumerate() {
        let b = &m.bytes.as_slice()[210 * (i / 256)..];
        let bound = f16::from_le_bytes([b[208], b[209]]).to_f32().abs() * 128.0 * 32.0;
        assert!(
            (a.to_f32() - e).abs() <= bound / 1024.0,
            "weight {i}: {a} as the kernel's f16, {e} dequantized"
        );
    }
    f16_like(m, "the tensor cores' f16", &w)
}

/// An f16 matrix of `m`'s shape holding `w`, named `m` "as" `what`.
pub fn f16_like(m: &HostMatrix, what: &str, w: &[f16]) -> HostMatrix {
    HostMatrix {
        name: format!("{} as {what}", m.name),
        ty: GgmlType::F16,
        rows: m.rows,
        cols: m.cols,
        bytes: HostBytes::Owned(Arc::from(
            w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
        )),
    }
}

/// `m` dequantized by the reference, each weight rounded once to f16.
pub fn dequantized_as_f16(m: &HostMatrix) -> HostMatrix {
    let w: Vec<f16> = reference::dequantize_matrix(m)
        .unwrap()
        .into_iter()
        .map(f16::from_f32)
        .collect();
    f16_like(m, "f16", &w)
}

/// The largest error relative to the largest output a product of rows `k` wide may show: the
/// tensor cores add f32 sums with truncation (not to nearest), so their error grows with the
/// k16 steps, about k/16 · 2^-23 of the partial sums, which on random inputs may exceed the
/// largest output (fresh random inputs showed Q4_K [2 560, 10 240] at 7 tokens 2.9e-5,
/// session 32, and Q4_K [4 100, 2 560] at 2 tokens 2.6e-5, session 33).
pub fn product_tolerance(k: usize) -> f32 {
    4e-5 * (k as f32 / 2_560.0).max(1.0)
}

/// `x` as 16-bit activations: each 32 values integers times max|x| / 32767, to nearest.
pub fn as_16_bit(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|c| {
            let m = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            c.iter().map(move |&v| {
                if m > 0.0 {
                    (v * (32767.0 / m)).round_ties_even() * (m / 32767.0)
                } else {
                    0.0
                }
            })
        })
        .collect()
}

/// `x` rounded to the 16-bit type the tensor-core products of weights stored as `ty` read:
/// bf16 for bf16 weights, else f16 saturating at ±65 504.
pub fn round_16(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            if ty == GgmlType::BF16 {
                bf16::from_f32(v).to_f32()
            } else {
                f16::from_f32(v.clamp(-65_504.0, 65_504.0)).to_f32()
            }
        })
        .collect()
}

/// Whether `got` is the token `d` picks from `row` (`markbase_core::sampling::pick`, the host
/// twin) or, where the device sums in another order or in integers (a draw over every token:
/// slices, then their sums; rank order: weights in 2^-40 units), a token whose running-sum
/// interval in the host's order holds u · total to within 1e-5 of the total — under `d`, or
/// under `d` with top-p or min-p moved by 1e-5 of itself, where a limit that falls on a sum
/// (equal values) keeps one token more or less after rounding.
pub fn agrees_with_pick(row: &[f32], d: &Draw, got: u32) -> bool {
    let mut cand = Vec::new();
    if pick(d, &mut cand, row) == got {
        return true;
    }
    if d.temperature == 0.0 {
        return false;
    }
    let nudged = |top_p: f32, min_p: f32| Draw {
        top_p: top_p.min(1.0),
        min_p: min_p.min(1.0),
        ..*d
    };
    let (p, m) = (d.top_p, d.min_p);
    let near = [
        *d,
        nudged(p * (1.0 - 1e-5), m),
        nudged(p * (1.0 + 1e-5), m),
        nudged(p, m * (1.0 - 1e-5)),
        nudged(p, m * (1.0 + 1e-5)),
    ];
    near.iter().any(|d| within_rounding(row, d, got, &mut cand))
}

/// Whether u · total falls in `got`'s running-sum interval of `d`'s kept tokens, in the host's
/// order, to within 1e-5 of the total (summed in f64).
fn within_rounding(row: &[f32], d: &Draw, got: u32, cand: &mut Vec<(u32, f32)>) -> bool {
    let probs = distribution(d, cand, row);
    // In f64: the host's own f32 running sum drifts by more than the slack over a
    // 262 144-token row.
    let total: f64 = probs.iter().map(|c| c.1 as f64).sum();
    let (target, slack) = (d.u as f64 * total, 1e-5 * total);
    let mut acc = 0f64;
    for &(id, p) in probs {
        let lo = acc;
        acc += p as f64;
        if id == got {
            return target >= lo - slack && target <= acc + slack;
        }
    }
    false
}
