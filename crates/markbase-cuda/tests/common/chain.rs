//! The chain of one-token products (chain.cu) in f64, and the chains the emulator and GPU
//! tests run: shared by emu_chain and gpu_ops.
#![allow(dead_code)]

use markbase_core::backend::HostMatrix;
use markbase_core::quant::GgmlType;
use markbase_cpu::reference;
use rand::rngs::StdRng;
use rand::Rng;

/// Where a link reads its input: the chain's outside input, or an earlier link's outputs from
/// `offset` on.
#[derive(Clone, Copy, Debug)]
pub enum Source {
    /// The outside input vector.
    Outside,
    /// Link `link`'s outputs.
    Link { link: usize, offset: usize },
}

/// One link of a test chain: weights `[rows, k]`, its input, gelu-paired or not, normed or
/// not, its rows (gate, up) pairs giving one output each (gated) or not.
#[derive(Clone, Copy, Debug)]
pub struct LinkSpec {
    pub rows: usize,
    pub k: usize,
    pub source: Source,
    pub pair: bool,
    pub norm: bool,
    pub gated: bool,
}

impl LinkSpec {
    /// Output values: the rows, or a gated link's pairs of them.
    pub fn outputs(&self) -> usize {
        if self.gated {
            self.rows / 2
        } else {
            self.rows
        }
    }

    /// The same link with its rows as (gate, up) pairs.
    fn gated(self) -> LinkSpec {
        LinkSpec {
            gated: true,
            ..self
        }
    }
}

/// The norms' epsilon.
pub const EPS: f32 = 1e-6;

fn link(rows: usize, k: usize, source: Source, pair: bool, norm: bool) -> LinkSpec {
    LinkSpec {
        rows,
        k,
        source,
        pair,
        norm,
        gated: false,
    }
}

fn from(link: usize, offset: usize) -> Source {
    Source::Link { link, offset }
}

/// A chain over every path of the bf16 kernel at sizes the emulator runs: rows past a tile, k
/// past and below a unit, a pair, norms, gated rows (over a partial item, read by a normed
/// link), links reading one not just before them, links of more units than blocks and of fewer;
/// with 3 or 5 blocks, tiles of several units cut between blocks. A gated link has at least 8
/// outputs of a normed x: were all of a link's outputs in gelu's far negative tail, where
/// 1 + tanh cancels in f32, its relative error would be past any tolerance.
pub fn test_chain() -> Vec<LinkSpec> {
    vec![
        link(2600, 296, Source::Outside, false, true),
        link(37, 2600, from(0, 0), false, true),
        link(2056, 24, from(1, 5), false, false),
        link(90, 1024, from(2, 8), true, true),
        link(13, 88, from(3, 0), false, false),
        link(61, 2048, from(2, 0), false, true),
        link(8, 8, from(4, 0), false, true),
        link(46, 1040, from(2, 100), false, true).gated(),
        link(16, 8, from(7, 15), false, true).gated(),
        link(16, 16, from(7, 0), false, true),
    ]
}

/// `test_chain`'s paths for Q4_K weights (k a multiple of 256): a unit's 8 super-blocks cut
/// short, several units a row, a pair, norms, links reading ones not just before them.
pub fn test_chain_q4k() -> Vec<LinkSpec> {
    vec![
        link(2600, 512, Source::Outside, false, true),
        link(37, 2560, from(0, 0), false, true),
        link(1030, 256, from(0, 8), true, false),
        link(19, 1024, from(2, 6), false, true),
        link(64, 2304, from(0, 200), false, false),
        link(8, 256, from(2, 0), false, true),
    ]
}

/// Gemma 4 E4B's products of a layer in the order a step runs them (q, k, v as one; o reading
/// q; gate and up as one; down reading their gelu pair — or, `gated`, gate and up as row pairs
/// and down reading their outputs; the per-layer-input gate and projection), twice, the second
/// layer reading the first's projection.
pub fn e4b_layers(gated: bool) -> Vec<LinkSpec> {
    let (d, ff, q, kv, ple) = (2560, 10240, 2048, 512, 256);
    let mut links = Vec::new();
    for layer in 0..2 {
        let base = links.len();
        let input = match layer {
            0 => Source::Outside,
            _ => from(base - 1, 0),
        };
        let gate_up = link(2 * ff, d, from(base + 1, 0), false, true);
        links.extend([
            link(q + 2 * kv, d, input, false, true),
            link(d, q, from(base, 0), false, false),
            LinkSpec { gated, ..gate_up },
            link(d, ff, from(base + 2, 0), !gated, false),
            link(ple, d, from(base + 3, 0), false, true),
            link(d, ple, from(base + 4, 0), false, false),
        ]);
    }
    links
}

