//! Whole models on the GPU, through the paged step (`Gemma3::step` / `Gemma4::step` over
//! block tables): Gemma3<CudaBackend> and Gemma4<CudaBackend> against transformers' logits on the tiny fixtures (tests/fixtures/gemma3_tiny, tests/fixtures/gemma4/*) and
//! against the same model on the CPU backend; and the real Gemma 3 270M weights (or the
//! cut-down copy scripts/make_gemma3_270m_cut.py writes, named by `MARKBASE_GEMMA3_CUT`)
//! decoding greedily like the CPU; and the public `Model` API loaded with `Device::Cuda`.
//!
//! Tolerances: f32 logits per position `max |diff| / max |ref| ≤ 1e-4` (as the CPU tests);
//! bf16 weights: argmax equal to transformers' bf16 run at every position.
//! Without a usable GPU every test prints why and passes.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use markbase_core::backend::Backend;
use markbase_core::config::Gemma3Config;
use markbase_core::gguf::GgufFile;
use markbase_core::quant::GgmlType;
use markbase_core::safetensors::SafetensorsDir;
use markbase_cpu::CpuBackend;
use markbase_cuda::{product_inputs, CudaBackend, ProductInputs};
use markbase_models::gemma3::Gemma3;
use markbase_models::gemma4::Gemma4;
use markbase_models::gemma4_config::Gemma4Config;
use markbase_models::{
    Device, LmHeadMode, LoadOptions, Logits, Model, ModelSource, PagedKv, SeqStep, StepOutput,
    WeightStore,
};
use serde_json::Value;

const REL_TOL: f32 = 1e-4;

/// CPU against GPU where the weights are block-quantized: below 16 token rows the CPU takes
/// 16-bit quantized activations, whose rounding alone moves logits by up to ≈ 1.8e-4 of their
/// scale (markbase-cpu `kernels::act`); the GPU keeps f32 activations.
const QUANT_ACT_TOL: f32 = 2e-4;

/// GPU against the references where block-quantized products of more than 16 token rows take
/// the tensor cores with activations and dequantized weights rounded to f16
/// (`product_inputs`: `F16`): ≈ 1.3e-3 measured on the tiny Gemma 3 GGUF (Q8_0) in one run.
const F16_PRODUCTS_TOL: f32 = 3e-3;

/// GPU against the CPU where the tensor-core kernels of quantized weights (mmq.rs) take
/// products of 2–128 token rows: they dequantize K-quant blocks in f16 arithmetic
/// (`k_quant_as_f16_fma` in the product tests), coarser than the f32 dequantization rounded
/// once that cuBLAS reads: the real 270M weights' third batched step of 72 sequences came
/// 3.8e-3 from the CPU this way, 2.1e-3 through f16 copies (H100, session 54).
const MMQ_PRODUCTS_TOL: f32 = 5e-3;

fn gpu() -> Option<CudaBackend> {
    common::backend_or_skip()
}

fn fixtures() -> PathBuf {
    // MARKBASE_FIXTURES lets a binary built elsewhere find the fixtures of its checkout.
    std::env::var_os("MARKBASE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
}

fn hf_store(dir: &Path) -> WeightStore {
    let st = SafetensorsDir::open(dir).unwrap();
    let prefix = ["model.", "language_model.model.", "model.language_model."]
        .into_iter()
        .find(|p| st.get(&format!("{p}embed_tokens.weight")).is_some())
        .expect("embedding prefix")
        .to_string();
    WeightStore::Hf { st, prefix }
}

fn gguf_store(path: &Path) -> (WeightStore, Arc<GgufFile>) {
    let f = Arc::new(GgufFile::open(path).unwrap());
    (WeightStore::Gguf(f.clone()), f)
}

/// Per position `max |got − want| / max |want|`, the worst.
fn worst_rel(got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "logit count");
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if diff.is_nan() {
                f32::INFINITY
            } else {
                diff / scale
            }
        })
        .fold(0f32, f32::max)
}

