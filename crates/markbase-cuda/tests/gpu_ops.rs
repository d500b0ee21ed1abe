//! Every CUDA kernel against the CPU reference (markbase-cpu's plain f64 twins, or the CPU
//! backend) on fresh random inputs — a new seed each run, printed so a failure can be
//! replayed with `MARKBASE_TEST_SEED`. Output buffers are poisoned with NaN first, so an
//! element a kernel forgot to write fails the comparison.
//!
//! Without a usable GPU (no driver, no device, no NVRTC) every test prints why and passes.

mod common;

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use markbase_core::backend::{
    AttnSpec, Backend, HostBytes, HostMatrix, KvLayout, NewKv, NormOut, Rope, Strided, ValueRows,
};
use markbase_core::quant::GgmlType;
use markbase_cpu::reference;
use markbase_cuda::{
    gemv_takes_16_bit_activations, moe_groups_pairs, moe_on_tensor_cores, product_inputs,
    CudaBackend, CudaBuffer, CudaMatrix, ProductInputs, SampleParams, ATTN_FLASH_MIN_ROWS,
};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

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

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("MARKBASE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn uniform(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-amp..amp)).collect()
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

/// `max |got − want| / max |want|`; NaN anywhere fails.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        if d.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(d);
    }
    worst / scale
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

/// Offsets of the f16 scale fields inside one block of `ty` (set to sane values; every other
/// byte of a quantized block is random).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// A random `[rows, cols]` matrix stored as `ty`.
fn random_matrix(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let n = rows * cols;
    let bytes: Vec<u8> = match ty {
        GgmlType::F32 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => uniform(r, n, 1.0)
            .into_iter()
            .flat_map(|v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => {
            let mut b = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
            r.fill_bytes(&mut b);
            for block in b.chunks_exact_mut(ty.type_size()) {
                for &o in scale_offsets(ty) {
                    let d = f16::from_f32(r.random_range(-0.05f32..0.05));
                    block[o..o + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
            b
        }
    };
    HostMatrix {
        name: format!("random {ty} [{rows}, {cols}]"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
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

/// A Q4_K or Q5_K matrix as the tensor-core kernels (mmq.cu, moe_mma.cu) dequantize it to f16:
/// each weight fma(q, S, −M) rounded once, S = f16(d · scale) and M = f16(dmin · min) each
/// rounded once (saturating at ±65 504). Checked against the reference's dequantization to
/// within those roundings.
fn k_quant_as_f16_fma(m: &HostMatrix) -> HostMatrix {
    let f16_sat = |v: f32| f16::from_f32(v.clamp(-65_504.0, 65_504.0));
    // Q5_K: 32 bytes of fifth bits (value l of chunk j at bit j of byte l) after the header.
    let (block, quants, top) = match m.ty {
        GgmlType::Q4_K => (144, 16, 15.0),
        GgmlType::Q5_K => (176, 48, 31.0),
        ty => panic!("{ty} is not Q4_K or Q5_K"),
    };
    let mut w = Vec::with_capacity(m.rows * m.cols);
    for b in m.bytes.as_slice().chunks_exact(block) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
        let sc = &b[4..16];
        for p in 0..256 {
            let (j, l) = (p / 64, p % 64);
            let chunk = 2 * j + l / 32;
            let (s, mn) = if chunk < 4 {
                (sc[chunk] & 63, sc[chunk + 4] & 63)
            } else {
                (
                    (sc[chunk + 4] & 15) | ((sc[chunk - 4] >> 6) << 4),
                    (sc[chunk + 4] >> 4) | ((sc[chunk] >> 6) << 4),
                )
            };
            let byte = b[quants + 32 * j + l % 32];
            let mut q = if l < 32 { byte & 15 } else { byte >> 4 };
            if m.ty == GgmlType::Q5_K {
                q |= ((b[16 + l % 32] >> chunk) & 1) << 4;
            }
            let s16 = f16_sat(d * f32::from(s)).to_f64();
            let m16 = f16_sat(dmin * f32::from(mn)).to_f64();
            w.push(f16::from_f64(f64::from(q) * s16 - m16));
        }
    }
    let exact = reference::dequantize_matrix(m).unwrap();
    for (i, (a, e)) in w.iter().zip(&exact).enumerate() {
        let b = &m.bytes.as_slice()[block * (i / 256)..];
        let scale = f16::from_le_bytes([b[0], b[1]]).to_f32().abs() * 63.0 * top
            + f16::from_le_bytes([b[2], b[3]]).to_f32().abs() * 63.0;
        let err = (a.to_f32() - e).abs();
        assert!(
            err <= scale / 1024.0,
            "weight {i}: {a} as the kernel's f16, {e} dequantized"
        );
    }
    f16_like(m, "the tensor cores' f16", &w)
}

/// A Q6_K matrix as the tensor-core kernel (mmq.cu, `MmqQ6k`) dequantizes it to f16: each
/// weight (q − 32) · S rounded once, S = f16(d · scale) rounded once (saturating at ±65 504).
/// Checked against the reference's dequantization to within those roundings.
fn q6k_as_f16(m: &HostMatrix) -> HostMatrix {
    let mut w = Vec::with_capacity(m.rows * m.cols);
    for b in m.bytes.as_slice().chunks_exact(210) {
        let d = f16::from_le_bytes([b[208], b[209]]).to_f32();
        for i in 0..256 {
            let (n, k, l) = (i / 128, (i % 128) / 32, i % 32);
            let lo = (b[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            let hi = (b[128 + 32 * n + l] >> (2 * k)) & 3;
            let q = i32::from(lo | (hi << 4)) - 32;
            let scale = f32::from(b[192 + i / 16] as i8);
            let s = f16::from_f32((d * scale).clamp(-65_504.0, 65_504.0)).to_f64();
            w.push(f16::from_f64(f64::from(q) * s));
        }
    }
    let exact = reference::dequantize_matrix(m).unwrap();
    for (i, (a, e)) in w.iter().zip(&exact).enumerate() {
        let b = &m.bytes.as_slice()[210 * (i / 256)..];
        let bound = f16::from_le_bytes([b[208], b[209]]).to_f32().abs() * 128.0 * 32.0;
        assert!(
            (a.to_f32() - e).abs() <= bound / 1024.0,
            "weight {i}: {a} as the kernel's f16, {e} dequantized"
        );
    }
    f16_like(m, "the tensor cores' f16", &w)
}

/// An f16 matrix of `m`'s shape holding `w`, named `m` "as" `what`.
fn f16_like(m: &HostMatrix, what: &str, w: &[f16]) -> HostMatrix {
    HostMatrix {
        name: format!("{} as {what}", m.name),
        ty: GgmlType::F16,
        rows: m.rows,
        cols: m.cols,
        bytes: HostBytes::Owned(Arc::from(
            w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
        )),
    }
}

/// `x` as 16-bit activations: each 32 values integers times max|x| / 32767, to nearest.
fn as_16_bit(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|c| {
            let m = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            c.iter().map(move |&v| {
                if m > 0.0 {
                    (v * (32767.0 / m)).round_ties_even() * (m / 32767.0)
                } else {
                    0.0
                }
            })
        })
        .collect()
}

/// `x` rounded to the 16-bit type the tensor-core products of weights stored as `ty` read:
/// bf16 for bf16 weights, else f16 saturating at ±65 504.
fn round_16(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            if ty == GgmlType::BF16 {
                bf16::from_f32(v).to_f32()
            } else {
                f16::from_f32(v.clamp(-65_504.0, 65_504.0)).to_f32()
            }
        })
        .collect()
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

/// `m` dequantized by the reference, each weight rounded once to f16.
fn dequantized_as_f16(m: &HostMatrix) -> HostMatrix {
    let w: Vec<f16> = reference::dequantize_matrix(m)
        .unwrap()
        .into_iter()
        .map(f16::from_f32)
        .collect();
    f16_like(m, "f16", &w)
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

/// The largest error relative to the largest output a product of rows `k` wide may show: the
/// tensor cores add f32 sums with truncation (not to nearest), so their error grows with the
/// k16 steps, about k/16 · 2^-23 of the partial sums, which on random inputs may exceed the
/// largest output (fresh random inputs showed Q4_K [2 560, 10 240] at 7 tokens 2.9e-5,
/// session 32, and Q4_K [4 100, 2 560] at 2 tokens 2.6e-5, session 33).
fn product_tolerance(k: usize) -> f32 {
    4e-5 * (k as f32 / 2_560.0).max(1.0)
}

#[test]
fn matmul_matches_reference_for_every_format_and_batch() {
    let g = gpu_or_skip!();
    let mut r = rng("matmul");
    for ty in GgmlType::SUPPORTED {
        for k in widths(ty) {
            let rows = 67;
            let m = random_matrix(&mut r, ty, rows, k);
            let w = g.load_matrix(&m).unwrap();
            // 1–8: one GEMV launch; 13: two; 40: cuBLAS (f32 and f16 weights in f32, bf16 and
            // quantized ones on the tensor cores, see `as_seen`); bf16 weights take the tensor
            // cores from 3 rows, Q4_K weights the tensor-core kernel for 2–64 (`mma_suits`).
            for n in [1, 2, 3, 8, 13, 40] {
                let x = uniform(&mut r, n * k, 1.0);
                matmul_checked(g, &m, &w, n, &up(g, &x), &x, &format!("matmul {ty} k={k}"));
            }
        }
    }
}

#[test]
fn matmul_many_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("matmul_many");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        // Three matrices (q, k, v-like): one launch or one shared rounding; a fourth of
        // another format among them takes a launch of its own, the three still sharing theirs.
        let mut mats: Vec<HostMatrix> = [37, 9, 9]
            .iter()
            .map(|&rows| random_matrix(&mut r, ty, rows, k))
            .collect();
        for other in [None, Some(GgmlType::F32)] {
            if let Some(o) = other {
                mats.insert(1, random_matrix(&mut r, o, 5, k));
            }
            let ws: Vec<_> = mats.iter().map(|m| g.load_matrix(m).unwrap()).collect();
            for n in [1, 3, 13, 40] {
                let x = uniform(&mut r, n * k, 1.0);
                let mut outs: Vec<CudaBuffer> =
                    mats.iter().map(|m| poisoned(g, n * m.rows)).collect();
                let mut products: Vec<_> = ws.iter().zip(outs.iter_mut()).collect();
                g.matmul_many(&up(g, &x), n, &mut products).unwrap();
                for (m, out) in mats.iter().zip(&outs) {
                    let (sx, sm) = as_seen(g, m, n, &x);
                    let want = reference::matmul(&sx, n, &sm).unwrap();
                    let got = down(g, out, n * m.rows);
                    let what = format!("matmul_many {ty} ({}) rows {} n={n}", mats.len(), m.rows);
                    assert_close(&what, &got, &want, product_tolerance(k));
                }
            }
        }
    }
}

#[test]
fn gelu_gated_matmul_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("gelu_gated_matmul");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        let ff = 45;
        let (gm, um) = (
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, ty, ff, k),
        );
        let (gw, uw) = (g.load_matrix(&gm).unwrap(), g.load_matrix(&um).unwrap());
        // 1–8 rows: the fused GEMV (one warp per gate / up row pair); 13: two launches; 40:
        // two cuBLAS products and the elementwise pass (Q4_K weights from 2 rows: two products
        // of the tensor-core kernel up to 32, then the pass).
        for n in [1, 3, 8, 13, 40] {
            let x = uniform(&mut r, n * k, 1.0);
            let ((sx, sg), (_, su)) = (as_seen(g, &gm, n, &x), as_seen(g, &um, n, &x));
            let want = reference::gelu_tanh_mul(
                &reference::matmul(&sx, n, &sg).unwrap(),
                &reference::matmul(&sx, n, &su).unwrap(),
            );
            let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
            g.gelu_gated_matmul(&up(g, &x), n, &gw, &uw, ff, &mut go, &mut uo)
                .unwrap();
            let got = down(g, &go, n * ff);
            assert_close(
                &format!("gated {ty} k={k} n={n}"),
                &got,
                &want,
                product_tolerance(k),
            );
        }
    }
    let m = random_matrix(&mut r, GgmlType::F32, 8, 16);
    let (a, b) = (g.load_matrix(&m).unwrap(), g.load_matrix(&m).unwrap());
    let (mut go, mut uo) = (poisoned(g, 16), poisoned(g, 16));
    let err = g
        .gelu_gated_matmul(&up(g, &[0.0; 16]), 1, &a, &b, 9, &mut go, &mut uo)
        .unwrap_err();
    assert!(err.to_string().contains("9 outputs"), "{err}");
}

/// One token row's products over more rows than the GPU holds warps at once: each warp of the
/// gated Q4_K walk (grid-stride over the resident blocks) takes several groups of rows, and
/// the one-warp-a-row kernels run several waves of blocks.
#[test]
fn one_token_products_over_many_rows_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("one-token walks");
    let rows = 9_001;
    for (ty, k) in [
        (GgmlType::BF16, 512),
        (GgmlType::F16, 256),
        (GgmlType::BF16, 2_560),
        (GgmlType::Q4_K, 512),
        (GgmlType::Q4_K, 768),
        (GgmlType::Q8_0, 512),
        (GgmlType::Q8_0, 768),
        (GgmlType::Q6_K, 512),
        (GgmlType::Q6_K, 768),
        (GgmlType::Q4_0, 512),
        (GgmlType::Q5_0, 768),
        (GgmlType::Q5_K, 768),
    ] {
        let (gm, um) = (
            random_matrix(&mut r, ty, rows, k),
            random_matrix(&mut r, ty, rows, k),
        );
        let (gw, uw) = (g.load_matrix(&gm).unwrap(), g.load_matrix(&um).unwrap());
        let x = uniform(&mut r, k, 1.0);
        let ((sx, sg), (_, su)) = (as_seen(g, &gm, 1, &x), as_seen(g, &um, 1, &x));
        let (gate, upv) = (
            reference::matmul(&sx, 1, &sg).unwrap(),
            reference::matmul(&sx, 1, &su).unwrap(),
        );
        let xb = up(g, &x);
        let mut out = poisoned(g, rows);
        g.matmul(&xb, 1, &gw, &mut out).unwrap();
        assert_close(
            &format!("matmul {ty} k={k} rows={rows}"),
            &down(g, &out, rows),
            &gate,
            2e-5,
        );
        let (mut go, mut uo) = (poisoned(g, rows), poisoned(g, rows));
        g.gelu_gated_matmul(&xb, 1, &gw, &uw, rows, &mut go, &mut uo)
            .unwrap();
        let want = reference::gelu_tanh_mul(&gate, &upv);
        assert_close(
            &format!("gated {ty} k={k} rows={rows}"),
            &down(g, &go, rows),
            &want,
            2e-5,
        );
    }
}

#[test]
fn one_token_products_over_an_lm_head_of_rows_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("one-token halves walk");
    // Q4_K (and Q8_0, Q6_K) matrices of 65 536 rows and more walk as two halves (pairs of 1
    // and of 2 rows a warp's group: 2 and 11 units a row); an odd count takes the plain GEMV.
    // Two products of each matrix, with fresh activations.
    for (ty, rows, k) in [
        (GgmlType::Q4_K, 65_538, 512),
        (GgmlType::Q4_K, 65_540, 2_816),
        (GgmlType::Q4_K, 65_537, 256),
        (GgmlType::Q4_K, 70_000, 2_560),
        (GgmlType::Q8_0, 65_538, 512),
        (GgmlType::Q8_0, 65_540, 2_816),
        (GgmlType::Q6_K, 65_538, 512),
        (GgmlType::Q6_K, 65_540, 2_816),
        (GgmlType::Q6_K, 65_537, 2_560),
        (GgmlType::Q4_0, 65_538, 512),
        (GgmlType::Q5_0, 65_540, 2_816),
        (GgmlType::Q5_K, 65_538, 512),
    ] {
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        for round in 0..2 {
            let x = uniform(&mut r, k, 1.0);
            let what = format!("matmul {ty} k={k} rows={rows} round {round}");
            matmul_checked(g, &m, &w, 1, &up(g, &x), &x, &what);
        }
    }
}

/// Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 products of 2–64 token rows on the tensor cores over
/// matrices of many row
/// tiles and long rows (tiles whose units several blocks share, part-filled tiles and splits),
/// every n-tile count and a part-filled n-tile; a second run gives the same bits. Then
/// several matrices in one launch.
#[test]
fn tensor_core_products_match_reference_and_repeat_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("tensor cores");
    let shapes = [
        (GgmlType::Q4_K, 2_560, 10_240),
        (GgmlType::Q4_K, 4_100, 2_560),
        (GgmlType::Q4_K, 333, 2_816),
        (GgmlType::Q8_0, 2_560, 10_240),
        (GgmlType::Q8_0, 333, 2_816),
        (GgmlType::Q6_K, 2_560, 10_240),
        (GgmlType::Q6_K, 333, 2_816),
        (GgmlType::Q5_K, 2_560, 10_240),
        (GgmlType::Q5_K, 333, 2_816),
        (GgmlType::Q4_0, 2_560, 10_240),
        (GgmlType::Q5_0, 333, 2_816),
    ];
    for (ty, rows, k) in shapes {
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        // 33–64: one launch of 8 n-tiles, or where it would split the tiles 8 ways or more
        // ([2 560, 10 240], [333, 2 816] on an H200) two launches up to 48 rows and cuBLAS on
        // the weights dequantized to f16 at 64 (`as_seen` models which).
        for n in [2, 7, 16, 29, 32, 41, 48, 64] {
            let x = uniform(&mut r, n * k, 1.0);
            let xb = up(g, &x);
            let got = matmul_checked(g, &m, &w, n, &xb, &x, &format!("{ty} [{rows}, {k}]"));
            let mut again = poisoned(g, n * rows);
            g.matmul(&xb, n, &w, &mut again).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&down(g, &again, n * rows)), bits(&got), "n={n} rerun");
        }
    }
    // Three matrices in one launch (q, k, v-like), tiles of each split over several blocks.
    let k = 2_560;
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
    ] {
        let mats: Vec<HostMatrix> = [2_048, 512, 520]
            .iter()
            .map(|&rows| random_matrix(&mut r, ty, rows, k))
            .collect();
        let ws: Vec<_> = mats.iter().map(|m| g.load_matrix(m).unwrap()).collect();
        // 50 and 64: one launch of 8 n-tiles, or two of 4 (one matrix alone: cuBLAS).
        for n in [5, 24, 50, 64] {
            let x = uniform(&mut r, n * k, 1.0);
            let mut outs: Vec<CudaBuffer> = mats.iter().map(|m| poisoned(g, n * m.rows)).collect();
            let mut products: Vec<_> = ws.iter().zip(outs.iter_mut()).collect();
            g.matmul_many(&up(g, &x), n, &mut products).unwrap();
            let rows: Vec<usize> = mats.iter().map(|m| m.rows).collect();
            for (m, out) in mats.iter().zip(&outs) {
                let (sx, sm) = as_seen_in(g, m, n, &x, &rows);
                let want = reference::matmul(&sx, n, &sm).unwrap();
                let what = format!("matmul_many {ty} rows {} n={n}", m.rows);
                assert_close(
                    &what,
                    &down(g, out, n * m.rows),
                    &want,
                    product_tolerance(k),
                );
            }
        }
    }
}

/// The gated feed-forward of a few token rows over Q4_K and Q8_0 weights as the tensor-core
/// launches (mmq.cu): gate and up in one launch storing gelu_tanh(gate) · up as f16, then
/// down; tiles split over several blocks and not, part-filled n-tiles. A second run gives the
/// same bits.
#[test]
fn gated_ffn_on_tensor_cores_matches_reference_and_repeats_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("gated ffn tensor cores");
    let f16_sat = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|x| f16::from_f32(x.clamp(-65_504.0, 65_504.0)).to_f32())
            .collect()
    };
    for (ty, k, ff, d) in [
        (GgmlType::Q4_K, 512, 1_024, 512),
        (GgmlType::Q4_K, 2_560, 10_240, 2_560),
        (GgmlType::Q8_0, 768, 1_280, 512),
        (GgmlType::Q6_K, 2_560, 1_280, 2_560),
        (GgmlType::Q5_K, 768, 1_280, 512),
        (GgmlType::Q4_0, 512, 1_024, 512),
    ] {
        let (gm, um, dm) = (
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, ty, ff, k),
            random_matrix(&mut r, ty, d, ff),
        );
        let [gw, uw, dw] = [&gm, &um, &dm].map(|m| g.load_matrix(m).unwrap());
        for n in [2, 8, 29, 45] {
            let x = uniform(&mut r, n * k, 1.0);
            let (sx, sg) = as_seen(g, &gm, n, &x);
            let (_, su) = as_seen(g, &um, n, &x);
            let gate = reference::matmul(&sx, n, &sg).unwrap();
            let upv = reference::matmul(&sx, n, &su).unwrap();
            let act = f16_sat(reference::gelu_tanh_mul(&gate, &upv));
            let (sa, sd) = as_seen(g, &dm, n, &act);
            let want = reference::matmul(&sa, n, &sd).unwrap();
            let mut got = Vec::new();
            for _ in 0..2 {
                let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
                let mut out = poisoned(g, n * d);
                g.gated_ffn(&up(g, &x), n, &gw, &uw, &dw, ff, &mut go, &mut uo, &mut out)
                    .unwrap();
                got.push(down(g, &out, n * d));
            }
            let what = format!("gated ffn {ty} [{k}, {ff}, {d}] n={n}");
            assert_close(&what, &got[0], &want, 2e-3);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got[1]), bits(&got[0]), "{what} rerun");
        }
    }
}

#[test]
fn gelu_matmul_mul_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("gelu_matmul_mul");
    for ty in GgmlType::SUPPORTED {
        let k = *widths(ty).last().unwrap();
        let rows = 37;
        let m = random_matrix(&mut r, ty, rows, k);
        let w = g.load_matrix(&m).unwrap();
        // The gate's rows are a slice of wider rows (Gemma 4's per-layer inputs of one layer).
        let from = Strided {
            offset: 2 * rows + 3,
            stride: 4 * rows,
        };
        // 1–8 rows: one GEMV launch reading the slice in place; 13: two; 40: the product, a
        // copy of the slice and the elementwise pass (so too Q4_K weights from 2 rows).
        for n in [1, 3, 8, 13, 40] {
            let x = uniform(&mut r, n * k, 1.0);
            let other = uniform(&mut r, from.at(n), 2.0);
            let (sx, sm) = as_seen(g, &m, n, &x);
            let slice: Vec<f32> = (0..n)
                .flat_map(|t| other[from.at(t)..from.at(t) + rows].to_vec())
                .collect();
            let want = reference::gelu_tanh_mul(&reference::matmul(&sx, n, &sm).unwrap(), &slice);
            let (mut out, mut scratch) = (poisoned(g, n * rows), poisoned(g, n * rows));
            g.gelu_matmul_mul(
                &up(g, &x),
                n,
                &w,
                rows,
                &up(g, &other),
                from,
                &mut out,
                &mut scratch,
            )
            .unwrap();
            let got = down(g, &out, n * rows);
            assert_close(
                &format!("gelu_matmul_mul {ty} k={k} n={n}"),
                &got,
                &want,
                product_tolerance(k),
            );
        }
        let mut out = poisoned(g, rows);
        let mut scratch = poisoned(g, rows);
        let err = g.gelu_matmul_mul(
            &up(g, &vec![0.0; k]),
            1,
            &w,
            rows + 1,
            &up(g, &vec![0.0; 8 * rows]),
            from,
            &mut out,
            &mut scratch,
        );
        assert!(
            err.is_err(),
            "a row count unlike the matrix's must be refused"
        );
    }
}

