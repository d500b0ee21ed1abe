//! A chain of one-token products of bf16 or Q4_K weights in one persistent launch
//! (kernels/chain.cu): an experiment towards a decode step in one kernel, timed by
//! `cuda_bench --chain` against the same chain launched a product at a time and against the
//! backend's own operations (docs/perf.md, sessions 44 and 58: it still loses to them). Each
//! block of the launch (one a multiprocessor) streams its share of every product's weights
//! into shared memory ahead of their use, across the products' boundaries, and waits for a
//! product's inputs on a count in global memory instead of a kernel boundary.

use std::ops::Range;

use markbase_core::backend::Backend;
use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::{int, CudaBackend};
use crate::buffer::{CudaBuffer, CudaMatrix};
use crate::kernels::{Arg, Grid};
use crate::sources::{define_number, defines_from_env, Module};

/// Weight rows of a Q4_K unit (a warp each) and of a tile.
pub const CHAIN_ROWS: usize = 8;

/// How chain.cu lays out a weight format's products: values a unit (bf16: an item, a row's
/// chunk), a unit's bytes of a row, the kernel, its threads and warps with a ring, the define
/// and number of the ring's stages, whether (bf16) its boundaries are pipelined.
#[derive(Clone, Copy, Debug)]
pub struct ChainFormat {
    /// Values of a unit's rows.
    pub k: usize,
    /// What a product's k must be a multiple of (bf16: a 16-byte piece; Q4_K: a super-block).
    pub k_multiple: usize,
    /// Bytes of a unit's row.
    pub chunk_bytes: usize,
    /// The kernel.
    pub kernel: &'static str,
    /// Threads of a block.
    pub threads: u32,
    /// Warps whose units a stage holds (bf16: each warp's own ring; Q4_K: a warp a row).
    pub ring_warps: usize,
    /// `MARKBASE_CUDA_DEFINES`' name for the ring's stages.
    pub stages_define: &'static str,
    /// The ring's stages.
    pub stages: usize,
    /// Whether its dot reads x as 16-bit tiles besides the floats (Q4_K).
    pub x_tiles: bool,
    /// Whether a block keeps its items' sums in shared memory (bf16) rather than run sums of
    /// tiles in global scratch (Q4_K).
    pub item_sums: bool,
    /// Whether each block stamps the phases of its share of every product (bf16 with
    /// `CHAIN_STAMPS=1`; read back by [`Chain::stamps`]).
    pub stamps: bool,
    /// Whether (bf16, `CHAIN_PIPE=1`) products are counted an output chunk at a time and each
    /// block has a warp staging x and one storing rows (chain.cu `chain_bf16_piped`).
    pub pipe: bool,
}

/// Output chunks a product of a pipelined chain has at most (chain.cu `CHAIN_OUT_CHUNKS`).
pub const CHAIN_OUT_CHUNKS: usize = 32;

/// Slots of a pipelined block's warps' arrivals (chain.cu `CHAIN_FIN_SLOTS`).
const CHAIN_FIN_SLOTS: usize = 128;

/// Items' values of a pipelined block's staging scratch (chain.cu `CHAIN_TMP_CHUNKS`).
const CHAIN_TMP_CHUNKS: usize = 4;

/// The phases a block's share of a product is stamped at: its start, its input ready, x
/// staged, its items multiplied, its rows stored and counted (chain.cu `CHAIN_PHASES`).
pub const CHAIN_PHASES: usize = 5;

/// The chain's layout of weights stored as `ty` (bf16: items of 1 024 values, 2 KB, 16 warps
/// with a ring each; Q4_K: units of 8 rows × 2 048 values, 9 KB, one ring a block), or None for
/// a format the chain does not take.
pub fn chain_format(ty: GgmlType) -> Option<ChainFormat> {
    match ty {
        GgmlType::BF16 => Some(ChainFormat {
            k: 1024,
            k_multiple: 8,
            chunk_bytes: 2048,
            kernel: "chain_bf16",
            threads: 512,
            ring_warps: 16,
            stages_define: "CHAIN_STAGES",
            stages: 5,
            x_tiles: false,
            item_sums: true,
            stamps: false,
            pipe: false,
        }),
        GgmlType::Q4_K => Some(ChainFormat {
            k: 2048,
            k_multiple: 256,
            chunk_bytes: 8 * 144,
            kernel: "chain_q4_k",
            threads: 256,
            ring_warps: 8,
            stages_define: "CHAIN_Q4K_STAGES",
            stages: 16,
            x_tiles: true,
            item_sums: false,
            stamps: false,
            pipe: false,
        }),
        _ => None,
    }
}

impl ChainFormat {
    /// Bytes of one stage over the block: a unit's row for each warp (bf16: an item in each
    /// warp's ring; Q4_K: a unit of 8 rows, a warp a row).
    pub fn stage_bytes(&self) -> usize {
        self.ring_warps * self.chunk_bytes
    }

