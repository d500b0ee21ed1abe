//! Products: GEMVs, batched and tensor-core products, the gated pairs, against the CPU reference.

use super::*;

#[test]
fn matmul_matches_reference_for_every_format_and_batch() {
    let g = gpu_or_skip!();
    let mut r = rng("matmul");
    for ty in GgmlType::SUPPORTED {
        for k in widths(ty) {
            let rows = 67;
            let m = random_matrix(&mut r, ty, rows, k);
            let w = g.load_matrix(&m).unwrap();
            // 1–8: one GEMV launch; 13: two; 40: cuBLAS (f32 and f16 weights in f32, bf16 and
            // quantized ones on the tensor cores, see `as_seen`); bf16 weights take the tensor
            // cores from 3 rows, Q4_K weights the tensor-core kernel for 2–64 (`mma_suits`).
            for n in [1, 2, 3, 8, 13, 40] {
                let x = uniform(&mut r, n * k, 1.0);
                matmul_checked(g, &m, &w, n, &up(g, &x), &x, &format!("matmul {ty} k={k}"));
            }
        }
    }
}

/// bf16 products whose token rows vary within a run of 16 time cuBLASLt's candidates once
/// and reuse the algorithm where cuBLASLt accepts it for the new count; every count matches
/// the reference. A backend of its own, so no other test's timings count.
#[test]
fn timed_algorithms_serve_nearby_row_counts() {
    let Some(g) = common::backend_or_skip() else {
        return;
    };
    if !g.has_cublas() || std::env::var("MARKBASE_CUBLASLT_TUNE").as_deref() == Ok("0") {
        eprintln!("skipped: no cuBLAS, or its timing is off");
        return;
    }
    let mut r = rng("timed algorithms");
    let (rows, k) = (1_000, 768);
    let m = random_matrix(&mut r, GgmlType::BF16, rows, k);
    let w = g.load_matrix(&m).unwrap();
    let mut timed = Vec::new();
    for n in [33, 40, 48, 49, 64, 65] {
        let x = uniform(&mut r, n * k, 1.0);
        matmul_checked(&g, &m, &w, n, &up(&g, &x), &x, &format!("bf16 n={n}"));
        timed.push(g.cublaslt_timed_shapes().unwrap());
    }
    // 33–48 rows share a timing, 49–64 another, 65 a third.
    assert_eq!(timed, [1, 1, 1, 2, 2, 3]);
}

#[test]
fn matmul_many_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("matmul_many");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        // Three matrices (q, k, v-like): one launch or one shared rounding; a fourth of
        // another format among them takes a launch of its own, the three still sharing theirs.
        let mut mats: Vec<HostMatrix> = [37, 9, 9]
            .iter()
            .map(|&rows| random_matrix(&mut r, ty, rows, k))
            .collect();
        for other in [None, Some(GgmlType::F32)] {
            if let Some(o) = other {
                mats.insert(1, random_matrix(&mut r, o, 5, k));
            }
            let ws: Vec<_> = mats.iter().map(|m| g.load_matrix(m).unwrap()).collect();
            for n in [1, 3, 13, 40] {
                let x = uniform(&mut r, n * k, 1.0);
                let mut outs: Vec<CudaBuffer> =
                    mats.iter().map(|m| poisoned(g, n * m.rows)).collect();
                let mut products: Vec<_> = ws.iter().zip(outs.iter_mut()).collect();
                g.matmul_many(&up(g, &x), n, &mut products).unwrap();
                for (m, out) in mats.iter().zip(&outs) {
                    let (sx, sm) = as_seen(g, m, n, &x);
                    let want = reference::matmul(&sx, n, &sm).unwrap();
                    let got = down(g, out, n * m.rows);
                    let what = format!("matmul_many {ty} ({}) rows {} n={n}", mats.len(), m.rows);
                    assert_close(&what, &got, &want, product_tolerance(k));
                }
            }
        }
    }
}