/// Rows `r0 .. r0 + count` of `m`, as stored.
fn rows_of(m: &HostMatrix, r0: usize, count: usize) -> HostMatrix {
    let rb = m.row_bytes();
    HostMatrix {
        name: format!("{} rows {r0}..{}", m.name, r0 + count),
        ty: m.ty,
        rows: count,
        cols: m.cols,
        bytes: HostBytes::Owned(Arc::from(&m.bytes.as_slice()[r0 * rb..(r0 + count) * rb])),
    }
}

/// Expert rows of one `moe_ffn` case: the stacked weights as stored and as loaded.
struct Experts {
    n_experts: usize,
    gate_up: HostMatrix,
    down: HostMatrix,
    gate_up_dev: CudaMatrix,
    down_dev: CudaMatrix,
}

impl Experts {
    /// Random experts stored as `ty`: gate/up rows `d` wide, down rows `f` wide.
    fn new(
        g: &CudaBackend,
        r: &mut StdRng,
        ty: GgmlType,
        n_experts: usize,
        d: usize,
        f: usize,
    ) -> Self {
        let gate_up = random_matrix(r, ty, n_experts * 2 * f, d);
        let down = random_matrix(r, ty, n_experts * d, f);
        Experts {
            n_experts,
            gate_up_dev: g.load_matrix(&gate_up).unwrap(),
            down_dev: g.load_matrix(&down).unwrap(),
            gate_up,
            down,
        }
    }

    /// `moe_ffn` on the reference twins: token t adds w · expert_e(x_t) for each (w, e) of its
    /// `top_k` routes (e = None: a bad id, which adds nothing). The products see their inputs
    /// as `g` takes them for `n` tokens: on the tensor cores (`moe_on_tensor_cores`: the down
    /// products, and the gate/up products of grouped pairs) activations rounded to 16 bits
    /// and weights as `moe_weights_as_seen`; otherwise as GEMVs, which take them as 16-bit
    /// integers where `gemv_takes_16_bit_activations`.
    fn reference(
        &self,
        g: &CudaBackend,
        x: &[f32],
        route: &[(f32, Option<usize>)],
        top_k: usize,
    ) -> Vec<f32> {
        let (d, f) = (self.gate_up.cols, self.down.cols);
        let n = x.len() / d;
        let tensor_cores = g.device().capability().0 >= 8
            && moe_on_tensor_cores(self.gate_up.ty, self.down.ty, d, f);
        // The down products run on the tensor cores on both paths, the gate/up products only
        // for grouped pairs (one pair's are GEMVs).
        let gate_up_mma =
            tensor_cores && moe_groups_pairs(n, self.n_experts, self.gate_up.ty, (d, f), true);
        let seen = |mma: bool, ty: GgmlType, v: &[f32]| {
            if mma {
                round_16(ty, v)
            } else if gemv_takes_16_bit_activations(ty, v.len()) {
                as_16_bit(v)
            } else {
                v.to_vec()
            }
        };
        let as_seen = |mma: bool, m: &HostMatrix| {
            if mma {
                moe_weights_as_seen(m)
            } else {
                m.clone()
            }
        };
        let (gate_up, down) = (
            as_seen(gate_up_mma, &self.gate_up),
            as_seen(tensor_cores, &self.down),
        );
        let mut want = vec![0f32; x.len()];
        for (t, routes) in route.chunks(top_k).enumerate() {
            let xt = seen(gate_up_mma, self.gate_up.ty, &x[t * d..(t + 1) * d]);
            for &(w, e) in routes {
                let Some(e) = e else { continue };
                let gate = reference::matmul(&xt, 1, &rows_of(&gate_up, e * 2 * f, f)).unwrap();
                let upv = reference::matmul(&xt, 1, &rows_of(&gate_up, e * 2 * f + f, f)).unwrap();
                let h = seen(
                    tensor_cores,
                    self.down.ty,
                    &reference::gelu_tanh_mul(&gate, &upv),
                );
                let y = reference::matmul(&h, 1, &rows_of(&down, e * d, d)).unwrap();
                for (o, v) in want[t * d..(t + 1) * d].iter_mut().zip(y) {
                    *o += w * v;
                }
            }
        }
        want
    }

    /// Queues `moe_ffn` of the token rows `x` on the GPU with each token's `top_k` expert ids
    /// `ids` (as f32, the Backend contract); returns the output buffer.
    fn run(
        &self,
        g: &CudaBackend,
        x: &[f32],
        top_k: usize,
        weights: &[f32],
        ids: &[f32],
    ) -> CudaBuffer {
        let n = x.len() / self.gate_up.cols;
        let mut out = poisoned(g, n * self.gate_up.cols);
        g.moe_ffn(
            &up(g, x),
            n,
            &self.gate_up_dev,
            &self.down_dev,
            self.n_experts,
            top_k,
            &up(g, weights),
            &up(g, ids),
            &mut out,
        )
        .unwrap();
        out
    }
}

/// Routes of `n` tokens: each token's `top_k` distinct experts, consecutive (mod the count)
/// among those of `0..n_experts` other than `left_out`, with random weights.
fn moe_routes(
    r: &mut StdRng,
    n: usize,
    n_experts: usize,
    top_k: usize,
    left_out: Option<usize>,
) -> Vec<(f32, usize)> {
    let chosen: Vec<usize> = (0..n_experts).filter(|&e| Some(e) != left_out).collect();
    let mut route = Vec::new();
    for _ in 0..n {
        let first = r.random_range(0..chosen.len());
        for j in 0..top_k {
            route.push((
                r.random_range(0.1f32..1.0),
                chosen[(first + j) % chosen.len()],
            ));
        }
    }
    route
}

#[test]
fn moe_route_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_route");
    // 26B-A4B's 128 experts, top 8, for one token and a batch; 40 experts (a lane's last
    // slots partly past the count), top 3; 256 experts, top 32 (every lane keeps a choice).
    for (n, n_experts, top_k) in [(1, 128, 8), (37, 128, 8), (5, 40, 3), (3, 256, 32)] {
        let logits = uniform(&mut r, n * n_experts, 4.0);
        let scale: Vec<f32> = (0..n_experts)
            .map(|_| r.random_range(0.5f32..2.0))
            .collect();
        let (mut weights, mut ids) = (poisoned(g, n * top_k), poisoned(g, n * top_k));
        g.moe_route(
            &up(g, &logits),
            n,
            n_experts,
            top_k,
            &up(g, &scale),
            &mut weights,
            &mut ids,
        )
        .unwrap();
        let want = reference::moe_route(&logits, n_experts, top_k, &scale);
        let what = format!("moe_route n={n} experts={n_experts} top_k={top_k}");
        let got_ids: Vec<usize> = down(g, &ids, n * top_k)
            .iter()
            .map(|&e| e as usize)
            .collect();
        let want_ids: Vec<usize> = want.iter().map(|&(_, e)| e).collect();
        assert_eq!(got_ids, want_ids, "{what}: experts chosen");
        let want_w: Vec<f32> = want.iter().map(|&(w, _)| w).collect();
        assert_close(&what, &down(g, &weights, n * top_k), &want_w, 1e-5);
    }
    // More choices than lanes is a clear error, not a wrong answer.
    let (mut weights, mut ids) = (poisoned(g, 33), poisoned(g, 33));
    let err = g
        .moe_route(
            &up(g, &[0.0; 64]),
            1,
            64,
            33,
            &up(g, &[1.0; 64]),
            &mut weights,
            &mut ids,
        )
        .unwrap_err();
    assert!(err.to_string().contains("top 33 of 64"), "{err}");
}

#[test]
fn moe_ffn_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_ffn");
    for ty in GgmlType::SUPPORTED {
        // Row widths of whole blocks: d for the gate/up rows, f for the down rows; plain rows
        // also at widths that are not multiples of 8 (which stay on the per-pair path).
        let mut shapes = vec![match ty.block_size() {
            1 => (264, 40),
            32 => (96, 64),
            _ => (768, 512),
        }];
        if ty.block_size() == 1 {
            // 260 × 36: not a multiple of 8; 256 × 192: whole 64-value units of the tensor
            // cores (bf16, f16).
            shapes.extend([(260, 36), (256, 192)]);
        }
        if ty == GgmlType::Q8_0 {
            // Rows of whole 256-value groups: the GEMVs on 16-bit activations, and on the
            // tensor cores 16-byte aligned quants. 320 × 192: a group and two blocks as stored
            // (quants 2- and 4-byte aligned), and blocks as stored only. 2 816 × 704: 26B-A4B's
            // experts.
            shapes.extend([(512, 256), (320, 192), (2_816, 704)]);
        }
        if ty == GgmlType::Q5_0 {
            // Whole 64-value units on the tensor cores, blocks as stored (2-byte aligned) or
            // laid out (rows of whole 8-block units, layout.rs): 26B-A4B's experts in
            // llama.cpp's Q4_K_M keep their down rows (704 wide) in Q5_0.
            shapes.extend([(320, 192), (512, 256), (2_816, 704)]);
        }
        if ty == GgmlType::Q4_0 {
            // Rows of whole 8-block units, laid out (the GEMVs on 16-bit activations), and on
            // the tensor cores as laid out or as stored (26B-A4B's experts).
            shapes.extend([(512, 256), (320, 192), (2_816, 704)]);
        }
        if ty == GgmlType::Q5_1 {
            // Whole 64-value units on the tensor cores (blocks as stored): llama.cpp's Q5_K_M
            // of 26B-A4B keeps its experts' down rows (704 wide) in Q5_1.
            shapes.extend([(320, 192), (2_816, 704)]);
        }
        for (d, f) in shapes {
            // (tokens, experts, top_k, an expert no token chooses): 3 tokens take the per-pair
            // path; 13 tokens over 3 experts of which one is left out, the grouped path with
            // two experts of 13 pairs each (a full tile of 8 and one of 5) and one of none; 16
            // tokens, 3 of 5 experts each, tiles of uneven sizes.
            for (n, n_experts, top_k, leave_out) in
                [(3, 4, 2, false), (13, 3, 2, true), (16, 5, 3, false)]
            {
                let on_tensor_cores =
                    g.device().capability().0 >= 8 && moe_on_tensor_cores(ty, ty, d, f);
                let grouped = moe_groups_pairs(n, n_experts, ty, (d, f), on_tensor_cores);
                assert_eq!(
                    grouped,
                    n > 3 && d % 8 == 0 && f % 8 == 0,
                    "n = {n}: not the path this case is for"
                );
                let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
                let x = uniform(&mut r, n * d, 1.0);
                let left_out = leave_out.then(|| r.random_range(0..n_experts));
                let route = moe_routes(&mut r, n, n_experts, top_k, left_out);
                let weights: Vec<f32> = route.iter().map(|&(w, _)| w).collect();
                let ids: Vec<f32> = route.iter().map(|&(_, e)| e as f32).collect();
                let out = experts.run(g, &x, top_k, &weights, &ids);
                let got = down(g, &out, n * d);
                let route: Vec<_> = route.iter().map(|&(w, e)| (w, Some(e))).collect();
                let want = experts.reference(g, &x, &route, top_k);
                // With the down products on the tensor cores the gated activations are rounded
                // to 16 bits between the products, where a sum a rounding step apart flips one
                // (as in the gated feed-forward test).
                assert_close(
                    &format!("moe_ffn {ty} d={d} f={f} n={n} experts={n_experts} top_k={top_k}"),
                    &got,
                    &want,
                    if on_tensor_cores { 2e-3 } else { 5e-5 },
                );
                // The same inputs again give the same bits (the grouping's order is fixed).
                let again = down(g, &experts.run(g, &x, top_k, &weights, &ids), n * d);
                assert!(
                    got.iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "moe_ffn {ty} n={n}: a second run differs"
                );
            }
        }
    }
}

