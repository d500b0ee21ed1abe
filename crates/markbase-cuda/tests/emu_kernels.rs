//! CUDA kernels run on the CPU emulator (markbase-kernel-emu) against the references the GPU
//! tests use, on fresh random inputs (seed printed, `MARKBASE_TEST_SEED` replays it): the
//! kernels' own code, lane by lane, checked on machines without a GPU. Launch shapes are
//! chosen here to cover the kernels' paths (every n-tile count, split and unsplit tiles, warps
//! walking several tiles), not taken from the backend's plan. Outputs are poisoned first, so
//! an element a kernel forgot fails.
//!
//! Without a C++ compiler every test prints why and passes.

#[path = "common/matrices.rs"]
mod matrices;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use half::f16;
use markbase_core::backend::{first_visible_key, AttnSpec, HostMatrix, KvLayout, Rope};
use markbase_core::quant::GgmlType;
use markbase_core::sampling::Draw;
use markbase_cpu::reference;
use markbase_cuda::sources::{define_value, defines_from_env, Module, Unit, FORMATS};
use markbase_cuda::{device_bytes, gemv_takes_16_bit_activations, SAMPLE_ROW_WORDS, SAMPLE_SHARED};
use markbase_kernel_emu::{compiler_available, EmuModule};
use matrices::*;
use rand::Rng;

/// The `Products` argument of the GEMV module's kernels (gemv.cu), with the C layout.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Products {
    w: [u64; 4],
    out: [u64; 4],
    rows: [i32; 4],
    count: i32,
}

/// `mmq_<format>_<NT>` (mmq.cu).
type MmqKernel = unsafe extern "C" fn(
    p: Products,
    row_bytes: u64,
    k: i32,
    xh: *const u16,
    n: i32,
    gated: i32,
    parts: *mut f32,
    tickets: *mut u32,
    splits: i32,
    per_split: i32,
);

/// Threads of an mmq block of `nt` n-tiles: 8 warps, or for 8 n-tiles `MMQ_WIDE_WARPS` of
/// `MARKBASE_CUDA_DEFINES` (mmq.cu's default: 12 with one block a multiprocessor, 8 with two).
fn mmq_threads(nt: usize) -> u32 {
    let defines = defines_from_env().unwrap();
    let warps = match define_value(&defines, "MMQ_WIDE_WARPS") {
        Some(w) => w.parse::<u32>().unwrap(),
        None if define_value(&defines, "MMQ_WIDE_BLOCKS") == Some("2") => 8,
        None => 12,
    };
    32 * if nt > 4 { warps } else { 8 }
}
/// Shared memory a token's 256-value unit of activations takes in an mmq block (MmqSlots).
const MMQ_TOKEN_BYTES: usize = 576;

/// The unit of `module` holding `format`'s kernels (None: its format-independent ones, or the
/// whole module) compiled for the emulator, once a test binary; None with the reason printed
/// where no C++ compiler runs.
fn emu_unit(module: Module, format: Option<&'static str>) -> Option<Arc<EmuModule>> {
    type Units = HashMap<String, Arc<EmuModule>>;
    static UNITS: Mutex<Option<Units>> = Mutex::new(None);
    if let Err(e) = compiler_available() {
        eprintln!("skipped: {e}");
        return None;
    }
    let unit = Unit::holding(module, format);
    let mut units = UNITS.lock().unwrap();
    let units = units.get_or_insert_with(HashMap::new);
    let module = units.entry(unit.name()).or_insert_with(|| {
        let defines = defines_from_env().unwrap_or_else(|e| panic!("{e}"));
        let module = EmuModule::compile(&unit.name(), &unit.source(&defines))
            .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(module)
    });
    Some(module.clone())
}

/// The GEMV module's unit of `format` on the emulator (`emu_unit`).
fn gemv_unit(format: &'static str) -> Option<Arc<EmuModule>> {
    emu_unit(Module::Gemv, Some(format))
}

/// `m`'s bytes as they lie on the device (`device_bytes`).
fn laid_out(m: &HostMatrix) -> Vec<u8> {
    device_bytes(m.ty, m.bytes.as_slice(), m.rows).into_owned()
}

/// Rows of `k` activations `v` as the GEMVs of weights stored as `ty` take them: 16-bit
/// integers a 32-value chunk where `gemv_takes_16_bit_activations`, else as they are.
fn as_gemvs_take(ty: GgmlType, v: &[f32], k: usize) -> Vec<f32> {
    match gemv_takes_16_bit_activations(ty, k) {
        true => v.chunks(k).flat_map(as_16_bit).collect(),
        false => v.to_vec(),
    }
}

/// A matrix's weights as the tensor-core kernel dequantizes them to f16, as f32.
fn mmq_weights(m: &HostMatrix) -> Vec<f32> {
    let w = match m.ty {
        GgmlType::Q4_K | GgmlType::Q5_K => k_quant_as_f16_fma(m),
        GgmlType::Q6_K => q6k_as_f16(m),
        _ => dequantized_as_f16(m),
    };
    w.bytes
        .as_slice()
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// `Σ_k w[r, k] · x[t, k]` in f64 for every token t and row r (out[t][r]).
fn products(w: &[f32], x: &[f32], rows: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let (wr, xt) = (&w[r * k..(r + 1) * k], &x[t * k..(t + 1) * k]);
            out[t * rows + r] = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    out
}

/// One launch of an mmq kernel: its n-tiles, its blocks and its splits of each tile's units.
struct MmqShape {
    nt: usize,
    blocks: u32,
    splits: usize,
}

/// What a launch covers: `mats` matrices of `rows` rows each (a gated pair: gate, up), `k`
/// wide, for `n` tokens.
struct MmqCase {
    ty: GgmlType,
    rows: Vec<usize>,
    k: usize,
    n: usize,
    gated: bool,
}

/// Runs `case` as `shape` on the emulator and checks it against the f64 products of the
/// weights as the kernel dequantizes them and the f16 activations.
fn check_mmq(unit: &EmuModule, format: &str, case: &MmqCase, shape: &MmqShape, seed_name: &str) {
    let mut r = rng(seed_name);
    let (k, n) = (case.k, case.n);
    let host: Vec<HostMatrix> = case
        .rows
        .iter()
        .map(|&rows| random_matrix(&mut r, case.ty, rows, k))
        .collect();
    let laid: Vec<Vec<u8>> = host.iter().map(laid_out).collect();
    let row_bytes = laid[0].len() / case.rows[0];
    let x: Vec<f32> = uniform(&mut r, n * k, 1.0)
        .into_iter()
        .map(|v| f16::from_f32(v).to_f32())
        .collect();
    let xh: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();

    // Outputs poisoned: f32 NaN, or (gated: f16 values, two a word) the f16 NaN 0x7fff.
    let mut outs: Vec<Vec<u32>> = case
        .rows
        .iter()
        .map(|&rows| match case.gated {
            true => vec![0x7fff_7fff; (n * rows).div_ceil(2)],
            false => vec![0x7fc0_0000; n * rows],
        })
        .collect();
    let tiles: usize = if case.gated {
        case.rows[0].div_ceil(8)
    } else {
        case.rows.iter().map(|r| r.div_ceil(16)).sum()
    };
    let units = k / 256;
    let per_split = units.div_ceil(shape.splits);
    assert_eq!(units.div_ceil(per_split), shape.splits, "no empty split");
    // 16 floats a tile, token slot (8 · nt of them: the parts keep every slot's) and split,
    // and a tile's more past the end, which no part may touch.
    let part_floats = shape.splits * 8 * shape.nt * tiles * 16;
    let mut parts = vec![f32::NAN; part_floats + 8 * shape.nt * 16];
    let mut tickets = vec![0u32; tiles];

    let mut p = Products {
        count: case.rows.len() as i32,
        ..Products::default()
    };
    for (i, (w, out)) in laid.iter().zip(&mut outs).enumerate() {
        p.w[i] = w.as_ptr() as u64;
        p.out[i] = out.as_mut_ptr() as u64;
        p.rows[i] = case.rows[i] as i32;
    }
    let name = format!("mmq_{format}_{}", shape.nt);
    // SAFETY: MmqKernel is the signature of the mmq kernels.
    let kernel: MmqKernel = unsafe { unit.kernel(&name) }.unwrap();
    let (xp, pp, tp) = (
        xh.as_ptr() as usize,
        parts.as_mut_ptr() as usize,
        tickets.as_mut_ptr() as usize,
    );
    let shared = per_split * 8 * shape.nt * MMQ_TOKEN_BYTES;
    let (gated, splits) = (i32::from(case.gated), shape.splits as i32);
    unit.launch(
        [shape.blocks, shape.splits as u32, 1],
        [mmq_threads(shape.nt), 1, 1],
        shared,
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        &|| unsafe {
            kernel(
                p,
                row_bytes as u64,
                k as i32,
                xp as *const u16,
                n as i32,
                gated,
                pp as *mut f32,
                tp as *mut u32,
                splits,
                per_split as i32,
            )
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(tickets.iter().all(|&t| t == 0), "{name}: tickets left set");
    assert!(
        parts[part_floats..].iter().all(|v| v.is_nan()),
        "{name}: a part stored past the last tile's"
    );

    let what = format!(
        "{name} {} rows {:?} k={k} n={n} splits={}",
        case.ty, case.rows, shape.splits
    );
    let weights: Vec<Vec<f32>> = host.iter().map(mmq_weights).collect();
    if case.gated {
        let rows = case.rows[0];
        let g = products(&weights[0], &x, rows, k, n);
        let u = products(&weights[1], &x, rows, k, n);
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| (gelu_tanh(g) * u).clamp(-65_504.0, 65_504.0) as f32)
            .collect();
        let got: Vec<f32> = outs[0]
            .iter()
            .flat_map(|&w| [w as u16, (w >> 16) as u16])
            .take(n * rows)
            .map(|b| f16::from_bits(b).to_f32())
            .collect();
        // f16 outputs (saturating at ±65 504, as to_f16 does).
        assert_close(&what, &got, &want, 2e-3);
    } else {
        for (i, &rows) in case.rows.iter().enumerate() {
            let want: Vec<f32> = products(&weights[i], &x, rows, k, n)
                .into_iter()
                .map(|v| v as f32)
                .collect();
            let got: Vec<f32> = outs[i].iter().map(|&b| f32::from_bits(b)).collect();
            assert_close(
                &format!("{what} matrix {i}"),
                &got,
                &want,
                product_tolerance(k),
            );
        }
    }
}

/// gelu with the tanh approximation, in f64.
fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + (0.797_884_560_802_865_4 * (x + 0.044_715 * x * x * x)).tanh())
}

/// Every n-tile count of one format's mmq kernels: products of two matrices (partial row
/// tiles), one launch unsplit and one split, more tiles than a block has warps, and the gated
/// pair, split.
fn mmq_format(ty: GgmlType, format: &'static str) {
    let Some(unit) = gemv_unit(format) else {
        return;
    };
    for (n, nt, splits, rows) in [
        (3, 1, 1, [40, 24]),
        (13, 2, 3, [40, 24]),
        (27, 4, 1, [40, 24]),
        (64, 8, 2, [40, 24]),
        // 22 row tiles: every warp of a block of 16 has one, some walk a second.
        (64, 8, 2, [200, 136]),
    ] {
        let case = MmqCase {
            ty,
            rows: rows.to_vec(),
            k: 768,
            n,
            gated: false,
        };
        let shape = MmqShape {
            nt,
            blocks: 1,
            splits,
        };
        let seed = format!("mmq {format} n={n} rows {rows:?}");
        check_mmq(&unit, format, &case, &shape, &seed);
    }
    for (n, nt, splits) in [(9, 2, 3), (40, 8, 1), (40, 8, 3)] {
        let case = MmqCase {
            ty,
            rows: vec![20, 20],
            k: 768,
            n,
            gated: true,
        };
        let shape = MmqShape {
            nt,
            blocks: 2,
            splits,
        };
        let seed = format!("mmq gated {format} n={n}");
        check_mmq(&unit, format, &case, &shape, &seed);
    }
}

#[test]
fn mmq_q4_k_matches_reference() {
    mmq_format(GgmlType::Q4_K, "q4_k");
}

#[test]
fn mmq_q5_k_matches_reference() {
    mmq_format(GgmlType::Q5_K, "q5_k");
}

#[test]
fn mmq_q6_k_matches_reference() {
    mmq_format(GgmlType::Q6_K, "q6_k");
}

#[test]
fn mmq_q8_0_matches_reference() {
    mmq_format(GgmlType::Q8_0, "q8_0");
}

#[test]
fn mmq_q4_0_matches_reference() {
    mmq_format(GgmlType::Q4_0, "q4_0");
}

#[test]
fn mmq_q5_0_matches_reference() {
    mmq_format(GgmlType::Q5_0, "q5_0");
}

/// `gemv_gelu_walk_<format>_<P>` and `gemv_halves_walk_<format>_<P>` (gemv_walk.cu).
type WalkGated = unsafe extern "C" fn(
    gate: *const u8,
    up: *const u8,
    row_bytes: u64,
    rows: i32,
    k: i32,
    x: *const f32,
    out: *mut f32,
    xt: *const u8,
);
type WalkHalves = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    rows: i32,
    k: i32,
    x: *const f32,
    out: *mut f32,
    xt: *const u8,
);

/// Shared memory a 256-value unit of a walk's row of activations takes (its Q4_K tiles).
const WALK_UNIT_SHARED: usize = 640;

