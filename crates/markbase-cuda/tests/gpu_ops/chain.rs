//! The chain of one-token products in one persistent launch (chain.cu), of bf16 and Q4_K
//! weights, against the f64 products (tests/common/chain.rs): a chain over the kernel's paths
//! and two of E4B's layers (bf16 also with gate and up as row pairs), the whole chain in one launch, then a launch a link and a second
//! whole pass bit for bit.

use super::*;
use chain_ref::*;
use markbase_cuda::{ChainLink, LinkInput};

/// Runs `spec` on the device: returns each pass's outputs (whole, a link a launch, whole), the
/// outputs poisoned before each.
fn run_chain(g: &CudaBackend, spec: &[LinkSpec], inputs: &ChainInputs) -> Vec<Vec<Vec<f32>>> {
    let weights: Vec<CudaMatrix> = inputs
        .weights
        .iter()
        .map(|m| g.load_matrix(m).unwrap())
        .collect();
    let outside = up(g, &inputs.outside);
    let norms: Vec<CudaBuffer> = inputs.norms.iter().map(|n| up(g, n)).collect();
    let links: Vec<ChainLink<'_>> = spec
        .iter()
        .enumerate()
        .map(|(j, l)| ChainLink {
            weights: &weights[j],
            input: match l.source {
                Source::Outside => LinkInput::Buffer(&outside),
                Source::Link { link, offset } => LinkInput::Link { link, offset },
            },
            pair: l.pair,
            norm: l.norm.then(|| (&norms[j], EPS)),
            gated: l.gated,
        })
        .collect();
    let mut chain = g.chain(&links).unwrap();
    let n = spec.len();
    let mut passes = Vec::new();
    for whole in [true, false, true] {
        for (j, l) in spec.iter().enumerate() {
            g.write(&vec![f32::NAN; l.outputs()], chain.output_mut(j))
                .unwrap();
        }
        match whole {
            true => g.run_chain(&mut chain, 0..n).unwrap(),
            false => (0..n).for_each(|j| g.run_chain(&mut chain, j..j + 1).unwrap()),
        }
        passes.push(
            (0..n)
                .map(|j| down(g, chain.output(j), spec[j].outputs()))
                .collect(),
        );
    }
    passes
}

fn check_on_gpu(g: &CudaBackend, ty: GgmlType, what: &str, spec: &[LinkSpec]) {
    let mut r = rng(what);
    let inputs = chain_inputs(&mut r, spec, ty);
    let passes = run_chain(g, spec, &inputs);
    check_chain(what, spec, &inputs, &passes[0]);
    for (p, pass) in passes.iter().enumerate().skip(1) {
        for (j, (a, b)) in passes[0].iter().zip(pass).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{what}: link {j} differs in pass {p}");
        }
    }
}

#[test]
fn chain_matches_reference_and_repeats_bit_for_bit() {
    let g = gpu_or_skip!();
    check_on_gpu(g, GgmlType::BF16, "bf16 chain", &test_chain());
    check_on_gpu(g, GgmlType::Q4_K, "Q4_K chain", &test_chain_q4k());
    check_on_gpu(
        g,
        GgmlType::BF16,
        "bf16 chain of two E4B layers",
        &e4b_layers(false),
    );
    check_on_gpu(
        g,
        GgmlType::BF16,
        "bf16 chain of two E4B layers, gate and up as row pairs",
        &e4b_layers(true),
    );
    check_on_gpu(
        g,
        GgmlType::Q4_K,
        "Q4_K chain of two E4B layers",
        &e4b_layers(false),
    );
}

#[test]
fn chain_refuses_gated_rows_it_cannot_pair() {
    let g = gpu_or_skip!();
    let mut r = rng("chain gated errors");
    let x = up(g, &vec![0.5; 256]);
    for (ty, rows) in [(GgmlType::BF16, 7), (GgmlType::Q4_K, 8)] {
        let m = g
            .load_matrix(&markbase_test_support::random_matrix(&mut r, ty, rows, 256))
            .unwrap();
        let link = ChainLink {
            weights: &m,
            input: LinkInput::Buffer(&x),
            pair: false,
            norm: None,
            gated: true,
        };
        let err = g.chain(&[link]).err().expect("a gated link it cannot pair");
        assert!(err.to_string().contains("gated"), "{ty} × {rows}: {err}");
    }
}
