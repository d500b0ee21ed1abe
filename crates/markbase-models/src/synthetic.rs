//! `--synthetic VARIANT[:FORMAT[:SEED]]`: random weights at a released Gemma 4 variant's exact
//! shapes, for benchmarks and GPU tests where real weights are not at hand.
//!
//! Variants: `e2b`, `e4b`, `12b`, `26b-a4b`, `31b` (hyper-parameters of gemma4.md §1.1).
//! Formats: `bf16` (default), `q8_0`, `q4_k`, `q5_k`, `q4_0` for the matrices; norms and
//! scalars are f32.
//! `q4_k_m` is llama.cpp's Q4_K_M mix, the file most users download: Q4_K, but Q6_K for the
//! tied embedding / LM head and, on the layers llama.cpp's `use_more_bits` picks (the first
//! and last eighth, and every third between), for `v_proj` and the down projections;
//! `q5_k_m` the same over Q5_K. A matrix whose rows do not split into whole blocks of the
//! format (the 26B-A4B experts' 704-wide down projection in Q4_K) falls back to Q8_0 (under the
//! `_m` mixes as llama.cpp does: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), then BF16; the
//! per-layer embedding table stays at ≥ 8 bits (Q8_0 under every format of fewer bits).
//! Nothing is generated until a tensor is asked for: the shapes and byte counts (`inspect`) come from the configuration alone, and each
//! tensor's bytes are a pure function of (seed, tensor name), so a run is reproducible. A
//! matrix is generated in fixed chunks of `CHUNK_WEIGHTS`, each from its own stream, on every
//! core (E4B's 7 G weights took 92 s on one core of two).

use std::collections::{BTreeMap, BTreeSet};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use markbase_core::backend::{HostBytes, HostMatrix};
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};
use serde_json::json;

use crate::gemma4::hf_tensor_shapes;
use crate::gemma4_config::Gemma4Config;

/// A released Gemma 4 variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// E2B: 35 layers, D 1536, PLE, 20 KV-shared layers, double-wide MLP.
    E2b,
    /// E4B: 42 layers, D 2560, PLE, 18 KV-shared layers.
    E4b,
    /// 12B unified: 48 layers, D 3840, k_eq_v with one global KV head.
    B12,
    /// 26B-A4B: 30 layers, D 2816, 128 experts (top 8) beside a dense MLP.
    B26A4,
    /// 31B: 60 layers, D 5376, k_eq_v with four global KV heads.
    B31,
}

impl Variant {
    /// The spelling used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Variant::E2b => "e2b",
            Variant::E4b => "e4b",
            Variant::B12 => "12b",
            Variant::B26A4 => "26b-a4b",
            Variant::B31 => "31b",
        }
    }

    /// Every variant.
    pub const ALL: [Variant; 5] = [
        Variant::E2b,
        Variant::E4b,
        Variant::B12,
        Variant::B26A4,
        Variant::B31,
    ];

    /// The text config of the released model, in HF `gemma4_text` form.
    fn hf_config(self) -> serde_json::Value {
        // (layers, D, ff, heads, kv sliding, kv full, k_eq_v, window, period, ple, shared,
        //  double-wide, context)
        let (l, d, ff, h, kv, kv_full, k_eq_v, window, period, ple, shared, wide, ctx) = match self
        {
            Variant::E2b => (
                35, 1536, 6144, 8, 1, 1, false, 512, 5, 256, 20, true, 131_072,
            ),
            Variant::E4b => (
                42, 2560, 10240, 8, 2, 2, false, 512, 6, 256, 18, false, 131_072,
            ),
            Variant::B12 => (
                48, 3840, 15360, 16, 8, 1, true, 1024, 6, 0, 0, false, 262_144,
            ),
            Variant::B26A4 => (
                30, 2816, 2112, 16, 8, 2, true, 1024, 6, 0, 0, false, 262_144,
            ),
            Variant::B31 => (
                60, 5376, 21504, 32, 16, 4, true, 1024, 6, 0, 0, false, 262_144,
            ),
        };
        let layer_types: Vec<&str> = (0..l)
            .map(|i| {
                if (i + 1) % period == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        let moe = self == Variant::B26A4;
        json!({
            "model_type": "gemma4_text",
            "vocab_size": 262_144,
            "hidden_size": d,
            "intermediate_size": ff,
            "num_hidden_layers": l,
            "num_attention_heads": h,
            "num_key_value_heads": kv,
            "num_global_key_value_heads": if k_eq_v { Some(kv_full) } else { None },
            "head_dim": 256,
            "global_head_dim": 512,
            "attention_k_eq_v": k_eq_v,
            "sliding_window": window,
            "layer_types": layer_types,
            "max_position_embeddings": ctx,
            "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0,
            "hidden_size_per_layer_input": ple,
            "vocab_size_per_layer_input": 262_144,
            "num_kv_shared_layers": shared,
            "use_double_wide_mlp": wide,
            "enable_moe_block": moe,
            "num_experts": if moe { Some(128) } else { None },
            "top_k_experts": if moe { Some(8) } else { None },
            "moe_intermediate_size": if moe { Some(704) } else { None },
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}
            }
        })
    }
}

