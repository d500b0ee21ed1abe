//! The CPU mixture-of-experts operations against their plain twins in
//! `markbase_cpu::reference`, on fresh random inputs (set MARKBASE_TEST_SEED to replay).

use std::sync::Arc;

use markbase_core::backend::{Backend, HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use markbase_cpu::{reference, CpuBackend};
use markbase_test_support::{rng, uniform};
use rand::rngs::StdRng;
use rand::Rng;

/// A random matrix in `ty`: f32 values, or random blocks with moderate f16 scales.
fn matrix(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let row_bytes = ty.bytes_for(cols).unwrap();
    let mut bytes = vec![0u8; rows * row_bytes];
    match ty {
        GgmlType::F32 => {
            for (c, v) in bytes.chunks_mut(4).zip(uniform(rng, rows * cols, 0.5)) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut bytes[..]);
            // Q8_0: each 34-byte block starts with its f16 scale; keep it small and finite.
            for block in bytes.chunks_mut(ty.type_size()) {
                let d = half::f16::from_f32(rng.random_range(0.001..0.01f32));
                block[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
    }
    HostMatrix {
        name: format!("random {ty}"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
}

#[test]
fn moe_route_matches_reference() {
    let mut rng = rng("moe_route_matches_reference");
    let be = CpuBackend::new(2).unwrap();
    for (n, e, k) in [(1, 8, 2), (5, 128, 8), (3, 4, 4)] {
        let logits = uniform(&mut rng, n * e, 4.0);
        let scale: Vec<f32> = (0..e).map(|_| rng.random_range(0.5..1.5)).collect();
        let mut lb = be.alloc(n * e).unwrap();
        be.write(&logits, &mut lb).unwrap();
        let (mut w, mut ids) = (be.alloc(n * k).unwrap(), be.alloc(n * k).unwrap());
        be.moe_route(
            &lb,
            n,
            e,
            k,
            &be.load_vector(&scale).unwrap(),
            &mut w,
            &mut ids,
        )
        .unwrap();
        let want = reference::moe_route(&logits, e, k, &scale);
        let (mut gw, mut gi) = (vec![0f32; n * k], vec![0f32; n * k]);
        be.read(&w, &mut gw).unwrap();
        be.read(&ids, &mut gi).unwrap();
        for (j, &(ww, wi)) in want.iter().enumerate() {
            assert_eq!(gi[j] as usize, wi, "pair {j} id");
            assert!(
                (gw[j] - ww).abs() <= 1e-5 * ww.abs().max(1.0),
                "pair {j}: {} vs {ww}",
                gw[j]
            );
        }
    }
    // top_k larger than the expert count is refused.
    let (lb, mut w, mut ids) = (
        be.alloc(8).unwrap(),
        be.alloc(9).unwrap(),
        be.alloc(9).unwrap(),
    );
    let s = be.load_vector(&[1.0; 8]).unwrap();
    assert!(be.moe_route(&lb, 1, 8, 9, &s, &mut w, &mut ids).is_err());
}

#[test]
fn moe_ffn_matches_reference() {
    let mut rng = rng("moe_ffn_matches_reference");
    let be = CpuBackend::new(2).unwrap();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let (n, e, k, d, f) = (6, 8, 3, 64, 96);
        let gate_up = matrix(&mut rng, ty, e * 2 * f, d);
        let down = matrix(&mut rng, ty, e * d, f);
        let x = uniform(&mut rng, n * d, 1.0);
        let mut route = Vec::new();
        for _ in 0..n {
            let mut chosen: Vec<usize> = (0..e).collect();
            for j in 0..k {
                let pick = rng.random_range(j..e);
                chosen.swap(j, pick);
                route.push((rng.random_range(0.1..1.0f32), chosen[j]));
            }
        }
        let mut xb = be.alloc(n * d).unwrap();
        be.write(&x, &mut xb).unwrap();
        let (mut wb, mut ib) = (be.alloc(n * k).unwrap(), be.alloc(n * k).unwrap());
        let ws: Vec<f32> = route.iter().map(|r| r.0).collect();
        let is: Vec<f32> = route.iter().map(|r| r.1 as f32).collect();
        be.write(&ws, &mut wb).unwrap();
        be.write(&is, &mut ib).unwrap();
        let mut out = be.alloc(n * d).unwrap();
        let (gm, dm) = (
            be.load_matrix(&gate_up).unwrap(),
            be.load_matrix(&down).unwrap(),
        );
        be.moe_ffn(&xb, n, &gm, &dm, e, k, &wb, &ib, &mut out)
            .unwrap();
        let want = reference::moe_ffn(&x, n, &gate_up, &down, k, &route).unwrap();
        let mut got = vec![0f32; n * d];
        be.read(&out, &mut got).unwrap();
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale, "{ty} [{i}]: {a} vs {b}");
        }
        // An expert id out of range is an error, not a panic.
        be.write(&[e as f32], &mut ib).unwrap();
        assert!(be
            .moe_ffn(&xb, n, &gm, &dm, e, k, &wb, &ib, &mut out)
            .is_err());
    }
}