    /// Floats of x a block stages for products of up to `k` values (whole units).
    pub fn x_floats(&self, k: usize) -> usize {
        k.div_ceil(self.k) * self.k
    }

    /// Floats of item sums a block of a `blocks`-block launch keeps for products of `(rows,
    /// k, gated)` (bf16: its share's rows × units a row; 0 for Q4_K).
    pub fn sum_floats(
        &self,
        products: impl Iterator<Item = (usize, usize, bool)>,
        blocks: usize,
    ) -> usize {
        if !self.item_sums {
            return 0;
        }
        products
            .map(|(rows, k, gated)| {
                // Pipelined: every G-th output of the product (a gated one's pairs of rows).
                let rows = match self.pipe {
                    true => (rows >> usize::from(gated)).div_ceil(blocks) << usize::from(gated),
                    false => rows.div_ceil(blocks),
                };
                rows * k.div_ceil(self.k)
            })
            .max()
            .unwrap_or(0)
    }

    /// Counts of finished outputs a product keeps in the launch's `done` (pipelined: one an
    /// output chunk).
    pub fn counts_per_link(&self) -> usize {
        if self.pipe {
            CHAIN_OUT_CHUNKS
        } else {
            1
        }
    }

    /// Dynamic shared memory of a block for products of up to `k` values and `sums` item sums:
    /// the ring(s), (bf16) an mbarrier a stage of each warp's ring and the product in use and
    /// the next, x, 32 floats of reductions and flags, the sums and (Q4_K) x's 16-bit tiles
    /// (2.5 bytes a value).
    pub fn shared_bytes(&self, k: usize, sums: usize) -> usize {
        let x = self.x_floats(k);
        if self.pipe {
            // The rings and their mbarriers (to 16 bytes), the arrivals' slots, the flags and
            // the Σ x² (4 words each), the staging's pair halves and γ, two x buffers and the
            // item sums of two products.
            let rings = self.stages * self.stage_bytes() + 8 * self.stages * self.ring_warps;
            return rings.next_multiple_of(16)
                + 4 * (CHAIN_FIN_SLOTS + 8 + CHAIN_TMP_CHUNKS * self.k + 2 * x + 2 * sums);
        }
        let tiles = if self.x_tiles { x * 5 / 2 } else { 0 };
        let slots = if self.item_sums {
            8 * self.stages * (self.threads as usize / 32) + 2 * 4 * CHAIN_OP_WORDS
        } else {
            0
        };
        self.stages * self.stage_bytes() + slots + 4 * (x + 32 + sums) + tiles
    }

    /// The layout as the `#define` lines `lines` (e.g. `defines_from_env`) set it, as chain.cu
    /// reads them: the ring's stages (2–32) and, for bf16, the warps of a block (`CHAIN_WARPS`,
    /// 1–32), an item's values (`CHAIN_K`, a multiple of 256 up to 4 096), the phases'
    /// stamps (`CHAIN_STAMPS`, 0 or 1) and pipelined boundaries (`CHAIN_PIPE`, 0 or 1: a
    /// stager and a finalizer warp more, rings of 3 stages by default, no stamps); errors name
    /// a value out of range.
    pub fn with_defines(mut self, lines: &str) -> Result<ChainFormat> {
        if self.item_sums {
            self.pipe = define_number(lines, "CHAIN_PIPE", (0, 1), 0)? == 1;
            if self.pipe {
                self.stages = 3;
            }
        }
        self.stages = define_number(lines, self.stages_define, (2, 32), self.stages)?;
        if self.item_sums {
            let warps = define_number(lines, "CHAIN_WARPS", (1, 32), self.ring_warps)?;
            let k = define_number(lines, "CHAIN_K", (256, 4096), self.k)?;
            if k % 256 != 0 {
                return Err(Error::Invalid(format!(
                    "CHAIN_K={k}: an item's values are a multiple of 256"
                )));
            }
            self.k = k;
            self.chunk_bytes = 2 * k;
            self.ring_warps = warps;
            self.threads = 32 * (warps + 2 * usize::from(self.pipe)) as u32;
            self.stamps = define_number(lines, "CHAIN_STAMPS", (0, 1), 0)? == 1;
            if self.stamps && self.pipe {
                return Err(Error::Invalid(
                    "CHAIN_STAMPS=1 with CHAIN_PIPE=1: a pipelined chain stamps no phases".into(),
                ));
            }
        }
        Ok(self)
    }
}

/// 32-bit words of chain.cu's `ChainOp`.
pub const CHAIN_OP_WORDS: usize = 22;