/// The one-token walks of one format, P = 1 and 2 row pairs a warp: the gated pair
/// (gelu_tanh(gate · x) · (up · x)) and one matrix's two halves, against f64 products of the
/// reference's weights and the activations as the walks quantize them (16-bit integers a
/// 32-value chunk), with fewer blocks than groups so warps walk several.
fn walk_format(ty: GgmlType, format: &'static str) {
    let Some(unit) = gemv_unit(format) else {
        return;
    };
    let (rows, k) = (37, 1024);
    for p in [1, 2] {
        let mut r = rng(&format!("walk {format} P={p}"));
        let mats: Vec<HostMatrix> = (0..2).map(|_| random_matrix(&mut r, ty, rows, k)).collect();
        let laid: Vec<Vec<u8>> = mats.iter().map(laid_out).collect();
        let row_bytes = laid[0].len() / rows;
        let x = uniform(&mut r, k, 1.0);
        let xs = as_16_bit(&x);
        let weights: Vec<Vec<f32>> = mats
            .iter()
            .map(|m| reference::dequantize_matrix(m).unwrap())
            .collect();
        let g = products(&weights[0], &xs, rows, k, 1);
        let u = products(&weights[1], &xs, rows, k, 1);
        let shared = WALK_UNIT_SHARED * k / 256;
        let (xp, wg, wu) = (
            x.as_ptr() as usize,
            laid[0].as_ptr() as usize,
            laid[1].as_ptr() as usize,
        );

        let mut out = vec![f32::NAN; rows];
        let op = out.as_mut_ptr() as usize;
        let name = format!("gemv_gelu_walk_{format}_{p}");
        // SAFETY: WalkGated is the signature of the gated walks.
        let kernel: WalkGated = unsafe { unit.kernel(&name) }.unwrap();
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            let (rb, (n, kk)) = (row_bytes as u64, (rows as i32, k as i32));
            let xt = std::ptr::null();
            kernel(wg as _, wu as _, rb, n, kk, xp as _, op as _, xt)
        };
        unit.launch([2, 1, 1], [256, 1, 1], shared, &body)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| (gelu_tanh(g) * u) as f32)
            .collect();
        assert_close(&format!("{name} {ty} [{rows}, {k}]"), &out, &want, 1e-4);

        // One matrix of 2·rows rows: the gate's rows, then the up's.
        let both: Vec<u8> = laid.concat();
        let bp = both.as_ptr() as usize;
        let mut out = vec![f32::NAN; 2 * rows];
        let op = out.as_mut_ptr() as usize;
        let name = format!("gemv_halves_walk_{format}_{p}");
        // SAFETY: WalkHalves is the signature of the halves walks.
        let kernel: WalkHalves = unsafe { unit.kernel(&name) }.unwrap();
        // SAFETY: as above.
        let body = || unsafe {
            let (rb, (n, kk)) = (row_bytes as u64, (rows as i32, k as i32));
            kernel(bp as _, rb, n, kk, xp as _, op as _, std::ptr::null())
        };
        unit.launch([2, 1, 1], [256, 1, 1], shared, &body)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<f32> = g.iter().chain(&u).map(|&v| v as f32).collect();
        assert_close(&format!("{name} {ty} [{rows}, {k}]"), &out, &want, 1e-4);
    }
}

#[test]
fn one_token_walks_match_reference_for_every_format() {
    for (ty, format) in [
        (GgmlType::Q4_K, "q4_k"),
        (GgmlType::Q5_K, "q5_k"),
        (GgmlType::Q6_K, "q6_k"),
        (GgmlType::Q8_0, "q8_0"),
        (GgmlType::Q4_0, "q4_0"),
        (GgmlType::Q5_0, "q5_0"),
    ] {
        walk_format(ty, format);
    }
}

/// The `AttnArgs` argument of the attention kernels (attention.cu), with the C layout.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnArgs {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    positions: u64,
    seq_start: u64,
    block_tables: u64,
    out: u64,
    part: u64,
    n_tokens: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    scale: f32,
    window: i32,
    softcap: f32,
    n_seqs: i32,
    table_width: i32,
    block_size: i32,
    chunk: i32,
    splits: i32,
    rounded: u64,
    round_kind: i32,
}

/// `attn_partial_<V>` (attention.cu).
type AttnPartial = unsafe extern "C" fn(a: AttnArgs);
/// `attn_combine` (attention.cu).
type AttnCombine = unsafe extern "C" fn(
    part: *const f32,
    rows: i32,
    splits: i32,
    head_dim: i32,
    out: *mut f32,
    rounded: *mut u16,
    round_kind: i32,
);

/// Warps of an attn_partial block (ATTN_ROW_WARPS).
const ATTN_ROW_WARPS: u32 = 8;

/// A split-K attention launch (`attn_partial_<V>` or `attn_rope_partial_<V>`, then
/// `attn_combine`): its spec, its step's layout and its chunk of keys a split.
struct SplitAttn<'a> {
    spec: AttnSpec,
    layout: KvLayout<'a>,
    chunk: usize,
}

impl SplitAttn<'_> {
    /// Splits of the longest row's keys.
    fn splits(&self) -> usize {
        let w = self.spec.window;
        let vis = |p: u32| p as usize + 1 - first_visible_key(p as usize, w);
        let most = self.layout.positions.iter().map(|&p| vis(p)).max().unwrap();
        most.div_ceil(self.chunk)
    }

    /// Attention rows: query rows × heads.
    fn rows(&self) -> usize {
        self.layout.positions.len() * self.spec.n_heads
    }

    /// The kernels' argument block over the queries, caches (addresses: the fused kernel
    /// writes them), output and split parts.
    fn args(&self, q: &[f32], k: u64, v: u64, out: &mut [f32], part: &mut [f32]) -> AttnArgs {
        let (s, l) = (&self.spec, &self.layout);
        AttnArgs {
            q: q.as_ptr() as u64,
            k_cache: k,
            v_cache: v,
            positions: l.positions.as_ptr() as u64,
            seq_start: l.seq_start.as_ptr() as u64,
            block_tables: l.block_tables.as_ptr() as u64,
            out: out.as_mut_ptr() as u64,
            part: part.as_mut_ptr() as u64,
            n_tokens: l.positions.len() as i32,
            n_heads: s.n_heads as i32,
            n_kv_heads: s.n_kv_heads as i32,
            head_dim: s.head_dim as i32,
            scale: s.scale,
            window: s.window.unwrap_or(0) as i32,
            softcap: s.softcap.unwrap_or(0.0),
            n_seqs: l.n_seqs() as i32,
            table_width: l.table_width as i32,
            block_size: l.block_size as i32,
            chunk: self.chunk as i32,
            splits: self.splits() as i32,
            rounded: 0,
            round_kind: 0,
        }
    }

    /// Runs `attn_combine` over the parts into `out` where the rows took several splits.
    fn combine(&self, unit: &EmuModule, part: &[f32], out: &mut [f32], what: &str) {
        let (rows, splits, hd) = (self.rows(), self.splits(), self.spec.head_dim);
        if splits == 1 {
            return;
        }
        // SAFETY: AttnCombine is attn_combine's signature.
        let combine: AttnCombine = unsafe { unit.kernel("attn_combine") }.unwrap();
        let (pp, op) = (part.as_ptr() as usize, out.as_mut_ptr() as usize);
        let (n, s, d) = (rows as i32, splits as i32, hd as i32);
        // SAFETY: the buffers outlive the launch and have the sizes the kernel indexes.
        let body = || unsafe { combine(pp as _, n, s, d, op as _, std::ptr::null_mut(), 0) };
        unit.launch([rows.div_ceil(4) as u32, 1, 1], [128, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    /// The reference's attention over these queries and caches.
    fn want(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        reference::attention(q, k, v, &self.spec, &self.layout)
    }
}

/// Split-K decode attention (`attn_partial_<V>`, then `attn_combine` where a row's keys take
/// several splits) over a paged cache with blocks in random order: two sequences (three rows
/// of one, one of the other), GQA, every head dim the kernels take (32 to 512), with and
/// without a window and a soft-cap, one split and several.
#[test]
fn split_attention_matches_reference() {
    let Some(unit) = emu_unit(Module::Attention, None) else {
        return;
    };
    let mut r = rng("split attention");
    let (nh, nkv, bs) = (4usize, 2usize, 16usize);
    let pos: Vec<u32> = vec![37, 38, 39, 100];
    let seq_start: Vec<u32> = vec![0, 3, 4];
    let table_width = 7; // up to position 111
    let n_blocks = 2 * table_width;
    let mut blocks: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, r.random_range(0..=i));
    }
    for (hd, window, softcap, chunk) in [
        (256, None, None, 200),
        (256, Some(24), Some(30.0), 40),
        (512, None, Some(50.0), 33),
        (128, Some(70), None, 1000),
        (64, Some(10), None, 50),
        (32, None, Some(20.0), 1000),
    ] {
        let what = format!("attention hd={hd} window={window:?} softcap={softcap:?} chunk={chunk}");
        let kv_w = nkv * hd;
        let q = uniform(&mut r, pos.len() * nh * hd, 1.0);
        let k = uniform(&mut r, n_blocks * bs * kv_w, 1.0);
        let v = uniform(&mut r, n_blocks * bs * kv_w, 1.0);
        let case = SplitAttn {
            spec: AttnSpec {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
                softcap,
            },
            layout: KvLayout {
                block_size: bs,
                positions: &pos,
                seq_start: &seq_start,
                block_tables: &blocks,
                table_width,
            },
            chunk,
        };
        let (rows, splits) = (case.rows(), case.splits());
        let mut out = vec![f32::NAN; rows * hd];
        let mut part = vec![f32::NAN; rows * splits * (hd + 2)];
        let args = case.args(
            &q,
            k.as_ptr() as u64,
            v.as_ptr() as u64,
            &mut out,
            &mut part,
        );
        let name = format!("attn_partial_{}", hd / 32);
        // SAFETY: AttnPartial is the signature of the attn_partial kernels.
        let partial: AttnPartial = unsafe { unit.kernel(&name) }.unwrap();
        let grid = [rows as u32, splits as u32, 1];
        // SAFETY: every buffer `args` points to outlives the launch and has the size the
        // kernel indexes.
        unit.launch(grid, [32 * ATTN_ROW_WARPS, 1, 1], 0, &|| unsafe {
            partial(args)
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        case.combine(&unit, &part, &mut out, &what);
        assert_close(&what, &out, &case.want(&q, &k, &v), 1e-5);
    }
}

/// `kv_gather_f16` (flash_attention.cu).
type KvGather = unsafe extern "C" fn(
    k_cache: *const f32,
    v_cache: *const f32,
    table: *const u32,
    block_size: i32,
    row: i32,
    k_lo: i32,
    kg: *mut u16,
    vg: *mut u16,
);
/// `attn_flash_<D>` (flash_attention.cu).
type AttnFlash = unsafe extern "C" fn(
    q: *const f32,
    kg: *const u16,
    vg: *const u16,
    out: *mut f32,
    rounded: *mut u16,
    positions: *const u32,
    n_rows: i32,
    n_heads: i32,
    n_kv_heads: i32,
    k_lo: i32,
    n_keys: i32,
    window: i32,
    round_kind: i32,
    scale: f32,
    softcap: f32,
);

/// Prefill attention, flash style (`kv_gather_f16`, then `attn_flash_<D>` over tiles of 64
/// query rows and stages of 32 or 64 keys through ldmatrix and mma.sync), for one sequence of
/// 70 rows continuing a cached prefix, against the f64 reference on the f16 queries, keys and
/// values the kernel reads: head dims 128, 256 and 512, GQA, window and soft-cap.
#[test]
fn flash_attention_matches_reference() {
    let Some(unit) = emu_unit(Module::FlashAttention, None) else {
        return;
    };
    let mut r = rng("flash attention");
    let (nh, nkv, bs) = (4usize, 2usize, 16usize);
    let pos: Vec<u32> = (30..100).collect();
    let seq_start: Vec<u32> = vec![0, pos.len() as u32];
    let table_width = 7;
    let mut blocks: Vec<u32> = (0..table_width as u32).collect();
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, r.random_range(0..=i));
    }
    // SAFETY: the signatures of the two kernels.
    let gather: KvGather = unsafe { unit.kernel("kv_gather_f16") }.unwrap();
    for (hd, window, softcap) in [
        (128, None, None),
        (256, Some(48), Some(30.0)),
        (512, None, Some(50.0)),
    ] {
        let what = format!("flash attention hd={hd} window={window:?} softcap={softcap:?}");
        let row = nkv * hd;
        let to_f16 = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect()
        };
        let q = to_f16(uniform(&mut r, pos.len() * nh * hd, 1.0));
        let k = to_f16(uniform(&mut r, table_width * bs * row, 1.0));
        let v = to_f16(uniform(&mut r, table_width * bs * row, 1.0));
        let scale = 1.0 / (hd as f32).sqrt();
        let (lo, hi) = (pos[0] as usize, *pos.last().unwrap() as usize);
        let k_lo = window.map_or(0, |w: usize| (lo + 1).saturating_sub(w));
        let n_keys = hi + 1 - k_lo;
        let halves = (n_keys * row).div_ceil(128) * 128;
        let mut gathered = vec![0x7fffu16; 2 * halves];
        let (kp, vp, tp) = (
            k.as_ptr() as usize,
            v.as_ptr() as usize,
            blocks.as_ptr() as usize,
        );
        let gp = gathered.as_mut_ptr() as usize;
        let (b, rw, kl) = (bs as i32, row as i32, k_lo as i32);
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            let g = gp as *mut u16;
            gather(kp as _, vp as _, tp as _, b, rw, kl, g, g.add(halves))
        };
        unit.launch([n_keys as u32, 1, 1], [128, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("{what}: kv_gather_f16: {e}"));

        let (stage_keys, swap) = if hd == 512 { (32, 8 * 2048) } else { (64, 0) };
        let shared = (64 + 4 * stage_keys) * (hd + 8) * 2 + swap;
        let tiles = (pos.len() * (nh / nkv)).div_ceil(64);
        let mut out = vec![f32::NAN; pos.len() * nh * hd];
        let name = format!("attn_flash_{hd}");
        // SAFETY: AttnFlash is the signature of the flash kernels.
        let flash: AttnFlash = unsafe { unit.kernel(&name) }.unwrap();
        let (qp, op, pp) = (
            q.as_ptr() as usize,
            out.as_mut_ptr() as usize,
            pos.as_ptr() as usize,
        );
        let ints = [pos.len(), nh, nkv, k_lo, n_keys, window.unwrap_or(0)].map(|v| v as i32);
        let cap = softcap.unwrap_or(0.0);
        // SAFETY: as above.
        let body = || unsafe {
            let g = gp as *const u16;
            let [n, h, kv, kl, nk, w] = ints;
            let rounded = std::ptr::null_mut();
            flash(
                qp as _,
                g,
                g.add(halves),
                op as _,
                rounded,
                pp as _,
                n,
                h,
                kv,
                kl,
                nk,
                w,
                0,
                scale,
                cap,
            )
        };
        unit.launch([tiles as u32, nkv as u32, 1], [256, 1, 1], shared, &body)
            .unwrap_or_else(|e| panic!("{what}: {name}: {e}"));
        let want = reference::attention(
            &q,
            &k,
            &v,
            &AttnSpec {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                scale,
                window,
                softcap,
            },
            &KvLayout {
                block_size: bs,
                positions: &pos,
                seq_start: &seq_start,
                block_tables: &blocks,
                table_width,
            },
        );
        assert_close(&what, &out, &want, 2e-3);
    }
}

