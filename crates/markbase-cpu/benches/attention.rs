//! Attention through the backend on one thread at the default model's shape (4 query heads,
//! 1 KV head, head_dim 256, sliding window 512): a prefill chunk of 128 tokens at positions
//! 384..512 and one decode token at position 511. Throughput in FLOP/s counts 4 · head_dim
//! per (query head, visible key) (divan reports it as "items").
//! Run: `cargo bench -p markbase-cpu --bench attention`.

use divan::counter::ItemsCount;
use divan::Bencher;
use markbase_core::backend::{AttnSpec, Backend, KvLayout};
use markbase_cpu::CpuBackend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const HEADS: usize = 4;
const HD: usize = 256;
/// Slots per KV block.
const BLOCK: usize = 16;
/// Blocks in the cache: positions 0..512, in a shuffled order.
const BLOCKS: usize = 32;

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
    let (q, kc, vc) = (
        buf(n * HEADS * HD),
        buf(BLOCKS * BLOCK * HD),
        buf(BLOCKS * BLOCK * HD),
    );
    let mut out = be.alloc(n * HEADS * HD).unwrap();
    let positions: Vec<u32> = (512 - n as u32..512).collect();
    let spec = AttnSpec {
        n_heads: HEADS,
        n_kv_heads: 1,
        head_dim: HD,
        scale: 0.0625,
        window: Some(512),
        softcap: None,
    };
    // One sequence whose blocks are scattered over the cache, as the block pool leaves them.
    let table: Vec<u32> = (0..BLOCKS as u32)
        .map(|b| (b * 7) % BLOCKS as u32)
        .collect();
    let seq_start = [0, n as u32];
    let layout = KvLayout {
        block_size: BLOCK,
        positions: &positions,
        seq_start: &seq_start,
        block_tables: &table,
        table_width: BLOCKS,
    };
    let flops = positions
        .iter()
        .map(|&p| (p as usize + 1).min(512) * HEADS * HD * 4)
        .sum::<usize>();
    bencher.counter(ItemsCount::new(flops)).bench_local(|| {
        be.attention(&q, &kc, &vc, &spec, &layout, &mut out)
            .unwrap()
    });
}