/// Operations queued after `next_beside_previous` run beside the product ahead of them (an
/// rms_norm; the per-pair experts' first kernel; the grouped experts, which ignore the hint)
/// and give the bits they give in order, also to the product after them that reads them.
#[test]
fn operations_beside_the_previous_give_their_ordered_bits() {
    let g = gpu_or_skip!();
    let mut r = rng("beside");
    // A long one-token product ahead (26B-A4B's width), which the next operation does not
    // touch.
    let (d, rows) = (2816, 8192);
    let long = g
        .load_matrix(&random_matrix(&mut r, GgmlType::BF16, rows, d))
        .unwrap();
    let (x, h) = (
        up(g, &uniform(&mut r, d, 1.0)),
        up(g, &uniform(&mut r, d, 2.0)),
    );
    let gain = g.load_vector(&uniform(&mut r, d, 1.0)).unwrap();
    let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let norm_then_product = |beside: bool| {
        let (mut ahead, mut normed, mut after) =
            (poisoned(g, rows), poisoned(g, d), poisoned(g, rows));
        g.matmul(&x, 1, &long, &mut ahead).unwrap();
        if beside {
            g.next_beside_previous();
        }
        g.rms_norm(&h, Some(&gain), 1e-6, 1, d, &mut normed, NormOut::Write)
            .unwrap();
        g.matmul(&normed, 1, &long, &mut after).unwrap();
        [
            down(g, &ahead, rows),
            down(g, &normed, d),
            down(g, &after, rows),
        ]
        .concat()
    };
    assert_eq!(
        bits(norm_then_product(true)),
        bits(norm_then_product(false)),
        "rms_norm beside a product"
    );
    // 3 tokens: the per-pair path; 16 tokens of 5 experts: grouped.
    for (ty, n, n_experts, top_k, f) in [
        (GgmlType::BF16, 3, 4, 2, 704),
        (GgmlType::Q8_0, 3, 8, 4, 704),
        (GgmlType::BF16, 16, 5, 3, 704),
    ] {
        let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
        let route = moe_routes(&mut r, n, n_experts, top_k, None);
        let weights = up(g, &route.iter().map(|&(w, _)| w).collect::<Vec<_>>());
        let ids = up(g, &route.iter().map(|&(_, e)| e as f32).collect::<Vec<_>>());
        let xs = up(g, &uniform(&mut r, n * d, 1.0));
        let experts_after_product = |beside: bool| {
            let (mut ahead, mut out) = (poisoned(g, rows), poisoned(g, n * d));
            g.matmul(&x, 1, &long, &mut ahead).unwrap();
            if beside {
                g.next_beside_previous();
            }
            let (gu, dn) = (&experts.gate_up_dev, &experts.down_dev);
            g.moe_ffn(&xs, n, gu, dn, n_experts, top_k, &weights, &ids, &mut out)
                .unwrap();
            [down(g, &ahead, rows), down(g, &out, n * d)].concat()
        };
        assert_eq!(
            bits(experts_after_product(true)),
            bits(experts_after_product(false)),
            "moe_ffn {ty} n={n} beside a product"
        );
    }
}

#[test]
fn moe_ffn_reports_a_bad_expert_id_on_both_paths() {
    if gpu().is_none() {
        eprintln!("skipped: no usable GPU");
        return;
    }
    // A backend of its own: the error word is the backend's, and a test sharing one would
    // see this test's error at its next read.
    let g = &CudaBackend::new(0).unwrap();
    let mut r = rng("moe_ffn bad id");
    let (ty, n_experts, top_k) = (GgmlType::BF16, 4, 2);
    // 264 × 40: GEMVs on both paths; 256 × 192: the tensor cores (the down products on both
    // paths), where a bad id's tile gives outputs of 0.
    for (d, f) in [(264, 40), (256, 192)] {
        let tensor_cores = g.device().capability().0 >= 8 && moe_on_tensor_cores(ty, ty, d, f);
        let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
        for n in [3, 13] {
            assert_eq!(
                moe_groups_pairs(n, n_experts, ty, (d, f), tensor_cores),
                n == 13
            );
            for bad in [n_experts as f32, 1.5, -1.0, f32::NAN] {
                let x = uniform(&mut r, n * d, 1.0);
                let mut route: Vec<_> = moe_routes(&mut r, n, n_experts, top_k, None)
                    .into_iter()
                    .map(|(w, e)| (w, Some(e)))
                    .collect();
                let which = r.random_range(0..n * top_k);
                route[which].1 = None;
                let weights: Vec<f32> = route.iter().map(|&(w, _)| w).collect();
                let ids: Vec<f32> = route
                    .iter()
                    .map(|&(_, e)| e.map_or(bad, |e| e as f32))
                    .collect();
                let out = experts.run(g, &x, top_k, &weights, &ids);
                // The read reports the bad id, after copying the output: the pair added
                // nothing.
                let mut got = vec![0f32; n * d];
                let err = g
                    .read(&out, &mut got)
                    .expect_err("a bad expert id must be reported");
                assert!(err.to_string().contains("expert id"), "{err}");
                let want = experts.reference(g, &x, &route, top_k);
                assert_close(
                    &format!("moe_ffn {d} × {f} n={n} with id {bad} at pair {which}"),
                    &got,
                    &want,
                    if tensor_cores { 2e-3 } else { 5e-5 },
                );
                // Reported once: the next read is clean.
                g.read(&out, &mut got).unwrap();
            }
        }
    }
}

#[test]
fn embed_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("embed");
    for ty in GgmlType::SUPPORTED {
        for k in widths(ty) {
            let m = random_matrix(&mut r, ty, 50, k);
            let w = g.load_matrix(&m).unwrap();
            let tokens: Vec<u32> = (0..7).map(|_| r.random_range(0..50)).collect();
            let scale = r.random_range(0.5f32..3.0);
            let want = reference::embed(&m, &tokens, scale).unwrap();
            let mut out = poisoned(g, tokens.len() * k);
            g.embed(&w, &tokens, scale, &mut out).unwrap();
            let got = down(g, &out, tokens.len() * k);
            assert_close(&format!("embed {ty} k={k}"), &got, &want, 1e-6);
            let bad = g.embed(&w, &[50], 1.0, &mut out);
            assert!(bad.is_err(), "token id past the table must be an error");
        }
    }
}

#[test]
fn rms_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("rms_norm");
    for dim in [8, 640, 1000, 2560] {
        let n = 5;
        let x = uniform(&mut r, n * dim, 3.0);
        let w: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let base = uniform(&mut r, n * dim, 1.0);
        let (xb, wb) = (up(g, &x), g.load_vector(&w).unwrap());
        for weighted in [false, true] {
            let wref = weighted.then_some(&w[..]);
            let normed = reference::rms_norm(&x, wref, 1e-6, dim);
            for mode in [NormOut::Write, NormOut::AddTo] {
                let mut out = match mode {
                    NormOut::Write => poisoned(g, n * dim),
                    NormOut::AddTo => up(g, &base),
                };
                g.rms_norm(&xb, weighted.then_some(&wb), 1e-6, n, dim, &mut out, mode)
                    .unwrap();
                let want: Vec<f32> = match mode {
                    NormOut::Write => normed.clone(),
                    NormOut::AddTo => normed.iter().zip(&base).map(|(a, b)| a + b).collect(),
                };
                let got = down(g, &out, n * dim);
                assert_close(
                    &format!("rms_norm {dim} {weighted} {mode:?}"),
                    &got,
                    &want,
                    1e-5,
                );
            }
        }
    }
}

/// `residual_norm` on the reference twins (eps 1e-6): `h' = (h + rms_norm(y) · w) · scale`
/// and the next norm `rms_norm(h') · w2`.
fn residual_norm_reference(
    y: &[f32],
    w: &[f32],
    h: &[f32],
    scale: f32,
    w2: &[f32],
    dim: usize,
) -> (Vec<f32>, Vec<f32>) {
    let normed = reference::rms_norm(y, Some(w), 1e-6, dim);
    let want_h: Vec<f32> = h
        .iter()
        .zip(&normed)
        .map(|(a, b)| (a + b) * scale)
        .collect();
    let want_x = reference::rms_norm(&want_h, Some(w2), 1e-6, dim);
    (want_h, want_x)
}

#[test]
fn moe_residual_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_residual_norm");
    // 26B-A4B's width for one and three tokens, a prefill-sized batch, a tiny row.
    for (dim, n) in [(2816, 1), (2816, 3), (1000, 70), (8, 3)] {
        let dense = uniform(&mut r, n * dim, 3.0);
        let experts = uniform(&mut r, n * dim, 0.5);
        let h = uniform(&mut r, n * dim, 2.0);
        let gain =
            |r: &mut StdRng| -> Vec<f32> { uniform(r, dim, 1.0).iter().map(|v| v + 1.0).collect() };
        let (wd, we, w, w2) = (gain(&mut r), gain(&mut r), gain(&mut r), gain(&mut r));
        let scale = r.random_range(0.25f32..2.0);
        let mix: Vec<f32> = reference::rms_norm(&dense, Some(&wd), 1e-6, dim)
            .iter()
            .zip(reference::rms_norm(&experts, Some(&we), 1e-6, dim))
            .map(|(a, b)| a + b)
            .collect();
        let (want_h, want_x) = residual_norm_reference(&mix, &w, &h, scale, &w2, dim);
        let vector = |v: &[f32]| g.load_vector(v).unwrap();
        let (wdb, web, wb, w2b) = (vector(&wd), vector(&we), vector(&w), vector(&w2));
        let (db, eb) = (up(g, &dense), up(g, &experts));
        for with_next in [false, true] {
            let mut hb = up(g, &h);
            let mut xb = poisoned(g, n * dim);
            let mut mixb = poisoned(g, n * dim);
            let next = with_next.then_some((&w2b, &mut xb));
            g.moe_residual_norm(
                (&db, &wdb),
                (&eb, &web),
                &mut mixb,
                &wb,
                1e-6,
                n,
                dim,
                &mut hb,
                scale,
                next,
            )
            .unwrap();
            let what = format!("moe_residual_norm {dim} × {n} next={with_next}");
            assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
            if with_next {
                assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
            }
        }
    }
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let (short, mut hb, mut mixb) = (up(g, &[1.0; 4]), up(g, &[0.0; 8]), up(g, &[0.0; 8]));
    let err = g.moe_residual_norm(
        (&yb, &wb),
        (&short, &wb),
        &mut mixb,
        &wb,
        1e-6,
        1,
        8,
        &mut hb,
        1.0,
        None,
    );
    assert!(
        err.is_err(),
        "experts' rows shorter than the dense rows must be refused"
    );
}

