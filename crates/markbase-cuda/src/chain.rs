//! A chain of one-token bf16 products in one persistent launch (kernels/chain.cu): an
//! experiment towards a decode step in one kernel, timed by `cuda_bench --chain` against the
//! same chain launched a product at a time (docs/perf.md, session 44). Each block of the launch
//! (one a multiprocessor) streams its share of every product's weights through a ring of
//! shared-memory stages across the products' boundaries, and waits for a product's inputs on
//! a count of its finished tiles in global memory instead of a kernel boundary.

use std::ops::Range;

use markbase_core::backend::Backend;
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::{int, CudaBackend};
use crate::buffer::{CudaBuffer, CudaMatrix};
use crate::kernels::{Arg, Grid};
use crate::sources::{define_value, defines_from_env, Module};

/// Weight rows of a unit (a warp each) and of a tile.
pub const CHAIN_ROWS: usize = 8;
/// Values of a unit's rows: a unit is 16 KB of bf16 weights, a stage of the ring.
pub const CHAIN_K: usize = 1024;
/// Stages of a block's ring unless `CHAIN_STAGES` is defined (chain.cu's default).
pub const CHAIN_STAGES: usize = 11;
/// Threads of a block: a warp a row of the unit.
pub const CHAIN_THREADS: u32 = 256;
/// Bytes of a stage.
const STAGE_BYTES: usize = CHAIN_ROWS * CHAIN_K * 2;

/// A product as chain.cu's `ChainOp` holds it: device addresses and sizes.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChainOp {
    /// bf16 weights, `[rows, k]`.
    pub weights: u64,
    /// f32 input: `k` values, or with `pair` 2k (x = gelu_tanh(a) · b of the two halves).
    pub input: u64,
    /// f32 RMSNorm weights of x (0: x as it is).
    pub norm: u64,
    /// f32 outputs, `rows` of them.
    pub out: u64,
    /// f32 scratch of `tiles · chunks · 8` values.
    pub parts: u64,
    /// u32 scratch of `tiles` zeros.
    pub tickets: u64,
    /// Output rows.
    pub rows: usize,
    /// Values of x (a multiple of 8).
    pub k: usize,
    /// Whether x is gelu_tanh(a) · b of the input's halves.
    pub pair: bool,
    /// The earlier product whose outputs the input is (waited for).
    pub dep: Option<usize>,
    /// The norm's epsilon.
    pub eps: f32,
}

impl ChainOp {
    /// Tiles of 8 rows.
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(CHAIN_ROWS)
    }

    /// Units a row: 1 024 values each.
    pub fn chunks(&self) -> usize {
        self.k.div_ceil(CHAIN_K)
    }

    /// The 20 words of chain.cu's `ChainOp` (its C layout: six addresses, six ints, the
    /// epsilon, a pad); errors name a size past an int.
    pub fn words(&self) -> Result<[u32; 20]> {
        let mut w = [0u32; 20];
        let addrs = [
            self.weights,
            self.input,
            self.norm,
            self.out,
            self.parts,
            self.tickets,
        ];
        for (i, a) in addrs.iter().enumerate() {
            w[2 * i] = *a as u32;
            w[2 * i + 1] = (*a >> 32) as u32;
        }
        let dep = match self.dep {
            Some(d) => int("chain dependency", d)?,
            None => -1,
        };
        let ints = [
            int("chain rows", self.rows)?,
            int("chain k", self.k)?,
            i32::from(self.pair),
            dep,
            int("chain tiles", self.tiles())?,
            int("chain chunks", self.chunks())?,
        ];
        for (i, v) in ints.iter().enumerate() {
            w[12 + i] = *v as u32;
        }
        w[18] = self.eps.to_bits();
        Ok(w)
    }
}

/// Dynamic shared memory of a block with `stages` stages for products of up to `k` values: the
/// ring, x (whole units of it) and 32 floats of reductions and flags.
pub fn chain_shared_bytes(stages: usize, k: usize) -> usize {
    stages * STAGE_BYTES + 4 * (k.div_ceil(CHAIN_K) * CHAIN_K + 32)
}

/// Where a link of a chain reads its input.
#[derive(Clone, Copy)]
pub enum LinkInput<'a> {
    /// A buffer filled before the chain runs.
    Buffer(&'a CudaBuffer),
    /// An earlier link's outputs from value `offset` on.
    Link {
        /// The link.
        link: usize,
        /// The first value read.
        offset: usize,
    },
}

/// One product of a chain: `weights` (bf16, `[rows, k]`) times x, its input's first k values
/// (with `pair`, gelu_tanh(a) · b of its first 2k), RMS-normed with `norm` (k weights and an
/// epsilon) where given.
pub struct ChainLink<'a> {
    /// The weights.
    pub weights: &'a CudaMatrix,
    /// Where x comes from.
    pub input: LinkInput<'a>,
    /// Whether x is gelu_tanh(a) · b of the input's two halves.
    pub pair: bool,
    /// RMSNorm weights and epsilon of x.
    pub norm: Option<(&'a CudaBuffer, f32)>,
}

/// A chain laid out on the device: the kernel's table, each link's outputs and scratch, the
/// counts of finished tiles and of exited blocks (0 between launches).
pub struct Chain {
    table: CudaBuffer,
    outputs: Vec<CudaBuffer>,
    _scratch: Vec<CudaBuffer>,
    done: CudaBuffer,
    exits: CudaBuffer,
    shared: u32,
    weight_bytes: u64,
}

impl Chain {
    /// Link `link`'s outputs (its weights' rows), as the last run left them.
    pub fn output(&self, link: usize) -> &CudaBuffer {
        &self.outputs[link]
    }

