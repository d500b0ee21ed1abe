//! Timing harness for the CUDA backend: the device's copy bandwidth (the roofline's ceiling),
//! decode products at E4B's or 31B's shapes per weight format (`--gemv`, `--gemv 31b`; one
//! token row, or `--tokens N`), the routed experts of one 26B-A4B layer (`--moe`, N tokens
//! routed uniformly at random, as a trained router spreads them), E4B's 42 layers of one-token
//! bf16 (`--chain`, `--chain bf16-pair`) or Q4_K (`--chain q4_k`) products as one persistent
//! launch, as a launch a product and as the backend's own operations (chain.rs), device picks
//! of `--tokens N` rows of a 262 144-token vocabulary under each kind of draw (`--sample`), and
//! whole-model decode steps (one host wait each) of a synthetic Gemma 4 (random weights at a
//! released variant's shapes) or a GGUF.
//!
//! ```sh
//! cargo run --release -p markbase-cuda --example cuda_bench -- --synthetic e4b:q4_k --steps 32
//! cargo run --release -p markbase-cuda --example cuda_bench -- --gguf model.gguf
//! ```

use std::sync::Arc;
use std::time::Instant;

use markbase_core::backend::{Backend, HostBytes, HostMatrix, NormOut};
use markbase_core::config::Gemma3Config;
use markbase_core::gguf::GgufFile;
use markbase_core::quant::GgmlType;
use markbase_core::sampling::Draw;
use markbase_cuda::{ChainLink, CudaBackend, CudaMatrix, LinkInput};
use markbase_models::gemma3::Gemma3;
use markbase_models::gemma4::Gemma4;
use markbase_models::synthetic::{SyntheticSpec, SyntheticWeights};
use markbase_models::{LmHeadMode, Logits, SeqStep, WeightStore};

/// Slots per KV block.
const BLOCK: usize = 16;

/// One sequence in a paged pool of its own (block `i` holds positions `16·i ..`).
struct OneSeq {
    table: Vec<u32>,
    len: usize,
}

impl OneSeq {
    /// Room for `n` positions.
    fn new(n: usize) -> OneSeq {
        OneSeq {
            table: (0..n.div_ceil(BLOCK) as u32).collect(),
            len: 0,
        }
    }

    /// Blocks the pool needs.
    fn blocks(&self) -> usize {
        self.table.len()
    }

