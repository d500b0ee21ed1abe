//! The integer dot kernels (16-bit quantized activations) against their reference twin —
//! `dequantize_row` of the weights times the dequantized activations, summed in f64 — on fresh
//! random weights and activations for every block-quantized format, several lengths and row
//! counts, both kernel sets. Set MARKBASE_TEST_SEED to replay a failure.

use markbase_core::quant::{dequantize_row, GgmlType};
use markbase_cpu::kernels::act::{ActRow, QuantAct};
use markbase_cpu::kernels::qdot::{
    qdot_gather_with, qdot_rows, qdot_rows_with, qdot_tokens_with, supports,
};
use markbase_cpu::kernels::Isa;
use rand::rngs::StdRng;
use rand::Rng;

mod common;
use common::{kernel_sets, random_row};
use markbase_test_support::seeded;

/// Relative tolerance against Σ_i M_i·|x_i|, M_i the largest |weight| of weight i's 32-block.
/// The kernels round only when scaling a block's exact integer sum (and its minimum term) to
/// f32 and adding blocks up: each such term is at most ~3·M·Σ|x| of its block (the scale and
/// minimum parts of a weight are each bounded by the block's largest weight times 3), so the
/// error is a few f32 ulps (6e-8) of this sum times the number of blocks' summation depth —
/// far below 1e-5. One wrong weight moves the result by about M·|x_i|, i.e. 1/k of the sum,
/// well above 1e-5 for every k tested (≤ 2080).
const REL_TOL: f64 = 1e-5;

fn quantized_formats() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|&t| supports(t))
}

/// Activations with a wide spread of magnitudes between blocks, some all-zero blocks.
fn random_acts(n: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut x = vec![0f32; n];
    for b in x.chunks_mut(32) {
        let scale = match rng.random_range(0..8) {
            0 => 0.0,
            1 => 1e-3,
            2 => 50.0,
            _ => 1.0,
        };
        for v in b {
            *v = rng.random_range(-1.0f32..1.0) * scale;
        }
    }
    x
}

/// Reference x · row in f64 and the error scale Σ_i M_i·|x_i|.
fn reference(ty: GgmlType, row: &[u8], x: ActRow) -> (f64, f64) {
    let k = x.len();
    let mut w = vec![0f32; k];
    dequantize_row(ty, row, &mut w).unwrap();
    let xd = x.dequantize();
    let dot = w.iter().zip(&xd).map(|(a, b)| *a as f64 * b).sum();
    let mut mag = 0f64;
    for (wb, xb) in w.chunks(32).zip(xd.chunks(32)) {
        let m = wb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        mag += m * xb.iter().map(|v| v.abs()).sum::<f64>();
    }
    (dot, mag)
}

fn lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        32 => vec![32, 64, 96, 640, 2080],
        _ => vec![256, 512, 768, 2048],
    }
}

#[test]
fn qdot_matches_reference_for_every_format() {
    let (seed, mut rng) = seeded("qdot_matches_reference_for_every_format");
    for isa in kernel_sets() {
        for ty in quantized_formats() {
            for k in lengths(ty) {
                let rows = [1, 3, 7][rng.random_range(0..3)];
                let bytes: Vec<u8> = (0..rows)
                    .flat_map(|_| random_row(ty, k, &mut rng))
                    .collect();
                let mut act = QuantAct::new();
                act.quantize(&random_acts(k, &mut rng), 1, k);
                let x = act.row(0);
                let mut out = vec![f32::NAN; rows];
                qdot_rows_with(isa, ty, &bytes, x, &mut out);
                let rb = bytes.len() / rows;
                for (r, got) in out.iter().enumerate() {
                    let (want, mag) = reference(ty, &bytes[r * rb..(r + 1) * rb], x);
                    let err = (*got as f64 - want).abs();
                    assert!(
                        err <= REL_TOL * mag + 1e-30,
                        "{isa:?} {ty} k={k} row {r}: got {got}, reference {want} \
                         (error {err:e}, scale {mag:e}); seed {seed}"
                    );
                }
            }
        }
    }
}