/// `gemv_many_<format>_<NT>` (gemv.cu).
type GemvMany = unsafe extern "C" fn(
    p: Products,
    row_bytes: u64,
    k: i32,
    x: *const f32,
    nt: i32,
    xt: *const u8,
);

/// One-token GEMVs of up to 8 token rows (`gemv_many_<format>_<NT>`, a warp a row, up to four
/// matrices a launch) for every format the kernels instantiate, rows of whole 256-value units
/// and (where the format's blocks allow) of other widths, against f64 products of the
/// reference's weights and the activations as the GEMVs take them (16-bit integers a 32-value
/// chunk where `gemv_takes_16_bit_activations`).
#[test]
fn gemv_many_matches_reference_for_every_format() {
    for (ty, format) in FORMATS {
        let Some(unit) = gemv_unit(format) else {
            return;
        };
        let mut r = rng(&format!("gemv_many {format}"));
        let block = ty.block_size();
        let widths = match block {
            1 => vec![40, 512],
            32 => vec![288, 512],
            _ => vec![512],
        };
        for k in widths {
            let rows = [5usize, 17, 9];
            let mats: Vec<HostMatrix> = rows
                .iter()
                .map(|&n| random_matrix(&mut r, ty, n, k))
                .collect();
            let laid: Vec<Vec<u8>> = mats.iter().map(laid_out).collect();
            let row_bytes = laid[0].len() / rows[0];
            let weights: Vec<Vec<f32>> = mats
                .iter()
                .map(|m| reference::dequantize_matrix(m).unwrap())
                .collect();
            for (nt_kernel, nt) in [(1, 1), (2, 2), (4, 3), (8, 8)] {
                let x = uniform(&mut r, nt * k, 1.0);
                let xs = as_gemvs_take(ty, &x, k);
                let mut outs: Vec<Vec<f32>> =
                    rows.iter().map(|&n| vec![f32::NAN; nt * n]).collect();
                let mut p = Products {
                    count: 3,
                    ..Products::default()
                };
                for (i, (w, out)) in laid.iter().zip(&mut outs).enumerate() {
                    p.w[i] = w.as_ptr() as u64;
                    p.out[i] = out.as_mut_ptr() as u64;
                    p.rows[i] = rows[i] as i32;
                }
                let name = format!("gemv_many_{format}_{nt_kernel}");
                // SAFETY: GemvMany is the signature of the gemv_many kernels.
                let kernel: GemvMany = unsafe { unit.kernel(&name) }.unwrap();
                let xp = x.as_ptr() as usize;
                let (rb, kk, n) = (row_bytes as u64, k as i32, nt as i32);
                let warps: usize = rows.iter().sum();
                // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
                let body = || unsafe { kernel(p, rb, kk, xp as _, n, std::ptr::null()) };
                unit.launch([warps.div_ceil(8) as u32, 1, 1], [256, 1, 1], 0, &body)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                for (i, &n_rows) in rows.iter().enumerate() {
                    let want: Vec<f32> = products(&weights[i], &xs, n_rows, k, nt)
                        .into_iter()
                        .map(|v| v as f32)
                        .collect();
                    let what = format!("{name} {ty} k={k} nt={nt} matrix {i}");
                    assert_close(&what, &outs[i], &want, 1e-4);
                }
            }
        }
    }
}

/// `moe_group` (moe.cu).
type MoeGroup = unsafe extern "C" fn(
    ids: *const f32,
    pairs: i32,
    n_experts: i32,
    tile: i32,
    most_tiles: i32,
    order: *mut i32,
    slot_of: *mut i32,
    tiles: *mut i32,
    err: *mut u32,
);
/// `moe_gather_16` (moe_mma.cu).
type MoeGather16 = unsafe extern "C" fn(
    x: *const f32,
    d: i32,
    top_k: i32,
    order: *const i32,
    kind: i32,
    xh: *mut u16,
);
/// `moe_mma_<format>` (moe_mma.cu).
type MoeMma = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    k: i32,
    rows: i32,
    x: *const u16,
    tiles: *const i32,
    ids: *const f32,
    n_experts: i32,
    err: *mut u32,
    gated: i32,
    out_kind: i32,
    out: *mut u8,
);

/// Pairs an expert tile of the grouped MoE path holds (MOE_TILE), and in crowded launches over
/// quantized experts on the tensor cores (moe.rs `WIDE_TILE`).
const MOE_TILE: usize = 8;
const WIDE_TILE: usize = 16;

/// 16-bit values as f32: bf16 (`bf16`) or f16.
fn from_16(v: &[u16], bf16: bool) -> Vec<f32> {
    v.iter()
        .map(|&b| match bf16 {
            true => half::bf16::from_bits(b).to_f32(),
            false => f16::from_bits(b).to_f32(),
        })
        .collect()
}

/// A 26B-A4B-like MoE layer's grouped path on the emulator, for every format of the
/// tensor-core expert products: `moe_group` (checked against its definition: each expert's
/// pairs in pair order, experts in order, tiles of up to 8 pairs — or 16 —, unused tiles and
/// slots marked), `moe_gather_16`, then `moe_mma_<format>` gated (gelu_tanh(gate) · up,
/// rounded to 16 bits) and down, against f64 products of the weights as the kernel
/// dequantizes them. Tiles of 8 pairs: 5 tokens routed at random (`moe_mma_<format>`); of 16: 34 tokens, 18 of them first to expert 0 and 11 to expert
/// 1 (tiles of 16 and 2 pairs, and one of 11: a part-filled second n-tile), their second
/// experts and the other 5 tokens' among experts 2–7 (`moe_mma_<format>_16`, quantized
/// formats only).
#[test]
fn grouped_moe_on_tensor_cores_matches_reference() {
    for tile in [MOE_TILE, WIDE_TILE] {
        grouped_moe_in_tiles(tile);
    }
}

/// `grouped_moe_on_tensor_cores_matches_reference` in tiles of `tile` pairs.
fn grouped_moe_in_tiles(tile: usize) {
    let Some(shared) = emu_unit(Module::Moe, None) else {
        return;
    };
    let wide = tile == WIDE_TILE;
    let (n, top_k, n_experts) = (if wide { 34usize } else { 5 }, 2usize, 8usize);
    let pairs = n * top_k;
    let most_tiles = (pairs + (tile - 1) * n_experts.min(pairs)) / tile;
    for (ty, format) in [
        (GgmlType::BF16, "bf16"),
        (GgmlType::F16, "f16"),
        (GgmlType::Q4_0, "q4_0"),
        (GgmlType::Q5_0, "q5_0"),
        (GgmlType::Q5_1, "q5_1"),
        (GgmlType::Q8_0, "q8_0"),
        (GgmlType::Q4_K, "q4_k"),
        (GgmlType::Q5_K, "q5_k"),
    ] {
        // 16-bit experts keep tiles of 8 (no `_16` kernels).
        if wide && matches!(ty, GgmlType::BF16 | GgmlType::F16) {
            continue;
        }
        let Some(unit) = emu_unit(Module::Moe, Some(format)) else {
            return;
        };
        // Down rows of 192 values (not whole 256-value groups: Q4_0, Q5_0 and Q8_0 as stored)
        // where the format allows them; Q4_K's and Q5_K's rows of 3 and 2 super-blocks, so a
        // warp walks past the units it loads ahead.
        let (d, ff) = if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
            (768, 512)
        } else {
            (256, 192)
        };
        let mut r = rng(&format!("moe {format} in tiles of {tile}"));
        // Each token's top_k distinct experts.
        let ids: Vec<f32> = (0..n)
            .flat_map(|t| {
                let (first, second) = if wide {
                    // (7t mod 29) spreads experts 0 (18 tokens) and 1 (11) over the first 29.
                    let first = match t {
                        0..29 => usize::from((7 * t) % 29 >= 18),
                        _ => r.random_range(2..n_experts),
                    };
                    let others = n_experts - 2;
                    let second = match first {
                        0 | 1 => r.random_range(2..n_experts),
                        f => 2 + (f - 2 + r.random_range(1..others)) % others,
                    };
                    (first, second)
                } else {
                    let first = r.random_range(0..n_experts);
                    (first, (first + r.random_range(1..n_experts)) % n_experts)
                };
                [first as f32, second as f32]
            })
            .collect();
        let mut order = vec![i32::MIN; pairs];
        let mut slot_of = vec![i32::MIN; pairs];
        let mut tiles = vec![i32::MIN; 3 * most_tiles];
        let mut err = 0u32;
        let ptrs = [
            ids.as_ptr() as usize,
            order.as_mut_ptr() as usize,
            slot_of.as_mut_ptr() as usize,
            tiles.as_mut_ptr() as usize,
            &mut err as *mut u32 as usize,
        ];
        // SAFETY: MoeGroup is moe_group's signature.
        let group: MoeGroup = unsafe { shared.kernel("moe_group") }.unwrap();
        let (p, e, t, m) = (
            pairs as i32,
            n_experts as i32,
            tile as i32,
            most_tiles as i32,
        );
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            let [ip, op, sp, tp, ep] = ptrs;
            group(ip as _, p, e, t, m, op as _, sp as _, tp as _, ep as _)
        };
        shared
            .launch([1, 1, 1], [256, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("moe_group: {e}"));
        assert_eq!(err, 0, "moe_group flagged valid ids");
        // The grouping by its definition.
        let mut want_order = Vec::new();
        let mut want_tiles = Vec::new();
        for e in 0..n_experts {
            let mine: Vec<usize> = (0..pairs).filter(|&p| ids[p] as usize == e).collect();
            for (i, chunk) in mine.chunks(tile).enumerate() {
                let first = want_order.len() + tile * i;
                want_tiles.push([e as i32, first as i32, chunk.len() as i32]);
            }
            want_order.extend(mine.iter().map(|&p| p as i32));
        }
        assert_eq!(order, want_order, "moe_group order");
        if wide {
            let sizes: Vec<i32> = want_tiles.iter().map(|t| t[2]).collect();
            assert!(
                sizes.contains(&16) && sizes.iter().any(|s| (9..16).contains(s)),
                "tiles of 16 pairs: sizes {sizes:?} lack a full tile or a part-filled second n-tile"
            );
        }
        for (s, &p) in order.iter().enumerate() {
            assert_eq!(slot_of[p as usize], s as i32, "slot_of[{p}]");
        }
        for (i, t) in tiles.chunks(3).enumerate() {
            match want_tiles.get(i) {
                Some(w) => assert_eq!(t, w, "tile {i}"),
                None => assert_eq!(t[2], 0, "unused tile {i} has pairs"),
            }
        }

        // The slots' token rows as 16-bit activations.
        let bf16 = ty == GgmlType::BF16;
        let kind = if bf16 { 1 } else { 2 };
        let x = uniform(&mut r, n * d, 1.0);
        let mut xh = vec![0xffffu16; pairs * d];
        // SAFETY: MoeGather16 is moe_gather_16's signature.
        let gather: MoeGather16 = unsafe { shared.kernel("moe_gather_16") }.unwrap();
        let (xp, op, hp) = (
            x.as_ptr() as usize,
            order.as_ptr() as usize,
            xh.as_mut_ptr() as usize,
        );
        // SAFETY: as above.
        let body = || unsafe { gather(xp as _, d as i32, top_k as i32, op as _, kind, hp as _) };
        shared
            .launch([pairs as u32, 1, 1], [256, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("moe_gather_16: {e}"));
        let xs = from_16(&xh, bf16);
        for (s, &p) in order.iter().enumerate() {
            let row = &x[p as usize / top_k * d..][..d];
            let want = round_16(ty, row);
            assert_eq!(&xs[s * d..][..d], &want[..], "moe_gather_16 slot {s}");
        }

        // Gate and up ([expert][gate rows, then up rows][d]), then down ([expert][d][ff]).
        let gate_up = random_matrix(&mut r, ty, n_experts * 2 * ff, d);
        let down = random_matrix(&mut r, ty, n_experts * d, ff);
        // The weights as the kernels dequantize them, and the gated outputs they must give.
        let seen = |m: &HostMatrix| -> Vec<f32> {
            let w = match m.ty {
                GgmlType::BF16 | GgmlType::F16 => m.clone(),
                GgmlType::Q4_K | GgmlType::Q5_K => k_quant_as_f16_fma(m),
                _ => dequantized_as_f16(m),
            };
            reference::dequantize_matrix(&w).unwrap()
        };
        let (wgu, wd) = (seen(&gate_up), seen(&down));
        let mut want_h = Vec::new();
        for (s, &p) in order.iter().enumerate() {
            let e = ids[p as usize] as usize;
            let xrow = &xs[s * d..][..d];
            let g = products(&wgu[e * 2 * ff * d..][..ff * d], xrow, ff, d, 1);
            let u = products(&wgu[(e * 2 + 1) * ff * d..][..ff * d], xrow, ff, d, 1);
            // Rounded to f16 (saturating, as to_f16) or bf16.
            let gated = g.iter().zip(&u).map(|(&g, &u)| (gelu_tanh(g) * u) as f32);
            want_h.extend(round_16(ty, &gated.collect::<Vec<_>>()));
        }
        let name = if wide {
            format!("moe_mma_{format}_16")
        } else {
            format!("moe_mma_{format}")
        };
        {
            let mma: MoeMma = unsafe { unit.kernel(&name) }.unwrap();
            let launch = |m: &HostMatrix, rows: usize, x: &[u16], gated: bool, out: usize| {
                let laid = laid_out(m);
                let row_bytes = laid.len() / m.rows;
                let (wp, xp, tp) = (
                    laid.as_ptr() as usize,
                    x.as_ptr() as usize,
                    tiles.as_ptr() as usize,
                );
                let (mut err, per) = (0u32, if gated { 8 } else { 16 });
                let ep = &mut err as *mut u32 as usize;
                let (k, n_rows, g) = (m.cols as i32, rows as i32, i32::from(gated));
                // SAFETY: MoeMma is the signature of moe_mma_<format>; every buffer outlives the
                // launch and has the size the kernel indexes.
                let body = || unsafe {
                    let ids = std::ptr::null();
                    mma(
                        wp as _,
                        row_bytes as u64,
                        k,
                        n_rows,
                        xp as _,
                        tp as _,
                        ids,
                        8,
                        ep as _,
                        g,
                        kind,
                        out as _,
                    )
                };
                let blocks = rows.div_ceil(per).div_ceil(8) as u32;
                unit.launch([blocks, most_tiles as u32, 1], [256, 1, 1], 0, &body)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(err, 0, "{name} flagged an error");
            };
            let mut h = vec![0xffffu16; pairs * ff];
            launch(&gate_up, ff, &xh, true, h.as_mut_ptr() as usize);
            let mut y = vec![f32::NAN; pairs * d];
            launch(&down, d, &h, false, y.as_mut_ptr() as usize);

            // The down products of the gated launch's own outputs.
            let mut want_y = Vec::new();
            for (s, &p) in order.iter().enumerate() {
                let e = ids[p as usize] as usize;
                let hrow = from_16(&h[s * ff..][..ff], bf16);
                let yr = products(&wd[e * d * ff..][..d * ff], &hrow, d, ff, 1);
                want_y.extend(yr.into_iter().map(|v| v as f32));
            }
            let tol = if bf16 { 1e-2 } else { 2e-3 };
            assert_close(&format!("{name} gated"), &from_16(&h, bf16), &want_h, tol);
            assert_close(&format!("{name} down"), &y, &want_y, 1e-4);
        }
    }
}