/// Whether the GGUF at `path` holds block-quantized matrices.
fn src_is_quantized(path: &Path) -> bool {
    GgufFile::open(path)
        .unwrap()
        .tensors()
        .iter()
        .any(|t| t.dtype.block_size() > 1)
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

/// Slots per KV block in these tests: small, so the fixtures' short sequences span many blocks.
const BLOCK: usize = 4;

/// One sequence's paged cache: a pool whose blocks are handed out in reverse order, so every
/// key read goes through a non-trivial block table.
struct Seq<B: Backend> {
    pool: PagedKv<B>,
    table: Vec<u32>,
    len: usize,
}

/// A paged step of either architecture on either backend.
trait Lm {
    type B: Backend;
    fn pool(&self, blocks: usize) -> PagedKv<Self::B>;
    fn run_step(&self, pool: &mut PagedKv<Self::B>, seqs: &[SeqStep]) -> StepOutput;

    /// A one-sequence cache for `n` tokens.
    fn cache(&self, n: usize) -> Seq<Self::B> {
        let blocks = n.div_ceil(BLOCK);
        Seq {
            pool: self.pool(blocks),
            table: (0..blocks as u32).rev().collect(),
            len: 0,
        }
    }

    /// Runs `ids` after the cache's tokens; the last token's logits or every token's.
    fn fwd(&self, c: &mut Seq<Self::B>, ids: &[u32], all: bool) -> Vec<f32> {
        let seq = SeqStep {
            tokens: ids,
            start: c.len,
            full_blocks: &c.table,
            sliding_blocks: &c.table,
            logits: Some(if all { Logits::All } else { Logits::Last }),
        };
        let out = self.run_step(&mut c.pool, &[seq]);
        c.len += ids.len();
        out.logits
    }
}

impl<B: Backend> Lm for Gemma3<B> {
    type B = B;
    fn pool(&self, blocks: usize) -> PagedKv<B> {
        self.new_kv_pool(BLOCK, [blocks, blocks]).unwrap()
    }
    fn run_step(&self, pool: &mut PagedKv<B>, seqs: &[SeqStep]) -> StepOutput {
        self.step(pool, seqs).unwrap()
    }
}

impl<B: Backend> Lm for Gemma4<B> {
    type B = B;
    fn pool(&self, blocks: usize) -> PagedKv<B> {
        self.new_kv_pool(BLOCK, [blocks, blocks]).unwrap()
    }
    fn run_step(&self, pool: &mut PagedKv<B>, seqs: &[SeqStep]) -> StepOutput {
        self.step(pool, seqs).unwrap()
    }
}

/// Three sequences in shared pools, run as batched steps (a mixed prefill, then two decode
/// steps of all three): the GPU's logits equal the CPU's to `tol` (the decode steps read the
/// prefill's keys and values), and its greedy picks are their argmax.
fn batched_matches_cpu<G: Lm, C: Lm>(
    name: &str,
    gpu: &G,
    cpu: &C,
    ids: &[u32],
    vocab: usize,
    tol: f32,
) {
    let lens = [ids.len(), ids.len() / 2, 3];
    let per: Vec<usize> = lens.iter().map(|l| (l + 2).div_ceil(BLOCK)).collect();
    let total: usize = per.iter().sum();
    // Sequence s gets every third block from s on (interleaved ownership).
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut next = 0u32;
    while tables.iter().zip(&per).any(|(t, &p)| t.len() < p) {
        for (t, &p) in tables.iter_mut().zip(&per) {
            if t.len() < p {
                t.push(next);
                next += 1;
            }
        }
    }
    let (mut gp, mut cp) = (gpu.pool(total), cpu.pool(total));
    let mut starts = [0usize; 3];
    let mut toks: Vec<Vec<u32>> = lens.iter().map(|&l| ids[..l].to_vec()).collect();
    for step in 0..3 {
        let seqs: Vec<SeqStep> = (0..3)
            .map(|s| SeqStep {
                tokens: &toks[s],
                start: starts[s],
                full_blocks: &tables[s],
                sliding_blocks: &tables[s],
                logits: Some(if step == 0 { Logits::All } else { Logits::Last }),
            })
            .collect();
        let got = gpu.run_step(&mut gp, &seqs).logits;
        let want = cpu.run_step(&mut cp, &seqs).logits;
        let rel = worst_rel(&got, &want, vocab);
        eprintln!("{name} batched step {step}: vs CPU {rel:e}");
        assert!(rel <= tol, "{name} batched step {step}: vs CPU {rel:e}");
        if step > 0 {
            // The same step again (it rewrites the same keys and values), greedy: the device's
            // picks are the argmax of the logits it just returned.
            let greedy: Vec<SeqStep> = seqs
                .iter()
                .map(|s| SeqStep {
                    logits: Some(Logits::Greedy),
                    ..*s
                })
                .collect();
            let picks = gpu.run_step(&mut gp, &greedy).ids;
            let want: Vec<u32> = got.chunks(vocab).map(|r| argmax(r) as u32).collect();
            assert_eq!(picks, want, "{name} batched step {step}: greedy picks");
        }
        for s in 0..3 {
            starts[s] += toks[s].len();
            toks[s] = vec![ids[(starts[s] + s) % ids.len()]];
        }
    }
}

/// Every position's logits: whole-sequence prefill (`split` = None) or a prefill of `k`
/// tokens then one token at a time.
fn run<M: Lm>(m: &M, ids: &[u32], split: Option<usize>) -> Vec<f32> {
    let mut c = m.cache(ids.len());
    match split {
        None => m.fwd(&mut c, ids, true),
        Some(k) => {
            let mut out = m.fwd(&mut c, &ids[..k], true);
            for &t in &ids[k..] {
                out.extend(m.fwd(&mut c, &[t], false));
            }
            out
        }
    }
}

/// GPU vs transformers and GPU vs CPU, for each way of running the sequence: to `full_tol`
/// when the whole sequence runs as one step, to `REL_TOL` when it runs as a short prefix then
/// one token at a time (GEMV products in f32).
fn compare<G: Lm, C: Lm>(
    name: &str,
    gpu: &G,
    cpu: &C,
    ids: &[u32],
    want: &[f32],
    vocab: usize,
    full_tol: f32,
) {
    for split in [None, Some(5), Some(13)] {
        let got = run(gpu, ids, split);
        let cpu_out = run(cpu, ids, split);
        let vs_ref = worst_rel(&got, want, vocab);
        let vs_cpu = worst_rel(&got, &cpu_out, vocab);
        eprintln!("{name} {split:?}: vs transformers {vs_ref:e}, vs CPU {vs_cpu:e}");
        let tol = if split.is_none() { full_tol } else { REL_TOL };
        assert!(
            vs_ref <= tol,
            "{name} {split:?}: vs transformers {vs_ref:e}"
        );
        assert!(vs_cpu <= tol, "{name} {split:?}: vs CPU {vs_cpu:e}");
    }
}

fn load_g3<B: Backend>(dir: &Path, gguf: bool, backend: B) -> Gemma3<B> {
    let nothing = |_: u64, _: u64| {};
    if gguf {
        let (store, f) = gguf_store(&dir.join("gguf/model.gguf"));
        Gemma3::load(
            Gemma3Config::from_gguf(&f).unwrap(),
            &store,
            backend,
            LmHeadMode::Exact,
            &nothing,
        )
        .unwrap()
    } else {
        let cfg = Gemma3Config::from_hf_file(&dir.join("config.json")).unwrap();
        Gemma3::load(cfg, &hf_store(dir), backend, LmHeadMode::Exact, &nothing).unwrap()
    }
}

#[test]
fn gemma3_tiny_matches_transformers_and_cpu() {
    let Some(_) = gpu() else { return };
    let dir = fixtures().join("gemma3_tiny");
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    let ids: Vec<u32> = meta["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    for gguf in [false, true] {
        let file = if gguf {
            "gguf/logits.f32"
        } else {
            "logits.f32"
        };
        let want: Vec<f32> = std::fs::read(dir.join(file))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let g = load_g3(&dir, gguf, gpu().unwrap());
        let c = load_g3(&dir, gguf, CpuBackend::new(2).unwrap());
        // The GGUF's Q8_0 products over the whole sequence (and over the batched prefill of
        // more rows) run in f16 (even widths).
        let full_tol = match product_inputs(GgmlType::Q8_0, 2, ids.len()) {
            ProductInputs::F16 if gguf => F16_PRODUCTS_TOL,
            _ => REL_TOL,
        };
        compare(
            &format!("gemma3_tiny gguf={gguf}"),
            &g,
            &c,
            &ids,
            &want,
            300,
            full_tol,
        );
        batched_matches_cpu(
            &format!("gemma3_tiny gguf={gguf}"),
            &g,
            &c,
            &ids,
            300,
            full_tol,
        );
    }
}

fn load_g4<B: Backend>(path: &Path, backend: B) -> Gemma4<B> {
    let nothing = |_: u64, _: u64| {};
    if path.extension().is_some_and(|e| e == "gguf") {
        let (store, f) = gguf_store(path);
        Gemma4::load(
            Gemma4Config::from_gguf(&f).unwrap(),
            &store,
            backend,
            LmHeadMode::Exact,
            &nothing,
        )
        .unwrap()
    } else {
        let cfg = Gemma4Config::from_hf_file(&path.join("config.json")).unwrap();
        Gemma4::load(cfg, &hf_store(path), backend, LmHeadMode::Exact, &nothing).unwrap()
    }
}

fn reference(dir: &Path) -> (Vec<u32>, usize, Value) {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = json["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let vocab = json["vocab_size"].as_u64().unwrap() as usize;
    (ids, vocab, json)
}

fn flat(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn gemma4_fixtures_match_transformers_and_cpu() {
    let Some(_) = gpu() else { return };
    let root = fixtures().join("gemma4");
    for (name, gguf) in [
        ("e2b_like", true),
        ("e4b_like", true),
        ("dense31b_like", true),
        ("moe26b_like", true),
        ("unified12b_like", false),
    ] {
        let dir = root.join(name);
        let (ids, vocab, json) = reference(&dir);
        let want = flat(&json["logits"]);
        let mut paths = vec![dir.clone()];
        if gguf {
            paths.push(dir.join("model.gguf"));
        }
        for p in paths {
            let g = load_g4(&p, gpu().unwrap());
            let c = load_g4(&p, CpuBackend::new(2).unwrap());
            let label = format!("{name} {}", p.file_name().unwrap().to_string_lossy());
            compare(&label, &g, &c, &ids, &want, vocab, REL_TOL);
            batched_matches_cpu(&label, &g, &c, &ids, vocab, REL_TOL);
        }
    }
}

#[test]
fn gemma4_bf16_argmax_matches_transformers_bf16() {
    let Some(b) = gpu() else { return };
    let dir = fixtures().join("gemma4/e4b_like_bf16");
    let (ids, vocab, json) = reference(&dir);
    let want: Vec<usize> = json["bf16_argmax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let g = load_g4(&dir, b);
    for split in [None, Some(5)] {
        let got = run(&g, &ids, split);
        let am: Vec<usize> = got.chunks(vocab).map(argmax).collect();
        assert_eq!(am, want, "bf16 argmax, split {split:?}");
    }
}

/// The real 270M weights: `MARKBASE_GEMMA3_CUT`'s cut-down copy, else the cached model; `None`
/// (with the reason printed) where neither exists.
fn gemma3_270m() -> Option<PathBuf> {
    let path = std::env::var_os("MARKBASE_GEMMA3_CUT")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/markbase/models/gemma-3-270m-q4_k_m.gguf"))
        })
        .filter(|p| p.is_file());
    if path.is_none() {
        eprintln!("skipped: neither MARKBASE_GEMMA3_CUT nor the cached 270M model exists");
    }
    path
}

/// The real 270M weights (quantized: Q8_0, Q5_0, Q4_K, Q6_K), 72 sequences in one pool as
/// batched steps: their prompts (2–5 tokens each, 252 rows) then two decode steps of 72 rows,
/// products past 64 rows all. On a backend with f16 copies and on one without (the
/// tensor-core kernels' runs of 64 rows, and tiles dequantized a call at a time past 128),
/// every step's logits equal the CPU's to the tolerance of the products that ran.
#[test]
fn gemma3_270m_batch_of_72_matches_cpu_with_and_without_f16_copies() {
    let Some(path) = gemma3_270m() else { return };
    if gpu().is_none() {
        return;
    }
    let (store, f) = gguf_store(&path);
    let cfg = Gemma3Config::from_gguf(&f).unwrap();
    let nothing = |_: u64, _: u64| {};
    let vocab = cfg.n_vocab;
    let cpu = CpuBackend::new(0).unwrap();
    let c = Gemma3::load(cfg.clone(), &store, cpu, LmHeadMode::Exact, &nothing).unwrap();
    let want = many_sequences(&c, vocab);
    for copies in [true, false] {
        let b = gpu().unwrap();
        b.set_f16_copies(copies);
        let g = Gemma3::load(cfg.clone(), &store, b, LmHeadMode::Exact, &nothing).unwrap();
        for (step, (got, want)) in many_sequences(&g, vocab).iter().zip(&want).enumerate() {
            let rel = worst_rel(got, want, vocab);
            eprintln!("f16 copies {copies}, step {step}: vs CPU {rel:e}");
            let tol = if copies {
                F16_PRODUCTS_TOL
            } else {
                MMQ_PRODUCTS_TOL
            };
            assert!(rel <= tol, "copies {copies}, step {step}: vs CPU {rel:e}");
        }
        let bytes = g.backend().f16_copy_bytes();
        assert_eq!(
            bytes > 0,
            copies,
            "f16 copies {copies}: {bytes} bytes of them"
        );
    }
}

/// 72 sequences of 2–5 prompt tokens in one pool: their prompts as one step, then two decode
/// steps of all 72 (fixed tokens); each step's last-token logits of every sequence.
fn many_sequences<M: Lm>(m: &M, vocab: usize) -> Vec<Vec<f32>> {
    const SEQS: usize = 72;
    let per = (5 + 2usize).div_ceil(BLOCK);
    let tables: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| (0..per).map(|b| (b * SEQS + s) as u32).collect())
        .collect();
    let mut pool = m.pool(SEQS * per);
    let token = |s: usize, i: usize| ((s * 31 + i * 7 + 3) % vocab) as u32;
    let mut toks: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| (0..2 + s % 4).map(|i| token(s, i)).collect())
        .collect();
    let mut starts = [0usize; SEQS];
    let mut out = Vec::new();
    for _ in 0..3 {
        let seqs: Vec<SeqStep> = (0..SEQS)
            .map(|s| SeqStep {
                tokens: &toks[s],
                start: starts[s],
                full_blocks: &tables[s],
                sliding_blocks: &tables[s],
                logits: Some(Logits::Last),
            })
            .collect();
        out.push(m.run_step(&mut pool, &seqs).logits);
        for s in 0..SEQS {
            starts[s] += toks[s].len();
            toks[s] = vec![token(s, starts[s] + 11)];
        }
    }
    out
}