#[test]
fn residual_norm_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("residual_norm");
    // Few rows (decode: four values a thread) and many (prefill: eight).
    for (dim, n) in [
        (8, 3),
        (640, 3),
        (1000, 70),
        (2560, 3),
        (2560, 70),
        (5376, 3),
        (8192, 70),
    ] {
        let y = uniform(&mut r, n * dim, 3.0);
        let h = uniform(&mut r, n * dim, 2.0);
        let w: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let w2: Vec<f32> = uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect();
        let scale = r.random_range(0.25f32..2.0);
        let (yb, wb, w2b) = (
            up(g, &y),
            g.load_vector(&w).unwrap(),
            g.load_vector(&w2).unwrap(),
        );
        let (want_h, want_x) = residual_norm_reference(&y, &w, &h, scale, &w2, dim);
        for with_next in [false, true] {
            let mut hb = up(g, &h);
            let mut xb = poisoned(g, n * dim);
            let next = with_next.then_some((&w2b, &mut xb));
            g.residual_norm(&yb, &wb, 1e-6, n, dim, &mut hb, scale, next)
                .unwrap();
            let what = format!("residual_norm {dim} next={with_next}");
            assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
            if with_next {
                assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
            }
        }
        // Two norms more of the new h in the same pass (a MoE layer's router and experts).
        let gains: Vec<Vec<f32>> = (0..2)
            .map(|_| uniform(&mut r, dim, 1.0).iter().map(|v| v + 1.0).collect())
            .collect();
        let (g3, g4) = (
            g.load_vector(&gains[0]).unwrap(),
            g.load_vector(&gains[1]).unwrap(),
        );
        let mut hb = up(g, &h);
        let (mut xb, mut x3, mut x4) = (
            poisoned(g, n * dim),
            poisoned(g, n * dim),
            poisoned(g, n * dim),
        );
        let mut extra = [(&g3, &mut x3), (&g4, &mut x4)];
        g.residual_norms(
            &yb,
            &wb,
            1e-6,
            n,
            dim,
            &mut hb,
            scale,
            (&w2b, &mut xb),
            &mut extra,
        )
        .unwrap();
        let what = format!("residual_norms {dim}");
        assert_close(&what, &down(g, &hb, n * dim), &want_h, 1e-5);
        assert_close(&what, &down(g, &xb, n * dim), &want_x, 1e-5);
        for (gain, out) in gains.iter().zip([&x3, &x4]) {
            let want = reference::rms_norm(&want_h, Some(gain), 1e-6, dim);
            assert_close(&what, &down(g, out, n * dim), &want, 1e-5);
        }
    }
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let mut hb = up(g, &[0.0; 4]);
    let err = g.residual_norm(&yb, &wb, 1e-6, 1, 8, &mut hb, 1.0, None);
    assert!(
        err.is_err(),
        "a residual shorter than the rows must be refused"
    );
    let wide = 8 * 1024 + 1;
    let (yb, wb) = (
        up(g, &vec![1.0; wide]),
        g.load_vector(&vec![1.0; wide]).unwrap(),
    );
    let mut hb = up(g, &vec![0.0; wide]);
    let err = g.residual_norm(&yb, &wb, 1e-6, 1, wide, &mut hb, 1.0, None);
    assert!(
        err.is_err(),
        "a row wider than the kernel holds must be refused"
    );
    let (yb, wb) = (up(g, &[1.0; 8]), g.load_vector(&[1.0; 8]).unwrap());
    let (mut hb, mut xb, mut short) = (up(g, &[0.0; 8]), up(g, &[0.0; 8]), up(g, &[0.0; 4]));
    let mut extra = [(&wb, &mut short)];
    let err = g.residual_norms(
        &yb,
        &wb,
        1e-6,
        1,
        8,
        &mut hb,
        1.0,
        (&wb, &mut xb),
        &mut extra,
    );
    assert!(
        err.is_err(),
        "an extra output shorter than the rows must be refused"
    );
}

#[test]
fn rope_write_kv_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("rope_write_kv");
    // (head_dim, rotated pairs, query heads, kv heads): Gemma 3 270M, Gemma 4 sliding, full.
    // Values stored as they are (Gemma 3) and through v_norm (Gemma 4).
    for ((hd, pairs, heads, kvh), v_norm) in [
        ((256, 128, 4, 1), false),
        ((256, 128, 8, 2), true),
        ((512, 64, 8, 1), true),
        ((512, 64, 8, 1), false),
    ] {
        let n = 3;
        let row = kvh * hd;
        let positions: Vec<u32> = (0..n).map(|_| r.random_range(0..8192)).collect();
        let slots_total = 2 * n + 1;
        let mut slots: Vec<u32> = (0..slots_total as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, r.random_range(0..=i));
        }
        slots.truncate(n);
        let q = uniform(&mut r, n * heads * hd, 2.0);
        let k = uniform(&mut r, n * row, 2.0);
        let v = uniform(&mut r, n * row, 2.0);
        let (qn, kn) = (uniform(&mut r, hd, 1.0), uniform(&mut r, hd, 1.0));
        let rope = Rope {
            theta: 1_000_000.0,
            linear_factor: 1.0,
            rotated_pairs: pairs,
        };
        let want_q = reference::head_norm_rope(&q, heads, hd, Some((&qn, 1e-6)), &rope, &positions);
        let want_k = reference::head_norm_rope(&k, kvh, hd, Some((&kn, 1e-6)), &rope, &positions);
        let want_v = if v_norm {
            reference::rms_norm(&v, None, 1e-6, hd)
        } else {
            v.clone()
        };
        let (mut qb, mut kb, vb) = (up(g, &q), up(g, &k), up(g, &v));
        let mut scratch = g.alloc(v.len()).unwrap();
        fn value_rows<'a>(
            v_norm: bool,
            raw: &'a CudaBuffer,
            scratch: &'a mut CudaBuffer,
        ) -> ValueRows<'a, CudaBuffer> {
            match v_norm {
                true => ValueRows::Normed { raw, scratch },
                false => ValueRows::AsIs(raw),
            }
        }
        let mut kc = poisoned(g, slots_total * row);
        let mut vc = poisoned(g, slots_total * row);
        let spec = AttnSpec {
            n_heads: heads,
            n_kv_heads: kvh,
            head_dim: hd,
            scale: 1.0,
            window: None,
            softcap: None,
        };
        let (qnb, knb) = (g.load_vector(&qn).unwrap(), g.load_vector(&kn).unwrap());
        g.rope_write_kv(
            &mut qb,
            &mut kb,
            value_rows(v_norm, &vb, &mut scratch),
            &spec,
            (&qnb, &knb, 1e-6),
            &rope,
            &positions,
            &slots,
            &mut kc,
            &mut vc,
        )
        .unwrap();
        let what = format!("rope_write_kv hd={hd} heads={heads}/{kvh} v_norm={v_norm}");
        assert_close(&what, &down(g, &qb, q.len()), &want_q, 1e-5);
        assert_close(&what, &down(g, &kb, k.len()), &want_k, 1e-5);
        let (kc, vc) = (
            down(g, &kc, slots_total * row),
            down(g, &vc, slots_total * row),
        );
        for (t, &s) in slots.iter().enumerate() {
            let cache_row = s as usize * row..(s as usize + 1) * row;
            let token_row = t * row..(t + 1) * row;
            assert_close(
                &what,
                &kc[cache_row.clone()],
                &want_k[token_row.clone()],
                1e-5,
            );
            assert_close(&what, &vc[cache_row], &want_v[token_row], 1e-5);
        }
        // A slot past the cache is refused.
        let mut bad = slots.clone();
        bad[0] = slots_total as u32;
        let mut kc2 = g.alloc(slots_total * row).unwrap();
        let mut vc2 = g.alloc(slots_total * row).unwrap();
        let err = g.rope_write_kv(
            &mut qb,
            &mut kb,
            value_rows(v_norm, &vb, &mut scratch),
            &spec,
            (&qnb, &knb, 1e-6),
            &rope,
            &positions,
            &bad,
            &mut kc2,
            &mut vc2,
        );
        assert!(
            err.is_err(),
            "{what}: a slot past the cache must be refused"
        );
    }
}

#[test]
fn head_norm_rope_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("head_norm_rope");
    // (head_dim, rotated pairs, θ, linear factor): default, proportional (partial), linear.
    for (hd, pairs, theta, lf) in [
        (32, 16, 10_000.0, 1.0),
        (64, 8, 1_000_000.0, 1.0),
        (256, 128, 1_000_000.0, 8.0),
        (512, 64, 1_000_000.0, 1.0),
    ] {
        let (heads, n) = (4, 3);
        let positions: Vec<u32> = (0..n).map(|_| r.random_range(0..8192)).collect();
        let x = uniform(&mut r, n * heads * hd, 2.0);
        let w = uniform(&mut r, hd, 1.0);
        let wb = g.load_vector(&w).unwrap();
        let rope = Rope {
            theta,
            linear_factor: lf,
            rotated_pairs: pairs,
        };
        for normed in [false, true] {
            let norm = normed.then_some((&w[..], 1e-6f32));
            let want = reference::head_norm_rope(&x, heads, hd, norm, &rope, &positions);
            let mut xb = up(g, &x);
            g.head_norm_rope(
                &mut xb,
                heads,
                hd,
                normed.then_some((&wb, 1e-6)),
                &rope,
                &positions,
            )
            .unwrap();
            let got = down(g, &xb, x.len());
            assert_close(&format!("rope hd={hd} norm={normed}"), &got, &want, 1e-5);
        }
    }
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

