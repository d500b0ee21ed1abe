//! Random inputs and result comparisons shared by the tests and benchmarks of the MarkBase
//! crates: a seeded generator that prints its seed, uniform values, random weight matrices of
//! every format, and the relative-error check the kernel tests use.

use std::sync::Arc;

use half::{bf16, f16};
use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// The seed of a test run and its generator: `MARKBASE_TEST_SEED` when it is set to an integer
/// (to replay a failure), else a fresh one (the clock's nanoseconds). The seed is printed on
/// stderr as `TEST: seed N`, so a failing run shows what replays it.
pub fn seeded(test: &str) -> (u64, StdRng) {
    let seed = std::env::var("MARKBASE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: seed {seed}");
    (seed, StdRng::seed_from_u64(seed))
}

/// The generator of [`seeded`], for a test that does not name its seed in its messages.
pub fn rng(test: &str) -> StdRng {
    seeded(test).1
}

/// `n` values uniform in `[-amp, amp)`.
pub fn uniform(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-amp..amp)).collect()
}

/// `max |got − want| / max |want|`; NaN anywhere fails.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        if d.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(d);
    }
    worst / scale
}

/// Panics, naming `what` and the element farthest off, unless `rel_err(got, want) <= tol`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let e = rel_err(got, want);
    if e <= tol {
        return;
    }
    let i = worst_at(got, want);
    panic!(
        "{what}: relative error {e:e} > {tol:e} (worst [{i}]: {} vs {})",
        got[i], want[i]
    );
}

/// The index of the largest `|got − want|` (a NaN difference counts as the largest).
fn worst_at(got: &[f32], want: &[f32]) -> usize {
    let d = |i: usize| {
        let d = (got[i] - want[i]).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            d
        }
    };
    (0..got.len()).fold(0, |w, i| if d(i) > d(w) { i } else { w })
}

/// Offsets of the f16 scale fields inside one block of `ty` (set to sane values; every other
/// byte of a quantized block is random).
pub fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// A random `[rows, cols]` matrix stored as `ty`: F32, F16 and BF16 values uniform in ±1;
/// quantized blocks of random bytes with their f16 scales ([`scale_offsets`]) uniform in ±0.05.
pub fn random_matrix(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let n = rows * cols;
    let bytes: Vec<u8> = match ty {
        GgmlType::F32 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => {
            let mut b = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
            r.fill_bytes(&mut b);
            for block in b.chunks_exact_mut(ty.type_size()) {
                for &o in scale_offsets(ty) {
                    let d = f16::from_f32(r.random_range(-0.05f32..0.05));
                    block[o..o + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
            b
        }
    };
    HostMatrix {
        name: format!("random {ty} [{rows}, {cols}]"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_is_relative_to_the_largest_wanted_value_and_fails_on_nan() {
        assert_eq!(rel_err(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_err(&[f32::NAN], &[1.0]), f32::INFINITY);
        assert_eq!(rel_err(&[1.0], &[f32::NAN]), f32::INFINITY);
    }

    #[test]
    #[should_panic(expected = "x: relative error 2.5e-1 > 1e-1 (worst [1]: 2.5 vs 2)")]
    fn assert_close_names_the_worst_element() {
        assert_close("x", &[1.0, 2.5, 1.9], &[1.0, 2.0, 2.0], 0.1);
    }

    #[test]
    fn random_matrix_has_the_shape_and_finite_scales() {
        let mut r = StdRng::seed_from_u64(1);
        for ty in GgmlType::SUPPORTED {
            let m = random_matrix(&mut r, ty, 3, 256);
            m.check().unwrap();
            let block = ty.type_size();
            for b in m.bytes.as_slice().chunks_exact(block) {
                for &o in scale_offsets(ty) {
                    let d = f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
                    assert!(d.abs() <= 0.05, "{ty} scale {d}");
                }
            }
        }
    }
}
