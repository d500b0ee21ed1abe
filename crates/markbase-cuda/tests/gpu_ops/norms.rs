//! RMSNorm and the fused residual norms against the CPU reference.

use super::*;

#[test]
fn rms_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("rms_norm");
    for dim in [8, 640, 1000, 2560] {
        let n = 5;
        let x = uniform(&mut r, n * dim, 3.0);
        let w: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let base = uniform(&mut r, n * dim, 1.0);
        let (xb, wb) = (up(g, &x), g.load_vector(&w).unwrap());
        for weighted in [false, true] {
            let wref = weighted.then_some(&w[..]);
            let normed = reference::rms_norm(&x, wref, 1e-6, dim);
            for mode in [NormOut::Write, NormOut::AddTo] {
                let mut out = match mode {
                    NormOut::Write => poisoned(g, n * dim),
                    NormOut::AddTo => up(g, &base),
                };
                g.rms_norm(&xb, weighted.then_some(&wb), 1e-6, n, dim, &mut out, mode)
                    .unwrap();
                let want: Vec<f32> = match mode {
                    NormOut::Write => normed.clone(),
                    NormOut::AddTo => normed.iter().zip(&base).map(|(a, b)| a + b).collect(),
                };
                let got = down(g, &out, n * dim);
                assert_close(
                    &format!("rms_norm {dim} {weighted} {mode:?}"),
                    &got,
                    &want,
                    1e-5,
                );
            }
        }
    }
}

/// `residual_norm` on the reference twins (eps 1e-6): `h' = (h + rms_norm(y) · w) · scale`
/// and the next norm `rms_norm(h') · w2`.
fn residual_norm_reference(
    y: &[f32],
    w: &[f32],
    h: &[f32],
    scale: f32,
    w2: &[f32],
    dim: usize,
) -> (Vec<f32>, Vec<f32>) {
    let normed = reference::rms_norm(y, Some(w), 1e-6, dim);
    let want_h: Vec<f32> = h
        .iter()
        .zip(&normed)
        .map(|(a, b)| (a + b) * scale)
        .collect();
    let want_x = reference::rms_norm(&want_h, Some(w2), 1e-6, dim);
    (want_h, want_x)
}

#[test]
fn moe_residual_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_residual_norm");
    // 26B-A4B's width for one and three tokens, a prefill-sized batch, a tiny row.
    for (dim, n) in [(2816, 1), (2816, 3), (1000, 70), (8, 3)] {
        let dense = uniform(&mut r, n * dim, 3.0);
        let experts = uniform(&mut r, n * dim, 0.5);
        let h = uniform(&mut r, n * dim, 2.0);
        let gain =
            |r: &mut StdRng| -> Vec<f32> { uniform(r, dim, 1.0).iter().map(|v| v + 1.0).collect() };
        let (wd, we, w, w2) = (gain(&mut r), gain(&mut r), gain(&mut r), gain(&mut r));
        let scale = r.random_range(0.25f32..2.0);
        let mix: Vec<f32> = reference::rms_norm(&dense, Some(&wd), 1e-6, dim)
            .iter()
            .zip(reference::rms_norm(&experts, Some(&we), 1e-6, dim))
            .map(|(a, b)| a + b)
            .collect();
        let (want_h, want_x) = residual_norm_reference(&mix, &w, &h, scale, &w2, dim);
        let vector = |v: &[f32]| g.load_vector(v).unwrap();
        let (wdb, web, wb, w2b) = (vector(&wd), vector(&we), vector(&w), vector(&w2));
        let (db, eb) = (up(g, &dense), up(g, &experts));
        for with_next in [false, true] {
            let mut hb = up(g, &h);
            let mut xb = poisoned(g, n * dim);
            let mut mixb = poisoned(g, n * dim);
            let next = with_next.then_some((&w2b, &mut xb));
            g.moe_residual_norm(
                (&db, &wdb),
                (&eb, &web),
                &mut mixb,
                &wb,
                1e-6,
                n,
                dim,
                &mut hb,
                scale,
                next,
            )
            .unwrap();
            let what = format!("moe_residual_norm {dim} × {n} next={with_next}");
            assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
            if with_next {
                assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
            }
        }
    }
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let (short, mut hb, mut mixb) = (up(g, &[1.0; 4]), up(g, &[0.0; 8]), up(g, &[0.0; 8]));
    let err = g.moe_residual_norm(
        (&yb, &wb),
        (&short, &wb),
        &mut mixb,
        &wb,
        1e-6,
        1,
        8,
        &mut hb,
        1.0,
        None,
    );
    assert!(
        err.is_err(),
        "experts' rows shorter than the dense rows must be refused"
    );
}