#[test]
fn write_kv_then_attention_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("attention");
    let cases: Vec<AttnCase> = vec![
        // Long decode over a full cache: several key splits.
        (256, 8, 2, None, None, 16, vec![vec![2999]]),
        // Sliding-window decode, one KV head (Gemma 3 270M-like); old blocks unmapped.
        (512, 8, 1, Some(512), None, 16, vec![vec![2000]]),
        // A prefill chunk with a score soft-cap beside an empty sequence and a second chunk.
        (
            32,
            4,
            2,
            Some(8),
            Some(50.0),
            4,
            vec![(100..120).collect(), vec![], vec![5, 6, 7]],
        ),
        // A causal prefill from position 0.
        (64, 4, 4, None, None, 32, vec![(0..40).collect()]),
        // Prefill chunks long enough for the batched products: a sliding window over a
        // GQA cache, two full-attention sequences of head dim 512, a soft-capped window that
        // starts inside the chunk.
        (256, 8, 2, Some(512), None, 16, vec![(600..700).collect()]),
        (
            512,
            8,
            1,
            None,
            None,
            16,
            vec![(0..48).collect(), (200..240).collect()],
        ),
        (
            128,
            4,
            2,
            Some(64),
            Some(30.0),
            16,
            vec![(10..90).collect()],
        ),
        // Head dim 128: a decode batch of four sequences of different lengths.
        (
            128,
            4,
            2,
            None,
            Some(30.0),
            16,
            vec![vec![150], vec![151], vec![7], vec![300]],
        ),
    ];
    for (hd, nh, nkv, window, softcap, bs, seqs) in cases {
        let row = nkv * hd;
        let (tables, width, n_blocks) = random_tables(&mut r, &seqs, bs, window);
        let slots_total = n_blocks * bs;
        let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
        let mut seq_start = vec![0u32];
        for p in &seqs {
            seq_start.push(seq_start.last().unwrap() + p.len() as u32);
        }
        let layout = KvLayout {
            block_size: bs,
            positions: &positions,
            seq_start: &seq_start,
            block_tables: &tables,
            table_width: width,
        };
        let n = positions.len();
        let kc = uniform(&mut r, slots_total * row, 1.0);
        let vc = uniform(&mut r, slots_total * row, 1.0);
        let q = uniform(&mut r, n * nh * hd, 1.0);
        let spec = AttnSpec {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
            softcap,
        };
        // Every other slot starts poisoned and is filled through write_kv.
        let slots: Vec<u32> = (0..slots_total as u32).step_by(2).collect();
        let (mut k0, mut v0) = (kc.clone(), vc.clone());
        for &s in &slots {
            k0[s as usize * row..][..row].fill(f32::NAN);
            v0[s as usize * row..][..row].fill(f32::NAN);
        }
        let (mut kb, mut vb) = (up(g, &k0), up(g, &v0));
        let ks: Vec<f32> = slots
            .iter()
            .flat_map(|&s| kc[s as usize * row..][..row].to_vec())
            .collect();
        let vs: Vec<f32> = slots
            .iter()
            .flat_map(|&s| vc[s as usize * row..][..row].to_vec())
            .collect();
        g.write_kv(&up(g, &ks), &up(g, &vs), row, &slots, &mut kb, &mut vb)
            .unwrap();
        assert_eq!(down(g, &kb, slots_total * row), kc, "write_kv K");
        assert_eq!(down(g, &vb, slots_total * row), vc, "write_kv V");
        let want = reference::attention(&q, &kc, &vc, &spec, &layout);
        let mut out = poisoned(g, n * nh * hd);
        g.attention(&up(g, &q), &kb, &vb, &spec, &layout, &mut out)
            .unwrap();
        let got = down(g, &out, n * nh * hd);
        // Steps whose sequences all bring many rows take the flash kernel (f16 inputs to the
        // tensor cores, 11-bit mantissas); the split-K kernel sums in f32.
        let products = seqs
            .iter()
            .all(|p| p.is_empty() || p.len() >= ATTN_FLASH_MIN_ROWS)
            && seqs.iter().any(|p| !p.is_empty());
        let tol = if products { 5e-3 } else { 1e-5 };
        assert_close(&format!("attention {spec:?} bs={bs}"), &got, &want, tol);
    }
}

/// `rope_attention` on `be` from host data (output poisoned with NaN first): the raw queries,
/// with `new_kv = Some(normed)` the raw keys and values (normed or as they are) going to cache
/// rows `slots`; returns the output and both caches.
#[allow(clippy::too_many_arguments)]
fn run_rope_attention<B: Backend>(
    be: &B,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (q_norm, k_norm): (&[f32], &[f32]),
    new_kv: Option<bool>,
    rope: &Rope,
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    slots: &[u32],
    (k_cache, v_cache): (&[f32], &[f32]),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let buf = |x: &[f32]| {
        let mut b = be.alloc(x.len()).unwrap();
        be.write(x, &mut b).unwrap();
        b
    };
    let get = |b: &B::Buffer, len: usize| {
        let mut h = vec![0f32; len];
        be.read(b, &mut h).unwrap();
        h
    };
    let (mut qb, mut kb, vb) = (buf(q), buf(k), buf(v));
    let mut scratch = be.alloc(v.len()).unwrap();
    let (mut kc, mut vc) = (buf(k_cache), buf(v_cache));
    let mut out = buf(&vec![f32::NAN; q.len()]);
    let (qn, kn) = (
        be.load_vector(q_norm).unwrap(),
        be.load_vector(k_norm).unwrap(),
    );
    let new = new_kv.map(|normed| NewKv {
        k: &mut kb,
        v: match normed {
            true => ValueRows::Normed {
                raw: &vb,
                scratch: &mut scratch,
            },
            false => ValueRows::AsIs(&vb),
        },
        k_norm: &kn,
        slots,
    });
    be.rope_attention(
        &mut qb, &qn, 1e-6, new, rope, spec, layout, &mut kc, &mut vc, &mut out,
    )
    .unwrap();
    (
        get(&out, q.len()),
        get(&kc, k_cache.len()),
        get(&vc, v_cache.len()),
    )
}

