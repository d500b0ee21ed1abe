//! Every CpuBackend operation against its plain twin in `markbase_cpu::reference`, on fresh
//! random inputs (set MARKBASE_TEST_SEED to replay a failure).

use std::sync::Arc;

use markbase_core::backend::{AttnSpec, Backend, HostBytes, HostMatrix, KvLayout, NormOut, Rope};
use markbase_core::quant::GgmlType;
use markbase_cpu::{reference, uses_quantized_activations, CpuBackend, CpuBuffer, F32_FROM_TOKENS};

mod common;
use markbase_test_support::{assert_close, rng, uniform};
use rand::rngs::StdRng;
use rand::Rng;

fn buf(be: &CpuBackend, v: &[f32], extra: usize) -> CpuBuffer {
    let mut b = be.alloc(v.len() + extra).unwrap();
    be.write(v, &mut b).unwrap();
    b
}

/// A random stored matrix of any format built from `common::random_row`: f16 scales (and F16
/// values) of random sign and magnitude 2^-14 … 2^3, F32 values in ±4, a wider spread than
/// `markbase_test_support::random_matrix` draws, which these tests have always checked.
fn wide_random_matrix(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let bytes: Vec<u8> = (0..rows)
        .flat_map(|_| common::random_row(ty, cols, rng))
        .collect();
    HostMatrix {
        name: format!("random {ty}"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
}

#[test]
fn matmul_and_embed_match_reference_for_every_format() {
    let mut rng = rng("matmul_and_embed_match_reference_for_every_format");
    let be = CpuBackend::new(2).unwrap();
    for ty in GgmlType::SUPPORTED {
        let rows = rng.random_range(1..80);
        let cols = match ty.block_size() {
            1 => rng.random_range(1..300),
            32 => 32 * rng.random_range(1..40),
            _ => 256 * rng.random_range(1..4),
        };
        let m = wide_random_matrix(&mut rng, ty, rows, cols);
        let w = be.load_matrix(&m).unwrap();
        for n in [1, 3, F32_FROM_TOKENS - 1, F32_FROM_TOKENS, 70] {
            let x = uniform(&mut rng, n * cols, 1.0);
            let mut out = be.alloc(n * rows + 5).unwrap();
            be.matmul(&buf(&be, &x, 0), n, &w, &mut out).unwrap();
            let want = if uses_quantized_activations(ty, n) {
                reference::matmul_quantized(&x, n, &m).unwrap()
            } else {
                reference::matmul(&x, n, &m).unwrap()
            };
            assert_close(
                &format!("matmul {ty} [{rows}, {cols}] n={n}"),
                &out.as_slice()[..n * rows],
                &want,
                1e-5,
            );
        }
        let tokens: Vec<u32> = (0..5).map(|_| rng.random_range(0..rows as u32)).collect();
        let mut out = be.alloc(5 * cols).unwrap();
        be.embed(&w, &tokens, 2.5, &mut out).unwrap();
        let want = reference::embed(&m, &tokens, 2.5).unwrap();
        assert_close(&format!("embed {ty}"), out.as_slice(), &want, 1e-6);
        assert!(be.embed(&w, &[rows as u32], 1.0, &mut out).is_err());
    }
}

/// The integer path's results do not depend on the number of threads.
#[test]
fn matmul_is_identical_on_any_thread_count() {
    let mut rng = rng("matmul_is_identical_on_any_thread_count");
    let (rows, cols) = (300, 512);
    for ty in [GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::F16] {
        let m = wide_random_matrix(&mut rng, ty, rows, cols);
        for n in [1, 4, 40] {
            let x = uniform(&mut rng, n * cols, 1.0);
            let results: Vec<Vec<f32>> = [1, 2, 3]
                .iter()
                .map(|&threads| {
                    let be = CpuBackend::new(threads).unwrap();
                    let w = be.load_matrix(&m).unwrap();
                    let mut out = be.alloc(n * rows).unwrap();
                    be.matmul(&buf(&be, &x, 0), n, &w, &mut out).unwrap();
                    out.as_slice().to_vec()
                })
                .collect();
            assert_eq!(results[0], results[1], "{ty} n={n}");
            assert_eq!(results[0], results[2], "{ty} n={n}");
        }
    }
}

/// On the integer path a token's result does not depend on the other tokens of the call: a
/// decode batch gives each sequence the logits it would get alone, bit for bit.
#[test]
fn batched_matmul_equals_one_token_at_a_time() {
    let mut rng = rng("batched_matmul_equals_one_token_at_a_time");
    let be = CpuBackend::new(2).unwrap();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q6_K,
        GgmlType::Q4_K,
    ] {
        let (rows, cols) = (rng.random_range(1..200), 512);
        let m = wide_random_matrix(&mut rng, ty, rows, cols);
        let w = be.load_matrix(&m).unwrap();
        let n = rng.random_range(2..F32_FROM_TOKENS);
        assert!(uses_quantized_activations(ty, n));
        let x = uniform(&mut rng, n * cols, 1.0);
        let mut all = be.alloc(n * rows).unwrap();
        be.matmul(&buf(&be, &x, 0), n, &w, &mut all).unwrap();
        for t in 0..n {
            let mut one = be.alloc(rows).unwrap();
            let xt = buf(&be, &x[t * cols..(t + 1) * cols], 0);
            be.matmul(&xt, 1, &w, &mut one).unwrap();
            assert_eq!(
                &all.as_slice()[t * rows..(t + 1) * rows],
                one.as_slice(),
                "{ty} n={n} token {t}"
            );
        }
    }
}

#[test]
fn rms_norm_matches_reference_both_modes() {
    let mut rng = rng("rms_norm_matches_reference_both_modes");
    let be = CpuBackend::new(2).unwrap();
    let (n, dim) = (rng.random_range(1..40), 64 * rng.random_range(1..5));
    let x = uniform(&mut rng, n * dim, 3.0);
    let w = uniform(&mut rng, dim, 2.0);
    let base = uniform(&mut rng, n * dim, 1.0);
    let wv = be.load_vector(&w).unwrap();
    let mut out = buf(&be, &base, 0);
    be.rms_norm(
        &buf(&be, &x, 0),
        Some(&wv),
        1e-6,
        n,
        dim,
        &mut out,
        NormOut::AddTo,
    )
    .unwrap();
    let normed = reference::rms_norm(&x, Some(&w), 1e-6, dim);
    let want: Vec<f32> = normed.iter().zip(&base).map(|(a, b)| a + b).collect();
    assert_close("rms_norm add", out.as_slice(), &want, 1e-5);
    let mut out = be.alloc(n * dim).unwrap();
    be.rms_norm(
        &buf(&be, &x, 0),
        None,
        1e-6,
        n,
        dim,
        &mut out,
        NormOut::Write,
    )
    .unwrap();
    assert_close(
        "rms_norm",
        out.as_slice(),
        &reference::rms_norm(&x, None, 1e-6, dim),
        1e-5,
    );
}

#[test]
fn head_norm_rope_matches_reference() {
    let mut rng = rng("head_norm_rope_matches_reference");
    let be = CpuBackend::new(2).unwrap();
    for (hd, pairs) in [(32, 16), (256, 128), (512, 64)] {
        let (n, heads) = (rng.random_range(1..20), rng.random_range(1..5));
        let x = uniform(&mut rng, n * heads * hd, 2.0);
        let w = uniform(&mut rng, hd, 1.5);
        let positions: Vec<u32> = (0..n).map(|_| rng.random_range(0..40_000)).collect();
        let rope = Rope {
            theta: [1e4, 1e6][rng.random_range(0..2)],
            linear_factor: [1.0, 8.0][rng.random_range(0..2)],
            rotated_pairs: pairs,
        };
        let mut b = buf(&be, &x, 0);
        let wv = be.load_vector(&w).unwrap();
        be.head_norm_rope(&mut b, heads, hd, Some((&wv, 1e-6)), &rope, &positions)
            .unwrap();
        let want = reference::head_norm_rope(&x, heads, hd, Some((&w, 1e-6)), &rope, &positions);
        assert_close(&format!("rope hd={hd}"), b.as_slice(), &want, 1e-5);
    }
}

/// The backend keeps the last RoPE tables: calls that alternate three configurations, repeat
/// position lists, then change one position must each match the reference.
#[test]
fn head_norm_rope_tables_follow_configs_and_positions() {
    let mut rng = rng("head_norm_rope_tables_follow_configs_and_positions");
    let be = CpuBackend::new(2).unwrap();
    let (hd, heads, n) = (64, 2, 9);
    let ropes = [(1e4, 1.0, 32), (1e6, 1.0, 32), (1e4, 8.0, 16)].map(|(t, f, p)| Rope {
        theta: t,
        linear_factor: f,
        rotated_pairs: p,
    });
    let mut positions: Vec<u32> = (100..100 + n as u32).collect();
    for step in 0..12 {
        if step == 8 {
            positions[3] += 1000;
        }
        let rope = &ropes[[0, 0, 1, 0, 2, 1, 1, 0][step % 8]];
        let x = uniform(&mut rng, n * heads * hd, 2.0);
        let mut b = buf(&be, &x, 0);
        be.head_norm_rope(&mut b, heads, hd, None, rope, &positions)
            .unwrap();
        let want = reference::head_norm_rope(&x, heads, hd, None, rope, &positions);
        assert_close(&format!("rope step {step}"), b.as_slice(), &want, 1e-5);
    }
}

#[test]
fn attention_matches_reference() {
    let mut rng = rng("attention_matches_reference");
    let be = CpuBackend::new(2).unwrap();
    for case in 0..6 {
        let hd = [32, 64, 256, 512][rng.random_range(0..4)];
        let kv = rng.random_range(1..3);
        let heads = kv * rng.random_range(1..4);
        let window = if case % 2 == 0 {
            Some(rng.random_range(1..20))
        } else {
            None
        };
        // Several sequences, each a run of query rows at the end of its keys, with blocks
        // scattered over the cache in a random order.
        let (bs, n_blocks, width) = (4, 48, 10);
        let mut free: Vec<u32> = (0..n_blocks as u32).collect();
        let (mut positions, mut seq_start, mut tables) = (Vec::new(), vec![0u32], Vec::new());
        for _ in 0..rng.random_range(1..4) {
            let len = rng.random_range(1..=width * bs);
            let rows = rng.random_range(1..=len.min(6));
            positions.extend((len - rows) as u32..len as u32);
            seq_start.push(positions.len() as u32);
            for b in 0..width {
                tables.push(if b * bs < len {
                    free.swap_remove(rng.random_range(0..free.len()))
                } else {
                    u32::MAX
                });
            }
        }
        let spec = AttnSpec {
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: hd,
            scale: rng.random_range(0.05..0.3),
            window,
            softcap: if case % 3 == 0 { Some(20.0) } else { None },
        };
        let layout = KvLayout {
            block_size: bs,
            positions: &positions,
            seq_start: &seq_start,
            block_tables: &tables,
            table_width: width,
        };
        let n = positions.len();
        let q = uniform(&mut rng, n * heads * hd, 1.0);
        let kc = uniform(&mut rng, n_blocks * bs * kv * hd, 1.0);
        let vc = uniform(&mut rng, n_blocks * bs * kv * hd, 1.0);
        let mut out = be.alloc(n * heads * hd).unwrap();
        let (kb, vb) = (buf(&be, &kc, 0), buf(&be, &vc, 0));
        be.attention(&buf(&be, &q, 0), &kb, &vb, &spec, &layout, &mut out)
            .unwrap();
        let want = reference::attention(&q, &kc, &vc, &spec, &layout);
        assert_close(&format!("attention {spec:?}"), out.as_slice(), &want, 1e-5);
        // A visible table entry outside the cache is an error, not a panic.
        let mut bad = tables.clone();
        bad[positions[0] as usize / bs] = n_blocks as u32;
        let bad_layout = KvLayout {
            block_tables: &bad,
            ..layout
        };
        let q0 = buf(&be, &q, 0);
        assert!(be
            .attention(&q0, &kb, &vb, &spec, &bad_layout, &mut out)
            .is_err());
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let mut rng = rng("elementwise_ops_match_reference");
    let be = CpuBackend::new(2).unwrap();
    let len = rng.random_range(1..10_000);
    let g = uniform(&mut rng, len, 5.0);
    let u = uniform(&mut rng, len, 2.0);
    let mut gb = buf(&be, &g, 0);
    be.gelu_tanh_mul(&mut gb, &buf(&be, &u, 0), len).unwrap();
    assert_close(
        "gelu_tanh_mul",
        gb.as_slice(),
        &reference::gelu_tanh_mul(&g, &u),
        1e-6,
    );
    let mut cb = buf(&be, &g, 0);
    be.softcap(&mut cb, 3.0, len).unwrap();
    assert_close("softcap", cb.as_slice(), &reference::softcap(&g, 3.0), 1e-6);
    let mut sb = buf(&be, &g, 0);
    be.scale(&mut sb, -0.5, len).unwrap();
    let want: Vec<f32> = g.iter().map(|v| v * -0.5).collect();
    assert_close("scale", sb.as_slice(), &want, 0.0);
    let mut kc = be.alloc(10 * 4).unwrap();
    let mut vc = be.alloc(10 * 4).unwrap();
    let k = uniform(&mut rng, 8, 1.0);
    let v = uniform(&mut rng, 8, 1.0);
    be.write_kv(
        &buf(&be, &k, 0),
        &buf(&be, &v, 0),
        4,
        &[7, 2],
        &mut kc,
        &mut vc,
    )
    .unwrap();
    assert_eq!(&kc.as_slice()[28..32], &k[..4]);
    assert_eq!(&vc.as_slice()[8..12], &v[4..]);
    assert!(be
        .write_kv(
            &buf(&be, &k, 0),
            &buf(&be, &v, 0),
            4,
            &[10, 2],
            &mut kc,
            &mut vc
        )
        .is_err());
}

/// `argmax_screened` through the backend: the same picks as the argmax of the exact logits
/// when one row per token stands out, and clear errors for a copy that is not one, a wrong
/// vocabulary size and `top_k` 0.
#[test]
fn argmax_screened_picks_and_rejects_bad_input() {
    let mut rng = rng("argmax_screened_picks_and_rejects_bad_input");
    let be = CpuBackend::new(2).unwrap();
    let (rows, cols, n) = (3000, 64, 3);
    let x = uniform(&mut rng, n * cols, 1.0);
    let mut w = uniform(&mut rng, rows * cols, 1.0);
    let want: Vec<u32> = (0..n).map(|_| rng.random_range(0..rows as u32)).collect();
    for (t, &r) in want.iter().enumerate() {
        for c in 0..cols {
            w[r as usize * cols + c] = x[t * cols + c].signum();
        }
    }
    let mut bytes = vec![0u8; rows * GgmlType::Q8_0.bytes_for(cols).unwrap()];
    markbase_core::quant::quantize_row(GgmlType::Q8_0, &w, &mut bytes).unwrap();
    let stored = HostMatrix {
        name: "head".into(),
        ty: GgmlType::Q8_0,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    };
    let exact = be.load_matrix(&stored).unwrap();
    let coarse = be.load_screen(&stored).unwrap().expect("a screening copy");
    let xb = buf(&be, &x, 0);
    let mut scratch = be.alloc(n * rows).unwrap();
    let got = be
        .argmax_screened(&xb, n, &coarse, &exact, 4096, rows, &mut scratch)
        .unwrap();
    assert_eq!(got, want);
    for (what, result) in [
        (
            "exact as copy",
            be.argmax_screened(&xb, n, &exact, &exact, 4096, rows, &mut scratch),
        ),
        (
            "vocabulary",
            be.argmax_screened(&xb, n, &coarse, &exact, 4096, rows + 1, &mut scratch),
        ),
        (
            "top_k 0",
            be.argmax_screened(&xb, n, &coarse, &exact, 0, rows, &mut scratch),
        ),
    ] {
        let err = result.expect_err(what).to_string();
        assert!(err.contains("argmax_screened"), "{what}: {err}");
    }
}
