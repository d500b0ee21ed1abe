//! Integer dot kernels (16-bit activations): 64 rows of 2048 weights per format, which stay in
//! L2 (the kernels' compute speed per core), AVX2 and portable; and the same rows against 4
//! and 8 tokens at once (decode batches), counted as weight bytes × tokens per second.
//! Also the LM head's screening kernel (4-bit copy × byte activations).
//! Run: `cargo bench -p markbase-cpu --bench qdot`; throughput is weight bytes per second.

use divan::counter::BytesCount;
use divan::Bencher;
use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use markbase_cpu::kernels::act::ActRow;
use markbase_cpu::kernels::act::QuantAct;
use markbase_cpu::kernels::qdot::{qdot_rows_with, qdot_tokens_with, supports};
use markbase_cpu::kernels::screen::{screen_tokens, ScreenAct, ScreenRow};
use markbase_cpu::kernels::screen_copy::ScreenCopy;
use markbase_cpu::kernels::Isa;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const K: usize = 2048;
const ROWS: usize = 64;

fn main() {
    divan::main();
}

const FORMATS: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
];

/// Random rows whose f16 scales are all 2^-4, and quantized activations.
fn inputs(ty: GgmlType, n: usize) -> (Vec<u8>, QuantAct) {
    assert!(supports(ty));
    let mut rng = StdRng::seed_from_u64(7);
    let mut rows = vec![0u8; ROWS * ty.bytes_for(K).unwrap()];
    rng.fill(&mut rows[..]);
    let scale_at: &[usize] = match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::Q8_K => &[],
        _ => &[0, 2],
    };
    for block in rows.chunks_exact_mut(ty.type_size()) {
        for &at in scale_at {
            block[at..at + 2].copy_from_slice(&0x2C00u16.to_le_bytes());
        }
    }
    let x: Vec<f32> = (0..n * K).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut act = QuantAct::new();
    act.quantize(&x, n, K);
    (rows, act)
}

fn run(bencher: Bencher, ty: GgmlType, isa: Isa) {
    let (rows, act) = inputs(ty, 1);
    let mut out = vec![0f32; ROWS];
    bencher
        .counter(BytesCount::new(rows.len()))
        .bench_local(|| {
            qdot_rows_with(isa, ty, divan::black_box(&rows), act.row(0), &mut out);
            divan::black_box(&out);
        });
}

#[divan::bench(args = FORMATS)]
fn rows64_k2048(bencher: Bencher, ty: GgmlType) {
    run(bencher, ty, Isa::detect());
}

#[divan::bench(args = FORMATS)]
fn rows64_k2048_portable(bencher: Bencher, ty: GgmlType) {
    run(bencher, ty, Isa::Portable);
}

/// The formats of the default model, `n` tokens at once.
fn run_tokens(bencher: Bencher, ty: GgmlType, n: usize) {
    let (rows, act) = inputs(ty, n);
    let xs: Vec<ActRow> = (0..n).map(|t| act.row(t)).collect();
    let mut out = vec![0f32; n * ROWS];
    bencher
        .counter(BytesCount::new(n * rows.len()))
        .bench_local(|| {
            let mut outs: Vec<&mut [f32]> = out.chunks_mut(ROWS).collect();
            qdot_tokens_with(Isa::detect(), ty, divan::black_box(&rows), &xs, &mut outs);
            divan::black_box(&outs);
        });
}

const MODEL_FORMATS: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

#[divan::bench(args = MODEL_FORMATS)]
fn rows64_k2048_tokens4(bencher: Bencher, ty: GgmlType) {
    run_tokens(bencher, ty, 4);
}

#[divan::bench(args = MODEL_FORMATS)]
fn rows64_k2048_tokens8(bencher: Bencher, ty: GgmlType) {
    run_tokens(bencher, ty, 8);
}

/// The LM head's screening kernel (4-bit copy with integer chunk scales × byte activations) for `n` tokens,
/// against the 16-bit integer path's formats above.
#[divan::bench(args = [1, 4, 8])]
fn screen_rows64_k2048(bencher: Bencher, n: usize) {
    let mut rng = StdRng::seed_from_u64(9);
    let w: Vec<u8> = (0..ROWS * K)
        .flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes())
        .collect();
    let copy = ScreenCopy::build(&HostMatrix {
        name: "bench".into(),
        ty: GgmlType::F32,
        rows: ROWS,
        cols: K,
        bytes: HostBytes::Owned(w.into()),
    })
    .unwrap();
    let x: Vec<f32> = (0..n * K).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut act = ScreenAct::new();
    act.quantize(&x, n, &copy);
    let xs: Vec<ScreenRow> = (0..n).map(|t| act.row(t)).collect();
    let mut out = vec![0f32; n * ROWS];
    bencher
        .counter(BytesCount::new(n * copy.codes.len()))
        .bench_local(|| {
            let mut outs: Vec<&mut [f32]> = out.chunks_mut(ROWS).collect();
            screen_tokens(divan::black_box(&copy), 0, &xs, &mut outs);
            divan::black_box(&outs);
        });
}