    /// Runs `ids` after the sequence's tokens through `step`; the last token's logits.
    fn run(&mut self, ids: &[u32], step: impl FnOnce(&[SeqStep]) -> Vec<f32>) -> Vec<f32> {
        let seq = SeqStep {
            tokens: ids,
            start: self.len,
            full_blocks: &self.table,
            sliding_blocks: &self.table,
            logits: Some(Logits::Last),
        };
        let out = step(&[seq]);
        self.len += ids.len();
        out
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The whole number given for `name` (`default` without one), at least `min`; a clear error
/// and exit otherwise.
fn count_arg(args: &[String], name: &str, default: usize, min: usize) -> usize {
    let Some(v) = arg(args, name) else {
        return default;
    };
    match v.parse::<usize>() {
        Ok(n) if n >= min => n,
        _ => {
            eprintln!("error: {name} takes a whole number of at least {min}, not '{v}'");
            std::process::exit(2)
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Device-to-device copy bandwidth, bytes read + written per second.
fn copy_bandwidth(be: &CudaBackend) -> f64 {
    let n = 256 << 20; // 1 GiB of f32
    let src = be.alloc(n).unwrap();
    let mut dst = be.alloc(n).unwrap();
    be.copy(&src, 0, &mut dst, 0, n).unwrap();
    be.synchronize().unwrap();
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        be.copy(&src, 0, &mut dst, 0, n).unwrap();
    }
    be.synchronize().unwrap();
    (2 * 4 * n * reps) as f64 / t.elapsed().as_secs_f64()
}

/// A `[rows, cols]` matrix of random blocks with small scales.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: &mut u64) -> HostMatrix {
    let len = rows * ty.bytes_for(cols).unwrap();
    let mut bytes = vec![0u8; len];
    for b in bytes.iter_mut() {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        *b = (*seed >> 56) as u8;
    }
    if matches!(ty, GgmlType::BF16 | GgmlType::F16) {
        for c in bytes.chunks_exact_mut(2) {
            c[1] &= 0x3f; // small magnitudes, no NaN/inf
        }
    } else {
        let offs: &[usize] = match ty {
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q5_1 => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => &[0],
        };
        for block in bytes.chunks_exact_mut(ty.type_size()) {
            for &o in offs {
                block[o..o + 2].copy_from_slice(&0x2000u16.to_le_bytes());
            }
        }
    }
    HostMatrix {
        name: format!("bench {ty}"),
        ty,
        rows,
        cols,
        bytes: HostBytes::Owned(Arc::from(bytes)),
    }
}

/// Seconds a call of `run` (given its index) takes: 4 calls to warm up, then `reps` timed
/// back to back, the queue drained before and after.
fn seconds_per_call(be: &CudaBackend, reps: usize, mut run: impl FnMut(usize)) -> f64 {
    (0..4).for_each(&mut run);
    be.synchronize().unwrap();
    let t = Instant::now();
    (0..reps).for_each(&mut run);
    be.synchronize().unwrap();
    t.elapsed().as_secs_f64() / reps as f64
}

/// A layer's product shapes: model width, feed-forward width, query and key/value widths (a
/// sliding layer's), per-layer-input width (0: none), and copies of the layer the timing
/// cycles through so that repeated launches do not run from L2.
struct LayerShapes {
    d: usize,
    ff: usize,
    q: usize,
    kv: usize,
    ple: usize,
    copies: usize,
}

/// Gemma 4 E4B's layer.
const E4B_LAYER: LayerShapes = LayerShapes {
    d: 2560,
    ff: 10240,
    q: 2048,
    kv: 512,
    ple: 256,
    copies: 4,
};

/// Gemma 4 31B's sliding layer (1 GB of bf16 weights: two copies are far past L2).
const B31_LAYER: LayerShapes = LayerShapes {
    d: 5376,
    ff: 21504,
    q: 8192,
    kv: 4096,
    ple: 0,
    copies: 2,
};

/// A layer's matrices of random `ty` weights at `shapes`: q, k, v, o, gate, up, down, and the
/// per-layer-input gate and projection where the layer has them.
fn layer_matrices(
    be: &CudaBackend,
    shapes: &LayerShapes,
    ty: GgmlType,
    seed: &mut u64,
) -> Vec<CudaMatrix> {
    let LayerShapes {
        d, ff, q, kv, ple, ..
    } = *shapes;
    let mut load = |rows, cols| {
        be.load_matrix(&random_matrix(ty, rows, cols, seed))
            .unwrap()
    };
    let mut m = vec![
        load(q, d),
        load(kv, d),
        load(kv, d),
        load(d, q),
        load(ff, d),
        load(ff, d),
        load(d, ff),
    ];
    if ple > 0 {
        m.extend([load(ple, d), load(d, ple)]);
    }
    m
}

/// Decode products of `n` token rows at a layer's shapes, per weight format: µs a product and
/// GB/s of weight bytes (back-to-back launches, as in a step without the kernels between).
fn gemv_bandwidth(be: &CudaBackend, shapes: &LayerShapes, n: usize) {
    let LayerShapes {
        d,
        ff,
        q,
        kv,
        ple,
        copies,
    } = *shapes;
    let mut seed = 7u64;
    let x = be.alloc(n * ff).unwrap();
    let (mut a, mut b, mut c) = (
        be.alloc(n * ff).unwrap(),
        be.alloc(n * ff).unwrap(),
        be.alloc(n * ff).unwrap(),
    );
    println!("token rows: {n}");
    println!("| format | product | µs | weight GB/s |");
    println!("| --- | --- | ---: | ---: |");
    for ty in [
        GgmlType::BF16,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q5_K,
    ] {
        let layers: Vec<_> = (0..copies)
            .map(|_| layer_matrices(be, shapes, ty, &mut seed))
            .collect();
        let bytes = |rows: usize, cols: usize| (ty.bytes_for(cols).unwrap() * rows) as f64;
        // (name, weight bytes, product): q alone is the q/k/v launch's largest matrix through
        // the one-matrix kernel, to tell row length from kernel apart.
        let mut products: Vec<(&str, f64, usize)> = vec![
            ("q, k, v", bytes(q + 2 * kv, d), 0),
            ("q alone", bytes(q, d), 1),
            ("o", bytes(d, q), 2),
            ("gate + up", 2.0 * bytes(ff, d), 3),
            ("down", bytes(d, ff), 4),
            ("feed-forward", 3.0 * bytes(ff, d), 7),
        ];
        if ple > 0 {
            products.extend([
                ("PLE gate", bytes(ple, d), 5),
                ("PLE projection", bytes(d, ple), 6),
            ]);
        }
        for &(name, weight_bytes, which) in &products {
            let run = |i: usize| {
                let m = &layers[i % layers.len()];
                match which {
                    0 => be
                        .matmul_many(
                            &x,
                            n,
                            &mut [(&m[0], &mut a), (&m[1], &mut b), (&m[2], &mut c)],
                        )
                        .unwrap(),
                    1 => be.matmul(&x, n, &m[0], &mut a).unwrap(),
                    2 => be.matmul(&x, n, &m[3], &mut a).unwrap(),
                    3 => be
                        .gelu_gated_matmul(&x, n, &m[4], &m[5], ff, &mut a, &mut b)
                        .unwrap(),
                    4 => be.matmul(&x, n, &m[6], &mut a).unwrap(),
                    5 => be.matmul(&x, n, &m[7], &mut a).unwrap(),
                    7 => be
                        .gated_ffn(&x, n, &m[4], &m[5], &m[6], ff, &mut a, &mut b, &mut c)
                        .unwrap(),
                    _ => be.matmul(&x, n, &m[8], &mut a).unwrap(),
                }
            };
            let s = seconds_per_call(be, 200, run);
            println!(
                "| {ty} | {name} | {:.1} | {:.0} |",
                s * 1e6,
                weight_bytes / s / 1e9
            );
        }
    }
}

/// E4B's one-token products of 42 layers (weights stored as `ty`: bf16 or Q4_K) in a step's
/// order — q/k/v, o (reading q), gate and up (`gated`: as row pairs, each pair's output
/// gelu(gate) · up), down (reading gelu(gate) · up), the per-layer-input gate and projection,
/// each reading the one before and the ones a norm precedes normed — three ways: through
/// `run_chain` as one persistent launch and as a launch a product, and as the backend's own
/// operations (`rms_norm`, `matmul_many`, `matmul`, `gated_ffn`: 9 launches a layer, as a
/// step queues them). Steps of 5 passes end in a host
/// wait, so the steps after the first two replay as CUDA graphs, as decode steps do. Layers
/// cycle through 4 copies of the weights (183 MB each in bf16, 51 MB in Q4_K), so no product
/// runs from L2. Prints ms a pass, µs a layer and GB/s of weight bytes beside the copy
/// bandwidth `bw`.
fn chain_bandwidth(be: &CudaBackend, bw: f64, ty: GgmlType, gated: bool) {
    let LayerShapes {
        d, ff, q, kv, ple, ..
    } = E4B_LAYER;
    let (layers, copies, passes) = (42, 4, 5);
    let mut seed = 5u64;
    let mut load = |rows, cols| {
        be.load_matrix(&random_matrix(ty, rows, cols, &mut seed))
            .unwrap()
    };
    // The chain's matrices: q, k, v and gate, up as one each (their products read one input).
    let fused: Vec<Vec<_>> = (0..copies)
        .map(|_| {
            vec![
                load(q + 2 * kv, d),
                load(d, q),
                load(2 * ff, d),
                load(d, ff),
                load(ple, d),
                load(d, ple),
            ]
        })
        .collect();
    // The backend's: q, k, v, o, gate, up, down, PLE gate, PLE projection.
    let apart: Vec<Vec<_>> = (0..copies)
        .map(|_| layer_matrices(be, &E4B_LAYER, ty, &mut seed))
        .collect();
    let norm_d = be.load_vector(&vec![1.0; d]).unwrap();
    let x = be.load_vector(&vec![0.01; d]).unwrap();
    let mut links = Vec::with_capacity(6 * layers);
    for layer in 0..layers {
        let m = &fused[layer % copies];
        let b = links.len();
        let from = |link| LinkInput::Link { link, offset: 0 };
        let input = if layer == 0 {
            LinkInput::Buffer(&x)
        } else {
            from(b - 1)
        };
        let link = |j: usize, input, pair, normed: bool| ChainLink {
            weights: &m[j],
            input,
            pair,
            norm: normed.then_some((&norm_d, 1e-6)),
            gated: false,
        };
        links.extend([
            link(0, input, false, true),
            link(1, from(b), false, false),
            ChainLink {
                gated,
                ..link(2, from(b + 1), false, true)
            },
            link(3, from(b + 2), !gated, false),
            link(4, from(b + 3), false, true),
            link(5, from(b + 4), false, false),
        ]);
    }
    let mut chain = be.chain(&links).unwrap();
    let bytes = chain.weight_bytes() as f64;
    let n = chain.len();
    let mut h = be.load_vector(&vec![0.01; d]).unwrap();
    let mut xn = be.alloc(d).unwrap();
    let (mut qo, mut ko, mut vo, mut oo) = (
        be.alloc(q).unwrap(),
        be.alloc(kv).unwrap(),
        be.alloc(kv).unwrap(),
        be.alloc(d).unwrap(),
    );
    let (mut g, mut u, mut dn, mut pg) = (
        be.alloc(ff).unwrap(),
        be.alloc(ff).unwrap(),
        be.alloc(d).unwrap(),
        be.alloc(ple).unwrap(),
    );
    println!(
        "chain: {layers} layers of E4B's {ty} products ({n} of them), {:.2} GB a pass; steps of \
         {passes} passes",
        bytes / 1e9
    );
    println!("| launches | ms a pass | µs a layer | weight GB/s | share of the copy rate |");
    let mut one_launch = 0.0;
    println!("| --- | ---: | ---: | ---: | ---: |");
    for mode in [0, 1, 2, 0, 1, 2] {
        let mut pass = |chain: &mut markbase_cuda::Chain| match mode {
            0 => be.run_chain(chain, 0..n).unwrap(),
            1 => (0..n).for_each(|j| be.run_chain(chain, j..j + 1).unwrap()),
            _ => {
                for layer in 0..layers {
                    let m = &apart[layer % copies];
                    let w = Some(&norm_d);
                    be.rms_norm(&h, w, 1e-6, 1, d, &mut xn, NormOut::Write)
                        .unwrap();
                    be.matmul_many(
                        &xn,
                        1,
                        &mut [(&m[0], &mut qo), (&m[1], &mut ko), (&m[2], &mut vo)],
                    )
                    .unwrap();
                    be.matmul(&qo, 1, &m[3], &mut oo).unwrap();
                    be.rms_norm(&oo, w, 1e-6, 1, d, &mut xn, NormOut::Write)
                        .unwrap();
                    be.gated_ffn(&xn, 1, &m[4], &m[5], &m[6], ff, &mut g, &mut u, &mut dn)
                        .unwrap();
                    be.rms_norm(&dn, w, 1e-6, 1, d, &mut xn, NormOut::Write)
                        .unwrap();
                    be.matmul(&xn, 1, &m[7], &mut pg).unwrap();
                    be.matmul(&pg, 1, &m[8], &mut h).unwrap();
                }
            }
        };
        let s = seconds_per_call(be, 8, |_| {
            (0..passes).for_each(|_| pass(&mut chain));
            be.synchronize().unwrap();
        }) / passes as f64;
        let label = [
            "one (chain)",
            "one a product (chain)",
            "9 a layer (backend)",
        ][mode];
        println!(
            "| {label} | {:.3} | {:.1} | {:.0} | {:.0} % |",
            s * 1e3,
            s * 1e6 / layers as f64,
            bytes / s / 1e9,
            100.0 * bytes / s / bw
        );
        if mode == 0 {
            one_launch = s;
        }
    }
    let link_bytes: Vec<f64> = links
        .iter()
        .map(|l| (l.weights.rows * l.weights.row_bytes) as f64)
        .collect();
    chain_phases(be, &mut chain, one_launch, &link_bytes, bw);
}

/// With `CHAIN_STAMPS=1` (`MARKBASE_CUDA_DEFINES`): one more pass of `chain` in one launch,
/// and each of a layer's 6 links' phases (chain.rs `CHAIN_PHASES`) averaged over the layers
/// and blocks, in µs at the SM clock that makes the stamped span of a pass last `pass`
/// seconds; beside them, the link's bytes at the copy rate `bw`. Prints nothing without stamps.
fn chain_phases(
    be: &CudaBackend,
    chain: &mut markbase_cuda::Chain,
    pass: f64,
    bytes: &[f64],
    bw: f64,
) {
    be.run_chain(chain, 0..chain.len()).unwrap();
    be.synchronize().unwrap();
    let Some(stamps) = chain.stamps(be).unwrap() else {
        return;
    };
    let blocks = stamps[0].len();
    let last = stamps.len() - 1;
    // Cycles from the first link's start to the last link's count, a block's mean.
    let span: f64 = (0..blocks)
        .map(|b| (stamps[last][b][4] - stamps[0][b][0]) as f64)
        .sum::<f64>()
        / blocks as f64;
    let us = pass * 1e6 / span;
    println!(
        "phases of a block's share (µs a link, mean of the layers and {blocks} blocks; SM clock \
         {:.0} MHz from the pass's {:.3} ms)",
        1.0 / us,
        pass * 1e3
    );
    println!("| link | wait | stage x | items | store + count | to next | sum | bytes at the copy rate |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let names = ["q/k/v", "o", "gate/up", "down", "PLE gate", "PLE proj"];
    let mut total = [0f64; 5];
    for (kind, name) in names.iter().enumerate() {
        let mut sum = [0f64; 5];
        let mut n = 0f64;
        let mut link_bytes = 0f64;
        for j in (kind..stamps.len()).step_by(names.len()) {
            link_bytes += bytes[j];
            for (b, s) in stamps[j].iter().enumerate() {
                let next = if j < last { stamps[j + 1][b][0] } else { s[4] };
                let d = [
                    s[1] - s[0],
                    s[2] - s[1],
                    s[3] - s[2],
                    s[4] - s[3],
                    next - s[4],
                ];
                d.iter().zip(&mut sum).for_each(|(d, t)| *t += *d as f64);
                n += 1.0;
            }
        }
        let layers = n / blocks as f64;
        let mean: Vec<f64> = sum.iter().map(|t| t / n * us).collect();
        mean.iter().zip(&mut total).for_each(|(m, t)| *t += m);
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            mean[0],
            mean[1],
            mean[2],
            mean[3],
            mean[4],
            mean.iter().sum::<f64>(),
            link_bytes / layers / bw * 1e6
        );
    }
    println!(
        "| a layer | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        total[0],
        total[1],
        total[2],
        total[3],
        total[4],
        total.iter().sum::<f64>(),
        bytes.iter().sum::<f64>() * names.len() as f64 / bytes.len() as f64 / bw * 1e6
    );
}

/// The routed experts of one 26B-A4B layer (`moe_ffn`: 128 experts 704 wide over a model
/// width of 2 816, top 8) for `n` tokens whose experts are drawn uniformly at random (distinct
/// per token, a fixed seed), per storage (gate/up, down): µs a call, the experts the tokens
/// chose, and GB/s of those experts' weight bytes.
fn moe_bandwidth(be: &CudaBackend, n: usize) {
    let (d, f, experts, top_k) = (2816, 704, 128, 8);
    let mut seed = 11u64;
    let mut next = |m: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % m
    };
    let mut ids = Vec::with_capacity(n * top_k);
    for _ in 0..n {
        let mut chosen: Vec<u64> = Vec::with_capacity(top_k);
        while chosen.len() < top_k {
            let e = next(experts as u64);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen.iter().map(|&e| e as f32));
    }
    let mut used = ids.clone();
    used.sort_by(f32::total_cmp);
    used.dedup();
    let weights: Vec<f32> = (0..n * top_k).map(|i| 0.1 + (i % 7) as f32 * 0.1).collect();
    let upload = |v: &[f32]| {
        let mut b = be.alloc(v.len()).unwrap();
        be.write(v, &mut b).unwrap();
        b
    };
    let (ids_b, weights_b) = (upload(&ids), upload(&weights));
    let x = upload(
        &(0..n * d)
            .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
            .collect::<Vec<_>>(),
    );
    let mut out = be.alloc(n * d).unwrap();
    println!(
        "token rows: {n}, experts chosen: {} of {experts}",
        used.len()
    );
    println!("| gate/up | down | µs | weight GB/s |");
    println!("| --- | --- | ---: | ---: |");
    for (gu_ty, down_ty) in [
        (GgmlType::BF16, GgmlType::BF16),
        (GgmlType::Q8_0, GgmlType::Q8_0),
        (GgmlType::Q4_K, GgmlType::Q8_0),
        // llama.cpp's Q4_K_M and Q5_K_M mixes (704-wide down rows fall back to Q5_0 / Q5_1).
        (GgmlType::Q4_K, GgmlType::Q5_0),
        (GgmlType::Q5_K, GgmlType::Q5_1),
        (GgmlType::Q4_0, GgmlType::Q4_0),
    ] {
        let mut s = 5u64;
        let gate_up = be
            .load_matrix(&random_matrix(gu_ty, experts * 2 * f, d, &mut s))
            .unwrap();
        let down = be
            .load_matrix(&random_matrix(down_ty, experts * d, f, &mut s))
            .unwrap();
        let expert_bytes = 2 * f * gu_ty.bytes_for(d).unwrap() + d * down_ty.bytes_for(f).unwrap();
        let bytes = (used.len() * expert_bytes) as f64;
        let run = |_| {
            be.moe_ffn(
                &x, n, &gate_up, &down, experts, top_k, &weights_b, &ids_b, &mut out,
            )
            .unwrap()
        };
        let s = seconds_per_call(be, 50, run);
        println!(
            "| {gu_ty} | {down_ty} | {:.1} | {:.0} |",
            s * 1e6,
            bytes / s / 1e9
        );
    }
}

/// Microseconds a `Backend::sample` call over `rows` rows of 262 144 logits takes (the kernel,
/// the picks' copy back and the host wait), for each kind of draw, on logits shaped as a
/// trained model's (a few tokens far ahead of a Gaussian crowd: a small nucleus) and on flat
/// ones (random weights: a nucleus of most of the vocabulary).
fn sample_speed(be: &CudaBackend, rows: usize) {
    let n = 262_144;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut unit = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    let draw = |temperature, top_k, top_p, min_p| Draw {
        temperature,
        top_k,
        top_p,
        min_p,
        u: 0.5,
    };
    let kinds = [
        ("greedy", Draw::GREEDY),
        ("t 1 (every token)", draw(1.0, 0, 1.0, 0.0)),
        ("top-k 40", draw(1.0, 40, 1.0, 0.0)),
        ("top-p 0.9", draw(1.0, 0, 0.9, 0.0)),
        ("top-k 40, top-p 0.95", draw(0.8, 40, 0.95, 0.0)),
        ("top-p 0.95, min-p 0.05", draw(1.0, 0, 0.95, 0.05)),
    ];
    println!("| logits | draw | rows | µs a call |\n| --- | --- | ---: | ---: |");
    for shape in ["trained", "flat"] {
        let logits: Vec<f32> = (0..rows * n)
            .map(|i| match shape {
                // Twelve uniforms make a Gaussian; every 50 000th token stands far ahead.
                "trained" if i % 50_000 == 7 => 12.0 + 4.0 * unit(),
                "trained" => 2.0 * ((0..12).map(|_| unit()).sum::<f32>() - 6.0),
                _ => unit() * 2.0 - 1.0,
            })
            .collect();
        let mut x = be.alloc(logits.len()).unwrap();
        be.write(&logits, &mut x).unwrap();
        for (name, d) in kinds {
            let mut draws = vec![d; rows];
            let s = seconds_per_call(be, 20, |i| {
                draws.iter_mut().for_each(|d| d.u = (i % 10) as f32 / 10.0);
                be.sample(&x, rows, n, &draws).unwrap();
            });
            println!("| {shape} | {name} | {rows} | {:.1} |", s * 1e6);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps = count_arg(&args, "--steps", 32, 0);
    let prompt = count_arg(&args, "--prompt", 128, 0);
    let tokens = count_arg(&args, "--tokens", 1, 1);
    // `--chain [bf16 | bf16-pair | q4_k]`: the chain's weight format (bf16: gate and up as row
    // pairs; bf16-pair: down reading gate and up's outputs as a pair, as Q4_K does).
    let chain =
        args.iter()
            .any(|a| a == "--chain")
            .then(|| match arg(&args, "--chain").as_deref() {
                Some("q4_k") => (GgmlType::Q4_K, false),
                Some("bf16") => (GgmlType::BF16, true),
                Some("bf16-pair") => (GgmlType::BF16, false),
                Some(a) if !a.starts_with("--") => {
                    eprintln!("error: --chain {a}: the chain takes bf16, bf16-pair or q4_k");
                    std::process::exit(1)
                }
                _ => (GgmlType::BF16, true),
            });
    let t = Instant::now();
    let be = CudaBackend::new(0).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    println!(
        "device: {} ({} SMs); kernels ready in {:.1} s",
        be.device().name(),
        be.device().multiprocessors(),
        t.elapsed().as_secs_f64()
    );
    let bw = copy_bandwidth(&be);
    println!("device copy bandwidth: {:.0} GB/s (read + write)", bw / 1e9);
    if args.iter().any(|a| a == "--gemv") {
        let shapes = match arg(&args, "--gemv").as_deref() {
            Some("31b") => &B31_LAYER,
            _ => &E4B_LAYER,
        };
        gemv_bandwidth(&be, shapes, tokens);
    }
    if args.iter().any(|a| a == "--moe") {
        moe_bandwidth(&be, tokens);
    }
    if args.iter().any(|a| a == "--sample") {
        sample_speed(&be, tokens);
    }
    if let Some((ty, gated)) = chain {
        chain_bandwidth(&be, bw, ty, gated);
    }
    let nothing = |_: u64, _: u64| {};
    let t = Instant::now();
    // (forward of one token → logits, bytes a decode step reads)
    type Step = Box<dyn FnMut(&[u32]) -> Vec<f32>>;
    let (mut step, step_bytes, label): (Step, u64, String) = if let Some(spec) =
        arg(&args, "--synthetic")
    {
        let spec = SyntheticSpec::parse(&spec).unwrap();
        let w = Arc::new(SyntheticWeights::new(spec).unwrap());
        let cfg = w.config().clone();
        // Decode reads every matrix except the PLE table, of which only one row per layer.
        let bytes = w.weight_bytes() - w.n_bytes("embed_tokens_per_layer.weight");
        let m = Gemma4::load(
            cfg,
            &WeightStore::Synthetic(w),
            be,
            LmHeadMode::Exact,
            &nothing,
        )
        .unwrap();
        let mut one = OneSeq::new(prompt + steps + 1);
        let mut pool = m.new_kv_pool(BLOCK, [one.blocks(), one.blocks()]).unwrap();
        (
            Box::new(move |ids| one.run(ids, |s| m.step(&mut pool, s).unwrap().logits)),
            bytes,
            format!("synthetic {}", spec.describe()),
        )
    } else if let Some(path) = arg(&args, "--gguf") {
        let f = Arc::new(GgufFile::open(&path).unwrap());
        let cfg = Gemma3Config::from_gguf(&f).unwrap();
        let bytes: u64 = f.tensors().iter().map(|t| t.n_bytes).sum();
        let m = Gemma3::load(cfg, &WeightStore::Gguf(f), be, LmHeadMode::Exact, &nothing).unwrap();
        let mut one = OneSeq::new(prompt + steps + 1);
        let mut pool = m.new_kv_pool(BLOCK, [one.blocks(), one.blocks()]).unwrap();
        (
            Box::new(move |ids| one.run(ids, |s| m.step(&mut pool, s).unwrap().logits)),
            bytes,
            path,
        )
    } else {
        return;
    };
    println!(
        "model {label}: loaded in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let ids: Vec<u32> = (0..prompt as u32).map(|i| (i * 7919) % 4096 + 10).collect();
    let t = Instant::now();
    let mut logits = step(&ids);
    let pre = t.elapsed().as_secs_f64();
    println!(
        "prefill {prompt} tokens: {:.1} ms ({:.0} tokens/s)",
        pre * 1e3,
        prompt as f64 / pre
    );
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let next = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        let t = Instant::now();
        logits = step(&[next as u32]);
        times.push(t.elapsed().as_secs_f64());
    }
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    let med = median(&mut times);
    // The memory system moves `bw` bytes per second (reads + writes); a step reads its weights.
    let floor = step_bytes as f64 / bw;
    println!(
        "decode: median {:.3} ms/step ({:.0} tokens/s), min {:.3} ms; {:.2} GB read per step \
         = {:.0} GB/s; bandwidth floor {:.3} ms, so {:.0}% of the roofline",
        med * 1e3,
        1.0 / med,
        min * 1e3,
        step_bytes as f64 / 1e9,
        step_bytes as f64 / med / 1e9,
        floor * 1e3,
        100.0 * floor / med
    );
}