/// Several tokens at once (groups of up to eight tokens share each legacy weight block, up to
/// four each K super-block; 2–19 tokens, so full groups and remainders): every token's result
/// matches the reference and equals, bit for bit, what the single-token call gives it.
#[test]
fn multi_token_matches_reference_and_single_token() {
    let (seed, mut rng) = seeded("multi_token_matches_reference_and_single_token");
    for isa in kernel_sets() {
        for ty in quantized_formats() {
            let k = lengths(ty)[rng.random_range(0..2)];
            let rows = rng.random_range(1..12);
            let n = rng.random_range(2..20);
            let bytes: Vec<u8> = (0..rows)
                .flat_map(|_| random_row(ty, k, &mut rng))
                .collect();
            let mut act = QuantAct::new();
            act.quantize(&random_acts(n * k, &mut rng), n, k);
            let xs: Vec<ActRow> = (0..act.rows()).map(|t| act.row(t)).collect();
            let mut out = vec![f32::NAN; n * rows];
            let mut outs: Vec<&mut [f32]> = out.chunks_mut(rows).collect();
            qdot_tokens_with(isa, ty, &bytes, &xs, &mut outs);
            let rb = bytes.len() / rows;
            for (t, x) in xs.iter().enumerate() {
                let mut alone = vec![f32::NAN; rows];
                qdot_rows_with(isa, ty, &bytes, *x, &mut alone);
                for r in 0..rows {
                    let got = out[t * rows + r];
                    let (want, mag) = reference(ty, &bytes[r * rb..(r + 1) * rb], *x);
                    let err = (got as f64 - want).abs();
                    assert!(
                        err <= REL_TOL * mag + 1e-30,
                        "{isa:?} {ty} k={k} n={n} token {t} row {r}: got {got}, reference \
                         {want} (error {err:e}, scale {mag:e}); seed {seed}"
                    );
                    assert_eq!(
                        got.to_bits(),
                        alone[r].to_bits(),
                        "{isa:?} {ty} k={k} n={n} token {t} row {r}: batched {got} vs alone {}; \
                         seed {seed}",
                        alone[r]
                    );
                }
            }
        }
    }
}

/// With a one-hot activation each kernel returns one weight times the activation: this pins
/// the unpacking of every weight position of a super-block.
#[test]
fn one_hot_activations_recover_every_weight() {
    let (seed, mut rng) = seeded("one_hot_activations_recover_every_weight");
    for isa in kernel_sets() {
        for ty in quantized_formats() {
            let k = 256;
            let row = random_row(ty, k, &mut rng);
            let mut w = vec![0f32; k];
            dequantize_row(ty, &row, &mut w).unwrap();
            let wmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let mut act = QuantAct::new();
            for i in 0..k {
                let mut x = vec![0f32; k];
                x[i] = 1.0;
                act.quantize(&x, 1, k);
                let mut out = [f32::NAN];
                qdot_rows_with(isa, ty, &row, act.row(0), &mut out);
                let want = w[i] as f64 * act.row(0).dequantize()[i];
                assert!(
                    (out[0] as f64 - want).abs() <= 1e-6 * wmax as f64,
                    "{isa:?} {ty} weight {i}: {} vs {want}; seed {seed}",
                    out[0]
                );
            }
        }
    }
}

