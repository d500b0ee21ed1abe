//! The LM head: the stored matrix (a separate head or the tied embedding) and, on backends that
//! screen ([`Backend::load_screen`]), a low-bit copy that ranks the vocabulary so only the
//! leading logits are computed from the stored rows ([`Backend::matmul_screened`]).
//!
//! Measured on the default Gemma 3 270M (Q8_0 tied head, 262 144 × 640) with transformers'
//! hidden states (docs/perf.md): the CPU's copy (4 bits, integer chunk scales) keeps
//! transformers' top 8 within its top 87 at every position tried, and perplexity +0.035 % with
//! the top 4 096 exact, against +8.4 % for a plain Q4_0 head.

use markbase_core::backend::{Backend, HostMatrix, NormOut};
use markbase_core::quant::GgmlType;
use markbase_core::sampling::Draw;
use markbase_core::Result;

use crate::paged::ChunkLayout;

/// Logits per row computed from the stored head when screening.
pub const SCREEN_TOP_K: usize = 4096;
/// Heads with fewer rows are always exact (screening pays on huge vocabularies only).
const SCREEN_MIN_ROWS: usize = 65_536;
/// Hidden-state rows put through the head together (each weight row is read once for all of
/// them). Each group's picks are a host wait of their own, so a decode step of more sequences
/// than this waits twice and cannot replay as a CUDA graph: with groups of 64, E4B bf16's
/// 65-sequence step took 6.61 ms and its 128-sequence step 7.30 ms, with 128 5.81 and 6.37 ms
/// (H100, docs/perf.md session 53); with 128, 256 sequences waited twice (E4B Q4_K_M with
/// f16 copies 25 553 t/s, 0 graph replays; session 54). 256 rows of a 262 144-token
/// vocabulary take 256 MiB of logits.
const LOGIT_ROWS: usize = 256;

/// Where the head's results for a set of rows go.
pub(crate) enum HeadOut<'a> {
    /// Logits rows, row-major, copied to the host.
    Logits(&'a mut [f32]),
    /// Each row's pick under its draw (`draws[r]`, [`Backend::sample`]; the largest logit's
    /// index where every draw is greedy), appended: only the ids leave the device.
    Picks {
        /// Where the picks go.
        ids: &'a mut Vec<u32>,
        /// A draw a row.
        draws: &'a [Draw],
    },
}

/// The final RMSNorm before the head and the logit softcap after it.
pub(crate) struct HeadNorm<B: Backend> {
    /// The final norm's weight.
    pub weight: B::Vector,
    /// Its epsilon.
    pub eps: f32,
    /// `cap · tanh(logit / cap)` when set.
    pub softcap: Option<f32>,
}

/// Device buffers of [`LmHead::run`] for [`LOGIT_ROWS`] rows of width `d` and `n_vocab`
/// logits.
pub(crate) struct HeadWork<B: Backend> {
    d: usize,
    n_vocab: usize,
    input: B::Buffer,
    normed: B::Buffer,
    logits: B::Buffer,
}

impl<B: Backend> HeadWork<B> {
    /// Allocates the buffers on `backend`.
    pub(crate) fn new(backend: &B, d: usize, n_vocab: usize) -> Result<Self> {
        Ok(HeadWork {
            d,
            n_vocab,
            input: backend.alloc(LOGIT_ROWS * d)?,
            normed: backend.alloc(LOGIT_ROWS * d)?,
            logits: backend.alloc(LOGIT_ROWS * n_vocab)?,
        })
    }
}

/// How the LM head is evaluated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LmHeadMode {
    /// Screened where the backend supports it and the head is a large ≥ 8-bit matrix; exact
    /// otherwise.
    #[default]
    Auto,
    /// Every logit from the stored weights.
    Exact,
}

/// The LM head of a loaded model.
pub struct LmHead<B: Backend> {
    /// A separate head matrix, or `None` when tied to the embedding.
    own: Option<B::Matrix>,
    /// The final norm before it and the softcap after it.
    norm: HeadNorm<B>,
    /// The backend's screening copy, when screening.
    coarse: Option<B::Matrix>,
}

impl<B: Backend> LmHead<B> {
    /// Prepares the head. `stored` is the head's matrix as stored (the embedding's when tied);
    /// `own` is the backend matrix of a separate head; `norm` the final norm and softcap.
    pub(crate) fn load(
        backend: &B,
        stored: &HostMatrix,
        own: Option<B::Matrix>,
        norm: HeadNorm<B>,
        mode: LmHeadMode,
    ) -> Result<Self> {
        let screen = mode == LmHeadMode::Auto
            && stored.rows >= SCREEN_MIN_ROWS
            && matches!(
                stored.ty,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
            );
        let coarse = if screen {
            backend.load_screen(stored)?
        } else {
            None
        };
        Ok(LmHead { own, norm, coarse })
    }