/// A parsed `--synthetic` spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticSpec {
    /// Which released model's shapes.
    pub variant: Variant,
    /// Storage format of the matrices (BF16, Q8_0, Q4_K, Q5_K or Q4_0).
    pub format: GgmlType,
    /// llama.cpp's `_M` mix over `format` (Q4_K or Q5_K): Q6_K for the LM head, and for
    /// `v_proj` and the down projections on the layers `use_more_bits` picks.
    pub mix_m: bool,
    /// Seed of the random weights.
    pub seed: u64,
}

impl SyntheticSpec {
    /// Parses `VARIANT[:FORMAT[:SEED]]`, e.g. `e2b`, `31b:q4_k`, `e4b:q4_k_m`, `e4b:q5_k_m`,
    /// `26b-a4b:q8_0:7` (format defaults to bf16, seed to 0).
    pub fn parse(spec: &str) -> Result<Self> {
        let mut parts = spec.split(':');
        let v = parts.next().unwrap_or("").to_ascii_lowercase();
        let variant = Variant::ALL
            .into_iter()
            .find(|x| x.name() == v)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "synthetic variant '{v}' (expected one of e2b, e4b, 12b, 26b-a4b, 31b)"
                ))
            })?;
        let (format, mix_m) = match parts.next().map(str::to_ascii_lowercase).as_deref() {
            None | Some("bf16") => (GgmlType::BF16, false),
            Some("q8_0") => (GgmlType::Q8_0, false),
            Some("q4_k") => (GgmlType::Q4_K, false),
            Some("q4_k_m") => (GgmlType::Q4_K, true),
            Some("q5_k") => (GgmlType::Q5_K, false),
            Some("q5_k_m") => (GgmlType::Q5_K, true),
            Some("q4_0") => (GgmlType::Q4_0, false),
            Some(other) => {
                return Err(Error::Invalid(format!(
                    "synthetic format '{other}' (expected bf16, q8_0, q4_k, q4_k_m, q5_k, \
                     q5_k_m or q4_0)"
                )))
            }
        };
        let seed = match parts.next() {
            None => 0,
            Some(s) => s
                .parse()
                .map_err(|_| Error::Invalid(format!("synthetic seed '{s}' is not an integer")))?,
        };
        if let Some(extra) = parts.next() {
            return Err(Error::Invalid(format!(
                "synthetic spec '{spec}': unexpected ':{extra}' (VARIANT[:FORMAT[:SEED]])"
            )));
        }
        Ok(SyntheticSpec {
            variant,
            format,
            mix_m,
            seed,
        })
    }

    /// The spec in its canonical spelling.
    pub fn describe(&self) -> String {
        let f = match (self.format, self.mix_m) {
            (GgmlType::Q8_0, _) => "q8_0",
            (GgmlType::Q4_K, false) => "q4_k",
            (GgmlType::Q4_K, true) => "q4_k_m",
            (GgmlType::Q5_K, false) => "q5_k",
            (GgmlType::Q5_K, true) => "q5_k_m",
            (GgmlType::Q4_0, _) => "q4_0",
            _ => "bf16",
        };
        format!("{}:{f}:{}", self.variant.name(), self.seed)
    }
}