/// A chain's random weights (their format), the weights as the kernel multiplies them, the
/// outside input and each link's norm weights.
pub struct ChainInputs {
    pub weights: Vec<HostMatrix>,
    pub dequant: Vec<Vec<f32>>,
    pub outside: Vec<f32>,
    pub norms: Vec<Vec<f32>>,
}

/// Values the outside input needs: the largest first link reading it.
pub fn outside_len(spec: &[LinkSpec]) -> usize {
    spec.iter()
        .filter(|l| matches!(l.source, Source::Outside))
        .map(|l| if l.pair { 2 * l.k } else { l.k })
        .max()
        .unwrap_or(0)
}

/// Random inputs of a chain of `ty` weights.
pub fn chain_inputs(r: &mut StdRng, spec: &[LinkSpec], ty: GgmlType) -> ChainInputs {
    let weights: Vec<HostMatrix> = spec
        .iter()
        .map(|l| markbase_test_support::random_matrix(r, ty, l.rows, l.k))
        .collect();
    let dequant = weights
        .iter()
        .map(|m| reference::dequantize_matrix(m).unwrap())
        .collect();
    let outside = (0..outside_len(spec))
        .map(|_| r.random_range(-1.0..1.0))
        .collect();
    let norms = spec
        .iter()
        .map(|l| (0..l.k).map(|_| r.random_range(0.5..1.5)).collect())
        .collect();
    ChainInputs {
        weights,
        dequant,
        outside,
        norms,
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// Link j's x in f64 from its input values `v` (as the kernel read them).
pub fn link_x(l: &LinkSpec, v: &[f32], norm: &[f32]) -> Vec<f64> {
    let mut x: Vec<f64> = (0..l.k)
        .map(|i| match l.pair {
            true => gelu_tanh(v[i] as f64) * v[l.k + i] as f64,
            false => v[i] as f64,
        })
        .collect();
    if l.norm {
        let ms = x.iter().map(|a| a * a).sum::<f64>() / l.k as f64;
        let s = 1.0 / (ms + EPS as f64).sqrt();
        for (a, &w) in x.iter_mut().zip(norm) {
            *a *= s * w as f64;
        }
    }
    x
}

/// Link j's outputs in f64, its input taken from `outputs` (the kernel's outputs of the links
/// before it) or the outside input, x as the kernel's products see it (`seen`, of x rounded to
/// f32): each link checked on its own, so errors do not compound.
pub fn link_want(
    spec: &[LinkSpec],
    inputs: &ChainInputs,
    outputs: &[Vec<f32>],
    j: usize,
    seen: &dyn Fn(&[f32]) -> Vec<f32>,
) -> Vec<f32> {
    let l = &spec[j];
    let v: &[f32] = match l.source {
        Source::Outside => &inputs.outside,
        Source::Link { link, offset } => &outputs[link][offset..],
    };
    let x32: Vec<f32> = link_x(l, v, &inputs.norms[j])
        .iter()
        .map(|&a| a as f32)
        .collect();
    let x = seen(&x32);
    let w = &inputs.dequant[j];
    let dot = |r: usize| -> f64 {
        let row = &w[r * l.k..(r + 1) * l.k];
        row.iter().zip(&x).map(|(&b, &a)| b as f64 * a as f64).sum()
    };
    (0..l.outputs())
        .map(|i| match l.gated {
            true => (gelu_tanh(dot(2 * i)) * dot(2 * i + 1)) as f32,
            false => dot(i) as f32,
        })
        .collect()
}

/// Checks every link's outputs against `link_want`, x as the products of the chain's weights
/// see it (Q4_K: 16-bit integers a 32-value chunk, `as_16_bit`), within the relative error
/// their sums may have.
pub fn check_chain(what: &str, spec: &[LinkSpec], inputs: &ChainInputs, outputs: &[Vec<f32>]) {
    type Seen = fn(&[f32]) -> Vec<f32>;
    let (seen, tol): (Seen, f32) = match inputs.weights[0].ty {
        GgmlType::Q4_K => (crate::matrices::as_16_bit, 1e-4),
        _ => (|x| x.to_vec(), 2e-5),
    };
    for j in 0..spec.len() {
        let want = link_want(spec, inputs, outputs, j, &seen);
        markbase_test_support::assert_close(
            &format!("{what}: link {j} ({:?})", spec[j]),
            &outputs[j],
            &want,
            tol,
        );
    }
}
