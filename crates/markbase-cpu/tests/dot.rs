//! The dot kernels against their reference twin — `dequantize_row` then an f64 dot product —
//! on fresh random weights and activations for every format, several lengths, both kernel sets
//! (AVX2 where the CPU has it, and portable). Set MARKBASE_TEST_SEED to replay a failure.

use markbase_core::quant::{dequantize_row, GgmlType};
use markbase_cpu::kernels::dot::{dot_row, dot_row_with, dot_rows, dot_rows_with};
use markbase_cpu::kernels::Isa;

mod common;
use common::{kernel_sets, random_row};
use markbase_test_support::{seeded, uniform};

/// Relative tolerance against the sum of |w·x| terms: far above f32 summation error over a
/// few thousand terms (≈1e-6 worst case here), far below the effect of one wrong weight.
const REL_TOL: f64 = 1e-5;

/// Reference x · row in f64, and Σ|w·x| (the scale of rounding errors).
fn reference(ty: GgmlType, row: &[u8], x: &[f32]) -> (f64, f64) {
    let mut w = vec![0f32; x.len()];
    dequantize_row(ty, row, &mut w).unwrap();
    let dot = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
    let mag = w
        .iter()
        .zip(x)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum();
    (dot, mag)
}

fn lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 7, 8, 33, 640, 2048, 2051],
        32 => vec![32, 64, 96, 640, 2048, 2080],
        _ => vec![256, 512, 768, 2048],
    }
}

fn check(what: &str, seed: u64, got: f32, (want, mag): (f64, f64)) {
    let err = (got as f64 - want).abs();
    assert!(
        err <= REL_TOL * mag + 1e-30,
        "{what}: got {got}, reference {want} (error {err:e}, Σ|w·x| {mag:e}); seed {seed}"
    );
}

#[test]
fn dot_row_matches_reference_for_every_format() {
    let (seed, mut rng) = seeded("dot_row_matches_reference_for_every_format");
    for isa in kernel_sets() {
        for ty in GgmlType::ALL {
            for k in lengths(ty) {
                let row = random_row(ty, k, &mut rng);
                let x = uniform(&mut rng, k, 1.0);
                let got = dot_row_with(isa, ty, &row, &x);
                check(
                    &format!("{isa:?} {ty} k={k}"),
                    seed,
                    got,
                    reference(ty, &row, &x),
                );
            }
        }
    }
}

#[test]
fn dot_rows_matches_reference_for_every_format() {
    let (seed, mut rng) = seeded("dot_rows_matches_reference_for_every_format");
    for isa in kernel_sets() {
        for ty in GgmlType::ALL {
            for k in lengths(ty) {
                for n in [1, 3, 8] {
                    let row = random_row(ty, k, &mut rng);
                    let xs = uniform(&mut rng, n * k, 1.0);
                    let mut out = vec![f32::NAN; n];
                    dot_rows_with(isa, ty, &row, &xs, k, &mut out);
                    for (i, (o, x)) in out.iter().zip(xs.chunks_exact(k)).enumerate() {
                        let what = format!("{isa:?} {ty} k={k} n={n} row {i}");
                        check(&what, seed, *o, reference(ty, &row, x));
                    }
                }
            }
        }
    }
}

/// With one-hot activations every kernel must return the dequantized weight itself, bit for
/// bit: this checks the unpacking of every weight, exactly.
#[test]
fn one_hot_activations_recover_every_weight_exactly() {
    let (seed, mut rng) = seeded("one_hot_activations_recover_every_weight_exactly");
    for isa in kernel_sets() {
        for ty in GgmlType::ALL {
            let k = 256;
            let row = random_row(ty, k, &mut rng);
            let mut w = vec![0f32; k];
            dequantize_row(ty, &row, &mut w).unwrap();
            let mut xs = vec![0f32; k * k];
            for i in 0..k {
                xs[i * k + i] = 1.0;
            }
            let mut out = vec![f32::NAN; k];
            dot_rows_with(isa, ty, &row, &xs, k, &mut out);
            for i in 0..k {
                let single = dot_row_with(isa, ty, &row, &xs[i * k..(i + 1) * k]);
                assert!(
                    out[i] == w[i] && single == w[i],
                    "{isa:?} {ty} weight {i}: dot_rows {}, dot_row {single}, reference {}; seed {seed}",
                    out[i],
                    w[i]
                );
            }
        }
    }
}

#[test]
fn default_entry_points_use_a_tested_kernel_set() {
    let (seed, mut rng) = seeded("default_entry_points_use_a_tested_kernel_set");
    let ty = GgmlType::Q4_K;
    let row = random_row(ty, 512, &mut rng);
    let xs = uniform(&mut rng, 1024, 1.0);
    let mut out = [0f32; 2];
    dot_rows(ty, &row, &xs, 512, &mut out);
    let best = Isa::detect();
    assert_eq!(
        dot_row(ty, &row, &xs[..512]),
        dot_row_with(best, ty, &row, &xs[..512])
    );
    let mut again = [0f32; 2];
    dot_rows_with(best, ty, &row, &xs, 512, &mut again);
    assert_eq!(out, again, "seed {seed}");
}

#[test]
#[should_panic(expected = "Q4_K row of 256 weights is 144 bytes, got 143 bytes")]
fn dot_row_rejects_a_short_row() {
    dot_row(GgmlType::Q4_K, &[0u8; 143], &[0f32; 256]);
}

#[test]
#[should_panic(expected = "not a whole number of Q8_0 blocks")]
fn dot_row_rejects_a_partial_block() {
    dot_row(GgmlType::Q8_0, &[0u8; 34], &[0f32; 33]);
}

#[test]
#[should_panic(expected = "dot_rows: 100 activations are not 2 rows of 32")]
fn dot_rows_rejects_ragged_activations() {
    dot_rows(GgmlType::Q8_0, &[0u8; 34], &[0f32; 100], 32, &mut [0f32; 2]);
}
