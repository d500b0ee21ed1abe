//! Decode matmuls through the backend (one token, the integer path) on matrices of the
//! default model's shapes and on a 262144 × 640 LM head in Q8_0 and Q4_0, with 1 and 2
//! threads. The big matrices do not fit in cache, so this is the GEMV's memory bandwidth.
//! Run: `cargo bench -p markbase-cpu --bench gemv`; throughput is weight bytes per second.

use divan::counter::BytesCount;
use divan::Bencher;
use markbase_core::backend::{Backend, HostMatrix};
use markbase_core::quant::GgmlType;
use markbase_cpu::CpuBackend;
use markbase_test_support::random_matrix;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn main() {
    divan::main();
}

/// (name, format, rows, cols)
const SHAPES: [(&str, GgmlType, usize, usize); 6] = [
    ("lm_head_q8_0", GgmlType::Q8_0, 262_144, 640),
    ("lm_head_q4_0", GgmlType::Q4_0, 262_144, 640),
    ("ffn_up_q5_0", GgmlType::Q5_0, 2048, 640),
    ("ffn_down_q6_k", GgmlType::Q6_K, 640, 2048),
    ("ffn_down_q4_k", GgmlType::Q4_K, 640, 2048),
    ("attn_q_q5_0", GgmlType::Q5_0, 1024, 640),
];

/// A random matrix of `SHAPES[shape]` (block scales uniform in ±0.05).
fn matrix(shape: usize, rng: &mut StdRng) -> HostMatrix {
    let (name, ty, rows, cols) = SHAPES[shape];
    HostMatrix {
        name: name.into(),
        ..random_matrix(rng, ty, rows, cols)
    }
}

fn run(bencher: Bencher, shape: usize, threads: usize) {
    let (_, _, rows, cols) = SHAPES[shape];
    let mut rng = StdRng::seed_from_u64(11);
    let m = matrix(shape, &mut rng);
    let len = m.bytes.as_slice().len();
    let be = CpuBackend::new(threads).unwrap();
    let w = be.load_matrix(&m).unwrap();
    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut xb = be.alloc(cols).unwrap();
    be.write(&x, &mut xb).unwrap();
    let mut out = be.alloc(rows).unwrap();
    bencher
        .counter(BytesCount::new(len))
        .bench_local(|| be.matmul(&xb, 1, &w, &mut out).unwrap());
}

#[divan::bench(args = 0..SHAPES.len(), sample_count = 20)]
fn one_thread(bencher: Bencher, shape: usize) {
    run(bencher, shape, 1);
}

#[divan::bench(args = 0..SHAPES.len(), sample_count = 20)]
fn two_threads(bencher: Bencher, shape: usize) {
    run(bencher, shape, 2);
}

/// The screened LM head as decoding uses it (the screening copy ranks, the top 4096 rows of
/// the Q8_0 head are exact) for `n` tokens on two threads; throughput counts the copy's bytes
/// once per token.
fn screened(bencher: Bencher, n: usize) {
    let mut rng = StdRng::seed_from_u64(12);
    let exact = matrix(0, &mut rng);
    let (rows, cols) = (exact.rows, exact.cols);
    let be = CpuBackend::new(2).unwrap();
    let (e, c) = (
        be.load_matrix(&exact).unwrap(),
        be.load_screen(&exact).unwrap().unwrap(),
    );
    let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut xb = be.alloc(n * cols).unwrap();
    be.write(&x, &mut xb).unwrap();
    let mut out = be.alloc(n * rows).unwrap();
    bencher
        .counter(BytesCount::new(n * rows * cols / 2))
        .bench_local(|| be.matmul_screened(&xb, n, &c, &e, 4096, &mut out).unwrap());
}

#[divan::bench(args = [1, 4, 8], sample_count = 10)]
fn screened_head_two_threads(bencher: Bencher, n: usize) {
    screened(bencher, n);
}
