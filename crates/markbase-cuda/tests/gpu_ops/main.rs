//! Every CUDA kernel against the CPU reference (markbase-cpu's plain f64 twins, or the CPU
//! backend) on fresh random inputs — a new seed each run, printed so a failure can be
//! replayed with `MARKBASE_TEST_SEED`. Output buffers are poisoned with NaN first, so an
//! element a kernel forgot to write fails the comparison.
//!
//! Without a usable GPU (no driver, no device, no NVRTC) every test prints why and passes.

#[path = "../common/chain.rs"]
mod chain_ref;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/matrices.rs"]
mod matrices;

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use markbase_core::backend::{
    AttnSpec, Backend, HostBytes, HostMatrix, KvLayout, NewKv, NormOut, Rope, Strided, ValueRows,
};
use markbase_core::quant::GgmlType;
use markbase_core::sampling::Draw;
use markbase_cpu::reference;
use markbase_cuda::{
    gemv_takes_16_bit_activations, moe_groups_pairs, moe_on_tensor_cores, product_inputs,
    CudaBackend, CudaBuffer, CudaMatrix, ProductInputs, ATTN_FLASH_MIN_ROWS,
};
use rand::rngs::StdRng;
use rand::Rng;

use matrices::*;

fn gpu() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| {
        let b = common::backend_or_skip()?;
        eprintln!(
            "GPU: {} (sm_{}{}, {} SMs), cuBLAS {}",
            b.device().name(),
            b.device().capability().0,
            b.device().capability().1,
            b.device().multiprocessors(),
            if b.has_cublas() { "found" } else { "absent" }
        );
        Some(b)
    })
    .as_ref()
}

macro_rules! gpu_or_skip {
    () => {
        match gpu() {
            Some(g) => g,
            None => {
                eprintln!("skipped: no usable GPU");
                return;
            }
        }
    };
}

/// A second backend on the same GPU whose quantized matrices get no f16 copies, so that
/// products of 65–128 token rows run on the tensor-core kernels (mmq.rs) there while `gpu`'s
/// read the copies (f16_copies.rs).
fn gpu_without_copies() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| {
        let b = common::backend_or_skip()?;
        b.set_f16_copies(false);
        Some(b)
    })
    .as_ref()
}

/// The GPU backend with cuBLAS, or return from the test (no product rounds its activations
/// without it).
macro_rules! gpu_with_cublas_or_skip {
    () => {{
        let g = gpu_or_skip!();
        if !g.has_cublas() {
            eprintln!("skipped: no cuBLAS, so no product rounds its activations");
            return;
        }
        g
    }};
}

fn up(g: &CudaBackend, v: &[f32]) -> CudaBuffer {
    let mut b = g.alloc(v.len()).unwrap();
    g.write(v, &mut b).unwrap();
    b
}

fn poisoned(g: &CudaBackend, n: usize) -> CudaBuffer {
    up(g, &vec![f32::NAN; n])
}

fn down(g: &CudaBackend, b: &CudaBuffer, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    g.read(b, &mut v).unwrap();
    v
}

/// The activations `x` (`n` rows) and the weights `m` as a product sees them
/// (`product_inputs`, with cuBLAS): activations rounded to bf16 for bf16 weights; activations
/// and dequantized weights rounded to f16 for quantized ones (Q4_K weights of the tensor-core
/// kernel's products as it dequantizes them, `k_quant_as_f16_fma`, Q6_K's `q6k_as_f16`); otherwise
/// as they are, or as 16-bit integers per 32 values where the GEMVs take them so
/// (`as_16_bit`).
fn as_seen(g: &CudaBackend, m: &HostMatrix, n: usize, x: &[f32]) -> (Vec<f32>, HostMatrix) {
    as_seen_in(g, m, n, x, &[m.rows])
}

/// `as_seen` for a product in one call with matrices of `rows` rows each, `m` among them
/// (`matmul_many`: whether the tensor-core kernel takes them depends on them all,
/// `mmq_takes_products`).
fn as_seen_in(
    g: &CudaBackend,
    m: &HostMatrix,
    n: usize,
    x: &[f32],
    rows: &[usize],
) -> (Vec<f32>, HostMatrix) {
    let inputs = if g.has_cublas() {
        product_inputs(m.ty, m.cols, n)
    } else {
        ProductInputs::F32
    };
    match inputs {
        ProductInputs::F32 => {
            let xs = if gemv_takes_16_bit_activations(m.ty, m.cols) {
                x.chunks(m.cols).flat_map(as_16_bit).collect()
            } else {
                x.to_vec()
            };
            (xs, m.clone())
        }
        ProductInputs::Bf16 => {
            let xs = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            (xs, m.clone())
        }
        ProductInputs::F16 => {
            let xs = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            if g.mmq_takes_products(m.ty, m.cols, rows, n) {
                match m.ty {
                    GgmlType::Q4_K | GgmlType::Q5_K => return (xs, k_quant_as_f16_fma(m)),
                    GgmlType::Q6_K => return (xs, q6k_as_f16(m)),
                    _ => {}
                }
            }
            (xs, dequantized_as_f16(m))
        }
    }
}