/// How a synthetic tensor is stored and filled.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fill {
    /// A matrix in a block/float format, values within about ±`amp`.
    Matrix { ty: GgmlType, amp: f32 },
    /// An f32 vector of values `center ± spread`.
    Vector { center: f32, spread: f32 },
}

/// One synthetic tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticTensor {
    /// Shape, PyTorch order.
    pub shape: Vec<usize>,
    /// Storage format.
    pub ty: GgmlType,
    /// Bytes it takes.
    pub n_bytes: u64,
    fill: Fill,
}

/// The weights of a synthetic model: every tensor's name, shape, format and size, with bytes
/// generated only on request.
pub struct SyntheticWeights {
    spec: SyntheticSpec,
    cfg: Gemma4Config,
    tensors: BTreeMap<String, SyntheticTensor>,
}

impl SyntheticWeights {
    /// The tensor list of `spec` (HF names without the `model.` prefix); generates nothing.
    pub fn new(spec: SyntheticSpec) -> Result<Self> {
        let cfg = Gemma4Config::from_hf_json(&spec.variant.hf_config())?;
        let ple_table = "embed_tokens_per_layer.weight";
        let shapes = hf_tensor_shapes(&cfg);
        let more_bits = more_bits_matrices(&cfg, &shapes, spec.mix_m);
        let mut tensors = BTreeMap::new();
        for (name, shape) in shapes {
            let fill = if shape.len() == 1 {
                if name.ends_with("layer_scalar") {
                    Fill::Vector {
                        center: 1.0,
                        spread: 0.0,
                    }
                } else if name.ends_with("router.scale") || name.ends_with("per_expert_scale") {
                    Fill::Vector {
                        center: 1.0,
                        spread: 0.2,
                    }
                } else {
                    Fill::Vector {
                        center: 1.0,
                        spread: 0.1,
                    }
                }
            } else {
                let cols = shape[shape.len() - 1];
                let want = if name == ple_table
                    && matches!(
                        spec.format,
                        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_0
                    ) {
                    GgmlType::Q8_0
                } else if more_bits.contains(&name) {
                    GgmlType::Q6_K
                } else {
                    spec.format
                };
                // Rows that do not split into whole blocks: llama.cpp's fallbacks under the
                // `_m` mixes (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0), Q8_0 otherwise; then BF16.
                let fallback = match want {
                    GgmlType::Q4_K if spec.mix_m => GgmlType::Q5_0,
                    GgmlType::Q5_K if spec.mix_m => GgmlType::Q5_1,
                    _ => GgmlType::Q8_0,
                };
                let ty = [want, fallback, GgmlType::BF16]
                    .into_iter()
                    .find(|t| cols % t.block_size() == 0)
                    .unwrap_or(GgmlType::F32);
                // Embedding rows ~0.03 (× sqrt(D) at the input); other matrices keep a unit
                // input at about unit output scale.
                let amp = if name.starts_with("embed_tokens") {
                    0.03
                } else {
                    (3.0 / cols as f32).sqrt()
                };
                Fill::Matrix { ty, amp }
            };
            let n: usize = shape.iter().product();
            let ty = match fill {
                Fill::Matrix { ty, .. } => ty,
                Fill::Vector { .. } => GgmlType::F32,
            };
            let n_bytes = ty.bytes_for(n)? as u64;
            tensors.insert(
                name,
                SyntheticTensor {
                    shape,
                    ty,
                    n_bytes,
                    fill,
                },
            );
        }
        Ok(SyntheticWeights { spec, cfg, tensors })
    }