#[test]
fn gelu_gated_matmul_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("gelu_gated_matmul");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        let ff = 45;
        let (gm, um) = (
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, ty, ff, k),
        );
        let (gw, uw) = (g.load_matrix(&gm).unwrap(), g.load_matrix(&um).unwrap());
        // 1–8 rows: the fused GEMV (one warp per gate / up row pair); 13: two launches; 40:
        // two cuBLAS products and the elementwise pass (Q4_K weights from 2 rows: two products
        // of the tensor-core kernel up to 32, then the pass).
        for n in [1, 3, 8, 13, 40] {
            let x = uniform(&mut r, n * k, 1.0);
            let ((sx, sg), (_, su)) = (as_seen(g, &gm, n, &x), as_seen(g, &um, n, &x));
            let want = reference::gelu_tanh_mul(
                &reference::matmul(&sx, n, &sg).unwrap(),
                &reference::matmul(&sx, n, &su).unwrap(),
            );
            let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
            g.gelu_gated_matmul(&up(g, &x), n, &gw, &uw, ff, &mut go, &mut uo)
                .unwrap();
            let got = down(g, &go, n * ff);
            assert_close(
                &format!("gated {ty} k={k} n={n}"),
                &got,
                &want,
                product_tolerance(k),
            );
        }
    }
    let m = random_matrix(&mut r, GgmlType::F32, 8, 16);
    let (a, b) = (g.load_matrix(&m).unwrap(), g.load_matrix(&m).unwrap());
    let (mut go, mut uo) = (poisoned(g, 16), poisoned(g, 16));
    let err = g
        .gelu_gated_matmul(&up(g, &[0.0; 16]), 1, &a, &b, 9, &mut go, &mut uo)
        .unwrap_err();
    assert!(err.to_string().contains("9 outputs"), "{err}");
}

/// One token row's products over more rows than the GPU holds warps at once: each warp of the
/// gated Q4_K walk (grid-stride over the resident blocks) takes several groups of rows, and
/// the one-warp-a-row kernels run several waves of blocks.
#[test]
fn one_token_products_over_many_rows_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("one-token walks");
    let rows = 9_001;
    for (ty, k) in [
        (GgmlType::BF16, 512),
        (GgmlType::F16, 256),
        (GgmlType::BF16, 2_560),
        (GgmlType::Q4_K, 512),
        (GgmlType::Q4_K, 768),
        (GgmlType::Q8_0, 512),
        (GgmlType::Q8_0, 768),
        (GgmlType::Q6_K, 512),
        (GgmlType::Q6_K, 768),
        (GgmlType::Q4_0, 512),
        (GgmlType::Q5_0, 768),
        (GgmlType::Q5_K, 768),
    ] {
        let (gm, um) = (
            random_matrix(&mut r, ty, rows, k),
            random_matrix(&mut r, ty, rows, k),
        );
        let (gw, uw) = (g.load_matrix(&gm).unwrap(), g.load_matrix(&um).unwrap());
        let x = uniform(&mut r, k, 1.0);
        let ((sx, sg), (_, su)) = (as_seen(g, &gm, 1, &x), as_seen(g, &um, 1, &x));
        let (gate, upv) = (
            reference::matmul(&sx, 1, &sg).unwrap(),
            reference::matmul(&sx, 1, &su).unwrap(),
        );
        let xb = up(g, &x);
        let mut out = poisoned(g, rows);
        g.matmul(&xb, 1, &gw, &mut out).unwrap();
        assert_close(
            &format!("matmul {ty} k={k} rows={rows}"),
            &down(g, &out, rows),
            &gate,
            2e-5,
        );
        let (mut go, mut uo) = (poisoned(g, rows), poisoned(g, rows));
        g.gelu_gated_matmul(&xb, 1, &gw, &uw, rows, &mut go, &mut uo)
            .unwrap();
        let want = reference::gelu_tanh_mul(&gate, &upv);
        assert_close(
            &format!("gated {ty} k={k} rows={rows}"),
            &down(g, &go, rows),
            &want,
            2e-5,
        );
    }
}