    /// Link `link`'s outputs, to fill (e.g. poison) before a run.
    pub fn output_mut(&mut self, link: usize) -> &mut CudaBuffer {
        &mut self.outputs[link]
    }

    /// Links of the chain.
    pub fn len(&self) -> usize {
        self.outputs.len()
    }

    /// Whether the chain has no links.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
    }

    /// Weight bytes a pass reads.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }
}

/// The ring's stages: `CHAIN_STAGES` of `MARKBASE_CUDA_DEFINES`, else chain.cu's default.
fn stages() -> Result<usize> {
    let defines = defines_from_env()?;
    match define_value(&defines, "CHAIN_STAGES") {
        None => Ok(CHAIN_STAGES),
        Some(v) => match v.parse::<usize>() {
            Ok(s) if (2..=14).contains(&s) => Ok(s),
            _ => Err(Error::Invalid(format!(
                "CHAIN_STAGES={v}: stages of the chain's ring are 2 to 14"
            ))),
        },
    }
}

impl CudaBackend {
    /// Lays out `links` on the device: outputs, scratch and the kernel's table. Errors name the
    /// link that is not a bf16 product of a multiple of 8 values, reads a later link or past
    /// its input, or whose norm is not k long.
    pub fn chain(&self, links: &[ChainLink<'_>]) -> Result<Chain> {
        let mut ops = Vec::with_capacity(links.len());
        let mut outputs: Vec<CudaBuffer> = Vec::with_capacity(links.len());
        let mut scratch = Vec::new();
        let mut weight_bytes = 0u64;
        let mut max_k = 0;
        for (j, l) in links.iter().enumerate() {
            let m = l.weights;
            let bad = |why: String| Error::Invalid(format!("chain link {j} ('{}'): {why}", m.name));
            if m.ty != GgmlType::BF16 || m.cols % 8 != 0 || m.rows == 0 {
                return Err(bad(format!(
                    "{} weights of {} × {}; the chain takes bf16 rows of a multiple of 8 values",
                    m.ty, m.rows, m.cols
                )));
            }
            let k = m.cols;
            let want = if l.pair { 2 * k } else { k };
            let (input, have, dep) = match l.input {
                LinkInput::Buffer(b) => (b.ptr, b.len(), None),
                LinkInput::Link { link, offset } => {
                    let Some(src) = outputs.get(link) else {
                        return Err(bad(format!("reads link {link}, not an earlier one")));
                    };
                    let have = src.len().saturating_sub(offset);
                    (src.ptr + 4 * offset as u64, have, Some(link))
                }
            };
            if have < want {
                return Err(bad(format!(
                    "needs {want} input values, its input has {have}"
                )));
            }
            let (norm, eps) = match l.norm {
                Some((n, eps)) if n.len() == k => (n.ptr, eps),
                Some((n, _)) => {
                    return Err(bad(format!("norm of {} weights for {k} values", n.len())))
                }
                None => (0, 0.0),
            };
            let out = self.alloc(m.rows)?;
            let mut op = ChainOp {
                weights: m.ptr,
                input,
                norm,
                out: out.ptr,
                rows: m.rows,
                k,
                pair: l.pair,
                dep,
                eps,
                ..ChainOp::default()
            };
            let parts = self.alloc(op.tiles() * op.chunks() * CHAIN_ROWS)?;
            let tickets = self.alloc(op.tiles())?;
            op.parts = parts.ptr;
            op.tickets = tickets.ptr;
            scratch.extend([parts, tickets]);
            outputs.push(out);
            weight_bytes += (m.rows * m.row_bytes) as u64;
            max_k = max_k.max(k);
            ops.push(op);
        }
        let mut words = Vec::with_capacity(20 * ops.len());
        for op in &ops {
            words.extend(op.words()?.map(f32::from_bits));
        }
        let mut table = self.alloc(words.len())?;
        self.write(&words, &mut table)?;
        let shared = chain_shared_bytes(stages()?, max_k);
        let limit = self.device().max_block_shared() as usize;
        if shared > limit {
            return Err(Error::Invalid(format!(
                "chain: {shared} bytes of shared memory a block (products of {max_k} values), \
                 the device allows {limit}"
            )));
        }
        Ok(Chain {
            table,
            outputs,
            _scratch: scratch,
            done: self.alloc(links.len())?,
            exits: self.alloc(1)?,
            shared: shared as u32,
            weight_bytes,
        })
    }

    /// Queues one launch of `chain`'s links `links` (the links it reads outside the range must
    /// have run before). Its arguments are the same every time, so a step of launches that
    /// repeats replays as a graph.
    pub fn run_chain(&self, chain: &mut Chain, links: Range<usize>) -> Result<()> {
        if links.is_empty() || links.end > chain.len() {
            return Err(Error::Invalid(format!(
                "chain: links {links:?} of a chain of {}",
                chain.len()
            )));
        }
        let f = self
            .kernels
            .func_with_shared(Module::Chain, "chain_bf16", chain.shared)?;
        let blocks = self.device().multiprocessors() as u32;
        let mut grid = Grid::new((blocks, 1), CHAIN_THREADS);
        grid.shared = chain.shared;
        let x_floats = (chain.shared as usize - stages()? * STAGE_BYTES) / 4 - 32;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::U64(chain.table.ptr),
                Arg::I32(int("chain link", links.start)?),
                Arg::I32(int("chain links", links.len())?),
                Arg::U64(chain.done.ptr),
                Arg::U64(chain.exits.ptr),
                Arg::I32(int("chain x", x_floats)?),
            ],
        )
    }
}