/// `residual_norm` (ops.cu).
type ResidualNorm = unsafe extern "C" fn(
    y: *const f32,
    w: *const f32,
    eps: f32,
    dim: i32,
    h: *mut f32,
    scale: f32,
    w2: *const f32,
    x: *mut f32,
    rounded: *mut u8,
    round_kind: i32,
);

/// `rounded.rs`'s kind of a producer's copy as Q4_K tiles (ROUND_Q4K_TILES).
const ROUND_Q4K_TILES: i32 = 3;
/// Bytes of a 256-value super-block of a row as Q4_K tiles (q4k_tiles_row_bytes).
const Q4K_TILE_BYTES: usize = 640;

/// A batch-1 decode link: `residual_norm` (the post-norm, the residual add with the layer
/// scalar, and the next pre-norm) against f64 arithmetic, writing the normed rows also as Q4_K
/// tiles; then the Q4_K GEMV reading those tiles gives the same bits as the GEMV quantizing the
/// rows itself, and matches the reference product.
#[test]
fn residual_norm_tiles_feed_the_q4_k_gemv() {
    let (Some(ops), Some(gemv)) = (emu_unit(Module::Ops, None), gemv_unit("q4_k")) else {
        return;
    };
    let mut r = rng("residual norm tiles");
    let (rows, dim, eps, scale) = (2usize, 512usize, 1e-6f32, 0.7f32);
    let y = uniform(&mut r, rows * dim, 2.0);
    let h0 = uniform(&mut r, rows * dim, 2.0);
    let w = uniform(&mut r, dim, 1.0);
    let w2 = uniform(&mut r, dim, 1.0);
    let mut h = h0.clone();
    let mut x = vec![f32::NAN; rows * dim];
    let tile_row = Q4K_TILE_BYTES * dim / 256;
    let mut tiles = vec![0xcdu8; rows * tile_row];
    // SAFETY: ResidualNorm is residual_norm's signature.
    let norm: ResidualNorm = unsafe { ops.kernel("residual_norm") }.unwrap();
    let ptrs = [
        y.as_ptr() as usize,
        w.as_ptr() as usize,
        h.as_mut_ptr() as usize,
        w2.as_ptr() as usize,
        x.as_mut_ptr() as usize,
        tiles.as_mut_ptr() as usize,
    ];
    // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
    let body = || unsafe {
        let [yp, wp, hp, w2p, xp, tp] = ptrs;
        let k = ROUND_Q4K_TILES;
        norm(
            yp as _, wp as _, eps, dim as i32, hp as _, scale, w2p as _, xp as _, tp as _, k,
        )
    };
    ops.launch([rows as u32, 1, 1], [64, 1, 1], 4 * dim, &body)
        .unwrap_or_else(|e| panic!("residual_norm: {e}"));
    let want_h: Vec<f32> = reference::rms_norm(&y, Some(&w), eps, dim)
        .iter()
        .zip(&h0)
        .map(|(n, h)| (h + n) * scale)
        .collect();
    let want_x = reference::rms_norm(&want_h, Some(&w2), eps, dim);
    assert_close("residual_norm h", &h, &want_h, 1e-5);
    assert_close("residual_norm x", &x, &want_x, 1e-5);

    // One token row at a time: the GEMV on the norm's tiles, and on the row itself.
    let m = random_matrix(&mut r, GgmlType::Q4_K, 24, dim);
    let row_bytes = m.bytes.as_slice().len() / m.rows;
    let weights = reference::dequantize_matrix(&m).unwrap();
    // SAFETY: GemvMany is the signature of the gemv_many kernels.
    let kernel: GemvMany = unsafe { gemv.kernel("gemv_many_q4_k_1") }.unwrap();
    for t in 0..rows {
        let run = |xt: *const u8| {
            let mut out = vec![f32::NAN; m.rows];
            let mut p = Products {
                count: 1,
                ..Products::default()
            };
            p.w[0] = m.bytes.as_slice().as_ptr() as u64;
            p.out[0] = out.as_mut_ptr() as u64;
            p.rows[0] = m.rows as i32;
            let (xp, tp) = (x[t * dim..].as_ptr() as usize, xt as usize);
            // SAFETY: as above.
            let body = || unsafe { kernel(p, row_bytes as u64, dim as i32, xp as _, 1, tp as _) };
            gemv.launch([3, 1, 1], [256, 1, 1], 0, &body)
                .unwrap_or_else(|e| panic!("gemv_many_q4_k_1: {e}"));
            out
        };
        let from_tiles = run(tiles[t * tile_row..].as_ptr());
        let from_row = run(std::ptr::null());
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&from_tiles),
            bits(&from_row),
            "row {t}: tiles and row differ"
        );
        let xs = as_16_bit(&x[t * dim..][..dim]);
        let want: Vec<f32> = products(&weights, &xs, m.rows, dim, 1)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        assert_close(&format!("gemv on tiles, row {t}"), &from_tiles, &want, 1e-4);
    }
}

/// `argmax_part` / `argmax_join` (sample.cu).
type ArgmaxPart = unsafe extern "C" fn(x: *const f32, n: i32, parts: i32, part: *mut f32);
type ArgmaxJoin = unsafe extern "C" fn(part: *const f32, parts: i32, n: i32, out: *mut u32);

/// Greedy picks in two passes (slices of a row, then the best slice) against the first index
/// of the largest value, NaN counting as −inf: ties across slices, a NaN row entry.
#[test]
fn argmax_picks_the_first_largest_logit() {
    let Some(unit) = emu_unit(Module::Sample, None) else {
        return;
    };
    let mut r = rng("argmax");
    let (rows, n, parts) = (3usize, 5000usize, 7usize);
    let mut x = uniform(&mut r, rows * n, 10.0);
    x[n + 17] = 50.0; // row 1: a tie across slices, the first wins
    x[n + 4321] = 50.0;
    x[2 * n + 9] = f32::NAN; // row 2: NaN is −inf
    let mut part = vec![f32::NAN; 2 * rows * parts];
    let mut picks = vec![u32::MAX; rows];
    // SAFETY: the signatures of the two kernels.
    let (pk, jk): (ArgmaxPart, ArgmaxJoin) = unsafe {
        (
            unit.kernel("argmax_part").unwrap(),
            unit.kernel("argmax_join").unwrap(),
        )
    };
    let (xp, pp, op) = (
        x.as_ptr() as usize,
        part.as_mut_ptr() as usize,
        picks.as_mut_ptr() as usize,
    );
    let (ni, pi) = (n as i32, parts as i32);
    // SAFETY: every buffer outlives the launches and has the size the kernels index.
    unit.launch(
        [rows as u32, parts as u32, 1],
        [256, 1, 1],
        256,
        &|| unsafe { pk(xp as _, ni, pi, pp as _) },
    )
    .unwrap();
    // SAFETY: as above.
    unit.launch([rows as u32, 1, 1], [32, 1, 1], 256, &|| unsafe {
        jk(pp as _, pi, ni, op as _)
    })
    .unwrap();
    for t in 0..rows {
        let row = &x[t * n..][..n];
        let clean = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        let best = (0..n).fold(0, |b, j| if clean(row[j]) > clean(row[b]) { j } else { b });
        assert_eq!(picks[t] as usize, best, "row {t}");
    }
}

/// `attn_rope_partial_<V>` (attention.cu).
type AttnRopePartial = unsafe extern "C" fn(
    a: AttnArgs,
    k: *const f32,
    v: *const f32,
    q_norm: *const f32,
    k_norm: *const f32,
    eps: f32,
    freqs: *const f32,
    pairs: i32,
    v_norm: i32,
    slots: *const u32,
);

/// RoPE frequencies of `pairs` turning pairs of a head of `hd` values (θ 10 000), as
/// `reference::head_norm_rope` forms them, and the reference's `Rope` for them.
fn rope_freqs(hd: usize, pairs: usize) -> (Vec<f32>, Rope) {
    let rope = Rope {
        theta: 10_000.0,
        linear_factor: 1.0,
        rotated_pairs: pairs,
    };
    let freqs = (0..pairs)
        .map(|i| 1.0 / rope.theta.powf((2 * i) as f32 / hd as f32))
        .collect();
    (freqs, rope)
}

/// The fused decode attention (`attn_rope_partial_<V>`): each sequence's one query row normed
/// and turned in the kernel, its new key normed and turned and its value (v_norm: normed
/// without gains) stored in the cache row of its position and folded in from registers, the
/// older keys read from the paged cache; against the f64 reference on the turned queries and the
/// cache with the new rows in place. Head dims 256 (some pairs not turning) and 512, with and
/// without v_norm, window and soft-cap, one split and several.
#[test]
fn fused_rope_attention_matches_reference() {
    let Some(unit) = emu_unit(Module::Attention, None) else {
        return;
    };
    let mut r = rng("fused rope attention");
    let (nh, nkv, bs, eps) = (4usize, 2usize, 16usize, 1e-6f32);
    let pos: Vec<u32> = vec![45, 100];
    let seq = [0usize, 1];
    let seq_start: Vec<u32> = vec![0, 1, 2];
    let table_width = 7;
    let n_blocks = 2 * table_width;
    let mut blocks: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, r.random_range(0..=i));
    }
    for (hd, pairs, v_norm, window, softcap, chunk) in [
        (256, 96, true, None, None, 400),
        (256, 128, false, Some(24), Some(30.0), 40),
        (512, 256, true, None, Some(50.0), 37),
    ] {
        let what = format!("fused attention hd={hd} v_norm={v_norm} window={window:?}");
        let kv_w = nkv * hd;
        let q = uniform(&mut r, pos.len() * nh * hd, 1.0);
        let k_new = uniform(&mut r, pos.len() * kv_w, 1.0);
        let v_new = uniform(&mut r, pos.len() * kv_w, 1.0);
        let mut k_cache = uniform(&mut r, n_blocks * bs * kv_w, 1.0);
        let mut v_cache = uniform(&mut r, n_blocks * bs * kv_w, 1.0);
        let q_norm = uniform(&mut r, hd, 1.0);
        let k_norm = uniform(&mut r, hd, 1.0);
        let (freqs, rope) = rope_freqs(hd, pairs);
        let slots: Vec<u32> = pos
            .iter()
            .zip(&seq)
            .map(|(&p, &s)| {
                let p = p as usize;
                blocks[s * table_width + p / bs] * bs as u32 + (p % bs) as u32
            })
            .collect();

        // The reference: turned queries, the cache with each sequence's new row in its slot.
        let q_turned = reference::head_norm_rope(&q, nh, hd, Some((&q_norm, eps)), &rope, &pos);
        let k_turned =
            reference::head_norm_rope(&k_new, nkv, hd, Some((&k_norm, eps)), &rope, &pos);
        let v_put = match v_norm {
            true => reference::rms_norm(&v_new, None, eps, hd),
            false => v_new.clone(),
        };
        let mut want_k = k_cache.clone();
        let mut want_v = v_cache.clone();
        for (t, &slot) in slots.iter().enumerate() {
            let (src, dst) = (t * kv_w, slot as usize * kv_w);
            want_k[dst..dst + kv_w].copy_from_slice(&k_turned[src..src + kv_w]);
            want_v[dst..dst + kv_w].copy_from_slice(&v_put[src..src + kv_w]);
        }
        let case = SplitAttn {
            spec: AttnSpec {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
                softcap,
            },
            layout: KvLayout {
                block_size: bs,
                positions: &pos,
                seq_start: &seq_start,
                block_tables: &blocks,
                table_width,
            },
            chunk,
        };
        let want = case.want(&q_turned, &want_k, &want_v);
        let (rows, splits) = (case.rows(), case.splits());
        let mut out = vec![f32::NAN; rows * hd];
        let mut part = vec![f32::NAN; rows * splits * (hd + 2)];
        let (kc, vc) = (k_cache.as_mut_ptr() as u64, v_cache.as_mut_ptr() as u64);
        let args = case.args(&q, kc, vc, &mut out, &mut part);
        let name = format!("attn_rope_partial_{}", hd / 32);
        // SAFETY: AttnRopePartial is the signature of the attn_rope_partial kernels.
        let kernel: AttnRopePartial = unsafe { unit.kernel(&name) }.unwrap();
        let ptrs = [
            k_new.as_ptr() as usize,
            v_new.as_ptr() as usize,
            q_norm.as_ptr() as usize,
            k_norm.as_ptr() as usize,
            freqs.as_ptr() as usize,
            slots.as_ptr() as usize,
        ];
        let (np, vn) = (pairs as i32, i32::from(v_norm));
        // SAFETY: every buffer `args` and `ptrs` point to outlives the launch and has the size
        // the kernel indexes.
        let body = || unsafe {
            let [kp, vp, qn, kn, fp, sp] = ptrs;
            kernel(
                args, kp as _, vp as _, qn as _, kn as _, eps, fp as _, np, vn, sp as _,
            )
        };
        unit.launch(
            [rows as u32, splits as u32, 1],
            [32 * ATTN_ROW_WARPS, 1, 1],
            0,
            &body,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        case.combine(&unit, &part, &mut out, &what);
        assert_close(&format!("{what} keys"), &k_cache, &want_k, 1e-5);
        assert_close(&format!("{what} values"), &v_cache, &want_v, 1e-5);
        assert_close(&what, &out, &want, 1e-5);
    }
}

