//! Paged KV storage shared by many sequences, and the flat layout of one step over several of
//! them.
//!
//! Every layer that owns K/V has one K and one V buffer of `blocks · block_size` slots. Layers
//! come in two kinds with separate block id spaces: full-attention layers (a sequence keeps a
//! block for every `block_size` positions) and sliding-window layers (a sequence only needs the
//! blocks its window still sees, so it can give the older ones back). A step lists, for each
//! sequence, the tokens to run, the position of the first, and its two block tables; the model
//! lays the tokens out flat (cut into chunks of at most its workspace rows), writes their keys
//! and values into the slots their tables name, and attends each token over its own sequence.

use markbase_core::backend::{Backend, KvLayout};
use markbase_core::config::LayerKind;
use markbase_core::sampling::Draw;
use markbase_core::{Error, Result};

use crate::model::Logits;

/// A table entry for a block a sequence does not hold (a sliding block out of the window).
pub const NO_BLOCK: u32 = u32::MAX;

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// Tokens to run, at positions `start ..`.
    pub tokens: &'a [u32],
    /// Position of the first token: the sequence's tokens already in the cache.
    pub start: usize,
    /// Block holding positions `i · block_size ..` in full-attention layers, for each `i`.
    pub full_blocks: &'a [u32],
    /// The same for sliding-window layers; only the blocks the window sees are read (others
    /// may be [`NO_BLOCK`]).
    pub sliding_blocks: &'a [u32],
    /// Logits to return: none, the last token's, or every token's.
    pub logits: Option<Logits>,
}

/// Index of a layer kind's block id space.
pub(crate) fn kind_index(kind: LayerKind) -> usize {
    match kind {
        LayerKind::Full => 0,
        LayerKind::Sliding => 1,
    }
}

/// Paged key/value storage on backend `B`: the K and V buffers of every layer that owns a
/// cache, `blocks(kind) · block_size` slots each (made by `Gemma3::new_kv_pool` /
/// `Gemma4::new_kv_pool`; [`crate::KvPool`] holds one of the loaded model's backend).
pub struct PagedKv<B: Backend> {
    /// Per cache: K, V, kind.
    pub(crate) layers: Vec<(B::Buffer, B::Buffer, LayerKind)>,
    /// Per cache: kind and row width (to recognise the model it was made for).
    pub(crate) geometry: Vec<(LayerKind, usize)>,
    /// Slots per block.
    pub(crate) block_size: usize,
    /// Blocks of each kind (indexed by [`kind_index`]).
    pub(crate) n_blocks: [usize; 2],
}

impl<B: Backend> PagedKv<B> {
    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks for layers of `kind`.
    pub fn blocks(&self, kind: LayerKind) -> usize {
        self.n_blocks[kind_index(kind)]
    }

    /// Whether some cache is of kind index `k`.
    pub(crate) fn has_kind(&self, k: usize) -> bool {
        self.geometry.iter().any(|g| kind_index(g.0) == k)
    }

    /// Buffers for caches of `(kind, row width)`, `n_blocks[kind]` blocks of `block_size`.
    pub(crate) fn new(
        backend: &B,
        caches: &[(LayerKind, usize)],
        block_size: usize,
        n_blocks: [usize; 2],
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::Invalid("KV block size 0".into()));
        }
        if n_blocks
            .iter()
            .any(|&n| n.saturating_mul(block_size) > u32::MAX as usize)
        {
            return Err(Error::Invalid(format!(
                "{n_blocks:?} KV blocks of {block_size} slots are more than 2^32 slots"
            )));
        }
        let layers = caches
            .iter()
            .map(|&(kind, row)| {
                let len = n_blocks[kind_index(kind)] * block_size * row;
                Ok((backend.alloc(len)?, backend.alloc(len)?, kind))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedKv {
            layers,
            geometry: caches.to_vec(),
            block_size,
            n_blocks,
        })
    }
}

/// A run of one sequence's tokens inside a chunk.
#[derive(Clone, Copy, Debug)]
struct Piece {
    seq: usize,
    from: usize,
    to: usize,
}