    /// The spec.
    pub fn spec(&self) -> &SyntheticSpec {
        &self.spec
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &Gemma4Config {
        &self.cfg
    }

    /// Every tensor by name.
    pub fn tensors(&self) -> &BTreeMap<String, SyntheticTensor> {
        &self.tensors
    }

    /// Total bytes of all tensors.
    pub fn weight_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.n_bytes).sum()
    }

    /// Bytes of one tensor (0 if absent).
    pub fn n_bytes(&self, name: &str) -> u64 {
        self.tensors.get(name).map_or(0, |t| t.n_bytes)
    }

    /// Whether the tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn get(&self, name: &str) -> Result<&SyntheticTensor> {
        self.tensors.get(name).ok_or_else(|| {
            Error::MissingTensor(format!("{name} (synthetic {})", self.spec.describe()))
        })
    }

    /// Generates a matrix viewed as `[rows, cols]` (a stacked `[E, r, c]` tensor is accepted as
    /// `[E·r, c]`).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix> {
        let t = self.get(name)?;
        let n: usize = t.shape.iter().product();
        if t.shape.last() != Some(&cols) || n != rows * cols {
            return Err(Error::BadTensor {
                name: name.to_string(),
                problem: format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
            });
        }
        let Fill::Matrix { ty, amp } = t.fill else {
            return Err(Error::BadTensor {
                name: name.to_string(),
                problem: "is a vector, not a matrix".into(),
            });
        };
        let bytes = fill_bytes(Rng::new(self.spec.seed, name), ty, n, amp)?;
        let m = HostMatrix {
            name: name.to_string(),
            ty,
            rows,
            cols,
            bytes: HostBytes::Owned(bytes),
        };
        m.check()?;
        Ok(m)
    }

    /// Generates an f32 vector of `len` values.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        let Fill::Vector { center, spread } = t.fill else {
            return Err(Error::BadTensor {
                name: name.to_string(),
                problem: "is a matrix, not a vector".into(),
            });
        };
        if t.shape != [len] {
            return Err(Error::BadTensor {
                name: name.to_string(),
                problem: format!("shape {:?}, expected [{len}]", t.shape),
            });
        }
        let mut rng = Rng::new(self.spec.seed, name);
        Ok((0..len).map(|_| center + spread * rng.uniform()).collect())
    }
}

/// The matrices llama.cpp's `_M` mixes store in Q6_K (none without `mix_m`): the tied
/// embedding (the LM head), and `v_proj` and the down projections (dense and experts') on
/// the layers of `use_more_bits(i, n)` — `i < n/8 || i >= 7n/8 || (i − n/8) % 3 == 2` in
/// integers, where for `v_proj` `i` counts the layers that have one. `shapes`: the model's
/// tensors (`hf_tensor_shapes`).
fn more_bits_matrices(
    cfg: &Gemma4Config,
    shapes: &[(String, Vec<usize>)],
    mix_m: bool,
) -> Vec<String> {
    if !mix_m {
        return Vec::new();
    }
    let use_more_bits = |i: usize, n: usize| {
        i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
    };
    let names: BTreeSet<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    let mut out = vec!["embed_tokens.weight".to_string()];
    let n_layers = cfg.layers.len();
    let v_layers: Vec<usize> = (0..n_layers)
        .filter(|i| names.contains(format!("layers.{i}.self_attn.v_proj.weight").as_str()))
        .collect();
    for (k, &i) in v_layers.iter().enumerate() {
        if use_more_bits(k, v_layers.len()) {
            out.push(format!("layers.{i}.self_attn.v_proj.weight"));
        }
    }
    for i in (0..n_layers).filter(|&i| use_more_bits(i, n_layers)) {
        for down in [
            format!("layers.{i}.mlp.down_proj.weight"),
            format!("layers.{i}.experts.down_proj"),
        ] {
            if names.contains(down.as_str()) {
                out.push(down);
            }
        }
    }
    out
}

/// Weights generated from one random stream: a multiple of every format's block (256), so
/// chunks split into whole blocks.
const CHUNK_WEIGHTS: usize = 1 << 20;