/// `gemv_<format>_<NT>` (gemv.cu).
type Gemv = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    rows: i32,
    k: i32,
    x: *const f32,
    nt: i32,
    out: *mut f32,
    split: i32,
    mul: *const f32,
    mul_stride: u64,
    xt: *const u8,
);
/// `gemv_gelu_<format>_<NT>` (gemv.cu).
type GemvGelu = unsafe extern "C" fn(
    wg: *const u8,
    wu: *const u8,
    row_bytes: u64,
    rows: i32,
    k: i32,
    x: *const f32,
    nt: i32,
    out: *mut f32,
);

/// The single-matrix GEMV (`gemv_<format>_<NT>`: rows shared by `split` warps where the format
/// allows, and the gated form gelu_tanh(x · w) · mul) and the fused gate/up GEMV
/// (`gemv_gelu_<format>_<NT>`) of every format, 1–8 token rows, against f64 products on the
/// activations as the GEMVs take them.
#[test]
fn gemv_and_gated_gemv_match_reference_for_every_format() {
    for (ty, format) in FORMATS {
        let Some(unit) = gemv_unit(format) else {
            return;
        };
        let mut r = rng(&format!("gemv {format}"));
        let (rows, k) = (13usize, 512usize);
        let i16 = gemv_takes_16_bit_activations(ty, k);
        let plain = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let mats: Vec<HostMatrix> = (0..2).map(|_| random_matrix(&mut r, ty, rows, k)).collect();
        let laid: Vec<Vec<u8>> = mats.iter().map(laid_out).collect();
        let row_bytes = laid[0].len() / rows;
        let weights: Vec<Vec<f32>> = mats
            .iter()
            .map(|m| reference::dequantize_matrix(m).unwrap())
            .collect();
        let (wg, wu) = (laid[0].as_ptr() as usize, laid[1].as_ptr() as usize);
        for (nt_kernel, nt, split) in [(1, 1, 4), (2, 2, 1), (4, 3, 2), (8, 8, 1)] {
            let split = if i16 || plain { split } else { 1 };
            let x = uniform(&mut r, nt * k, 1.0);
            let xs = as_gemvs_take(ty, &x, k);
            let g = products(&weights[0], &xs, rows, k, nt);
            let u = products(&weights[1], &xs, rows, k, nt);
            let mul = uniform(&mut r, nt * rows, 1.0);
            let xp = x.as_ptr() as usize;
            let (n, kk, rr) = (nt as i32, k as i32, rows as i32);

            // Plain, then gated by `mul`.
            let name = format!("gemv_{format}_{nt_kernel}");
            // SAFETY: Gemv is the signature of the gemv kernels.
            let kernel: Gemv = unsafe { unit.kernel(&name) }.unwrap();
            for gated in [false, true] {
                let mut out = vec![f32::NAN; nt * rows];
                let op = out.as_mut_ptr() as usize;
                let mp = if gated { mul.as_ptr() as usize } else { 0 };
                let sp = split as i32;
                // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
                let body = || unsafe {
                    let rb = row_bytes as u64;
                    let xt = std::ptr::null();
                    kernel(
                        wg as _,
                        rb,
                        rr,
                        kk,
                        xp as _,
                        n,
                        op as _,
                        sp,
                        mp as _,
                        rows as u64,
                        xt,
                    )
                };
                let blocks = (rows * split).div_ceil(8) as u32;
                unit.launch([blocks, 1, 1], [256, 1, 1], 0, &body)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let want: Vec<f32> = g
                    .iter()
                    .zip(&mul)
                    .map(|(&v, &m)| match gated {
                        true => (gelu_tanh(v) * m as f64) as f32,
                        false => v as f32,
                    })
                    .collect();
                let what = format!("{name} {ty} nt={nt} split={split} gated={gated}");
                assert_close(&what, &out, &want, 1e-4);
            }

            // The fused gate and up (one token: the walks take Q4_K).
            if nt_kernel == 1 && ty == GgmlType::Q4_K {
                continue;
            }
            let name = format!("gemv_gelu_{format}_{nt_kernel}");
            // SAFETY: GemvGelu is the signature of the gemv_gelu kernels.
            let kernel: GemvGelu = unsafe { unit.kernel(&name) }.unwrap();
            let mut out = vec![f32::NAN; nt * rows];
            let op = out.as_mut_ptr() as usize;
            // SAFETY: as above.
            let body = || unsafe {
                kernel(
                    wg as _,
                    wu as _,
                    row_bytes as u64,
                    rr,
                    kk,
                    xp as _,
                    n,
                    op as _,
                )
            };
            unit.launch([rows.div_ceil(8) as u32, 1, 1], [256, 1, 1], 0, &body)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let want: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| (gelu_tanh(g) * u) as f32)
                .collect();
            assert_close(&format!("{name} {ty} nt={nt}"), &out, &want, 1e-4);
        }
    }
}

/// `embed_<format>` (ops.cu).
type Embed = unsafe extern "C" fn(
    table: *const u8,
    row_bytes: u64,
    tokens: *const u32,
    k: i32,
    scale: f32,
    out: *mut f32,
);
/// `dequant_<format>` and `dequant_f16_<format>` (ops.cu; `dst` f32 or f16).
type Dequant = unsafe extern "C" fn(w: *const u8, row_bytes: u64, r0: i32, k: i32, dst: *mut u8);

/// Values a block of the dequantizing kernels covers (32 · DEQUANT_THREADS).
const DEQUANT_SPAN: usize = 32 * 128;

/// Embedding rows (`embed_<format>`: gathered by token, scaled) and dequantization to f32 and
/// f16 (`dequant_<format>`, `dequant_f16_<format>`, from row r0 on) of every format, rows of
/// two block spans, against the reference's dequantization (f16: rounded once, saturating).
#[test]
fn embedding_and_dequantization_match_reference_for_every_format() {
    for (ty, format) in FORMATS {
        let Some(unit) = emu_unit(Module::Ops, Some(format)) else {
            return;
        };
        let mut r = rng(&format!("embed {format}"));
        let (rows, k, scale) = (6usize, 4352usize, 0.75f32);
        let m = random_matrix(&mut r, ty, rows, k);
        let laid = laid_out(&m);
        let row_bytes = laid.len() / rows;
        let exact = reference::dequantize_matrix(&m).unwrap();
        let wp = laid.as_ptr() as usize;
        let spans = k.div_ceil(DEQUANT_SPAN) as u32;

        let tokens: Vec<u32> = vec![4, 0, 4, 5];
        let mut out = vec![f32::NAN; tokens.len() * k];
        let (tp, op) = (tokens.as_ptr() as usize, out.as_mut_ptr() as usize);
        let name = format!("embed_{format}");
        // SAFETY: Embed is the signature of the embed kernels.
        let embed: Embed = unsafe { unit.kernel(&name) }.unwrap();
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body =
            || unsafe { embed(wp as _, row_bytes as u64, tp as _, k as i32, scale, op as _) };
        unit.launch([tokens.len() as u32, spans, 1], [128, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| exact[t as usize * k..][..k].iter().map(|v| v * scale))
            .collect();
        assert_close(&format!("{name} {ty}"), &out, &want, 1e-6);

        let r0 = 2usize;
        let n = rows - r0;
        for f16_out in [false, true] {
            let name = match f16_out {
                true => format!("dequant_f16_{format}"),
                false => format!("dequant_{format}"),
            };
            let mut dst = vec![0xffu8; n * k * if f16_out { 2 } else { 4 }];
            let dp = dst.as_mut_ptr() as usize;
            // SAFETY: Dequant is the signature of the dequant kernels.
            let kernel: Dequant = unsafe { unit.kernel(&name) }.unwrap();
            // SAFETY: as above.
            let body =
                || unsafe { kernel(wp as _, row_bytes as u64, r0 as i32, k as i32, dp as _) };
            unit.launch([spans, n as u32, 1], [128, 1, 1], 0, &body)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let rows_exact = &exact[r0 * k..];
            let (got, want): (Vec<f32>, Vec<f32>) = match f16_out {
                true => (
                    dst.chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    round_16(GgmlType::F16, rows_exact),
                ),
                false => (
                    dst.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    rows_exact.to_vec(),
                ),
            };
            assert_close(&format!("{name} {ty}"), &got, &want, 1e-6);
        }
    }
}

/// `rope_write_kv` (ops.cu).
type RopeWriteKv = unsafe extern "C" fn(
    q: *mut f32,
    k: *mut f32,
    v: *const f32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    q_norm: *const f32,
    k_norm: *const f32,
    eps: f32,
    freqs: *const f32,
    pairs: i32,
    positions: *const u32,
    slots: *const u32,
    k_cache: *mut f32,
    v_cache: *mut f32,
    v_norm: i32,
);

/// A layer's queries and new keys and values in one launch (`rope_write_kv`): queries normed
/// and turned in place, keys likewise and into their cache rows, values (through a weightless
/// norm with v_norm) into theirs; head dims 256 (pairs not turning) and 512, against f64.
#[test]
fn rope_write_kv_matches_reference() {
    let Some(unit) = emu_unit(Module::Ops, None) else {
        return;
    };
    let mut r = rng("rope_write_kv");
    let (nh, nkv, eps) = (4usize, 2usize, 1e-6f32);
    let pos: Vec<u32> = vec![7, 300, 12];
    let slots: Vec<u32> = vec![5, 0, 9];
    for (hd, pairs, v_norm) in [(256, 64, true), (512, 256, false)] {
        let q0 = uniform(&mut r, pos.len() * nh * hd, 1.0);
        let k0 = uniform(&mut r, pos.len() * nkv * hd, 1.0);
        let v = uniform(&mut r, pos.len() * nkv * hd, 1.0);
        let q_norm = uniform(&mut r, hd, 1.0);
        let k_norm = uniform(&mut r, hd, 1.0);
        let (freqs, rope) = rope_freqs(hd, pairs);
        let cache_rows = 10;
        let mut k_cache = vec![f32::NAN; cache_rows * nkv * hd];
        let mut v_cache = vec![f32::NAN; cache_rows * nkv * hd];
        let (mut q, mut k) = (q0.clone(), k0.clone());
        let ptrs = [
            q.as_mut_ptr() as usize,
            k.as_mut_ptr() as usize,
            v.as_ptr() as usize,
            q_norm.as_ptr() as usize,
            k_norm.as_ptr() as usize,
            freqs.as_ptr() as usize,
            pos.as_ptr() as usize,
            slots.as_ptr() as usize,
            k_cache.as_mut_ptr() as usize,
            v_cache.as_mut_ptr() as usize,
        ];
        // SAFETY: RopeWriteKv is rope_write_kv's signature.
        let kernel: RopeWriteKv = unsafe { unit.kernel("rope_write_kv") }.unwrap();
        let ints = [nh, nkv, hd, pairs].map(|v| v as i32);
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            let [qp, kp, vp, qn, kn, fp, pp, sp, kc, vc] = ptrs;
            let [h, kv, d, np] = ints;
            kernel(
                qp as _,
                kp as _,
                vp as _,
                h,
                kv,
                d,
                qn as _,
                kn as _,
                eps,
                fp as _,
                np,
                pp as _,
                sp as _,
                kc as _,
                vc as _,
                i32::from(v_norm),
            )
        };
        let blocks = (pos.len() * (nh + nkv)) as u32;
        unit.launch([blocks, 1, 1], [32, 1, 1], 4 * hd, &body)
            .unwrap_or_else(|e| panic!("rope_write_kv: {e}"));
        let want_q = reference::head_norm_rope(&q0, nh, hd, Some((&q_norm, eps)), &rope, &pos);
        let want_k = reference::head_norm_rope(&k0, nkv, hd, Some((&k_norm, eps)), &rope, &pos);
        let v_put = match v_norm {
            true => reference::rms_norm(&v, None, eps, hd),
            false => v.clone(),
        };
        let kv_w = nkv * hd;
        let mut want_kc = vec![f32::NAN; k_cache.len()];
        let mut want_vc = vec![f32::NAN; v_cache.len()];
        for (t, &slot) in slots.iter().enumerate() {
            let (src, dst) = (t * kv_w, slot as usize * kv_w);
            want_kc[dst..dst + kv_w].copy_from_slice(&want_k[src..src + kv_w]);
            want_vc[dst..dst + kv_w].copy_from_slice(&v_put[src..src + kv_w]);
        }
        let what = format!("rope_write_kv hd={hd} pairs={pairs} v_norm={v_norm}");
        assert_close(&format!("{what} q"), &q, &want_q, 1e-5);
        assert_close(&format!("{what} k"), &k, &want_k, 1e-5);
        // Rows no token writes stay NaN in both: compare the written ones.
        for (t, &s) in slots.iter().enumerate() {
            let row = s as usize * nkv * hd..(s as usize + 1) * nkv * hd;
            let w = format!("{what} cache row of token {t}");
            assert_close(&w, &k_cache[row.clone()], &want_kc[row.clone()], 1e-5);
            assert_close(&w, &v_cache[row.clone()], &want_vc[row], 1e-5);
        }
    }
}