/// The flat layout of one chunk of a step: the host-side arrays every layer uses.
pub(crate) struct ChunkLayout {
    /// Token ids, sequence by sequence.
    pub tokens: Vec<u32>,
    /// Position of each token.
    pub positions: Vec<u32>,
    /// First row of each sequence, then the row count.
    pub seq_start: Vec<u32>,
    /// Block tables per kind, row-major `[sequences, width[kind]]`; the width is the most
    /// blocks a sequence of the chunk reaches, rounded up to a power of two.
    tables: [Vec<u32>; 2],
    width: [usize; 2],
    /// Cache slot of each token per kind.
    slots: [Vec<u32>; 2],
    /// Rows whose logits are returned, in output order.
    pub logit_rows: Vec<usize>,
    /// Rows whose pick is returned, in output order, each with its draw (greedy:
    /// [`Draw::GREEDY`]).
    pub pick_rows: Vec<(usize, Draw)>,
    block_size: usize,
}

impl ChunkLayout {
    /// Rows in the chunk.
    pub fn n(&self) -> usize {
        self.tokens.len()
    }

    /// The attention layout of a layer of `kind`.
    pub fn kv(&self, kind: LayerKind) -> KvLayout<'_> {
        let k = kind_index(kind);
        KvLayout {
            block_size: self.block_size,
            positions: &self.positions,
            seq_start: &self.seq_start,
            block_tables: &self.tables[k],
            table_width: self.width[k],
        }
    }

    /// The slots a layer of `kind` writes its new keys and values to.
    pub fn slots(&self, kind: LayerKind) -> &[u32] {
        &self.slots[kind_index(kind)]
    }
}

/// What an architecture provides to run a step.
pub(crate) trait StepModel {
    /// The backend it runs on.
    type Backend: Backend;
    /// The backend.
    fn backend(&self) -> &Self::Backend;
    /// Kind and K/V row width (f32 values per position) of each layer that owns a cache.
    fn caches(&self) -> Vec<(LayerKind, usize)>;
    /// Checks that the model can run every token id (an [`Error::Invalid`] naming the first
    /// that it cannot).
    fn check_tokens(&self, tokens: &[u32]) -> Result<()>;
    /// Most token rows one chunk may have.
    fn max_rows(&self) -> usize;
    /// Logits per token.
    fn n_vocab(&self) -> usize;
    /// Runs a chunk through every layer, writes the logits of `layout.logit_rows` (row-major)
    /// to `logits` and appends the picks of `layout.pick_rows` to `ids`.
    fn run_chunk(
        &self,
        kv: &mut PagedKv<Self::Backend>,
        layout: &ChunkLayout,
        logits: &mut [f32],
        ids: &mut Vec<u32>,
    ) -> Result<()>;
}

/// What a step returns, each part in sequence order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    /// The logits rows (`n_vocab` values each) of the sequences that asked for
    /// [`Logits::Last`] (one row) or [`Logits::All`] (a row per token).
    pub logits: Vec<f32>,
    /// The pick of each sequence that asked for [`Logits::Greedy`] or [`Logits::Sample`].
    pub ids: Vec<u32>,
}

/// Runs a step over `seqs` and returns the logits and picks each asked for, sequence by
/// sequence.
pub(crate) fn step<M: StepModel>(
    model: &M,
    kv: &mut PagedKv<M::Backend>,
    seqs: &[SeqStep],
) -> Result<StepOutput> {
    let bs = kv.block_size;
    let mut n_out = 0;
    for (i, s) in seqs.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(Error::Invalid(format!("step: sequence {i} has no tokens")));
        }
        let blocks = (s.start + s.tokens.len()).div_ceil(bs);
        for (kind, table) in [(0, s.full_blocks), (1, s.sliding_blocks)] {
            if kv.has_kind(kind) && table.len() < blocks {
                return Err(Error::Invalid(format!(
                    "step: sequence {i} reaches position {} but its {} table has {} blocks of {bs}",
                    s.start + s.tokens.len() - 1,
                    ["full-attention", "sliding-window"][kind],
                    table.len()
                )));
            }
        }
        n_out += match s.logits {
            None | Some(Logits::Greedy | Logits::Sample(_)) => 0,
            Some(Logits::Last) => 1,
            Some(Logits::All) => s.tokens.len(),
        };
    }
    let nv = model.n_vocab();
    let mut out = StepOutput {
        logits: vec![0f32; n_out * nv],
        ids: Vec::new(),
    };
    let mut done = 0;
    for chunk in chunks(seqs, model.max_rows()) {
        let layout = layout(seqs, &chunk, kv)?;
        let rows = layout.logit_rows.len();
        let logits = &mut out.logits[done * nv..(done + rows) * nv];
        model.run_chunk(kv, &layout, logits, &mut out.ids)?;
        done += rows;
    }
    Ok(out)
}