/// `rope_attention` (one fused kernel on a decode step) against the CPU backend's steps
/// (`rope_write_kv` or `head_norm_rope`, then `attention`): decode steps of several sequences
/// (one at position 0, an empty one, one in the first splits and one long enough for several
/// key splits) over a cache of random rows, head dims 256 and 512 (proportional RoPE), 8 query
/// heads over 2 or 1 KV heads, full causal, a sliding window with a soft-cap and a window of
/// one key (only the new key), values normed and as they are, and a KV-shared layer (no new
/// keys); a prefill step beside a decode row takes the unfused path. The cache rows the new
/// keys go to start as NaN, so a block that read them from the cache fails; every other row
/// must come back unchanged.
#[test]
fn rope_attention_matches_cpu_backend() {
    let g = gpu_or_skip!();
    let cpu = markbase_cpu::CpuBackend::new(2).unwrap();
    let mut r = rng("rope_attention");
    let bs = 16;
    let decode = vec![vec![0], vec![], vec![r.random_range(1..700)], vec![2999]];
    let prefill = vec![vec![40, 41, 42], vec![r.random_range(1..300)]];
    for (hd, pairs) in [(256, 128), (512, 64)] {
        for kvh in [2, 1] {
            for window in [None, Some(512), Some(1)] {
                for new_kv in [Some(true), Some(false), None] {
                    let mut steps = vec![&decode];
                    if kvh == 2 && window.is_none() {
                        steps.push(&prefill);
                    }
                    for seqs in steps {
                        let row = kvh * hd;
                        let (tables, width, n_blocks) = random_tables(&mut r, seqs, bs, window);
                        let slots_total = n_blocks * bs;
                        let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
                        let mut seq_start = vec![0u32];
                        let mut slots = Vec::new();
                        for (s, ps) in seqs.iter().enumerate() {
                            seq_start.push(seq_start.last().unwrap() + ps.len() as u32);
                            for &p in ps {
                                let block = tables[s * width + p as usize / bs];
                                slots.push(block * bs as u32 + p % bs as u32);
                            }
                        }
                        let layout = KvLayout {
                            block_size: bs,
                            positions: &positions,
                            seq_start: &seq_start,
                            block_tables: &tables,
                            table_width: width,
                        };
                        let n = positions.len();
                        let spec = AttnSpec {
                            n_heads: 8,
                            n_kv_heads: kvh,
                            head_dim: hd,
                            scale: 1.0 / (hd as f32).sqrt(),
                            window,
                            softcap: window.filter(|&w| w > 1).map(|_| 30.0),
                        };
                        let rope = Rope {
                            theta: 1_000_000.0,
                            linear_factor: 1.0,
                            rotated_pairs: pairs,
                        };
                        let mut kc = uniform(&mut r, slots_total * row, 1.0);
                        let mut vc = uniform(&mut r, slots_total * row, 1.0);
                        let written: &[u32] = if new_kv.is_some() { &slots } else { &[] };
                        for &s in written {
                            kc[s as usize * row..][..row].fill(f32::NAN);
                            vc[s as usize * row..][..row].fill(f32::NAN);
                        }
                        let q = uniform(&mut r, n * spec.n_heads * hd, 2.0);
                        let k = uniform(&mut r, n * row, 2.0);
                        let v = uniform(&mut r, n * row, 2.0);
                        let (qn, kn) = (uniform(&mut r, hd, 1.0), uniform(&mut r, hd, 1.0));
                        let what = format!(
                            "rope_attention hd={hd} heads=8/{kvh} window={window:?} \
                             new_kv(v_norm)={new_kv:?} rows={seqs:?}"
                        );
                        let one_row_each = seqs.iter().all(|p| p.len() <= 1);
                        assert_eq!(
                            g.fuses_rope_attention(
                                &spec,
                                &rope,
                                &layout,
                                new_kv.map(|_| &slots[..])
                            ),
                            one_row_each,
                            "{what}: fused exactly on decode steps"
                        );
                        let inputs = (&q[..], &k[..], &v[..]);
                        let caches = (&kc[..], &vc[..]);
                        let want = run_rope_attention(
                            &cpu,
                            inputs,
                            (&qn, &kn),
                            new_kv,
                            &rope,
                            &spec,
                            &layout,
                            &slots,
                            caches,
                        );
                        let got = run_rope_attention(
                            g,
                            inputs,
                            (&qn, &kn),
                            new_kv,
                            &rope,
                            &spec,
                            &layout,
                            &slots,
                            caches,
                        );
                        assert_close(&what, &got.0, &want.0, 1e-4);
                        for (name, got_c, want_c) in
                            [("K", &got.1, &want.1), ("V", &got.2, &want.2)]
                        {
                            for &s in written {
                                let rows = s as usize * row..(s as usize + 1) * row;
                                assert_close(
                                    &format!("{what}: {name} cache row {s}"),
                                    &got_c[rows.clone()],
                                    &want_c[rows],
                                    1e-5,
                                );
                            }
                            let others = |c: &[f32]| -> Vec<u32> {
                                c.chunks(row)
                                    .enumerate()
                                    .filter(|(i, _)| !written.contains(&(*i as u32)))
                                    .flat_map(|(_, x)| x.iter().map(|v| v.to_bits()))
                                    .collect()
                            };
                            assert!(
                                others(got_c) == others(want_c),
                                "{what}: {name} cache rows other than the new ones changed"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Cached keys and values beyond f16's range (±65 504): the flash kernel rounds them to f16
/// saturating, so a prefill's output stays finite and equals the result for values clamped to
/// that range (an infinity would have turned its rows into NaN).
#[test]
fn flash_attention_saturates_values_beyond_f16() {
    let g = gpu_or_skip!();
    let mut r = rng("attention_f16_range");
    let (hd, nh, nkv, bs) = (256, 8, 2, 16);
    let seqs = vec![(0..64).collect::<Vec<u32>>()];
    let row = nkv * hd;
    let (tables, width, n_blocks) = random_tables(&mut r, &seqs, bs, None);
    let slots_total = n_blocks * bs;
    let positions = seqs[0].clone();
    let seq_start = [0, positions.len() as u32];
    let layout = KvLayout {
        block_size: bs,
        positions: &positions,
        seq_start: &seq_start,
        block_tables: &tables,
        table_width: width,
    };
    let n = positions.len();
    let spec = AttnSpec {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let q = uniform(&mut r, n * nh * hd, 1.0);
    let kc = uniform(&mut r, slots_total * row, 1.0);
    let mut vc = uniform(&mut r, slots_total * row, 1.0);
    // One value in 37 far past f16's range, either sign.
    for (i, v) in vc.iter_mut().enumerate().step_by(37) {
        *v = if i % 2 == 0 { 1.0e5 } else { -3.0e6 };
    }
    let clamped: Vec<f32> = vc.iter().map(|v| v.clamp(-65_504.0, 65_504.0)).collect();
    let want = reference::attention(&q, &kc, &clamped, &spec, &layout);
    let attend = |k: &[f32], v: &[f32]| {
        let mut out = poisoned(g, n * nh * hd);
        g.attention(&up(g, &q), &up(g, k), &up(g, v), &spec, &layout, &mut out)
            .unwrap();
        down(g, &out, n * nh * hd)
    };
    assert_close(
        "flash attention, values past f16",
        &attend(&kc, &vc),
        &want,
        5e-3,
    );
    // Keys past the range as well: scores stay finite, so every output does.
    let mut kbig = kc.clone();
    for k in kbig.iter_mut().step_by(41) {
        *k = 2.0e5;
    }
    let got = attend(&kbig, &vc);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "flash attention with keys past f16: non-finite outputs"
    );
}

#[test]
fn attention_rejects_bad_specs_and_layouts() {
    let g = gpu_or_skip!();
    let b = g.alloc(1024).unwrap();
    let mut o = g.alloc(1024).unwrap();
    let layout = |positions: &'static [u32], tables: &'static [u32]| KvLayout {
        block_size: 4,
        positions,
        seq_start: &[0, 1],
        block_tables: tables,
        table_width: tables.len(),
    };
    // Unsupported head dims are an error, not a wrong answer.
    let mut spec = AttnSpec {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 48,
        scale: 1.0,
        window: None,
        softcap: None,
    };
    assert!(g
        .attention(&b, &b, &b, &spec, &layout(&[0], &[0]), &mut o)
        .is_err());
    // A 1024-float cache of 32-wide slots holds 8 blocks of 4.
    spec.head_dim = 32;
    g.attention(&b, &b, &b, &spec, &layout(&[5], &[0, 7]), &mut o)
        .unwrap();
    // A block outside the cache, a position beyond its table, bad sequence starts.
    for bad in [layout(&[5], &[0, 8]), layout(&[9], &[0, 1])] {
        assert!(g.attention(&b, &b, &b, &spec, &bad, &mut o).is_err());
    }
    let mut split = layout(&[1], &[0]);
    split.seq_start = &[0, 2];
    assert!(g.attention(&b, &b, &b, &spec, &split, &mut o).is_err());
    g.read(&o, &mut [0f32; 1]).unwrap();
}

#[test]
fn elementwise_ops_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("elementwise");
    let n = 10_007;
    let a = uniform(&mut r, n, 6.0);
    let b = uniform(&mut r, n, 2.0);
    let mut x = up(g, &a);
    g.gelu_tanh_mul(&mut x, &up(g, &b), n).unwrap();
    assert_close(
        "gelu",
        &down(g, &x, n),
        &reference::gelu_tanh_mul(&a, &b),
        1e-6,
    );
    let mut x = up(g, &a);
    g.add(&mut x, &up(g, &b), n).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    assert_eq!(down(g, &x, n), want, "add");
    let mut x = up(g, &a);
    g.scale(&mut x, 0.37, n).unwrap();
    let want: Vec<f32> = a.iter().map(|p| p * 0.37).collect();
    assert_eq!(down(g, &x, n), want, "scale");
    let mut x = up(g, &a);
    g.softcap(&mut x, 3.0, n).unwrap();
    assert_close(
        "softcap",
        &down(g, &x, n),
        &reference::softcap(&a, 3.0),
        1e-6,
    );
    let mut x = up(g, &a);
    g.copy(&up(g, &b), 100, &mut x, 7, 500).unwrap();
    let mut want = a.clone();
    want[7..507].copy_from_slice(&b[100..600]);
    assert_eq!(down(g, &x, n), want, "copy");
    assert!(g.copy(&up(g, &b), n - 10, &mut x, 0, 20).is_err());
    // Strided rows (one queued 2-D copy) against the CPU backend's row-by-row default.
    let cpu = markbase_cpu::CpuBackend::new(1).unwrap();
    let (rows, len) = (r.random_range(1..40), r.random_range(1..90));
    let from = Strided {
        offset: r.random_range(0..50),
        stride: len + r.random_range(0..30),
    };
    let to = Strided {
        offset: r.random_range(0..50),
        stride: len + r.random_range(0..30),
    };
    let mut x = up(g, &a);
    g.copy_rows(&up(g, &b), from, &mut x, to, rows, len)
        .unwrap();
    let mut want = cpu.alloc(n).unwrap();
    cpu.write(&a, &mut want).unwrap();
    let mut src = cpu.alloc(n).unwrap();
    cpu.write(&b, &mut src).unwrap();
    cpu.copy_rows(&src, from, &mut want, to, rows, len).unwrap();
    let mut want_host = vec![0f32; n];
    cpu.read(&want, &mut want_host).unwrap();
    assert_eq!(
        down(g, &x, n),
        want_host,
        "copy_rows {rows} x {len} {from:?} -> {to:?}"
    );
    let past_end = Strided {
        offset: n - len,
        stride: len,
    };
    assert!(g
        .copy_rows(&up(g, &b), past_end, &mut x, to, 2, len)
        .is_err());
    let overlapping = Strided {
        offset: 0,
        stride: len - 1,
    };
    assert!(g
        .copy_rows(&up(g, &b), overlapping, &mut x, to, 2, len)
        .is_err());
}

/// Host twin of the top-k / top-p sampler.
fn sample_ref(row: &[f32], p: &SampleParams, u: f32) -> u32 {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let cand = &idx[..p.top_k.min(row.len())];
    let mx = row[cand[0]];
    let e: Vec<f32> = cand
        .iter()
        .map(|&i| ((row[i] - mx) / p.temperature).exp())
        .collect();
    let total: f32 = e.iter().sum();
    let mut keep = cand.len();
    let mut mass = 0f32;
    for (c, v) in e.iter().enumerate() {
        mass += v / total;
        if mass >= p.top_p {
            keep = c + 1;
            break;
        }
    }
    let kept: f32 = e[..keep].iter().sum();
    let target = u * kept;
    let mut run = 0f32;
    for c in 0..keep {
        run += e[c];
        if target < run {
            return cand[c] as u32;
        }
    }
    cand[keep - 1] as u32
}

#[test]
fn argmax_and_sampling_match_host_twins() {
    let g = gpu_or_skip!();
    let mut r = rng("sampling");
    let (rows, n) = (3, 262_144);
    let mut logits = uniform(&mut r, rows * n, 10.0);
    // A tie: the lower index must win.
    logits[n + 500] = 99.0;
    logits[n + 70_000] = 99.0;
    logits[2 * n + 9] = f32::NAN;
    let lb = up(g, &logits);
    let got = g.argmax(&lb, rows, n).unwrap();
    let want: Vec<u32> = logits
        .chunks(n)
        .map(|row| {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] || row[best].is_nan() {
                    best = i;
                }
            }
            best as u32
        })
        .collect();
    assert_eq!(got, want, "argmax");
    assert_eq!(got[1], 500);
    // Rows whose last slice of the first pass is partial, and rows shorter than one slice.
    for (rows, n) in [(5, 4097), (2, 7)] {
        let small = uniform(&mut r, rows * n, 10.0);
        let got = g.argmax(&up(g, &small), rows, n).unwrap();
        let want: Vec<u32> = small
            .chunks(n)
            .map(|row| (0..n).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32)
            .collect();
        assert_eq!(got, want, "argmax of {rows} rows of {n}");
    }
    let clean: Vec<f32> = logits
        .iter()
        .map(|v| if v.is_nan() { -1e30 } else { *v })
        .collect();
    let lb = up(g, &clean);
    for (top_k, top_p, temperature) in [(40, 0.9, 0.8), (1, 1.0, 1.0), (256, 0.5, 2.0)] {
        let p = SampleParams {
            temperature,
            top_k,
            top_p,
        };
        for _ in 0..5 {
            let draws: Vec<f32> = (0..rows).map(|_| r.random_range(0.0f32..1.0)).collect();
            let got = g.sample(&lb, rows, n, &p, &draws).unwrap();
            let want: Vec<u32> = clean
                .chunks(n)
                .zip(&draws)
                .map(|(row, &u)| sample_ref(row, &p, u))
                .collect();
            assert_eq!(got, want, "sample {p:?} draws {draws:?}");
        }
    }
    let bad = SampleParams {
        temperature: 0.0,
        top_k: 5,
        top_p: 1.0,
    };
    assert!(g.sample(&lb, rows, n, &bad, &[0.5; 3]).is_err());
}

/// Runs `attempt` (a producer, then a product of its output; returns the product's result)
/// until the product took the producer's rounded copy: other tests queue work on the shared
/// backend in between, and the copy is then rightly ignored.
fn with_rounded_copy(g: &CudaBackend, mut attempt: impl FnMut() -> Vec<f32>) -> Vec<f32> {
    for _ in 0..50 {
        let before = g.rounded_copies_used().unwrap();
        let got = attempt();
        if g.rounded_copies_used().unwrap() > before {
            return got;
        }
    }
    panic!("the product never took the producer's rounded copy");
}

#[test]
fn rounded_copies_feed_the_next_product_exactly_and_only_while_fresh() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("rounded_copies");
    let d = 256;
    // bf16 weights at 8 rows (tensor cores from 3), Q8_0 at 20 (f16 from 17) and Q4_K at 8
    // (its tensor-core kernel from 2).
    for (ty, n, ff) in [
        (GgmlType::BF16, 8, 96),
        (GgmlType::Q8_0, 20, 96),
        (GgmlType::Q4_K, 8, 256),
    ] {
        let wo = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let gate = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let upm = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let down_m = g.load_matrix(&random_matrix(&mut r, ty, d, ff)).unwrap();
        let y = up(g, &uniform(&mut r, n * d, 3.0));
        let h0 = uniform(&mut r, n * d, 2.0);
        let w = g.load_vector(&vec![1.5; d]).unwrap();
        let mut h = up(g, &h0);
        let mut x = g.alloc(n * d).unwrap();
        let mut out = g.alloc(n * ff).unwrap();
        let mut product = |src: &CudaBuffer| {
            g.matmul(src, n, &wo, &mut out).unwrap();
            down(g, &out, n * ff)
        };
        // A product of this kind first, so producers know how the next one rounds.
        product(&y);

        // residual_norm's x, then its h (no next norm): the product equals one that rounds
        // the same values itself, bit for bit.
        for with_next in [true, false] {
            let taken = with_rounded_copy(g, || {
                g.write(&h0, &mut h).unwrap();
                let next = with_next.then_some((&w, &mut x));
                g.residual_norm(&y, &w, 1e-6, n, d, &mut h, 1.0, next)
                    .unwrap();
                product(if with_next { &x } else { &h })
            });
            let again = product(if with_next { &x } else { &h });
            assert_eq!(taken, again, "{ty} residual_norm next={with_next}");
        }

        // rms_norm's output likewise.
        let taken = with_rounded_copy(g, || {
            g.rms_norm(&y, Some(&w), 1e-6, n, d, &mut x, NormOut::Write)
                .unwrap();
            product(&x)
        });
        assert_eq!(taken, product(&x), "{ty} rms_norm");

        // Written between producer and product: the copy is stale and must not be used.
        g.write(&h0, &mut h).unwrap();
        g.residual_norm(&y, &w, 1e-6, n, d, &mut h, 1.0, Some((&w, &mut x)))
            .unwrap();
        g.scale(&mut x, -2.0, n * d).unwrap();
        let after_write = product(&x);
        assert_eq!(after_write, product(&x), "{ty}: a stale copy was used");

        // The gated feed-forward's activations feed the down projection.
        let (mut g_out, mut u_out) = (g.alloc(n * ff).unwrap(), g.alloc(n * ff).unwrap());
        let mut dn = g.alloc(n * d).unwrap();
        let taken = with_rounded_copy(g, || {
            g.gelu_gated_matmul(&x, n, &gate, &upm, ff, &mut g_out, &mut u_out)
                .unwrap();
            g.matmul(&g_out, n, &down_m, &mut dn).unwrap();
            down(g, &dn, n * d)
        });
        g.matmul(&g_out, n, &down_m, &mut dn).unwrap();
        assert_eq!(taken, down(g, &dn, n * d), "{ty} gelu_gated_matmul");
    }
}

/// Q4_K or Q8_0 weights for the one-token products a decode step runs on one activation row:
/// `matmul` (gemv), `matmul_many` (q, k, v-like), `gelu_gated_matmul` and `gelu_matmul_mul`,
/// with their CPU references on 16-bit activations. The outputs are allocated once: a
/// product queued right after its producer must find nothing queued in between.
struct TileProducts {
    host: Vec<HostMatrix>,
    dev: Vec<CudaMatrix>,
    other: Vec<f32>,
    other_dev: CudaBuffer,
    outs: Vec<CudaBuffer>,
}

impl TileProducts {
    /// Rows of the long product and the gated pair: more than the gated kernel's warps on
    /// tiles (2 resident blocks of 8 warps a multiprocessor: 2 112 on an H200), so its warps
    /// walk several row pairs.
    const MANY: usize = 3000;
    const ROWS: [usize; 6] = [Self::MANY, 37, 9, 9, Self::MANY, Self::MANY];

    fn new(g: &CudaBackend, r: &mut StdRng, ty: GgmlType, k: usize) -> TileProducts {
        let host: Vec<HostMatrix> = Self::ROWS
            .iter()
            .map(|&rows| random_matrix(r, ty, rows, k))
            .collect();
        let dev = host.iter().map(|m| g.load_matrix(m).unwrap()).collect();
        let other = uniform(r, Self::MANY, 2.0);
        let other_dev = up(g, &other);
        let outs = Self::ROWS.iter().map(|&n| poisoned(g, n)).collect();
        TileProducts {
            host,
            dev,
            other,
            other_dev,
            outs,
        }
    }

    /// Runs product `which` (0 matmul, 1 matmul_many, 2 gated, 3 gelu_matmul_mul, 4 matmul of
    /// a short matrix) of the one row at `x`; returns its outputs.
    fn run(&mut self, g: &CudaBackend, which: usize, x: &CudaBuffer) -> Vec<f32> {
        let d = &self.dev;
        let [o0, o1, o2, o3, o4, o5] = &mut self.outs[..] else {
            unreachable!("six outputs")
        };
        match which {
            0 => {
                g.matmul(x, 1, &d[0], o0).unwrap();
                down(g, o0, Self::MANY)
            }
            1 => {
                let mut products = [(&d[1], &mut *o1), (&d[2], &mut *o2), (&d[3], &mut *o3)];
                g.matmul_many(x, 1, &mut products).unwrap();
                [(&*o1, 37), (&*o2, 9), (&*o3, 9)]
                    .iter()
                    .flat_map(|&(o, n)| down(g, o, n))
                    .collect()
            }
            2 => {
                g.gelu_gated_matmul(x, 1, &d[4], &d[5], Self::MANY, o4, o5)
                    .unwrap();
                down(g, o4, Self::MANY)
            }
            4 => {
                g.matmul(x, 1, &d[1], o1).unwrap();
                down(g, o1, 37)
            }
            _ => {
                let from = Strided {
                    offset: 0,
                    stride: Self::MANY,
                };
                g.gelu_matmul_mul(x, 1, &d[0], Self::MANY, &self.other_dev, from, o0, o1)
                    .unwrap();
                down(g, o0, Self::MANY)
            }
        }
    }

    /// The CPU reference of `run(which)` for the activation row `x`.
    fn want(&self, which: usize, x: &[f32]) -> Vec<f32> {
        let xs = as_16_bit(x);
        let mm = |i: usize| reference::matmul(&xs, 1, &self.host[i]).unwrap();
        match which {
            0 => mm(0),
            1 => (1..4).flat_map(mm).collect(),
            2 => reference::gelu_tanh_mul(&mm(4), &mm(5)),
            3 => reference::gelu_tanh_mul(&mm(0), &self.other),
            _ => mm(1),
        }
    }
}

#[test]
fn q4k_tiles_from_norms_feed_one_token_products() {
    let g = gpu_or_skip!();
    let mut r = rng("q4k_tiles");
    // One unit; 17 and 32 (the short matrix's rows shared by 2 and 4 warps; 32 the widest row
    // a norm writes as tiles). Q4_K and Q8_0 products read the same tiles.
    let cases = [256, 4352, 8192]
        .into_iter()
        .flat_map(|k| [(GgmlType::Q4_K, k), (GgmlType::Q8_0, k)]);
    for (ty, k) in cases {
        let mut p = TileProducts::new(g, &mut r, ty, k);
        let y = up(g, &uniform(&mut r, k, 3.0));
        let h0 = uniform(&mut r, k, 2.0);
        let w = g.load_vector(&uniform(&mut r, k, 1.0)).unwrap();
        let (mut h, mut x) = (up(g, &h0), g.alloc(k).unwrap());
        for which in 0..5 {
            // A product of this kind first, so producers know how the next one reads.
            p.run(g, which, &x);
            // residual_norm's x and rms_norm's output (residual_norm without a next norm
            // writes no tiles): the product that takes the tiles equals the one that stages
            // the same values itself, and the CPU reference on them.
            for with_residual in [true, false] {
                let what = format!("{ty} k={k} product {which} residual_norm {with_residual}");
                let mut normed = Vec::new();
                let taken = with_rounded_copy(g, || {
                    g.write(&h0, &mut h).unwrap();
                    if with_residual {
                        g.residual_norm(&y, &w, 1e-6, 1, k, &mut h, 1.0, Some((&w, &mut x)))
                    } else {
                        g.rms_norm(&y, Some(&w), 1e-6, 1, k, &mut x, NormOut::Write)
                    }
                    .unwrap();
                    let got = p.run(g, which, &x);
                    normed = down(g, &x, k);
                    got
                });
                let staged = p.run(g, which, &x);
                assert_close(&format!("{what}: tiles vs staged"), &taken, &staged, 1e-6);
                assert_close(&what, &taken, &p.want(which, &normed), 2e-5);
            }
        }
    }
}

/// Decode attention (one query row a sequence, split-K) writes the rounded copy of its output
/// that the o product then takes, for bf16 weights (cuBLAS from 3 rows) and Q8_0 / Q4_K ones
/// (their tensor-core kernel): the same bits as the product rounding the output itself. Short
/// contexts take one split (the partial kernel writes the output), a long one several (the
/// combine kernel does).
#[test]
fn decode_attention_output_feeds_the_o_product_rounded_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("decode_attention_rounded");
    for (ty, context) in [
        (GgmlType::BF16, 20),
        (GgmlType::Q8_0, 20),
        (GgmlType::Q4_K, 20),
        (GgmlType::BF16, 3_000),
    ] {
        // Eight sequences at positions near `context`, one query row each.
        let seqs: Vec<Vec<u32>> = (0..8).map(|i| vec![(context + 7 * i) as u32]).collect();
        let what = format!("{ty} context {context}");
        o_product_takes_attention_copy(g, &mut r, &seqs, ty, 512, &what);
    }
}

#[test]
fn flash_attention_output_feeds_the_o_product_rounded_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("flash_rounded");
    let seqs: Vec<Vec<u32>> = vec![(0..40).collect(), (100..150).collect()];
    assert!(seqs.iter().all(|s| s.len() >= ATTN_FLASH_MIN_ROWS));
    o_product_takes_attention_copy(g, &mut r, &seqs, GgmlType::BF16, 384, "flash");
}

/// Attention (head dim 256, GQA 8/2, blocks of 16) of random queries at the positions `seqs`
/// over random caches, then the o product with a random `[d, 2 048]` matrix stored as `ty` on
/// its output: the product takes the attention's rounded copy and gets the bits it gets
/// rounding the output itself.
fn o_product_takes_attention_copy(
    g: &CudaBackend,
    r: &mut StdRng,
    seqs: &[Vec<u32>],
    ty: GgmlType,
    d: usize,
    what: &str,
) {
    let (hd, nh, nkv, bs) = (256, 8, 2, 16);
    let (tables, width, n_blocks) = random_tables(r, seqs, bs, None);
    let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
    let mut seq_start = vec![0u32];
    for s in seqs {
        seq_start.push(seq_start.last().unwrap() + s.len() as u32);
    }
    let layout = KvLayout {
        block_size: bs,
        positions: &positions,
        seq_start: &seq_start,
        block_tables: &tables,
        table_width: width,
    };
    let n = positions.len();
    let row = nkv * hd;
    let kc = up(g, &uniform(r, n_blocks * bs * row, 1.0));
    let vc = up(g, &uniform(r, n_blocks * bs * row, 1.0));
    let q = up(g, &uniform(r, n * nh * hd, 1.0));
    let spec = AttnSpec {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let wo = g.load_matrix(&random_matrix(r, ty, d, nh * hd)).unwrap();
    let mut attn = g.alloc(n * nh * hd).unwrap();
    let mut proj = g.alloc(n * d).unwrap();
    // A product of this kind first, so the attention knows how the next one rounds.
    g.matmul(&q, n, &wo, &mut proj).unwrap();
    let taken = with_rounded_copy(g, || {
        g.attention(&q, &kc, &vc, &spec, &layout, &mut attn)
            .unwrap();
        g.matmul(&attn, n, &wo, &mut proj).unwrap();
        down(g, &proj, n * d)
    });
    g.matmul(&attn, n, &wo, &mut proj).unwrap();
    assert_eq!(
        taken,
        down(g, &proj, n * d),
        "{what}: o product from the rounded copy"
    );
}

#[test]
fn gated_ffn_keeps_bf16_activations_between_bf16_products() {
    let g = gpu_or_skip!();
    let mut r = rng("gated_ffn");
    let (k, ff, d) = (256, 96, 160);
    let ty = GgmlType::BF16;
    let (gm, um, dm) = (
        random_matrix(&mut r, ty, ff, k),
        random_matrix(&mut r, ty, ff, k),
        random_matrix(&mut r, ty, d, ff),
    );
    let [gw, uw, dw] = [&gm, &um, &dm].map(|m| g.load_matrix(m).unwrap());
    let round =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    // 2 rows: GEMVs in f32 (the default composition); 8 and 40: tensor-core products with bf16
    // gate, up and activations.
    for n in [2, 8, 40] {
        let x = uniform(&mut r, n * k, 1.0);
        let (sx, _) = as_seen(g, &gm, n, &x);
        let bf16_path = g.has_cublas() && product_inputs(ty, k, n) == ProductInputs::Bf16;
        let (gate, upv) = (
            reference::matmul(&sx, n, &gm).unwrap(),
            reference::matmul(&sx, n, &um).unwrap(),
        );
        let exact = reference::gelu_tanh_mul(&gate, &upv);
        let (act, tol) = if bf16_path {
            // What the GPU computes: gate and up rounded, the activations rounded.
            (
                round(reference::gelu_tanh_mul(&round(gate), &round(upv))),
                2e-3,
            )
        } else {
            let (sa, _) = as_seen(g, &dm, n, &exact);
            (sa, 2e-5)
        };
        let want = reference::matmul(&act, n, &dm).unwrap();
        let (mut go, mut uo) = (poisoned(g, n * ff), poisoned(g, n * ff));
        let mut out = poisoned(g, n * d);
        g.gated_ffn(&up(g, &x), n, &gw, &uw, &dw, ff, &mut go, &mut uo, &mut out)
            .unwrap();
        let got = down(g, &out, n * d);
        assert_close(&format!("gated ffn n={n}"), &got, &want, tol);
        // The cost of the bf16 activations against f32 ones: within bf16's precision.
        let (se, _) = as_seen(g, &dm, n, &exact);
        let f32_acts = reference::matmul(&se, n, &dm).unwrap();
        assert_close(
            &format!("gated ffn n={n} vs f32 activations"),
            &got,
            &f32_acts,
            1e-2,
        );
    }
}