#[test]
fn one_token_products_over_an_lm_head_of_rows_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("one-token halves walk");
    // Q4_K (and Q8_0, Q6_K) matrices of 65 536 rows and more walk as two halves (pairs of 1
    // and of 2 rows a warp's group: 2 and 11 units a row); an odd count takes the plain GEMV.
    // Two products of each matrix, with fresh activations.
    for (ty, rows, k) in [
        (GgmlType::Q4_K, 65_538, 512),
        (GgmlType::Q4_K, 65_540, 2_816),
        (GgmlType::Q4_K, 65_537, 256),
        (GgmlType::Q4_K, 70_000, 2_560),
        (GgmlType::Q8_0, 65_538, 512),
        (GgmlType::Q8_0, 65_540, 2_816),
        (GgmlType::Q6_K, 65_538, 512),
        (GgmlType::Q6_K, 65_540, 2_816),
        (GgmlType::Q6_K, 65_537, 2_560),
        (GgmlType::Q4_0, 65_538, 512),
        (GgmlType::Q5_0, 65_540, 2_816),
        (GgmlType::Q5_K, 65_538, 512),
    ] {
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        for round in 0..2 {
            let x = uniform(&mut r, k, 1.0);
            let what = format!("matmul {ty} k={k} rows={rows} round {round}");
            matmul_checked(g, &m, &w, 1, &up(g, &x), &x, &what);
        }
    }
}

/// Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 products of 2–128 token rows on the tensor cores over
/// matrices of many row
/// tiles and long rows (tiles whose units several blocks share, part-filled tiles and splits),
/// every n-tile count and a part-filled n-tile; a second run gives the same bits. Then
/// several matrices in one launch. Past 64 rows, once with the matrices' f16 copies and once
/// on a backend without them (the tensor-core kernels' runs of 64 rows).
#[test]
fn tensor_core_products_match_reference_and_repeat_exactly() {
    let with_copies = gpu_with_cublas_or_skip!();
    let without = gpu_without_copies().unwrap();
    let one = [2, 7, 16, 29, 32, 41, 48, 64, 65, 100, 128];
    tensor_core_products_on(with_copies, &one, &[5, 24, 50, 64, 100]);
    // Up to 64 rows both backends run the same launches.
    tensor_core_products_on(without, &[65, 100, 128], &[100]);
    assert!(with_copies.f16_copy_bytes() > 0, "no f16 copy was made");
    assert_eq!(without.f16_copy_bytes(), 0, "copies made while off");
}

/// `tensor_core_products_match_reference_and_repeat_exactly` on `g`: one matrix of each shape
/// at `one` token rows, three at once at `many`.
fn tensor_core_products_on(g: &CudaBackend, one: &[usize], many: &[usize]) {
    let mut r = rng("tensor cores");
    let shapes = [
        (GgmlType::Q4_K, 2_560, 10_240),
        (GgmlType::Q4_K, 4_100, 2_560),
        (GgmlType::Q4_K, 333, 2_816),
        (GgmlType::Q8_0, 2_560, 10_240),
        (GgmlType::Q8_0, 333, 2_816),
        (GgmlType::Q6_K, 2_560, 10_240),
        (GgmlType::Q6_K, 333, 2_816),
        (GgmlType::Q5_K, 2_560, 10_240),
        (GgmlType::Q5_K, 333, 2_816),
        (GgmlType::Q4_0, 2_560, 10_240),
        (GgmlType::Q5_0, 333, 2_816),
    ];
    for (ty, rows, k) in shapes {
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        // 33–64: one launch of 8 n-tiles, or where it would split the tiles 8 ways or more
        // ([2 560, 10 240], [333, 2 816] on an H200) two launches up to 48 rows and cuBLAS on
        // the weights dequantized to f16 at 64 (`as_seen` models which); 65–128: a run of 64
        // rows planned so, then the rest.
        for &n in one {
            let x = uniform(&mut r, n * k, 1.0);
            let xb = up(g, &x);
            let got = matmul_checked(g, &m, &w, n, &xb, &x, &format!("{ty} [{rows}, {k}]"));
            let mut again = poisoned(g, n * rows);
            g.matmul(&xb, n, &w, &mut again).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&down(g, &again, n * rows)), bits(&got), "n={n} rerun");
        }
    }
    // Three matrices in one launch (q, k, v-like), tiles of each split over several blocks.
    let k = 2_560;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
    ] {
        let mats: Vec<HostMatrix> = [2_048, 512, 520]
            .iter()
            .map(|&rows| random_matrix(&mut r, ty, rows, k))
            .collect();
        let ws: Vec<_> = mats.iter().map(|m| g.load_matrix(m).unwrap()).collect();
        // 50 and 64: one launch of 8 n-tiles, or two of 4 (one matrix alone: cuBLAS); 100: 64
        // rows so, then 36.
        for &n in many {
            let x = uniform(&mut r, n * k, 1.0);
            let mut outs: Vec<CudaBuffer> = mats.iter().map(|m| poisoned(g, n * m.rows)).collect();
            let mut products: Vec<_> = ws.iter().zip(outs.iter_mut()).collect();
            g.matmul_many(&up(g, &x), n, &mut products).unwrap();
            let rows: Vec<usize> = mats.iter().map(|m| m.rows).collect();
            for (m, out) in mats.iter().zip(&outs) {
                let (sx, sm) = as_seen_in(g, m, n, &x, &rows);
                let want = reference::matmul(&sx, n, &sm).unwrap();
                let what = format!("matmul_many {ty} rows {} n={n}", m.rows);
                assert_close(
                    &what,
                    &down(g, out, n * m.rows),
                    &want,
                    product_tolerance(k),
                );
            }
        }
    }
}

