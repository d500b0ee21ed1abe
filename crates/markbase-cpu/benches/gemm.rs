//! The prefill GEMM: on one core as the backend runs it per task (24 Q5_0 weight rows
//! dequantized, times 128 tokens packed in tiles, k = 640 and 2048), and through the backend
//! for the seven matmuls of one layer of the default model with 512 tokens. Throughput in
//! FLOP/s is 2 · rows · tokens · k per iteration (divan reports it as "items").
//! Run: `cargo bench -p markbase-cpu --bench gemm`.

use divan::counter::ItemsCount;
use divan::Bencher;
use markbase_core::backend::Backend;
use markbase_core::quant::GgmlType;
use markbase_cpu::kernels::gemm::{pack_tokens, packed_len, rows_matmul, unpack_rows};
use markbase_cpu::CpuBackend;
use markbase_test_support::random_matrix;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TOKENS: usize = 128;
const ROWS: usize = 24;

fn main() {
    divan::main();
}

#[divan::bench(args = [640, 2048])]
fn q5_0_rows24_x128(bencher: Bencher, k: usize) {
    let ty = GgmlType::Q5_0;
    let mut rng = StdRng::seed_from_u64(3);
    let rb = ty.bytes_for(k).unwrap();
    let mut rows = vec![0u8; ROWS * rb];
    rng.fill(&mut rows[..]);
    for b in rows.chunks_exact_mut(ty.type_size()) {
        b[..2].copy_from_slice(&0x2C00u16.to_le_bytes());
    }
    let x: Vec<f32> = (0..TOKENS * k)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut xt = vec![0f32; packed_len(TOKENS, k)];
    pack_tokens(&x, TOKENS, k, &mut xt);
    let mut w = vec![0f32; ROWS * k];
    let mut out = vec![0f32; TOKENS * ROWS];
    bencher
        .counter(ItemsCount::new(2 * ROWS * TOKENS * k))
        .bench_local(|| {
            unpack_rows(ty, &rows, rb, k, &mut w);
            rows_matmul(&w, k, divan::black_box(&xt), TOKENS, &mut out, ROWS);
            divan::black_box(&out);
        });
}

/// One layer of the default model (Gemma 3 270M Q4_K_M): (format, rows, cols) of attn_q,
/// attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down.
const LAYER: [(GgmlType, usize, usize); 7] = [
    (GgmlType::Q5_0, 1024, 640),
    (GgmlType::Q5_0, 256, 640),
    (GgmlType::Q8_0, 256, 640),
    (GgmlType::Q4_K, 640, 1024),
    (GgmlType::Q5_0, 2048, 640),
    (GgmlType::Q5_0, 2048, 640),
    (GgmlType::Q6_K, 640, 2048),
];

/// Prefill tokens of the layer benchmark.
const PREFILL: usize = 512;

/// The seven matmuls of one layer for 512 tokens through the backend (thread pool, packing,
/// dequantization and all), as prefill runs them.
#[divan::bench(args = [1, 2], sample_count = 20)]
fn layer_x512(bencher: Bencher, threads: usize) {
    let mut rng = StdRng::seed_from_u64(5);
    let be = CpuBackend::new(threads).unwrap();
    let mut flops = 0;
    let mut mats = Vec::new();
    for (ty, rows, cols) in LAYER {
        let w = be
            .load_matrix(&random_matrix(&mut rng, ty, rows, cols))
            .unwrap();
        let x: Vec<f32> = (0..PREFILL * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut xb = be.alloc(x.len()).unwrap();
        be.write(&x, &mut xb).unwrap();
        let out = be.alloc(PREFILL * rows).unwrap();
        flops += 2 * PREFILL * rows * cols;
        mats.push((w, xb, out));
    }
    bencher.counter(ItemsCount::new(flops)).bench_local(|| {
        for (w, x, out) in &mut mats {
            be.matmul(x, PREFILL, w, out).unwrap();
        }
    });
}