/// A product as chain.cu's `ChainOp` holds it: device addresses and sizes.
#[derive(Clone, Copy, Debug)]
pub struct ChainOp {
    /// The unit of the weights' format.
    pub format: ChainFormat,
    /// The weights, `[rows, k]` (Q4_K: super-blocks as stored).
    pub weights: u64,
    /// f32 input: `k` values, or with `pair` 2k (x = gelu_tanh(a) · b of the two halves).
    pub input: u64,
    /// f32 RMSNorm weights of x (0: x as it is).
    pub norm: u64,
    /// f32 outputs, `rows` of them.
    pub out: u64,
    /// Q4_K: f32 scratch of `tiles · chunks · 8` values (0 for bf16).
    pub parts: u64,
    /// Q4_K: u32 scratch of `tiles` zeros (0 for bf16).
    pub tickets: u64,
    /// bf16 with stamps: u64 scratch of `blocks · CHAIN_PHASES` stamps (else 0).
    pub stamps: u64,
    /// Output rows.
    pub rows: usize,
    /// Values of x (bf16: a multiple of 8; Q4_K: of 256).
    pub k: usize,
    /// Whether x is gelu_tanh(a) · b of the input's halves.
    pub pair: bool,
    /// The earlier product whose outputs the input is (waited for).
    pub dep: Option<usize>,
    /// The norm's epsilon.
    pub eps: f32,
    /// bf16: whether the rows are (gate, up) pairs whose outputs are
    /// gelu_tanh(gate · x) · (up · x), half as many as the rows.
    pub gated: bool,
}

impl ChainOp {
    /// Tiles of 8 rows (Q4_K).
    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(CHAIN_ROWS)
    }

    /// Output values: the rows, or a gated product's pairs of them.
    pub fn outputs(&self) -> usize {
        if self.gated {
            self.rows / 2
        } else {
            self.rows
        }
    }

    /// Units (bf16: items) a row.
    pub fn chunks(&self) -> usize {
        self.k.div_ceil(self.format.k)
    }

    /// The 22 words of chain.cu's `ChainOp` (its C layout: seven addresses, six ints, the
    /// epsilon, whether gated); errors name a size past an int.
    pub fn words(&self) -> Result<[u32; CHAIN_OP_WORDS]> {
        let mut w = [0u32; CHAIN_OP_WORDS];
        let addrs = [
            self.weights,
            self.input,
            self.norm,
            self.out,
            self.parts,
            self.tickets,
            self.stamps,
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
            w[14 + i] = *v as u32;
        }
        w[20] = self.eps.to_bits();
        w[21] = u32::from(self.gated);
        Ok(w)
    }
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

/// One product of a chain: `weights` (bf16 or Q4_K, `[rows, k]`) times x, its input's first k
/// values (with `pair`, gelu_tanh(a) · b of its first 2k), RMS-normed with `norm` (k weights
/// and an epsilon) where given; with `gated` (bf16), each pair of rows one output.
pub struct ChainLink<'a> {
    /// The weights.
    pub weights: &'a CudaMatrix,
    /// Where x comes from.
    pub input: LinkInput<'a>,
    /// Whether x is gelu_tanh(a) · b of the input's two halves.
    pub pair: bool,
    /// RMSNorm weights and epsilon of x.
    pub norm: Option<(&'a CudaBuffer, f32)>,
    /// Whether the weights' rows are (gate, up) pairs, each giving one output
    /// gelu_tanh(gate · x) · (up · x) (bf16 only).
    pub gated: bool,
}

/// A chain laid out on the device: the kernel's table, each link's outputs and scratch, the
/// counts of finished tiles and of exited blocks (0 between launches).
pub struct Chain {
    format: ChainFormat,
    x_floats: usize,
    table: CudaBuffer,
    outputs: Vec<CudaBuffer>,
    _scratch: Vec<CudaBuffer>,
    stamps: Vec<CudaBuffer>,
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

    /// The phases' stamps of the last run (SM cycles; see [`CHAIN_PHASES`]): for each link,
    /// each block's; None when the chain was laid out without stamps.
    pub fn stamps(&self, be: &CudaBackend) -> Result<Option<Vec<Vec<[u64; CHAIN_PHASES]>>>> {
        if !self.format.stamps {
            return Ok(None);
        }
        let mut links = Vec::with_capacity(self.stamps.len());
        for buffer in &self.stamps {
            let mut halves = vec![0f32; buffer.len()];
            be.read(buffer, &mut halves)?;
            let words: Vec<u64> = halves
                .chunks_exact(2)
                .map(|p| u64::from(p[0].to_bits()) | u64::from(p[1].to_bits()) << 32)
                .collect();
            links.push(
                words
                    .chunks_exact(CHAIN_PHASES)
                    .map(|b| std::array::from_fn(|i| b[i]))
                    .collect(),
            );
        }
        Ok(Some(links))
    }
}