/// Stored bytes of `n` weights of format `ty` with values within about ±`amp`: chunk `i` of
/// `CHUNK_WEIGHTS` weights comes from `rng.fork(i)`, the chunks spread over the cores.
fn fill_bytes(rng: Rng, ty: GgmlType, n: usize, amp: f32) -> Result<Arc<[u8]>> {
    if !matches!(
        ty,
        GgmlType::F32
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
    ) {
        return Err(Error::Unsupported(format!("synthetic weights in {ty}")));
    }
    // Allocated where it will stay (an `Arc` from a `Vec` would copy it); the workers zero and
    // fill their chunks, so page faults and writes spread over the cores.
    let mut out = Arc::<[u8]>::new_uninit_slice(ty.bytes_for(n)?);
    let slots = Arc::get_mut(&mut out).expect("a new Arc has no other owner");
    let chunks = Mutex::new(slots.chunks_mut(ty.bytes_for(CHUNK_WEIGHTS)?).enumerate());
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    std::thread::scope(|s| {
        for _ in 0..threads.min(n.div_ceil(CHUNK_WEIGHTS)) {
            s.spawn(|| {
                // (A poisoned lock still hands out chunks: every chunk must be initialized.)
                let next = || chunks.lock().unwrap_or_else(|e| e.into_inner()).next();
                while let Some((i, chunk)) = next() {
                    chunk.fill(MaybeUninit::new(0));
                    // SAFETY: every byte of `chunk` was initialized on the line above.
                    let bytes = unsafe { &mut *(chunk as *mut [MaybeUninit<u8>] as *mut [u8]) };
                    fill_chunk(&mut rng.fork(i as u64), ty, bytes, amp);
                }
            });
        }
    });
    // SAFETY: the chunks cover the slice and each was initialized by a worker (a worker's
    // panic ends the scope above with that panic, before this line).
    let out = unsafe { out.assume_init() };
    Ok(out)
}

/// Fills `out` (whole blocks of `ty`, one of the synthetic formats) from `rng`.
fn fill_chunk(rng: &mut Rng, ty: GgmlType, out: &mut [u8], amp: f32) {
    match ty {
        GgmlType::F32 => fill_pairs(rng, out, |v| (amp * v).to_le_bytes()),
        GgmlType::BF16 => fill_pairs(rng, out, |v| {
            (((amp * v).to_bits() >> 16) as u16).to_le_bytes()
        }),
        GgmlType::Q8_0 => {
            let d = f16_bits(amp / 127.0).to_le_bytes();
            for block in out.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                block[2..]
                    .iter_mut()
                    .for_each(|q| *q = ((rng.next() % 255) as i32 - 127) as i8 as u8);
            }
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 => {
            // w = d·(q − o), o = 8 for Q4_0's 4-bit q, 16 for Q5_0's 5-bit q (the fifth bits
            // in a word ahead of the nibbles): d = amp / o gives ±amp. Uniform q has the mean
            // −d/2 (levels −o .. o − 1), so every other block takes −d: a row's weights then
            // add up to no common offset, which would otherwise grow through the layers into
            // hidden states alike for every token (and send every token of a mixture of
            // experts to the same few experts).
            let o = if ty == GgmlType::Q4_0 { 8.0 } else { 16.0 };
            let d = f16_bits(amp / o);
            for (i, block) in out.chunks_exact_mut(ty.type_size()).enumerate() {
                block[..2].copy_from_slice(&alternating_sign(d, i).to_le_bytes());
                block[2..].iter_mut().for_each(|q| *q = rng.next() as u8);
            }
        }
        GgmlType::Q5_1 => {
            // w = d·q + m with 5-bit q (the fifth bits in a word ahead of the nibbles):
            // d = amp / 16 and m = −15.5·d give ±amp with the mean 0.
            let d = f16_bits(amp / 16.0);
            let m = (f16_bits(15.5 * half::f16::from_bits(d).to_f32()) | 0x8000).to_le_bytes();
            let d = d.to_le_bytes();
            for block in out.chunks_exact_mut(24) {
                block[..2].copy_from_slice(&d);
                block[2..4].copy_from_slice(&m);
                block[4..].iter_mut().for_each(|q| *q = rng.next() as u8);
            }
        }
        GgmlType::Q6_K => {
            // Q6_K: w = d·sc·(q − 32) with 8-bit sc and 6-bit q (low 4 bits in ql, high 2 in
            // qh): sc = ±16 and d = amp / 512 give ±amp. Scale j covers values 16j .. 16j + 15
            // of the super-block; as for Q4_0, every other one is −16 so that uniform q's
            // mean (−d·sc/2) cancels.
            let d = f16_bits(amp / 512.0).to_le_bytes();
            for block in out.chunks_exact_mut(210) {
                block[..192].iter_mut().for_each(|q| *q = rng.next() as u8);
                for (j, sc) in block[192..208].iter_mut().enumerate() {
                    *sc = if j.is_multiple_of(2) {
                        16
                    } else {
                        (-16i8) as u8
                    };
                }
                block[208..].copy_from_slice(&d);
            }
        }
        _ => {
            // Q4_K (Q5_K): w = d·sc·q − dmin·m with 6-bit sc, m and 4-bit (5-bit) q: sc = m =
            // 32 gives d·32·(q − dmin/d) ≈ ±amp for q in 0..15 with dmin = 7.5·d (0..31, 15.5·d).
            // Q5_K's 32 bytes of fifth bits lie between the header and the nibbles, random
            // as the nibbles.
            let (block_bytes, mid) = if ty == GgmlType::Q5_K {
                (176, 15.5)
            } else {
                (144, 7.5)
            };
            let d = amp / (32.0 * mid);
            let (dh, mh) = (f16_bits(d).to_le_bytes(), f16_bits(mid * d).to_le_bytes());
            for block in out.chunks_exact_mut(block_bytes) {
                block[..2].copy_from_slice(&dh);
                block[2..4].copy_from_slice(&mh);
                // Every sub-block scale and min = 32: bytes 0..4 / 4..8 hold those of
                // sub-blocks 0..4 in their low 6 bits and bit 5 of those of sub-blocks 4..8 in
                // bit 7; bytes 8..12 hold the low nibbles of sub-blocks 4..8 (zero).
                block[4..12].fill(0xA0);
                block[12..16].fill(0);
                block[16..].iter_mut().for_each(|q| *q = rng.next() as u8);
            }
        }
    }
}