/// `moe_route` (moe.cu).
type MoeRoute = unsafe extern "C" fn(
    logits: *const f32,
    n: i32,
    n_experts: i32,
    top_k: i32,
    expert_scale: *const f32,
    weights: *mut f32,
    ids: *mut f32,
);
/// `moe_gate_up_<format>` (moe.cu, the per-pair path).
type MoeGateUp = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    d: i32,
    f: i32,
    x: *const f32,
    top_k: i32,
    n_experts: i32,
    ids: *const f32,
    h_kind: i32,
    h: *mut f32,
    err: *mut u32,
    beside: i32,
);
/// `moe_down_<format>` (moe.cu, the per-pair path).
type MoeDown = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    d: i32,
    f: i32,
    h: *const f32,
    n_experts: i32,
    ids: *const f32,
    y: *mut f32,
    err: *mut u32,
);
/// `moe_combine` (moe.cu).
type MoeCombine = unsafe extern "C" fn(
    y: *const f32,
    d: i32,
    top_k: i32,
    weights: *const f32,
    slot_of: *const i32,
    out: *mut f32,
);

/// Routing (`moe_route`: softmax, the top k with ties to the lower id, renormalized, times the
/// expert's scale) against its definition; then the per-pair expert path of every format
/// (`moe_gate_up_<format>`, `moe_down_<format>`, `moe_combine`) against f64 products on the
/// activations as its GEMVs take them, one pair given a bad expert id: flagged, and adding
/// nothing.
#[test]
fn moe_routing_and_per_pair_experts_match_reference() {
    let Some(shared) = emu_unit(Module::Moe, None) else {
        return;
    };
    let mut r = rng("moe per pair");
    let (n, top_k, n_experts, d, f) = (3usize, 2usize, 16usize, 512usize, 256usize);
    let pairs = n * top_k;
    let mut logits = uniform(&mut r, n * n_experts, 3.0);
    logits[n_experts + 4] = logits[n_experts + 9]; // a possible tie: the lower id first
    let scales = uniform(&mut r, n_experts, 2.0);
    let mut weights = vec![f32::NAN; pairs];
    let mut ids = vec![f32::NAN; pairs];
    // SAFETY: MoeRoute is moe_route's signature.
    let route: MoeRoute = unsafe { shared.kernel("moe_route") }.unwrap();
    let ptrs = [
        logits.as_ptr() as usize,
        scales.as_ptr() as usize,
        weights.as_mut_ptr() as usize,
        ids.as_mut_ptr() as usize,
    ];
    // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
    let body = || unsafe {
        let [lp, sp, wp, ip] = ptrs;
        route(
            lp as _,
            n as i32,
            n_experts as i32,
            top_k as i32,
            sp as _,
            wp as _,
            ip as _,
        )
    };
    shared
        .launch([1, 1, 1], [32 * n as u32, 1, 1], 0, &body)
        .unwrap_or_else(|e| panic!("moe_route: {e}"));
    for t in 0..n {
        let row = &logits[t * n_experts..][..n_experts];
        let m = row
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut order: Vec<usize> = (0..n_experts).collect();
        order.sort_by(|&a, &b| e[b].partial_cmp(&e[a]).unwrap().then(a.cmp(&b)));
        let kept: f64 = order[..top_k].iter().map(|&i| e[i] / sum).sum();
        for j in 0..top_k {
            let x = order[j];
            assert_eq!(ids[t * top_k + j], x as f32, "token {t} choice {j}");
            let want = (e[x] / sum / kept * scales[x] as f64) as f32;
            assert!((weights[t * top_k + j] - want).abs() <= 1e-5 * want.abs().max(1.0));
        }
    }
    ids[3] = 99.0; // a bad id
                   // SAFETY: MoeCombine is moe_combine's signature.
    let combine: MoeCombine = unsafe { shared.kernel("moe_combine") }.unwrap();

    for (ty, format) in FORMATS {
        let Some(unit) = emu_unit(Module::Moe, Some(format)) else {
            return;
        };
        let gate_up = random_matrix(&mut r, ty, n_experts * 2 * f, d);
        let down = random_matrix(&mut r, ty, n_experts * d, f);
        let (gu, dn) = (laid_out(&gate_up), laid_out(&down));
        let (gu_rb, dn_rb) = (gu.len() / gate_up.rows, dn.len() / down.rows);
        let x = uniform(&mut r, n * d, 1.0);
        let mut h = vec![f32::NAN; pairs * f];
        let mut y = vec![f32::NAN; pairs * d];
        let mut out = vec![f32::NAN; n * d];
        let mut err = 0u32;
        let p = [
            gu.as_ptr() as usize,
            dn.as_ptr() as usize,
            x.as_ptr() as usize,
            ids.as_ptr() as usize,
            h.as_mut_ptr() as usize,
            y.as_mut_ptr() as usize,
            &mut err as *mut u32 as usize,
            weights.as_ptr() as usize,
            out.as_mut_ptr() as usize,
        ];
        let (di, fi, ki, ei) = (d as i32, f as i32, top_k as i32, n_experts as i32);
        // SAFETY: the signatures of the per-pair kernels.
        let (gate_k, down_k): (MoeGateUp, MoeDown) = unsafe {
            (
                unit.kernel(&format!("moe_gate_up_{format}")).unwrap(),
                unit.kernel(&format!("moe_down_{format}")).unwrap(),
            )
        };
        // SAFETY: every buffer outlives the launches and has the size the kernels index.
        let body = || unsafe {
            let [gp, _, xp, ip, hp, _, ep, _, _] = p;
            gate_k(
                gp as _,
                gu_rb as u64,
                di,
                fi,
                xp as _,
                ki,
                ei,
                ip as _,
                0,
                hp as _,
                ep as _,
                0,
            )
        };
        unit.launch(
            [f.div_ceil(8) as u32, pairs as u32, 1],
            [256, 1, 1],
            0,
            &body,
        )
        .unwrap_or_else(|e| panic!("moe_gate_up_{format}: {e}"));
        // SAFETY: as above.
        let body = || unsafe {
            let [_, dp, _, ip, hp, yp, ep, _, _] = p;
            down_k(
                dp as _,
                dn_rb as u64,
                di,
                fi,
                hp as _,
                ei,
                ip as _,
                yp as _,
                ep as _,
            )
        };
        unit.launch(
            [d.div_ceil(8) as u32, pairs as u32, 1],
            [256, 1, 1],
            0,
            &body,
        )
        .unwrap_or_else(|e| panic!("moe_down_{format}: {e}"));
        // SAFETY: as above.
        let body = || unsafe {
            let [_, _, _, _, _, yp, _, wp, op] = p;
            combine(yp as _, di, ki, wp as _, std::ptr::null(), op as _)
        };
        shared
            .launch([d.div_ceil(128) as u32, n as u32, 1], [128, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("moe_combine: {e}"));
        assert_eq!(
            err, 1,
            "moe {format}: the bad id is flagged (MB_ERR_EXPERT_ID)"
        );

        let seen = |v: &[f32], k: usize| as_gemvs_take(ty, v, k);
        let (wgu, wd) = (
            reference::dequantize_matrix(&gate_up).unwrap(),
            reference::dequantize_matrix(&down).unwrap(),
        );
        let xs = seen(&x, d);
        let mut want_h = vec![0f32; pairs * f];
        let mut want_y = vec![0f32; pairs * d];
        for pair in 0..pairs {
            if ids[pair] as usize >= n_experts {
                continue; // a bad id: zeros
            }
            let e = ids[pair] as usize;
            let xr = &xs[pair / top_k * d..][..d];
            let g = products(&wgu[e * 2 * f * d..][..f * d], xr, f, d, 1);
            let u = products(&wgu[(e * 2 + 1) * f * d..][..f * d], xr, f, d, 1);
            for i in 0..f {
                want_h[pair * f + i] = (gelu_tanh(g[i]) * u[i]) as f32;
            }
            let hs = seen(&h[pair * f..][..f], f);
            let yr = products(&wd[e * d * f..][..d * f], &hs, d, f, 1);
            for (i, v) in yr.into_iter().enumerate() {
                want_y[pair * d + i] = v as f32;
            }
        }
        let want_out: Vec<f32> = (0..n * d)
            .map(|i| {
                let (t, r) = (i / d, i % d);
                (0..top_k)
                    .filter(|&j| (ids[t * top_k + j] as usize) < n_experts)
                    .map(|j| weights[t * top_k + j] * y[(t * top_k + j) * d + r])
                    .sum()
            })
            .collect();
        assert_close(&format!("moe_gate_up_{format}"), &h, &want_h, 1e-4);
        assert_close(&format!("moe_down_{format}"), &y, &want_y, 1e-4);
        assert_close(&format!("moe_combine ({format})"), &out, &want_out, 1e-6);
    }
}

/// `sample_rows` (sample.cu).
type SampleRows = unsafe extern "C" fn(
    x: *const f32,
    n: i32,
    draws: *const u32,
    out: *mut u32,
    scratch: *mut u64,
    parts: i32,
    err: *mut u32,
);
/// `sample_reset` (sample.cu).
type SampleReset = unsafe extern "C" fn(scratch: *mut u64);

/// Device picks against the host's (`agrees_with_pick`) for each kind of draw — greedy, every
/// token in index order (with and without min-p, and a top-k as large as the row), and in rank
/// order top-k, top-p and min-p alone and together (min-p ending the kept prefix first; a
/// top-p keeping one token, a nucleus over the whole row, top-k past the window) — on rows of
/// distinct values, of many ties (values on a grid of 1/4) and with -inf and NaN entries: each
/// row in one block, and each in 3 blocks that meet at barriers (all resident at once), with
/// the kernel's window of 2 048 tokens; and with windows of 64 and 1, where every search
/// narrows pass after pass.
#[test]
fn sampled_picks_match_the_host_twin() {
    let Some(unit) = emu_unit(Module::Sample, None) else {
        return;
    };
    let n = 3000usize;
    let draw = |temperature, top_k, top_p, min_p, u| Draw {
        temperature,
        top_k,
        top_p,
        min_p,
        u,
    };
    let mut draws = Vec::new();
    for u in [0.0f32, 0.37, 0.81, 0.9999] {
        draws.extend([
            draw(0.0, 0, 1.0, 0.0, u),
            draw(1.0, 0, 1.0, 0.0, u),
            draw(0.7, 0, 1.0, 0.05, u),
            draw(1.3, n, 1.0, 0.0, u),
            draw(0.8, 40, 0.9, 0.0, u),
            draw(1.0, 1000, 1.0, 0.5, u),
            draw(1.0, 20, 1e-6, 0.0, u),
            draw(1.0, 0, 0.9, 0.0, u),
            draw(2.0, 0, 0.999, 0.0, u),
            draw(1.0, 0, 0.99, 0.2, u),
            draw(1.0, 2500, 0.95, 0.0, u),
            draw(1.0, 300, 1.0, 0.0, u),
        ]);
    }
    let mut r = rng("sampling");
    let rows = draws.len();
    let mut x = uniform(&mut r, rows * n, 4.0);
    for (i, row) in x.chunks_mut(n).enumerate() {
        match i % 3 {
            // Ties: the lower index comes first in rank order.
            1 => row.iter_mut().for_each(|v| *v = (*v * 4.0).round() / 4.0),
            2 => {
                row[..400].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                row[7] = f32::NAN;
            }
            _ => {}
        }
    }
    let small = |window: usize| {
        let source = Unit::holding(Module::Sample, None)
            .source(&format!("#define SAMPLE_WINDOW {window}\n"));
        EmuModule::compile(&format!("sample-window-{window}"), &source)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let w64 = small(64);
    // Rows 12–23: every kind of draw at u 0.37, on each kind of row.
    let (x12, d12) = (&x[12 * n..][..12 * n], &draws[12..24]);
    check_sample_rows(&unit, n, &x, &draws, 1, "one block a row");
    check_sample_rows(&unit, n, x12, d12, 3, "three blocks a row");
    check_sample_rows(&w64, n, &x, &draws, 1, "a window of 64");
    check_sample_rows(&w64, n, x12, d12, 3, "a window of 64, three blocks a row");
    // A window of 1 narrows to single keys: the rank-order draws of one u, on each kind of row.
    let (x1, d1) = (&x[4 * n..][..8 * n], &draws[4..12]);
    check_sample_rows(&small(1), n, x1, d1, 2, "a window of 1, two blocks a row");
}

/// Runs `sample_reset` and `sample_rows` of `unit` over `x` (rows of `n`) with one draw a row,
/// `parts` blocks a row (all resident where more than one), and checks each pick against the
/// host's.
fn check_sample_rows(
    unit: &EmuModule,
    n: usize,
    x: &[f32],
    draws: &[Draw],
    parts: usize,
    what: &str,
) {
    let words: Vec<u32> = draws
        .iter()
        .flat_map(|d| {
            [
                d.temperature.to_bits(),
                d.top_k.min(n) as u32,
                d.top_p.to_bits(),
                d.min_p.to_bits(),
                d.u.to_bits(),
            ]
        })
        .collect();
    // SAFETY: the signatures of sample_rows and sample_reset.
    let (kernel, reset): (SampleRows, SampleReset) = unsafe {
        (
            unit.kernel("sample_rows").unwrap(),
            unit.kernel("sample_reset").unwrap(),
        )
    };
    let rows = draws.len();
    // Room for a row's words with the default window (a smaller window uses fewer).
    let mut scratch = vec![u64::MAX; rows * SAMPLE_ROW_WORDS];
    let mut picks = vec![0u32; rows];
    let mut err = 0u32;
    let (xp, wp, pp, sp, ep) = (
        x.as_ptr() as usize,
        words.as_ptr() as usize,
        picks.as_mut_ptr() as usize,
        scratch.as_mut_ptr() as usize,
        &mut err as *mut u32 as usize,
    );
    let parts_i = parts as i32;
    // SAFETY: every buffer outlives the launches and has the size the kernels index.
    unit.launch([rows as u32, 1, 1], [256, 1, 1], 0, &|| unsafe {
        reset(sp as _)
    })
    .unwrap();
    let body = || unsafe {
        kernel(
            xp as _, n as i32, wp as _, pp as _, sp as _, parts_i, ep as _,
        )
    };
    let (grid, block, shared) = (
        [parts as u32, rows as u32, 1],
        [1024, 1, 1],
        SAMPLE_SHARED as usize,
    );
    if parts == 1 {
        unit.launch(grid, block, shared, &body)
    } else {
        unit.launch_resident(grid, block, shared, &body)
    }
    .unwrap_or_else(|e| panic!("sample_rows ({what}): {e}"));
    assert_eq!(err, 0, "{what}: error word");
    for (t, d) in draws.iter().enumerate() {
        let row = &x[t * n..][..n];
        assert!(
            agrees_with_pick(row, d, picks[t]),
            "{what}: row {t} {d:?}: {}",
            picks[t]
        );
    }
}

/// `rms_norm` (ops.cu).
type RmsNorm = unsafe extern "C" fn(
    x: *const f32,
    weight: *const f32,
    eps: f32,
    dim: i32,
    out: *mut f32,
    add: i32,
    rounded: *mut u16,
    round_kind: i32,
    beside: i32,
);
/// `residual_norm_extra` (ops.cu).
type ResidualNormExtra = unsafe extern "C" fn(
    y: *const f32,
    w: *const f32,
    eps: f32,
    dim: i32,
    h: *mut f32,
    scale: f32,
    w2: *const f32,
    x: *mut f32,
    w3: *const f32,
    x3: *mut f32,
    w4: *const f32,
    x4: *mut f32,
    rounded: *mut u16,
    round_kind: i32,
);
/// `moe_residual_norm` (ops.cu).
type MoeResidualNorm = unsafe extern "C" fn(
    dense: *const f32,
    w_dense: *const f32,
    experts: *const f32,
    w_experts: *const f32,
    w: *const f32,
    eps: f32,
    dim: i32,
    h: *mut f32,
    scale: f32,
    w2: *const f32,
    x: *mut f32,
    rounded: *mut u16,
    round_kind: i32,
);

/// The norms besides `residual_norm`: `rms_norm` (written, or added into its output; rows of a
/// multiple of 4 values and not; with its bf16 and f16 rounded copies), `residual_norm_extra`
/// (two more norms of the same row) and `moe_residual_norm` (the dense and expert branches
/// normed and summed first), against markbase-cpu's rms_norm.
#[test]
fn norms_match_reference() {
    let Some(ops) = emu_unit(Module::Ops, None) else {
        return;
    };
    let mut r = rng("norms");
    let (rows, eps, scale) = (3usize, 1e-6f32, 0.5f32);
    // SAFETY: RmsNorm is rms_norm's signature.
    let norm: RmsNorm = unsafe { ops.kernel("rms_norm") }.unwrap();
    for (dim, add, kind) in [(640, 0, 1), (640, 1, 2), (250, 0, 0)] {
        let x = uniform(&mut r, rows * dim, 2.0);
        let w = uniform(&mut r, dim, 1.0);
        let before = uniform(&mut r, rows * dim, 1.0);
        let mut out = before.clone();
        let mut rounded = vec![0xffffu16; rows * dim];
        let p = [
            x.as_ptr() as usize,
            w.as_ptr() as usize,
            out.as_mut_ptr() as usize,
            rounded.as_mut_ptr() as usize,
        ];
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            let [xp, wp, op, rp] = p;
            norm(
                xp as _, wp as _, eps, dim as i32, op as _, add, rp as _, kind, 0,
            )
        };
        ops.launch([rows as u32, 1, 1], [128, 1, 1], 0, &body)
            .unwrap_or_else(|e| panic!("rms_norm: {e}"));
        let normed = reference::rms_norm(&x, Some(&w), eps, dim);
        let want: Vec<f32> = match add {
            1 => normed.iter().zip(&before).map(|(n, b)| n + b).collect(),
            _ => normed,
        };
        let what = format!("rms_norm dim={dim} add={add}");
        assert_close(&what, &out, &want, 1e-5);
        if kind != 0 {
            let ty = if kind == 1 {
                GgmlType::BF16
            } else {
                GgmlType::F16
            };
            let got = from_16(&rounded, kind == 1);
            assert_eq!(got, round_16(ty, &out), "{what}: its rounded copy");
        }
    }

    let dim = 512;
    let v = |r: &mut rand::rngs::StdRng, n: usize| uniform(r, n, 2.0);
    let (y, h0, experts) = (
        v(&mut r, rows * dim),
        v(&mut r, rows * dim),
        v(&mut r, rows * dim),
    );
    let [w, w2, w3, w4, wd, we] = [0; 6].map(|_| uniform(&mut r, dim, 1.0));
    let outputs = |h: &[f32]| {
        let nx = |g: &[f32]| reference::rms_norm(h, Some(g), eps, dim);
        (nx(&w2), nx(&w3), nx(&w4))
    };
    let residual = |branch: &[f32]| -> Vec<f32> {
        let n = reference::rms_norm(branch, Some(&w), eps, dim);
        n.iter().zip(&h0).map(|(n, h)| (h + n) * scale).collect()
    };

    // Two extra norms beside the next one.
    let (mut h, mut x, mut x3, mut x4) = (
        h0.clone(),
        vec![f32::NAN; rows * dim],
        vec![f32::NAN; rows * dim],
        vec![f32::NAN; rows * dim],
    );
    // SAFETY: ResidualNormExtra is residual_norm_extra's signature.
    let extra: ResidualNormExtra = unsafe { ops.kernel("residual_norm_extra") }.unwrap();
    let p = [
        y.as_ptr() as usize,
        w.as_ptr() as usize,
        h.as_mut_ptr() as usize,
        w2.as_ptr() as usize,
        x.as_mut_ptr() as usize,
        w3.as_ptr() as usize,
        x3.as_mut_ptr() as usize,
        w4.as_ptr() as usize,
        x4.as_mut_ptr() as usize,
    ];
    // SAFETY: as above.
    let body = || unsafe {
        let [yp, wp, hp, w2p, xp, w3p, x3p, w4p, x4p] = p;
        let none = std::ptr::null_mut();
        extra(
            yp as _, wp as _, eps, dim as i32, hp as _, scale, w2p as _, xp as _, w3p as _,
            x3p as _, w4p as _, x4p as _, none, 0,
        )
    };
    ops.launch([rows as u32, 1, 1], [64, 1, 1], 0, &body)
        .unwrap_or_else(|e| panic!("residual_norm_extra: {e}"));
    let want_h = residual(&y);
    let (wx, wx3, wx4) = outputs(&want_h);
    assert_close("residual_norm_extra h", &h, &want_h, 1e-5);
    assert_close("residual_norm_extra x", &x, &wx, 1e-5);
    assert_close("residual_norm_extra x3", &x3, &wx3, 1e-5);
    assert_close("residual_norm_extra x4", &x4, &wx4, 1e-5);

    // The MoE layer's two branches, normed and summed, then as residual_norm.
    let (mut h, mut x) = (h0.clone(), vec![f32::NAN; rows * dim]);
    // SAFETY: MoeResidualNorm is moe_residual_norm's signature.
    let moe: MoeResidualNorm = unsafe { ops.kernel("moe_residual_norm") }.unwrap();
    let p = [
        y.as_ptr() as usize,
        wd.as_ptr() as usize,
        experts.as_ptr() as usize,
        we.as_ptr() as usize,
        w.as_ptr() as usize,
        h.as_mut_ptr() as usize,
        w2.as_ptr() as usize,
        x.as_mut_ptr() as usize,
    ];
    // SAFETY: as above.
    let body = || unsafe {
        let [dp, wdp, ep, wep, wp, hp, w2p, xp] = p;
        let none = std::ptr::null_mut();
        moe(
            dp as _, wdp as _, ep as _, wep as _, wp as _, eps, dim as i32, hp as _, scale,
            w2p as _, xp as _, none, 0,
        )
    };
    ops.launch([rows as u32, 1, 1], [64, 1, 1], 0, &body)
        .unwrap_or_else(|e| panic!("moe_residual_norm: {e}"));
    let summed: Vec<f32> = reference::rms_norm(&y, Some(&wd), eps, dim)
        .iter()
        .zip(reference::rms_norm(&experts, Some(&we), eps, dim))
        .map(|(a, b)| a + b)
        .collect();
    let want_h = residual(&summed);
    assert_close("moe_residual_norm h", &h, &want_h, 1e-5);
    assert_close("moe_residual_norm x", &x, &outputs(&want_h).0, 1e-5);
}

/// `gelu_tanh_mul` (ops.cu).
type GeluTanhMul = unsafe extern "C" fn(
    gate: *mut f32,
    up: *const f32,
    n: u64,
    rows: u64,
    stride: u64,
    rounded: *mut u16,
    round_kind: i32,
);
/// `gelu_tanh_mul4` (ops.cu).
type GeluTanhMul4 =
    unsafe extern "C" fn(gate: *mut f32, up: *const f32, n4: u64, rounded: *mut u16, kind: i32);
/// `gelu_tanh_mul_bf16` (ops.cu).
type GeluTanhMulBf16 = unsafe extern "C" fn(g: *const u16, u: *const u16, out: *mut u16, n8: u64);

/// The gated feed-forward's elementwise passes: `gelu_tanh_mul` (up's rows `stride` apart, an
/// f16 rounded copy), `gelu_tanh_mul4` (a bf16 copy) and `gelu_tanh_mul_bf16` (bf16 in and
/// out), against markbase-cpu's gelu_tanh_mul.
#[test]
fn gelu_gated_elementwise_passes_match_reference() {
    let Some(ops) = emu_unit(Module::Ops, None) else {
        return;
    };
    let mut r = rng("gelu elementwise");
    let (rows, width, stride) = (3usize, 96usize, 100usize);
    let gate = uniform(&mut r, rows * width, 3.0);
    let up_strided = uniform(&mut r, rows * stride, 1.0);
    let up: Vec<f32> = up_strided
        .chunks(stride)
        .flat_map(|row| row[..width].to_vec())
        .collect();
    let want = reference::gelu_tanh_mul(&gate, &up);
    let n = rows * width;

    let (mut g, mut rounded) = (gate.clone(), vec![0xffffu16; n]);
    // SAFETY: the signatures of the three kernels.
    let (k1, k4, kb): (GeluTanhMul, GeluTanhMul4, GeluTanhMulBf16) = unsafe {
        (
            ops.kernel("gelu_tanh_mul").unwrap(),
            ops.kernel("gelu_tanh_mul4").unwrap(),
            ops.kernel("gelu_tanh_mul_bf16").unwrap(),
        )
    };
    let (gp, upp, rp) = (
        g.as_mut_ptr() as usize,
        up_strided.as_ptr() as usize,
        rounded.as_mut_ptr() as usize,
    );
    // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
    let body = || unsafe {
        k1(
            gp as _,
            upp as _,
            n as u64,
            width as u64,
            stride as u64,
            rp as _,
            2,
        )
    };
    ops.launch([n.div_ceil(128) as u32, 1, 1], [128, 1, 1], 0, &body)
        .unwrap();
    assert_close("gelu_tanh_mul", &g, &want, 1e-6);
    assert_eq!(
        from_16(&rounded, false),
        round_16(GgmlType::F16, &g),
        "its f16 copy"
    );

    let mut g = gate.clone();
    let (gp, upp, rp) = (
        g.as_mut_ptr() as usize,
        up.as_ptr() as usize,
        rounded.as_mut_ptr() as usize,
    );
    // SAFETY: as above.
    let body = || unsafe { k4(gp as _, upp as _, (n / 4) as u64, rp as _, 1) };
    ops.launch([(n / 4).div_ceil(128) as u32, 1, 1], [128, 1, 1], 0, &body)
        .unwrap();
    assert_close("gelu_tanh_mul4", &g, &want, 1e-6);
    assert_eq!(
        from_16(&rounded, true),
        round_16(GgmlType::BF16, &g),
        "its bf16 copy"
    );

    let bits = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect()
    };
    let (gb, ub) = (bits(&gate), bits(&up));
    let mut out = vec![0xffffu16; n];
    let (gp, upp, op) = (
        gb.as_ptr() as usize,
        ub.as_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    // SAFETY: as above.
    let body = || unsafe { kb(gp as _, upp as _, op as _, (n / 8) as u64) };
    ops.launch([(n / 8).div_ceil(128) as u32, 1, 1], [128, 1, 1], 0, &body)
        .unwrap();
    let want_bf16 = reference::gelu_tanh_mul(&from_16(&gb, true), &from_16(&ub, true));
    assert_close(
        "gelu_tanh_mul_bf16",
        &from_16(&out, true),
        &round_16(GgmlType::BF16, &want_bf16),
        1e-2,
    );
}

/// `moe_gather` (moe.cu).
type MoeGather =
    unsafe extern "C" fn(x: *const f32, d: i32, top_k: i32, order: *const i32, xg: *mut f32);
/// `moe_gate_up_grouped_<format>` (moe.cu).
type MoeGateUpGrouped = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    d: i32,
    f: i32,
    xg: *const f32,
    tiles: *const i32,
    h: *mut f32,
);
/// `moe_down_grouped_<format>` (moe.cu).
type MoeDownGrouped = unsafe extern "C" fn(
    w: *const u8,
    row_bytes: u64,
    d: i32,
    f: i32,
    h: *const f32,
    tiles: *const i32,
    y: *mut f32,
);

