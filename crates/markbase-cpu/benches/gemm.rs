//! The prefill GEMM on one core, as the backend runs it per task: 24 Q5_0 weight rows
//! dequantized, times 128 tokens packed in tiles, k = 640 and 2048. Throughput in FLOP/s is
//! 2 · 24 · 128 · k per iteration (divan reports it as "items").
//! Run: `cargo bench -p markbase-cpu --bench gemm`.

use divan::counter::ItemsCount;
use divan::Bencher;
use markbase_core::quant::GgmlType;
use markbase_cpu::kernels::gemm::{pack_tokens, packed_len, rows_matmul, unpack_rows};
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
