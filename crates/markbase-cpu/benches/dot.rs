//! `dot_row` on one 2048-weight row per format (weights and activations stay in L1, so this is
//! the kernels' compute speed), and `dot_rows` with 8 activation rows.
//! Run: `cargo bench -p markbase-cpu --bench dot`; throughput is weight bytes per second.

use divan::counter::BytesCount;
use divan::Bencher;
use markbase_core::quant::GgmlType;
use markbase_cpu::kernels::dot::{dot_row, dot_row_with, dot_rows};
use markbase_cpu::kernels::Isa;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const K: usize = 2048;

fn main() {
    divan::main();
}

/// A row of random bytes whose f16 scales are all 2^-4 (finite weights), and activations.
fn inputs(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(7);
    let mut row = vec![0u8; ty.bytes_for(K).unwrap()];
    match ty {
        GgmlType::F32 => {
            for b in row.chunks_exact_mut(4) {
                b.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            let one = if ty == GgmlType::F16 {
                0x3C00u16
            } else {
                0x3F80
            };
            for b in row.chunks_exact_mut(2) {
                b.copy_from_slice(&(one | rng.random_range(0..64u16)).to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut row[..]);
            let scale_at: &[usize] = match ty {
                GgmlType::Q2_K => &[80, 82],
                GgmlType::Q3_K => &[108],
                GgmlType::Q6_K => &[208],
                _ => &[0, 2],
            };
            for block in row.chunks_exact_mut(ty.type_size()) {
                for &at in scale_at {
                    block[at..at + 2].copy_from_slice(&0x2C00u16.to_le_bytes());
                }
            }
        }
    }
    let x = (0..K).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    (row, x)
}

#[divan::bench(args = GgmlType::SUPPORTED)]
fn row_2048(bencher: Bencher, ty: GgmlType) {
    let (row, x) = inputs(ty);
    bencher
        .counter(BytesCount::new(row.len()))
        .bench(|| dot_row(ty, divan::black_box(&row), divan::black_box(&x)));
}

#[divan::bench(args = GgmlType::SUPPORTED)]
fn row_2048_portable(bencher: Bencher, ty: GgmlType) {
    let (row, x) = inputs(ty);
    bencher.counter(BytesCount::new(row.len())).bench(|| {
        dot_row_with(
            Isa::Portable,
            ty,
            divan::black_box(&row),
            divan::black_box(&x),
        )
    });
}

#[divan::bench(args = GgmlType::SUPPORTED)]
fn rows_2048_x8(bencher: Bencher, ty: GgmlType) {
    let (row, x) = inputs(ty);
    let xs: Vec<f32> = (0..8).flat_map(|_| x.iter().copied()).collect();
    let mut out = [0f32; 8];
    bencher.counter(BytesCount::new(row.len())).bench_local(|| {
        dot_rows(
            ty,
            divan::black_box(&row),
            divan::black_box(&xs),
            K,
            &mut out,
        );
        divan::black_box(&out);
    });
}