/// The grouped MoE path on GEMVs (formats the tensor-core expert products do not take, and
/// every other): `moe_group`, `moe_gather`, `moe_gate_up_grouped_<format>`,
/// `moe_down_grouped_<format>` and `moe_combine` through `slot_of`, for all 13 formats, against
/// f64 products on the activations as the GEMVs take them.
#[test]
fn grouped_moe_on_gemvs_matches_reference() {
    let Some(shared) = emu_unit(Module::Moe, None) else {
        return;
    };
    let mut r = rng("moe grouped gemv");
    let (n, top_k, n_experts, d, f) = (9usize, 2usize, 4usize, 512usize, 256usize);
    let pairs = n * top_k;
    let most_tiles = (pairs + (MOE_TILE - 1) * n_experts.min(pairs)) / MOE_TILE;
    let ids: Vec<f32> = (0..n)
        .flat_map(|_| {
            let first = r.random_range(0..n_experts);
            [first as f32, ((first + 1) % n_experts) as f32]
        })
        .collect();
    let weights = uniform(&mut r, pairs, 1.0);
    let (mut order, mut slot_of) = (vec![0i32; pairs], vec![0i32; pairs]);
    let mut tiles = vec![0i32; 3 * most_tiles];
    let mut err = 0u32;
    // SAFETY: the signatures of the shared kernels.
    let (group, gather, combine): (MoeGroup, MoeGather, MoeCombine) = unsafe {
        (
            shared.kernel("moe_group").unwrap(),
            shared.kernel("moe_gather").unwrap(),
            shared.kernel("moe_combine").unwrap(),
        )
    };
    let p = [
        ids.as_ptr() as usize,
        order.as_mut_ptr() as usize,
        slot_of.as_mut_ptr() as usize,
        tiles.as_mut_ptr() as usize,
        &mut err as *mut u32 as usize,
    ];
    let (pi, ei, mi) = (pairs as i32, n_experts as i32, most_tiles as i32);
    // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
    let body = || unsafe {
        let [ip, op, sp, tp, ep] = p;
        group(
            ip as _,
            pi,
            ei,
            MOE_TILE as i32,
            mi,
            op as _,
            sp as _,
            tp as _,
            ep as _,
        )
    };
    shared.launch([1, 1, 1], [256, 1, 1], 0, &body).unwrap();
    assert_eq!(err, 0);

    for (ty, format) in FORMATS {
        let Some(unit) = emu_unit(Module::Moe, Some(format)) else {
            return;
        };
        let gate_up = random_matrix(&mut r, ty, n_experts * 2 * f, d);
        let down = random_matrix(&mut r, ty, n_experts * d, f);
        let (gu, dn) = (laid_out(&gate_up), laid_out(&down));
        let (gu_rb, dn_rb) = (gu.len() / gate_up.rows, dn.len() / down.rows);
        let x = uniform(&mut r, n * d, 1.0);
        let mut xg = vec![f32::NAN; pairs * d];
        let mut h = vec![f32::NAN; pairs * f];
        let mut y = vec![f32::NAN; pairs * d];
        let mut out = vec![f32::NAN; n * d];
        let b = [
            x.as_ptr() as usize,
            order.as_ptr() as usize,
            xg.as_mut_ptr() as usize,
            gu.as_ptr() as usize,
            tiles.as_ptr() as usize,
            h.as_mut_ptr() as usize,
            dn.as_ptr() as usize,
            y.as_mut_ptr() as usize,
            weights.as_ptr() as usize,
            slot_of.as_ptr() as usize,
            out.as_mut_ptr() as usize,
        ];
        let (di, fi, ki) = (d as i32, f as i32, top_k as i32);
        // SAFETY: the signatures of the grouped kernels of this format.
        let (gate_k, down_k): (MoeGateUpGrouped, MoeDownGrouped) = unsafe {
            (
                unit.kernel(&format!("moe_gate_up_grouped_{format}"))
                    .unwrap(),
                unit.kernel(&format!("moe_down_grouped_{format}")).unwrap(),
            )
        };
        let [xp, op, xgp, gup, tp, hp, dnp, yp, wp, sp, outp] = b;
        // SAFETY: every buffer outlives the launches and has the size the kernels index.
        unsafe {
            let run = |m: &EmuModule, grid: [u32; 3], threads: u32, body: &dyn Fn()| {
                m.launch(grid, [threads, 1, 1], 0, body)
                    .unwrap_or_else(|e| panic!("moe grouped {format}: {e}"))
            };
            run(&shared, [pairs as u32, 1, 1], 128, &|| {
                gather(xp as _, di, ki, op as _, xgp as _)
            });
            let tiles_y = most_tiles as u32;
            run(&unit, [f.div_ceil(8) as u32, tiles_y, 1], 256, &|| {
                gate_k(gup as _, gu_rb as u64, di, fi, xgp as _, tp as _, hp as _)
            });
            run(&unit, [d.div_ceil(8) as u32, tiles_y, 1], 256, &|| {
                down_k(dnp as _, dn_rb as u64, di, fi, hp as _, tp as _, yp as _)
            });
            run(&shared, [d.div_ceil(128) as u32, n as u32, 1], 128, &|| {
                combine(yp as _, di, ki, wp as _, sp as _, outp as _)
            });
        }

        let seen = |v: &[f32], k: usize| as_gemvs_take(ty, v, k);
        let wgu = reference::dequantize_matrix(&gate_up).unwrap();
        let wd = reference::dequantize_matrix(&down).unwrap();
        let (mut want_h, mut want_y) = (vec![0f32; pairs * f], vec![0f32; pairs * d]);
        for (s, &pair) in order.iter().enumerate() {
            let e = ids[pair as usize] as usize;
            let xs = seen(&x[pair as usize / top_k * d..][..d], d);
            let g = products(&wgu[e * 2 * f * d..][..f * d], &xs, f, d, 1);
            let u = products(&wgu[(e * 2 + 1) * f * d..][..f * d], &xs, f, d, 1);
            for i in 0..f {
                want_h[s * f + i] = (gelu_tanh(g[i]) * u[i]) as f32;
            }
            let hs = seen(&h[s * f..][..f], f);
            let yr = products(&wd[e * d * f..][..d * f], &hs, d, f, 1);
            for (i, v) in yr.into_iter().enumerate() {
                want_y[s * d + i] = v as f32;
            }
        }
        let want_out: Vec<f32> = (0..n * d)
            .map(|i| {
                let (t, col) = (i / d, i % d);
                (0..top_k)
                    .map(|j| {
                        let pair = t * top_k + j;
                        weights[pair] * y[slot_of[pair] as usize * d + col]
                    })
                    .sum()
            })
            .collect();
        assert_close(&format!("moe_gate_up_grouped_{format}"), &h, &want_h, 1e-4);
        assert_close(&format!("moe_down_grouped_{format}"), &y, &want_y, 1e-4);
        assert_close(
            &format!("moe_combine grouped ({format})"),
            &out,
            &want_out,
            1e-6,
        );
    }
}