/// Expert weights as the MoE tensor-core products (moe_mma.cu) see them: bf16 and f16 as
/// stored, Q4_K as `k_quant_as_f16_fma`, other formats as `dequantized_as_f16`.
fn moe_weights_as_seen(m: &HostMatrix) -> HostMatrix {
    match m.ty {
        GgmlType::BF16 | GgmlType::F16 => m.clone(),
        GgmlType::Q4_K | GgmlType::Q5_K => k_quant_as_f16_fma(m),
        _ => dequantized_as_f16(m),
    }
}

/// Row widths to try for a format: odd widths for the plain formats, and long ones whose
/// rows several GEMV warps share (split 4 at 2 056, split 8 at 4 104, a partial span last).
fn widths(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![8, 12, 40, 264, 2056, 4104],
        // Q8_0 rows lie on the device in groups of 8 blocks (layout.rs): 96 is a tail alone,
        // 800 three groups and a tail (staged), 512 / 4352 / 12800 whole groups on 16-bit
        // activations like Q4_K's super-blocks below. Q4_0 and Q5_0 rows of whole groups are
        // laid out likewise (96 and 800 stay as stored).
        32 if matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0) => {
            vec![96, 512, 800, 4352, 12800]
        }
        32 => vec![96, 512],
        // 17 and 33 super-blocks: Q4_K rows shared by 2 and 4 warps (2 at 8 token rows), a
        // last pass part-filled; 50: Q4_K activations staged in several tiles, the last
        // part-filled (48 + 2 super-blocks for one token row, 24 / 16 / 8 a tile for 2 / 4 / 8).
        _ => vec![256, 768, 4352, 8448, 12800],
    }
}

/// `g`'s product of the `n` rows `x` (on the device: `xb`) with `w` (stored as `m`), checked
/// against the reference as the product sees its inputs (`as_seen`); returns it.
fn matmul_checked(
    g: &CudaBackend,
    m: &HostMatrix,
    w: &CudaMatrix,
    n: usize,
    xb: &CudaBuffer,
    x: &[f32],
    what: &str,
) -> Vec<f32> {
    let (sx, sm) = as_seen(g, m, n, x);
    let want = reference::matmul(&sx, n, &sm).unwrap();
    let mut out = poisoned(g, n * m.rows);
    g.matmul(xb, n, w, &mut out).unwrap();
    let got = down(g, &out, n * m.rows);
    assert_close(
        &format!("{what} n={n}"),
        &got,
        &want,
        product_tolerance(m.cols),
    );
    got
}

/// (head_dim, heads, kv heads, window, softcap, block size, positions of each sequence).
type AttnCase = (
    usize,
    usize,
    usize,
    Option<usize>,
    Option<f32>,
    usize,
    Vec<Vec<u32>>,
);

/// Block tables for sequences reaching `last[s]`, blocks drawn in random order from a cache of
/// the returned block count (two spare); blocks wholly before every query's window are
/// `u32::MAX`, as a sliding pool leaves them.
fn random_tables(
    r: &mut StdRng,
    seqs: &[Vec<u32>],
    bs: usize,
    window: Option<usize>,
) -> (Vec<u32>, usize, usize) {
    let width = seqs
        .iter()
        .map(|p| p.iter().max().map_or(0, |&m| m as usize / bs + 1))
        .max()
        .unwrap_or(0)
        .max(1);
    let n_blocks = seqs.len() * width + 2;
    let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let mut tables = vec![u32::MAX; seqs.len() * width];
    for (s, pos) in seqs.iter().enumerate() {
        let lo = pos
            .iter()
            .map(|&p| window.map_or(0, |w| (p as usize + 1).saturating_sub(w)))
            .min()
            .unwrap_or(0);
        for b in lo / bs..width {
            tables[s * width + b] = ids[s * width + b];
        }
    }
    (tables, width, n_blocks)
}

mod attention;
mod chain;
mod elementwise;
mod moe;
mod norms;
mod products;
mod rounded;
mod sampling;