/// Fills `out` with the `N`-byte encodings of uniform values in [-1, 1), two from each draw.
fn fill_pairs<const N: usize>(rng: &mut Rng, out: &mut [u8], encode: impl Fn(f32) -> [u8; N]) {
    let mut pairs = out.chunks_exact_mut(2 * N);
    for b in &mut pairs {
        let (u, v) = rng.uniform_pair();
        b[..N].copy_from_slice(&encode(u));
        b[N..].copy_from_slice(&encode(v));
    }
    let last = pairs.into_remainder();
    if last.len() == N {
        last.copy_from_slice(&encode(rng.uniform()));
    }
}

/// The f16 bits `d` of block `i`, negated for every odd `i`.
fn alternating_sign(d: u16, i: usize) -> u16 {
    if i.is_multiple_of(2) {
        d
    } else {
        d | 0x8000
    }
}

/// f16 bits of a positive normal-range value (truncating the mantissa).
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let exp = exp.clamp(1, 30) as u32;
    ((exp << 10) | ((b >> 13) & 0x3ff)) as u16
}

/// SplitMix64 seeded by (seed, tensor name).
struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        Rng(h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// An independent stream for chunk `i` of the same tensor.
    fn fork(&self, i: u64) -> Rng {
        let mut r = Rng(self.0 ^ i.wrapping_mul(0xd1b5_4a32_d192_ed03));
        r.next();
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        unit(self.next() >> 40)
    }

    /// Two values uniform in [-1, 1) from one draw (24 bits each).
    fn uniform_pair(&mut self) -> (f32, f32) {
        let r = self.next();
        (unit(r >> 40), unit((r >> 8) & 0xff_ffff))
    }
}