#[test]
fn residual_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("residual_norm");
    // Few rows (decode: four values a thread) and many (prefill: eight).
    for (dim, n) in [
        (8, 3),
        (640, 3),
        (1000, 70),
        (2560, 3),
        (2560, 70),
        (5376, 3),
        (8192, 70),
    ] {
        let y = uniform(&mut r, n * dim, 3.0);
        let h = uniform(&mut r, n * dim, 2.0);
        let w: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let w2: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let scale = r.random_range(0.25f32..2.0);
        let (yb, wb, w2b) = (
            up(g, &y),
            g.load_vector(&w).unwrap(),
            g.load_vector(&w2).unwrap(),
        );
        let (want_h, want_x) = residual_norm_reference(&y, &w, &h, scale, &w2, dim);
        for with_next in [false, true] {
            let mut hb = up(g, &h);
            let mut xb = poisoned(g, n * dim);
            let next = with_next.then_some((&w2b, &mut xb));
            g.residual_norm(&yb, &wb, 1e-6, n, dim, &mut hb, scale, next)
                .unwrap();
            let what = format!("residual_norm {dim} next={with_next}");
            assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
            if with_next {
                assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
            }
        }
        // Two norms more of the new h in the same pass (a MoE layer's router and experts).
        let gains: Vec<Vec<f32>> = (0..2)
            .map(|_| uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect())
            .collect();
        let (g3, g4) = (
            g.load_vector(&gains[0]).unwrap(),
            g.load_vector(&gains[1]).unwrap(),
        );
        let mut hb = up(g, &h);
        let (mut xb, mut x3, mut x4) = (
            poisoned(g, n * dim),
            poisoned(g, n * dim),
            poisoned(g, n * dim),
        );
        let mut extra = [(&g3, &mut x3), (&g4, &mut x4)];
        g.residual_norms(
            &yb,
            &wb,
            1e-6,
            n,
            dim,
            &mut hb,
            scale,
            (&w2b, &mut xb),
            &mut extra,
        )
        .unwrap();
        let what = format!("residual_norms {dim}");
        assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
        assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
        for (gain, out) in gains.iter().zip([&x3, &x4]) {
            let want = reference::rms_norm(&want_h, Some(gain), 1e-6, dim);
            assert_close(&what, &down(g, out, n * dim), &want, 1e-5);
        }
    }
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let mut hb = up(g, &[0.0; 4]);
    let err = g.residual_norm(&yb, &wb, 1e-6, 1, 8, &mut hb, 1.0, None);
    assert!(
        err.is_err(),
        "a residual shorter than the rows must be refused"
    );
    let wide = 8 * 1024 + 1;
    let (yb, wb) = (
        up(g, &vec![1.0; wide]),
        g.load_vector(&vec![1.0; wide]).unwrap(),
    );
    let mut hb = up(g, &vec![0.0; wide]);
    let err = g.residual_norm(&yb, &wb, 1e-6, 1, wide, &mut hb, 1.0, None);
    assert!(
        err.is_err(),
        "a row wider than the kernel holds must be refused"
    );
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let (mut hb, mut xb, mut short) = (up(g, &[0.0; 8]), up(g, &[0.0; 8]), up(g, &[0.0; 4]));
    let mut extra = [(&wb, &mut short)];
    let err = g.residual_norms(
        &yb,
        &wb,
        1e-6,
        1,
        8,
        &mut hb,
        1.0,
        (&wb, &mut xb),
        &mut extra,
    );
    assert!(
        err.is_err(),
        "an extra output shorter than the rows must be refused"
    );
}