/// The gated feed-forward of a few token rows over quantized weights as the tensor-core
/// launches (mmq.cu): gate and up in one launch storing gelu_tanh(gate) · up as f16, then
/// down, of the same format or (llama.cpp's Q4_K_M and Q5_K_M layers) Q6_K; tiles split over
/// several blocks and not, part-filled n-tiles. A second run gives the same bits. Past 64 rows,
/// once on the f16 copies (gate, up and down apart) and once without.
#[test]
fn gated_ffn_on_tensor_cores_matches_reference_and_repeats_exactly() {
    let with_copies = gpu_with_cublas_or_skip!();
    gated_ffn_on_tensor_cores_on(with_copies, &[2, 8, 29, 45, 72, 130]);
    // Up to 64 rows both backends run the same launches.
    gated_ffn_on_tensor_cores_on(gpu_without_copies().unwrap(), &[72]);
}

/// `gated_ffn_on_tensor_cores_matches_reference_and_repeats_exactly` on `g` at `batches`
/// token rows.
fn gated_ffn_on_tensor_cores_on(g: &CudaBackend, batches: &[usize]) {
    let mut r = rng("gated ffn tensor cores");
    let f16_sat = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|x| f16::from_f32(x.clamp(-65_504.0, 65_504.0)).to_f32())
            .collect()
    };
    use GgmlType::{Q4_0, Q4_K, Q5_K, Q6_K, Q8_0};
    for (ty, down_ty, k, ff, d) in [
        (Q4_K, Q4_K, 512, 1_024, 512),
        (Q4_K, Q4_K, 2_560, 10_240, 2_560),
        (Q4_K, Q6_K, 2_560, 10_240, 2_560),
        (Q8_0, Q8_0, 768, 1_280, 512),
        (Q6_K, Q6_K, 2_560, 1_280, 2_560),
        (Q5_K, Q5_K, 768, 1_280, 512),
        (Q5_K, Q6_K, 768, 1_280, 512),
        (Q4_0, Q4_0, 512, 1_024, 512),
    ] {
        let (gm, um, dm) = (
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, down_ty, d, ff),
        );
        let [gw, uw, dw] = [&gm, &um, &dm].map(|m| g.load_matrix(m).unwrap());
        for &n in batches {
            let x = uniform(&mut r, n * k, 1.0);
            let (sx, sg) = as_seen(g, &gm, n, &x);
            let (_, su) = as_seen(g, &um, n, &x);
            let gate = reference::matmul(&sx, n, &sg).unwrap();
            let upv = reference::matmul(&sx, n, &su).unwrap();
            let act = f16_sat(reference::gelu_tanh_mul(&gate, &upv));
            let (sa, sd) = as_seen(g, &dm, n, &act);
            let want = reference::matmul(&sa, n, &sd).unwrap();
            let mut got = Vec::new();
            for _ in 0..2 {
                let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
                let mut out = poisoned(g, n * d);
                g.gated_ffn(&up(g, &x), n, &gw, &uw, &dw, ff, &mut go, &mut uo, &mut out)
                    .unwrap();
                got.push(down(g, &out, n * d));
            }
            let what = format!("gated ffn {ty} / {down_ty} [{k}, {ff}, {d}] n={n}");
            assert_close(&what, &got[0], &want, 2e-3);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[1]), bits(&got[0]), "{what} rerun");
        }
    }
}