/// The real 270M weights (or their cut-down copy): a 700-token prompt (longer than the
/// sliding window) then 24 greedy steps; at every step the GPU's argmax must equal the CPU's
/// wherever the CPU's top-2 margin exceeds 1e-3, and logits agree to 1e-3 relative.
#[test]
fn gemma3_270m_greedy_matches_cpu() {
    let Some(path) = gemma3_270m() else { return };
    let Some(b) = gpu() else { return };
    let (store, f) = gguf_store(&path);
    let cfg = Gemma3Config::from_gguf(&f).unwrap();
    let nothing = |_: u64, _: u64| {};
    let vocab = cfg.n_vocab;
    let g = Gemma3::load(cfg.clone(), &store, b, LmHeadMode::Exact, &nothing).unwrap();
    let c = Gemma3::load(
        cfg,
        &store,
        CpuBackend::new(0).unwrap(),
        LmHeadMode::Exact,
        &nothing,
    )
    .unwrap();
    let mut x = 12345u64;
    let prompt: Vec<u32> = (0..700)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab.min(8192) as u64) as u32
        })
        .collect();
    let (mut gc, mut cc) = (g.cache(800), c.cache(800));
    let mut gl = g.fwd(&mut gc, &prompt, false);
    let mut cl = c.fwd(&mut cc, &prompt, false);
    let mut agree = 0;
    for step in 0..24 {
        let rel = worst_rel(&gl, &cl, vocab);
        let want = argmax(&cl);
        let mut sorted = cl.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let margin = sorted[0] - sorted[1];
        eprintln!("step {step}: token {want}, margin {margin:.4}, logits rel {rel:e}");
        assert!(rel <= 1e-3, "step {step}: logits differ by {rel:e}");
        if margin > 1e-3 {
            assert_eq!(argmax(&gl), want, "step {step}: greedy token differs");
            agree += 1;
        }
        gl = g.fwd(&mut gc, &[want as u32], false);
        cl = c.fwd(&mut cc, &[want as u32], false);
    }
    eprintln!("{} greedy steps compared, {agree} with a clear margin", 24);
}

