//! The prefill GEMM (token tiles × dequantized weight rows, f32) against the reference — the
//! dequantized weights times the activations summed in f64 — on fresh random inputs for every
//! format, odd token and row counts, both kernel sets. Set MARKBASE_TEST_SEED to replay.

use markbase_core::quant::{dequantize_row, GgmlType};
use markbase_cpu::kernels::gemm::{
    pack_tokens, pack_tokens_with, packed_len, rows_matmul_with, unpack_rows, NT,
};
use markbase_cpu::kernels::Isa;
use rand::Rng;

mod common;
use common::{kernel_sets, random_row};
use markbase_test_support::{seeded, uniform};

/// Relative tolerance against Σ|w·x| of each output: f32 sums of at most 2048 terms.
const REL_TOL: f64 = 1e-5;

#[test]
fn rows_matmul_matches_reference_for_every_format() {
    let (seed, mut rng) = seeded("rows_matmul_matches_reference_for_every_format");
    for isa in kernel_sets() {
        for (i, ty) in GgmlType::SUPPORTED.into_iter().enumerate() {
            let k = match ty.block_size() {
                1 => rng.random_range(1..600),
                bs => bs * rng.random_range(1..2048 / bs + 1),
            };
            // The first format takes a shape that runs every tail of every kernel set (29 rows:
            // 12 + 12 + 4 + 1, 24 + 5, 6 · 4 + 5; 40 tokens: a pair of tiles and a single one).
            let (nr, n) = match i {
                0 => (29, 40),
                _ => (rng.random_range(1..30), rng.random_range(1..40)),
            };
            let rows: Vec<Vec<u8>> = (0..nr).map(|_| random_row(ty, k, &mut rng)).collect();
            let bytes: Vec<u8> = rows.concat();
            let x = uniform(&mut rng, n * k, 1.0);
            let mut xt = vec![f32::NAN; packed_len(n, k) + 3];
            pack_tokens(&x, n, k, &mut xt);
            let mut w = vec![f32::NAN; nr * k];
            unpack_rows(ty, &bytes, bytes.len() / nr, k, &mut w);
            let ldo = nr + rng.random_range(0..3);
            let mut out = vec![f32::NAN; n * ldo];
            rows_matmul_with(isa, &w, k, &xt, n, &mut out, ldo);
            for (r, row) in rows.iter().enumerate() {
                let mut wr = vec![0f32; k];
                dequantize_row(ty, row, &mut wr).unwrap();
                assert_eq!(
                    &w[r * k..(r + 1) * k],
                    &wr[..],
                    "{ty}: unpacked row {r}; seed {seed}"
                );
                for t in 0..n {
                    let xt = &x[t * k..(t + 1) * k];
                    let prods = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64);
                    let want: f64 = prods.clone().sum();
                    let mag: f64 = prods.map(f64::abs).sum();
                    let got = out[t * ldo + r] as f64;
                    assert!(
                        (got - want).abs() <= REL_TOL * mag + 1e-30,
                        "{isa:?} {ty} k={k} n={n} nr={nr}: token {t} row {r}: {got} vs {want}; \
                         seed {seed}"
                    );
                }
            }
            for t in 0..n {
                assert!(
                    out[t * ldo + nr..(t + 1) * ldo].iter().all(|v| v.is_nan()),
                    "{isa:?} {ty}: wrote past the rows; seed {seed}"
                );
            }
        }
    }
}

/// Packing is a pure copy: every kernel set lays out exactly the same tiles.
#[test]
fn packed_tiles_hold_each_activation_once() {
    let (seed, mut rng) = seeded("packed_tiles_hold_each_activation_once");
    for (n, k) in [(1, 8), (16, 640), (37, 35), (48, 2048)] {
        let x = uniform(&mut rng, n * k, 1.0);
        for isa in kernel_sets() {
            let mut xt = vec![f32::NAN; packed_len(n, k)];
            pack_tokens_with(isa, &x, n, k, &mut xt);
            for (tile, dst) in xt.chunks_exact(NT * k).enumerate() {
                for t in 0..NT {
                    let tok = tile * NT + t;
                    for kk in 0..k {
                        let want = if tok < n { x[tok * k + kk] } else { 0.0 };
                        assert_eq!(dst[kk * NT + t], want, "{isa:?} n={n} k={k}; seed {seed}");
                    }
                }
            }
        }
    }
    let mut a = vec![0f32; packed_len(5, 64)];
    let x = uniform(&mut rng, 5 * 64, 1.0);
    pack_tokens(&x, 5, 64, &mut a);
    let mut b = vec![0f32; a.len()];
    pack_tokens_with(Isa::Portable, &x, 5, 64, &mut b);
    assert_eq!(a, b);
}