/// `head_norm_rope` (ops.cu).
type HeadNormRope = unsafe extern "C" fn(
    x: *mut f32,
    n_heads: i32,
    head_dim: i32,
    norm_w: *const f32,
    eps: f32,
    freqs: *const f32,
    pairs: i32,
    positions: *const u32,
);
/// `write_kv` (ops.cu).
type WriteKv = unsafe extern "C" fn(
    k: *const f32,
    v: *const f32,
    row: i32,
    slots: *const u32,
    k_cache: *mut f32,
    v_cache: *mut f32,
);
/// `add`, `scale` and `softcap` (ops.cu): x and a float or a second array, n values.
type Add = unsafe extern "C" fn(x: *mut f32, y: *const f32, n: u64);
type Scale = unsafe extern "C" fn(x: *mut f32, s: f32, n: u64);
/// `f32_to_bf16` and `f32_to_f16` (ops.cu).
type ToHalf = unsafe extern "C" fn(x: *const f32, y: *mut u16, n: u64);

/// The small kernels: `head_norm_rope` (with and without norm weights) against markbase-cpu's,
/// `write_kv` into scattered cache rows, `add`, `scale`, `softcap`, and the conversions to bf16
/// and f16 (to nearest, f16 saturating), on lengths that are not a multiple of the block.
#[test]
fn small_kernels_match_reference() {
    let Some(ops) = emu_unit(Module::Ops, None) else {
        return;
    };
    let mut r = rng("small kernels");
    let (nh, hd, eps) = (3usize, 256usize, 1e-6f32);
    let pos: Vec<u32> = vec![3, 1000];
    let (freqs, rope) = rope_freqs(hd, 100);
    let norm_w = uniform(&mut r, hd, 1.0);
    // SAFETY: HeadNormRope is head_norm_rope's signature.
    let kernel: HeadNormRope = unsafe { ops.kernel("head_norm_rope") }.unwrap();
    for weighted in [true, false] {
        let x0 = uniform(&mut r, pos.len() * nh * hd, 2.0);
        let mut x = x0.clone();
        let (xp, wp, fp, pp) = (
            x.as_mut_ptr() as usize,
            if weighted {
                norm_w.as_ptr() as usize
            } else {
                0
            },
            freqs.as_ptr() as usize,
            pos.as_ptr() as usize,
        );
        // SAFETY: every buffer outlives the launch and has the size the kernel indexes.
        let body = || unsafe {
            kernel(
                xp as _, nh as i32, hd as i32, wp as _, eps, fp as _, 100, pp as _,
            )
        };
        ops.launch([(pos.len() * nh) as u32, 1, 1], [32, 1, 1], 4 * hd, &body)
            .unwrap_or_else(|e| panic!("head_norm_rope: {e}"));
        let norm = match weighted {
            true => Some((&norm_w[..], eps)),
            // Without weights the kernel still norms nothing: turn only.
            false => None,
        };
        let want = reference::head_norm_rope(&x0, nh, hd, norm, &rope, &pos);
        assert_close(
            &format!("head_norm_rope weighted={weighted}"),
            &x,
            &want,
            1e-5,
        );
    }

    let (row, slots) = (300usize, vec![4u32, 0, 2]);
    let k = uniform(&mut r, slots.len() * row, 1.0);
    let v = uniform(&mut r, slots.len() * row, 1.0);
    let (mut kc, mut vc) = (vec![f32::NAN; 5 * row], vec![f32::NAN; 5 * row]);
    // SAFETY: WriteKv is write_kv's signature.
    let write: WriteKv = unsafe { ops.kernel("write_kv") }.unwrap();
    let p = [
        k.as_ptr() as usize,
        v.as_ptr() as usize,
        slots.as_ptr() as usize,
        kc.as_mut_ptr() as usize,
        vc.as_mut_ptr() as usize,
    ];
    // SAFETY: as above.
    let body = || unsafe {
        let [kp, vp, sp, kcp, vcp] = p;
        write(kp as _, vp as _, row as i32, sp as _, kcp as _, vcp as _)
    };
    ops.launch(
        [row.div_ceil(128) as u32, slots.len() as u32, 1],
        [128, 1, 1],
        0,
        &body,
    )
    .unwrap();
    for (t, &s) in slots.iter().enumerate() {
        let (src, dst) = (t * row, s as usize * row);
        assert_eq!(kc[dst..dst + row], k[src..src + row], "k of token {t}");
        assert_eq!(vc[dst..dst + row], v[src..src + row], "v of token {t}");
    }
    assert!(
        kc[row..2 * row].iter().all(|v| v.is_nan()),
        "row 1 untouched"
    );

    let n = 1000usize;
    let grid = [n.div_ceil(128) as u32, 1, 1];
    let a = uniform(&mut r, n, 40.0);
    let b = uniform(&mut r, n, 1.0);
    // SAFETY: the signatures of the elementwise kernels.
    let (add, scale, softcap): (Add, Scale, Scale) = unsafe {
        (
            ops.kernel("add").unwrap(),
            ops.kernel("scale").unwrap(),
            ops.kernel("softcap").unwrap(),
        )
    };
    let mut x = a.clone();
    let (xp, bp) = (x.as_mut_ptr() as usize, b.as_ptr() as usize);
    // SAFETY: as above.
    ops.launch(grid, [128, 1, 1], 0, &|| unsafe {
        add(xp as _, bp as _, n as u64)
    })
    .unwrap();
    ops.launch(grid, [128, 1, 1], 0, &|| unsafe {
        scale(xp as _, 0.5, n as u64)
    })
    .unwrap();
    ops.launch(grid, [128, 1, 1], 0, &|| unsafe {
        softcap(xp as _, 15.0, n as u64)
    })
    .unwrap();
    let want: Vec<f32> = a
        .iter()
        .zip(&b)
        .map(|(a, b)| 15.0 * (((a + b) * 0.5) / 15.0).tanh())
        .collect();
    assert_close("add, scale, softcap", &x, &want, 1e-6);

    let mut wide = uniform(&mut r, n, 3.0);
    wide[7] = 1e6; // past f16's range: saturates
    wide[8] = -1e6;
    for (name, ty) in [
        ("f32_to_bf16", GgmlType::BF16),
        ("f32_to_f16", GgmlType::F16),
    ] {
        let mut y = vec![0u16; n];
        // SAFETY: ToHalf is the conversions' signature.
        let kernel: ToHalf = unsafe { ops.kernel(name) }.unwrap();
        let (wp, yp) = (wide.as_ptr() as usize, y.as_mut_ptr() as usize);
        // SAFETY: as above.
        ops.launch(grid, [128, 1, 1], 0, &|| unsafe {
            kernel(wp as _, yp as _, n as u64)
        })
        .unwrap();
        let bf16 = ty == GgmlType::BF16;
        assert_eq!(from_16(&y, bf16), round_16(ty, &wide), "{name}");
    }
}