#[test]
fn quantized_activations_are_within_half_a_step() {
    let (seed, mut rng) = seeded("quantized_activations_are_within_half_a_step");
    let (n, k) = (3, 96);
    let x = random_acts(n * k, &mut rng);
    let mut act = QuantAct::new();
    act.quantize(&random_acts(4 * 2048, &mut rng), 4, 2048);
    act.quantize(&x, n, k);
    assert_eq!(act.rows(), n);
    for t in 0..n {
        let r = act.row(t);
        assert_eq!(
            (r.q.len(), r.d.len(), r.s32.len(), r.s16.len()),
            (k, 3, 3, 6)
        );
        for (b, xb) in x[t * k..(t + 1) * k].chunks(32).enumerate() {
            let qb: Vec<i16> = (0..32).map(|l| r.at(32 * b + l)).collect();
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(r.d[b], amax / 32767.0, "seed {seed}");
            assert!(qb.iter().all(|&q| q != i16::MIN));
            if amax > 0.0 {
                assert_eq!(qb.iter().map(|q| q.abs()).max(), Some(32767), "seed {seed}");
            }
            for (q, v) in qb.iter().zip(xb) {
                // Half a step, plus three f32 roundings of up to 2^-24 relative at a level of up
                // to 32767 (0.002 of a step each): 32767 / amax and v times it in the
                // quantizer, and d = amax / 32767 here (seed 1796580815596652131 gave 0.5024 of a
                // step, 300 random seeds at most 0.5031).
                let err = (r.d[b] as f64 * *q as f64 - *v as f64).abs();
                assert!(err <= 0.506 * r.d[b] as f64, "seed {seed}: {v} → {q}");
            }
            let sum = |s: &[i16]| s.iter().map(|&q| q as i32).sum::<i32>();
            assert_eq!(r.s32[b], r.d[b] * sum(&qb) as f32);
            assert_eq!(r.s16[2 * b], r.d[b] * sum(&qb[..16]) as f32);
            assert_eq!(r.s16[2 * b + 1], r.d[b] * sum(&qb[16..]) as f32);
        }
    }
}

#[test]
fn default_entry_point_uses_a_tested_kernel_set() {
    let (seed, mut rng) = seeded("default_entry_point_uses_a_tested_kernel_set");
    let ty = GgmlType::Q4_K;
    let row = random_row(ty, 512, &mut rng);
    let mut act = QuantAct::new();
    act.quantize(&random_acts(512, &mut rng), 1, 512);
    let (mut a, mut b) = ([0f32], [0f32]);
    qdot_rows(ty, &row, act.row(0), &mut a);
    qdot_rows_with(Isa::detect(), ty, &row, act.row(0), &mut b);
    assert_eq!(a, b, "seed {seed}");
}

#[test]
#[should_panic(expected = "fewer than 2 Q4_K rows")]
fn qdot_rejects_short_rows() {
    let mut act = QuantAct::new();
    act.quantize(&[0.5f32; 256], 1, 256);
    qdot_rows(GgmlType::Q4_K, &[0u8; 287], act.row(0), &mut [0f32; 2]);
}

#[test]
#[should_panic(expected = "not a block-quantized format")]
fn qdot_rejects_float_formats() {
    let mut act = QuantAct::new();
    act.quantize(&[0.5f32; 32], 1, 32);
    qdot_rows(GgmlType::F16, &[0u8; 64], act.row(0), &mut [0f32; 1]);
}

/// Gathered rows (random indices, repeats and any order) give each row exactly what the
/// contiguous kernel gives it, for every format and both kernel sets.
#[test]
fn gathered_rows_equal_contiguous_rows() {
    let (seed, mut rng) = seeded("gathered_rows_equal_contiguous_rows");
    for isa in kernel_sets() {
        for ty in quantized_formats() {
            let k = lengths(ty)[1];
            let rows = 9;
            let bytes: Vec<u8> = (0..rows)
                .flat_map(|_| random_row(ty, k, &mut rng))
                .collect();
            let mut act = QuantAct::new();
            act.quantize(&random_acts(k, &mut rng), 1, k);
            let mut all = vec![0f32; rows];
            qdot_rows_with(isa, ty, &bytes, act.row(0), &mut all);
            let index: Vec<u32> = (0..13).map(|_| rng.random_range(0..rows as u32)).collect();
            let mut got = vec![0f32; index.len()];
            qdot_gather_with(isa, ty, &bytes, &index, act.row(0), &mut got);
            for (g, &i) in got.iter().zip(&index) {
                assert_eq!(
                    g.to_bits(),
                    all[i as usize].to_bits(),
                    "{isa:?} {ty} row {i} (seed {seed})"
                );
            }
        }
    }
}