/// A 24-bit integer as a value in [-1, 1).
fn unit(bits: u64) -> f32 {
    bits as f32 / (1u64 << 23) as f32 - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use markbase_core::quant::dequantize_row;

    /// Every weight of a multi-chunk tensor of odd length is written, within ±amp, and the same
    /// on a second generation; chunks differ from one another.
    #[test]
    fn chunks_fill_every_weight_the_same_way_each_time() {
        let n = 2 * CHUNK_WEIGHTS + 3;
        for ty in [GgmlType::F32, GgmlType::BF16] {
            let a = fill_bytes(Rng::new(7, "t"), ty, n, 0.5).unwrap();
            let b = fill_bytes(Rng::new(7, "t"), ty, n, 0.5).unwrap();
            assert_eq!(a[..], b[..], "{ty}");
            let mut w = vec![0f32; n];
            dequantize_row(ty, &a, &mut w).unwrap();
            assert!(w.iter().all(|v| v.abs() <= 0.5), "{ty}");
            // Unwritten bytes would read as zeros (a draw gives exactly 0 once in 2²⁴).
            assert!(w.iter().filter(|v| **v == 0.0).count() < 4, "{ty}");
            assert_ne!(w[..64], w[CHUNK_WEIGHTS..CHUNK_WEIGHTS + 64], "{ty}");
        }
        let q = fill_bytes(Rng::new(7, "t"), GgmlType::Q4_K, 2 * CHUNK_WEIGHTS, 0.5).unwrap();
        let mut w = vec![0f32; 2 * CHUNK_WEIGHTS];
        dequantize_row(GgmlType::Q4_K, &q, &mut w).unwrap();
        assert!(w.iter().all(|v| v.abs() <= 0.51));
        // Q6_K: within ±amp, and the 6-bit values spread over their range (a unit variance
        // of the uniform 64 levels has mean square ≈ amp²/3).
        let q = fill_bytes(Rng::new(7, "t"), GgmlType::Q6_K, 2 * CHUNK_WEIGHTS, 0.5).unwrap();
        dequantize_row(GgmlType::Q6_K, &q, &mut w).unwrap();
        assert!(w.iter().all(|v| v.abs() <= 0.51));
        let mean_sq = w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        assert!((mean_sq / (0.25 / 3.0) - 1.0).abs() < 0.1, "{mean_sq}");
        let q = fill_bytes(Rng::new(7, "t"), GgmlType::Q4_0, 2 * CHUNK_WEIGHTS, 0.5).unwrap();
        dequantize_row(GgmlType::Q4_0, &q, &mut w).unwrap();
        assert!(w.iter().all(|v| v.abs() <= 0.51));
        let q = fill_bytes(Rng::new(7, "t"), GgmlType::Q5_0, 2 * CHUNK_WEIGHTS, 0.5).unwrap();
        dequantize_row(GgmlType::Q5_0, &q, &mut w).unwrap();
        assert!(w.iter().all(|v| v.abs() <= 0.51));
        let mean_sq = w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        assert!((mean_sq / (0.25 / 3.0) - 1.0).abs() < 0.1, "{mean_sq}");
        for ty in [GgmlType::Q5_K, GgmlType::Q5_1] {
            let q = fill_bytes(Rng::new(7, "t"), ty, 2 * CHUNK_WEIGHTS, 0.5).unwrap();
            dequantize_row(ty, &q, &mut w).unwrap();
            assert!(w.iter().all(|v| v.abs() <= 0.51), "{ty}");
            let mean_sq = w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
            assert!(
                (mean_sq / (0.25 / 3.0) - 1.0).abs() < 0.1,
                "{ty}: {mean_sq}"
            );
        }
        assert!(fill_bytes(Rng::new(7, "t"), GgmlType::Q3_K, 256, 0.5).is_err());
    }

    /// Every format's weights have the mean 0: a common offset of a row's weights would grow
    /// through the layers into hidden states alike for every token (uniform Q4_0 levels have
    /// the mean −d/2, and such a 26B-A4B sent 32 tokens to 8–13 of its 128 experts in most
    /// layers). Over 2²¹ weights within ±0.5 the mean of fair draws is within ±0.002 (10 of
    /// its standard deviations); a block's −d/2 would be 0.031.
    #[test]
    fn every_format_has_weights_of_mean_zero() {
        let n = 2 * CHUNK_WEIGHTS;
        let mut w = vec![0f32; n];
        for ty in [
            GgmlType::F32,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            let q = fill_bytes(Rng::new(7, "t"), ty, n, 0.5).unwrap();
            dequantize_row(ty, &q, &mut w).unwrap();
            let mean = w.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            assert!(mean.abs() < 0.002, "{ty}: mean {mean}");
        }
    }
}
