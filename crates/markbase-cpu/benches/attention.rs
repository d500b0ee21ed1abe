//! Attention through the backend on one thread at the default model's shape (4 query heads,
//! 1 KV head, head_dim 256, sliding window 512): a prefill chunk of 128 tokens at positions
//! 384..512 and one decode token at position 511. Throughput in FLOP/s counts 4 · head_dim
//! per (query head, visible key) (divan reports it as "items").
//! Run: `cargo bench -p markbase-cpu --bench attention`.

use divan::counter::ItemsCount;
use divan::Bencher;
use markbase_core::backend::{AttnSpec, Backend};
use markbase_cpu::CpuBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const HEADS: usize = 4;
const HD: usize = 256;
const RING: usize = 640;

fn main() {
    divan::main();
}

#[divan::bench(args = [1, 128])]
fn gemma3_270m_window(bencher: Bencher, n: usize) {
    let mut rng = StdRng::seed_from_u64(5);
    let be = CpuBackend::new(1).unwrap();
    let mut buf = |len: usize| {
        let v: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut b = be.alloc(len).unwrap();
        be.write(&v, &mut b).unwrap();
        b
    };
    let (q, kc, vc) = (buf(n * HEADS * HD), buf(RING * HD), buf(RING * HD));
    let mut out = be.alloc(n * HEADS * HD).unwrap();
    let positions: Vec<u32> = (512 - n as u32..512).collect();
    let spec = AttnSpec {
        n_heads: HEADS,
        n_kv_heads: 1,
        head_dim: HD,
        scale: 0.0625,
        window: Some(512),
        softcap: None,
        ring: RING,
    };
    let flops = positions
        .iter()
        .map(|&p| (p as usize + 1).min(512) * HEADS * HD * 4)
        .sum::<usize>();
    bencher.counter(ItemsCount::new(flops)).bench_local(|| {
        be.attention(&q, &kc, &vc, &spec, &positions, &mut out)
            .unwrap()
    });
}