    /// `out = x · headᵀ` for `n` rows (`embed` is the tied embedding).
    pub fn matmul(
        &self,
        backend: &B,
        embed: &B::Matrix,
        x: &B::Buffer,
        n: usize,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let head = self.own.as_ref().unwrap_or(embed);
        match &self.coarse {
            Some(coarse) => backend.matmul_screened(x, n, coarse, head, SCREEN_TOP_K, out),
            None => backend.matmul(x, n, head, out),
        }
    }

    /// A step's head work: the logits of `layout.logit_rows` into `logits` (row-major), then
    /// the picks of `layout.pick_rows` appended to `ids`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_step(
        &self,
        backend: &B,
        embed: &B::Matrix,
        h: &B::Buffer,
        layout: &ChunkLayout,
        work: &mut HeadWork<B>,
        logits: &mut [f32],
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        let rows = &layout.logit_rows;
        self.run(backend, embed, h, rows, work, HeadOut::Logits(logits))?;
        let (rows, draws): (Vec<usize>, Vec<Draw>) = layout.pick_rows.iter().copied().unzip();
        self.run(
            backend,
            embed,
            h,
            &rows,
            work,
            HeadOut::Picks { ids, draws: &draws },
        )
    }

    /// Final norm, head and softcap for the hidden-state rows `rows` of `h` (rows of
    /// `work.d`), [`LOGIT_ROWS`] at a time, into `out`. Greedy picks skip the softcap (it keeps
    /// the order) and, on a screening backend, ask for the picks alone
    /// ([`Backend::argmax_screened`]); sampled picks draw from the logits as returned.
    pub(crate) fn run(
        &self,
        backend: &B,
        embed: &B::Matrix,
        h: &B::Buffer,
        rows: &[usize],
        work: &mut HeadWork<B>,
        mut out: HeadOut,
    ) -> Result<()> {
        let (d, nv, norm) = (work.d, work.n_vocab, &self.norm);
        for (g, group) in rows.chunks(LOGIT_ROWS).enumerate() {
            let n = group.len();
            // Runs of consecutive rows (all of a decode step's) move in one copy each.
            let mut i = 0;
            while i < n {
                let run = 1 + group[i + 1..]
                    .iter()
                    .zip(&group[i..])
                    .take_while(|(next, prev)| **next == **prev + 1)
                    .count();
                backend.copy(h, group[i] * d, &mut work.input, i * d, run * d)?;
                i += run;
            }
            backend.rms_norm(
                &work.input,
                Some(&norm.weight),
                norm.eps,
                n,
                d,
                &mut work.normed,
                NormOut::Write,
            )?;
            let head = self.own.as_ref().unwrap_or(embed);
            let r0 = g * LOGIT_ROWS;
            match (&mut out, &self.coarse) {
                (HeadOut::Picks { ids, draws }, _)
                    if draws[r0..r0 + n].iter().any(|d| d.temperature != 0.0) =>
                {
                    self.logits(backend, embed, work, n)?;
                    ids.extend(backend.sample(&work.logits, n, nv, &draws[r0..r0 + n])?);
                }
                (HeadOut::Picks { ids, .. }, Some(coarse)) => ids.extend(backend.argmax_screened(
                    &work.normed,
                    n,
                    coarse,
                    head,
                    SCREEN_TOP_K,
                    nv,
                    &mut work.logits,
                )?),
                (HeadOut::Picks { ids, .. }, None) => {
                    backend.matmul(&work.normed, n, head, &mut work.logits)?;
                    ids.extend(backend.argmax(&work.logits, n, nv)?);
                }
                (HeadOut::Logits(logits), _) => {
                    self.logits(backend, embed, work, n)?;
                    backend.read(&work.logits, &mut logits[r0 * nv..(r0 + n) * nv])?;
                }
            }
        }
        Ok(())
    }

    /// The logits of the `n` normed rows of `work` into `work.logits`, soft-capped where the
    /// model caps them.
    fn logits(
        &self,
        backend: &B,
        embed: &B::Matrix,
        work: &mut HeadWork<B>,
        n: usize,
    ) -> Result<()> {
        self.matmul(backend, embed, &work.normed, n, &mut work.logits)?;
        if let Some(cap) = self.norm.softcap {
            backend.softcap(&mut work.logits, cap, n * work.n_vocab)?;
        }
        Ok(())
    }

    /// How logits are computed, for `inspect` / `bench` output.
    pub fn describe(&self) -> String {
        match self.coarse {
            Some(_) => format!("screened (coarse copy ranks, top {SCREEN_TOP_K} exact)"),
            None => "exact".into(),
        }
    }
}