#[test]
fn gelu_matmul_mul_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("gelu_matmul_mul");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        let rows = 37;
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        // The gate's rows are a slice of wider rows (Gemma 4's per-layer inputs of one layer).
        let from = Strided {
            offset: 2 * rows + 3,
            stride: 4 * rows,
        };
        // 1–8 rows: one GEMV launch reading the slice in place; 13: two; 40: the product, a
        // copy of the slice and the elementwise pass (so too Q4_K weights from 2 rows).
        for n in [1, 3, 8, 13, 40] {
            let x = uniform(&mut r, n * k, 1.0);
            let other = uniform(&mut r, from.at(n), 2.0);
            let (sx, sm) = as_seen(g, &m, n, &x);
            let slice: Vec<f32> = (0..n)
                .flat_map(|t| other[from.at(t)..from.at(t) + rows].to_vec())
                .collect();
            let want = reference::gelu_tanh_mul(&reference::matmul(&sx, n, &sm).unwrap(), &slice);
            let (mut out, mut scratch) = (poisoned(g, n * rows), poisoned(g, n * rows));
            g.gelu_matmul_mul(
                &up(g, &x),
                n,
                &w,
                rows,
                &up(g, &other),
                from,
                &mut out,
                &mut scratch,
            )
            .unwrap();
            let got = down(g, &out, n * rows);
            assert_close(
                &format!("gelu_matmul_mul {ty} k={k} n={n}"),
                &got,
                &want,
                product_tolerance(k),
            );
        }
        let mut out = poisoned(g, rows);
        let mut scratch = poisoned(g, rows);
        let err = g.gelu_matmul_mul(
            &up(g, &vec![0.0; k]),
            1,
            &w,
            rows + 1,
            &up(g, &vec![0.0; 8 * rows]),
            from,
            &mut out,
            &mut scratch,
        );
        assert!(
            err.is_err(),
            "a row count unlike the matrix's must be refused"
        );
    }
}

#[test]
fn gated_ffn_keeps_bf16_activations_between_bf16_products() {
    let g = gpu_or_skip!();
    let mut r = rng("gated_ffn");
    let (k, ff, d) = (256, 96, 160);
    let ty = GgmlType::BF16;
    let (gm, um, dm) = (
        random_matrix(&mut r, ty, ff, k),
        random_matrix(&mut r, ty, ff, k),
        random_matrix(&mut r, ty, d, ff),
    );
    let [gw, uw, dw] = [&gm, &um, &dm].map(|m| g.load_matrix(m).unwrap());
    let round =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    // 2 rows: GEMVs in f32 (the default composition); 8 and 40: tensor-core products with bf16
    // gate, up and activations.
    for n in [2, 8, 40] {
        let x = uniform(&mut r, n * k, 1.0);
        let (sx, _) = as_seen(g, &gm, n, &x);
        let bf16_path = g.has_cublas() && product_inputs(ty, k, n) == ProductInputs::Bf16;
        let (gate, upv) = (
            reference::matmul(&sx, n, &gm).unwrap(),
            reference::matmul(&sx, n, &um).unwrap(),
        );
        let exact = reference::gelu_tanh_mul(&gate, &upv);
        let (act, tol) = if bf16_path {
            // What the GPU computes: gate and up rounded, the activations rounded.
            (
                round(reference::gelu_tanh_mul(&round(gate), &round(upv))),
                2e-3,
            )
        } else {
            let (sa, _) = as_seen(g, &dm, n, &exact);
            (sa, 2e-5)
        };
        let want = reference::matmul(&act, n, &dm).unwrap();
        let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
        let mut out = poisoned(g, n * d);
        g.gated_ffn(&up(g, &x), n, &gw, &uw, &dw, ff, &mut go, &mut uo, &mut out)
            .unwrap();
        let got = down(g, &out, n * d);
        assert_close(&format!("gated ffn n={n}"), &got, &want, tol);
        // The cost of the bf16 activations against f32 ones: within bf16's precision.
        let (se, _) = as_seen(g, &dm, n, &exact);
        let f32_acts = reference::matmul(&se, n, &dm).unwrap();
        assert_close(
            &format!("gated ffn n={n} vs f32 activations"),
            &got,
            &f32_acts,
            1e-2,
        );
    }
}