/// The public `Model` API with `Device::Cuda(0)`: the logits equal the CPU model's, a step runs
/// from a thread other than the loading one (as the engine's worker does) and waits for the
/// device once, and a pool of the other device is refused.
#[test]
fn model_api_on_cuda_matches_cpu() {
    let Some(_) = gpu() else { return };
    let root = fixtures();
    for path in [
        root.join("gemma3_tiny/gguf/model.gguf"),
        root.join("gemma4/e2b_like/model.gguf"),
    ] {
        let src = ModelSource::open(&path).unwrap();
        let load = |device| {
            let opts = LoadOptions {
                device,
                threads: 2,
                lm_head: LmHeadMode::Exact,
                ..LoadOptions::default()
            };
            Model::load(&src, &opts).unwrap()
        };
        let (g, c) = (Arc::new(load(Device::Cuda(0))), load(Device::Cpu));
        assert!(
            g.info().device.starts_with("cuda:0 "),
            "{}",
            g.info().device
        );
        assert!(c.info().device.starts_with("cpu ("), "{}", c.info().device);
        let vocab = c.info().n_vocab;
        let ids: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % vocab as u32).collect();
        let mut cc = c.new_cache(32).unwrap();
        let want = [
            c.forward(&mut cc, &ids[..12], Logits::All).unwrap(),
            c.forward(&mut cc, &ids[12..], Logits::Last).unwrap(),
        ];
        let gm = g.clone();
        let ids2 = ids.clone();
        let got = std::thread::spawn(move || {
            let mut gc = gm.new_cache(32).unwrap();
            let waits = gm.host_waits();
            let out = [
                gm.forward(&mut gc, &ids2[..12], Logits::All).unwrap(),
                gm.forward(&mut gc, &ids2[12..], Logits::Last).unwrap(),
            ];
            assert_eq!(gm.host_waits() - waits, 2, "one host wait per step");
            out
        })
        .join()
        .unwrap();
        let quantized = src_is_quantized(&path);
        let tol = if quantized { QUANT_ACT_TOL } else { REL_TOL };
        for (part, (a, b)) in got.iter().zip(&want).enumerate() {
            let rel = worst_rel(a, b, vocab);
            eprintln!("{}: part {part} vs CPU {rel:e}", path.display());
            assert!(rel <= tol, "{}: part {part} vs CPU {rel:e}", path.display());
        }
        let mut cpu_pool = c.new_kv_pool(16, 4, 4).unwrap();
        let table = [0u32];
        let seq = SeqStep {
            tokens: &ids[..1],
            start: 0,
            full_blocks: &table,
            sliding_blocks: &table,
            logits: Some(Logits::Last),
        };
        let e = g.step(&mut cpu_pool, &[seq]).unwrap_err().to_string();
        assert!(e.contains("another device"), "{e}");
    }
}

