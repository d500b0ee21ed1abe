//! Embedding gathers and elementwise kernels against the CPU reference.

use super::*;

#[test]
fn embed_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("embed");
    for ty in GgmlType::SUPPORTED {
        for k in widths(ty) {
            let m = random_matrix(&mut r, ty, 50, k);
            let w = g.load_matrix(&m).unwrap();
            let tokens: Vec<u32> = (0..7).map(|_| r.random_range(0..50)).collect();
            let scale = r.random_range(0.5f32..3.0);
            let want = reference::embed(&m, &tokens, scale).unwrap();
            let mut out = poisoned(g, tokens.len() * k);
            g.embed(&w, &tokens, scale, &mut out).unwrap();
            let got = down(g, &out, tokens.len() * k);
            assert_close(&format!("embed {ty} k={k}"), &got, &want, 1e-6);
            let bad = g.embed(&w, &[50], 1.0, &mut out);
            assert!(bad.is_err(), "token id past the table must be an error");
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("elementwise");
    let n = 10_007;
    let a = uniform(&mut r, n, 6.0);
    let b = uniform(&mut r, n, 2.0);
    let mut x = up(g, &a);
    g.gelu_tanh_mul(&mut x, &up(g, &b), n).unwrap();
    assert_close(
        "gelu",
        &down(g, &x, n),
        &reference::gelu_tanh_mul(&a, &b),
        1e-6,
    );
    let mut x = up(g, &a);
    g.add(&mut x, &up(g, &b), n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    assert_eq!(down(g, &x, n), want, "add");
    let mut x = up(g, &a);
    g.scale(&mut x, 0.37, n).unwrap();
    let want: Vec<f32> = a.iter().map(|p| p * 0.37).collect();
    assert_eq!(down(g, &x, n), want, "scale");
    let mut x = up(g, &a);
    g.softcap(&mut x, 3.0, n).unwrap();
    assert_close(
        "softcap",
        &down(g, &x, n),
        &reference::softcap(&a, 3.0),
        1e-6,
    );
    let mut x = up(g, &a);
    g.copy(&up(g, &b), 100, &mut x, 7, 500).unwrap();
    let mut want = a.clone();
    want[7..507].copy_from_slice(&b[100..600]);
    assert_eq!(down(g, &x, n), want, "copy");
    assert!(g.copy(&up(g, &b), n - 10, &mut x, 0, 20).is_err());
    // Strided rows (one queued 2-D copy) against the CPU backend's row-by-row default.
    let cpu = markbase_cpu::CpuBackend::new(1).unwrap();
    let (rows, len) = (r.random_range(1..40), r.random_range(1..90));
    let from = Strided {
        offset: r.random_range(0..50),
        stride: len + r.random_range(0..30),
    };
    let to = Strided {
        offset: r.random_range(0..50),
        stride: len + r.random_range(0..30),
    };
    let mut x = up(g, &a);
    g.copy_rows(&up(g, &b), from, &mut x, to, rows, len)
        .unwrap();
    let mut want = cpu.alloc(n).unwrap();
    cpu.write(&a, &mut want).unwrap();
    let mut src = cpu.alloc(n).unwrap();
    cpu.write(&b, &mut src).unwrap();
    cpu.copy_rows(&src, from, &mut want, to, rows, len).unwrap();
    let mut want_host = vec![0f32; n];
    cpu.read(&want, &mut want_host).unwrap();
    assert_eq!(
        down(g, &x, n),
        want_host,
        "copy_rows {rows} x {len} {from:?} -> {to:?}"
    );
    let past_end = Strided {
        offset: n - len,
        stride: len,
    };
    assert!(g
        .copy_rows(&up(g, &b), past_end, &mut x, to, 2, len)
        .is_err());
    let overlapping = Strided {
        offset: 0,
        stride: len - 1,
    };
    assert!(g
        .copy_rows(&up(g, &b), overlapping, &mut x, to, 2, len)
        .is_err());
}