impl CudaBackend {
    /// Lays out `links` on the device: outputs, scratch and the kernel's table. Errors name the
    /// link whose weights are not of the first link's format (bf16, or Q4_K), whose k is not
    /// a multiple of 8 (Q4_K: 256), that reads a later link or past its input, whose norm
    /// is not k long, or that is gated over Q4_K weights or an odd number of rows.
    pub fn chain(&self, links: &[ChainLink<'_>]) -> Result<Chain> {
        let Some(first) = links.first() else {
            return Err(Error::Invalid("chain: no links".into()));
        };
        let ty = first.weights.ty;
        let format = chain_format(ty)
            .ok_or_else(|| {
                Error::Unsupported(format!("chain of {ty} weights (bf16 and Q4_K are taken)"))
            })?
            .with_defines(&defines_from_env()?)?;
        let multiple = format.k_multiple;
        let mut ops = Vec::with_capacity(links.len());
        let mut outputs: Vec<CudaBuffer> = Vec::with_capacity(links.len());
        let mut scratch = Vec::new();
        let mut stamps = Vec::new();
        let blocks = self.device().multiprocessors() as usize;
        let mut weight_bytes = 0u64;
        let mut max_k = 0;
        for (j, l) in links.iter().enumerate() {
            let m = l.weights;
            let bad = |why: String| Error::Invalid(format!("chain link {j} ('{}'): {why}", m.name));
            if m.ty != ty || m.cols % multiple != 0 || m.rows == 0 {
                return Err(bad(format!(
                    "{} weights of {} × {}; this chain takes {ty} rows of a multiple of \
                     {multiple} values",
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
            if l.gated && (!format.item_sums || m.rows % 2 != 0) {
                return Err(bad(format!(
                    "gated rows of {ty} weights, {} of them; gated links take an even number \
                     of bf16 rows",
                    m.rows
                )));
            }
            let mut op = ChainOp {
                format,
                weights: m.ptr,
                input,
                norm,
                out: 0,
                rows: m.rows,
                k,
                pair: l.pair,
                dep,
                eps,
                parts: 0,
                tickets: 0,
                stamps: 0,
                gated: l.gated,
            };
            let outs = op.outputs();
            if format.pipe && (outs > CHAIN_OUT_CHUNKS * format.k || k > 255 * format.k) {
                return Err(bad(format!(
                    "{outs} outputs of {k} values; a pipelined chain takes up to {} outputs \
                     of up to {} values",
                    CHAIN_OUT_CHUNKS * format.k,
                    255 * format.k
                )));
            }
            let out = self.alloc(outs)?;
            op.out = out.ptr;
            if !format.item_sums {
                let parts = self.alloc(op.tiles() * op.chunks() * CHAIN_ROWS)?;
                let tickets = self.alloc(op.tiles())?;
                op.parts = parts.ptr;
                op.tickets = tickets.ptr;
                scratch.extend([parts, tickets]);
            }
            if format.stamps {
                let buffer = self.alloc(2 * CHAIN_PHASES * blocks)?;
                op.stamps = buffer.ptr;
                stamps.push(buffer);
            }
            outputs.push(out);
            weight_bytes += (m.rows * m.row_bytes) as u64;
            max_k = max_k.max(k);
            ops.push(op);
        }
        let mut words = Vec::with_capacity(CHAIN_OP_WORDS * ops.len());
        for op in &ops {
            words.extend(op.words()?.map(f32::from_bits));
        }
        let mut table = self.alloc(words.len())?;
        self.write(&words, &mut table)?;
        let sums = format.sum_floats(ops.iter().map(|o| (o.rows, o.k, o.gated)), blocks);
        let shared = format.shared_bytes(max_k, sums);
        let limit = self.device().max_block_shared() as usize;
        if shared > limit {
            return Err(Error::Invalid(format!(
                "chain: {shared} bytes of shared memory a block (products of {max_k} values), \
                 the device allows {limit}"
            )));
        }
        Ok(Chain {
            format,
            x_floats: format.x_floats(max_k),
            table,
            outputs,
            _scratch: scratch,
            stamps,
            done: self.alloc(links.len() * format.counts_per_link())?,
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
            .func_with_shared(Module::Chain, chain.format.kernel, chain.shared)?;
        let blocks = self.device().multiprocessors() as u32;
        let mut grid = Grid::new((blocks, 1), chain.format.threads);
        grid.shared = chain.shared;
        self.launch_fn(
            &f,
            grid,
            &[
                Arg::U64(chain.table.ptr),
                Arg::I32(int("chain link", links.start)?),
                Arg::I32(int("chain links", links.len())?),
                Arg::U64(chain.done.ptr),
                Arg::U64(chain.exits.ptr),
                Arg::I32(int("chain x", chain.x_floats)?),
            ],
        )
    }
}