/// Worst relative difference of two logit vectors and whether any value differs at all.
fn diff(a: &[f32], b: &[f32], vocab: usize) -> (f32, bool) {
    (worst_rel(a, b, vocab), a != b)
}

/// Decode steps of `on` (CUDA graphs on: `on_backend`) and of `off` (graphs off), the same
/// model: one sequence's steps asking for logits, then for greedy picks, then three sequences
/// in one pool stepping together. Steps replayed as graphs must return what the same steps
/// queued one operation at a time return, and most steps must be replays.
///
/// A run of equal steps is queued twice before its graph exists. Steps stop being equal where
/// the block-table width (a power of two, `paged::layout`) grows: with blocks of 4 the
/// sequence steps at positions 12–15 (width 4) and 16–29 (width 8); the batch reaches
/// position 15 (width 4) in its first two steps and 16–21 (width 8) in the other six. So 2 + 4
/// logits steps, 6 greedy steps and 4 batched steps are replays (16 on the H200, phase by
/// phase as counted here). A prefill step repeated is not replayed.
fn graphs_match_eager<M: Lm<B = CudaBackend>>(
    name: &str,
    on: &M,
    off: &M,
    on_backend: &CudaBackend,
) {
    let replays0 = on_backend.graph_replays().unwrap();
    let phase = |what: &str| {
        let r = on_backend.graph_replays().unwrap() - replays0;
        eprintln!("{name}: {r} replayed after the {what} steps");
    };
    let (mut a, mut b) = (on.cache(64), off.cache(64));
    let prompt: Vec<u32> = (0..12).map(|i| (7 * i + 5) % 50).collect();
    let (la, lb) = (
        on.fwd(&mut a, &prompt, false),
        off.fwd(&mut b, &prompt, false),
    );
    let vocab = lb.len();
    assert_eq!(diff(&la, &lb, vocab), (0.0, false), "{name}: prefill");
    let mut next = argmax(&lb) as u32;
    for step in 0..10 {
        let (la, lb) = (
            on.fwd(&mut a, &[next], false),
            off.fwd(&mut b, &[next], false),
        );
        let (rel, differs) = diff(&la, &lb, vocab);
        assert!(!differs, "{name}: logits step {step} differ ({rel:e})");
        next = argmax(&lb) as u32;
        phase(&format!("logits {step}"));
    }
    for step in 0..8 {
        let picks = |m: &M, c: &mut Seq<CudaBackend>| {
            let seq = SeqStep {
                tokens: &[next],
                start: c.len,
                full_blocks: &c.table,
                sliding_blocks: &c.table,
                logits: Some(Logits::Greedy),
            };
            c.len += 1;
            m.run_step(&mut c.pool, &[seq]).ids
        };
        let (pa, pb) = (picks(on, &mut a), picks(off, &mut b));
        assert_eq!(pa, pb, "{name}: greedy step {step}");
        next = pb[0];
        phase(&format!("greedy {step}"));
    }
    // Three sequences of one pool (blocks interleaved), filled with 12, 13 and 14 tokens,
    // then decoding together.
    let tables: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..8).map(|i| 3 * i + s).collect())
        .collect();
    let (mut pa, mut pb) = (on.pool(24), off.pool(24));
    for (s, table) in tables.iter().enumerate() {
        let fill: Vec<u32> = (0..12 + s as u32).collect();
        for (m, p) in [(on, &mut pa), (off, &mut pb)] {
            let seq = SeqStep {
                tokens: &fill,
                start: 0,
                full_blocks: table,
                sliding_blocks: table,
                logits: None,
            };
            m.run_step(p, &[seq]);
        }
    }
    let mut toks = [3u32, 4, 6];
    for step in 0..8 {
        let seqs: Vec<SeqStep> = (0..3)
            .map(|s| SeqStep {
                tokens: &toks[s..s + 1],
                start: 12 + s + step,
                full_blocks: &tables[s],
                sliding_blocks: &tables[s],
                logits: Some(Logits::Last),
            })
            .collect();
        let (la, lb) = (
            on.run_step(&mut pa, &seqs).logits,
            off.run_step(&mut pb, &seqs).logits,
        );
        let (rel, differs) = diff(&la, &lb, vocab);
        assert!(!differs, "{name}: batched step {step} differs ({rel:e})");
        for (s, t) in toks.iter_mut().enumerate() {
            *t = argmax(&lb[s * vocab..(s + 1) * vocab]) as u32;
        }
        phase(&format!("batched {step}"));
    }
    assert_eq!(on_backend.graphs_off_reason().unwrap(), None, "{name}");
    let replays = on_backend.graph_replays().unwrap() - replays0;
    eprintln!("{name}: {replays} of 26 decode steps replayed as graphs");
    assert!(
        replays >= 16,
        "{name}: only {replays} steps replayed as graphs"
    );
    // Prefill steps are not captured (graph.rs): six sequences of 50 tokens in one step (300
    // token rows), the same step three times in one pool, replay nothing.
    let fill: Vec<u32> = (0..50).map(|i| (3 * i + 1) % 50).collect();
    let tables: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..13).map(|i| 13 * s + i).collect())
        .collect();
    let mut pool = on.pool(6 * 13);
    let before = on_backend.graph_replays().unwrap();
    for _ in 0..3 {
        let seqs: Vec<SeqStep> = tables
            .iter()
            .map(|t| SeqStep {
                tokens: &fill,
                start: 0,
                full_blocks: t,
                sliding_blocks: t,
                logits: Some(Logits::Last),
            })
            .collect();
        on.run_step(&mut pool, &seqs);
    }
    assert_eq!(
        on_backend.graph_replays().unwrap(),
        before,
        "{name}: a prefill step of 300 rows was replayed"
    );
}

#[test]
fn graph_replays_match_eager_steps() {
    let Some(_) = gpu() else { return };
    let root = fixtures();
    let eager = || {
        let b = gpu().unwrap();
        b.set_graphs(false).unwrap();
        assert!(!b.graphs_enabled().unwrap());
        b
    };
    let path = root.join("gemma4/e2b_like/model.gguf");
    let (on, off) = (load_g4(&path, gpu().unwrap()), load_g4(&path, eager()));
    graphs_match_eager("gemma4 e2b_like", &on, &off, on.backend());
    assert_eq!(off.backend().graph_replays().unwrap(), 0);
    let dir = root.join("gemma3_tiny");
    let (on, off) = (
        load_g3(&dir, true, gpu().unwrap()),
        load_g3(&dir, true, eager()),
    );
    graphs_match_eager("gemma3 tiny", &on, &off, on.backend());
}