/// Cuts the step's tokens into chunks of at most `max_rows` rows, in order.
fn chunks(seqs: &[SeqStep], max_rows: usize) -> Vec<Vec<Piece>> {
    let mut out = vec![Vec::new()];
    let mut room = max_rows;
    for (seq, s) in seqs.iter().enumerate() {
        let mut from = 0;
        while from < s.tokens.len() {
            if room == 0 {
                out.push(Vec::new());
                room = max_rows;
            }
            let to = s.tokens.len().min(from + room);
            out.last_mut()
                .expect("a chunk")
                .push(Piece { seq, from, to });
            room -= to - from;
            from = to;
        }
    }
    out
}

/// The layout of one chunk; checks every slot it writes.
fn layout<B: Backend>(seqs: &[SeqStep], pieces: &[Piece], kv: &PagedKv<B>) -> Result<ChunkLayout> {
    let bs = kv.block_size;
    let mut l = ChunkLayout {
        tokens: Vec::new(),
        positions: Vec::new(),
        seq_start: vec![0],
        tables: [Vec::new(), Vec::new()],
        width: [0, 0],
        slots: [Vec::new(), Vec::new()],
        logit_rows: Vec::new(),
        pick_rows: Vec::new(),
        block_size: bs,
    };
    let used = [kv.has_kind(0), kv.has_kind(1)];
    for p in pieces {
        let s = &seqs[p.seq];
        let blocks = (s.start + p.to).div_ceil(bs);
        for k in (0..2).filter(|&k| used[k]) {
            // A power of two (padded with NO_BLOCK): the width is an argument of the attention
            // kernels, and a decode step whose arguments repeat the step before is replayed as
            // a CUDA graph; growing it with every block would break that every block_size steps.
            l.width[k] = l.width[k].max(blocks.next_power_of_two());
        }
    }
    for p in pieces {
        let s = &seqs[p.seq];
        let row0 = l.tokens.len();
        l.tokens.extend_from_slice(&s.tokens[p.from..p.to]);
        l.positions
            .extend((s.start + p.from..s.start + p.to).map(|q| q as u32));
        l.seq_start.push(l.tokens.len() as u32);
        for k in (0..2).filter(|&k| used[k]) {
            let table = [s.full_blocks, s.sliding_blocks][k];
            let w = l.width[k];
            let have = table.len().min(w);
            l.tables[k].extend_from_slice(&table[..have]);
            l.tables[k].extend(std::iter::repeat_n(NO_BLOCK, w - have));
            for q in s.start + p.from..s.start + p.to {
                let b = table[q / bs];
                if b as usize >= kv.n_blocks[k] {
                    return Err(Error::Invalid(format!(
                        "step: position {q} is in block {b}, outside the {} {} blocks",
                        kv.n_blocks[k],
                        ["full-attention", "sliding-window"][k]
                    )));
                }
                l.slots[k].push((b as usize * bs + q % bs) as u32);
            }
        }
        match s.logits {
            Some(Logits::All) => l.logit_rows.extend(row0..l.tokens.len()),
            Some(Logits::Last) if p.to == s.tokens.len() => l.logit_rows.push(l.tokens.len() - 1),
            Some(Logits::Greedy) if p.to == s.tokens.len() => {
                l.pick_rows.push((l.tokens.len() - 1, Draw::GREEDY))
            }
            Some(Logits::Sample(d)) if p.to == s.tokens.len() => {
                l.pick_rows.push((l.tokens.len() - 1, d))
            }
            _ => {}
        }
    }
    Ok(l)
}
