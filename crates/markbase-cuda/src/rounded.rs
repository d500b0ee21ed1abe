//! Activations written twice by the kernel that makes them: in f32 and in the form the next
//! product reads them, so that product skips its own pass over them. Tensor-core products
//! read them rounded (bf16 or f16): in a batch-64 decode step of E4B the rounding passes were
//! 254 launches and 0.73 of 6.4 ms (Nsight Compute, session 12). A one-token Q4_K GEMV reads
//! them as 16-bit tiles (common.cuh, `store_q4k_tiles`) instead of every block quantizing the
//! whole row into shared memory (≈ 0.3 of E4B's 2.47 ms Q4_K step, docs/perf.md session 23).
//!
//! A producer (a norm, the gated activation, attention) asks [`RoundedCopy::target`] where to
//! write the copy, queues its kernel and [`RoundedCopy::hold`]s the copy. A product's
//! [`RoundedCopy::take`] uses it only if it is the same values in the form the product reads
//! and nothing at all was queued on the stream in between — any kernel, copy, allocation or
//! cuBLAS product counts ([`QueueCount`]), so a copy is never stale; otherwise the product
//! makes its inputs as before. The state lives in the backend's scratch, whose lock both sides
//! hold from asking to queueing: another thread's producer cannot overwrite the copy between a
//! product's take and its launch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use markbase_core::Result;

use crate::buffer::Growable;
use crate::graph::Steps;
use crate::products::ProductInputs;

/// Work items (kernels, copies, allocations, cuBLAS products) queued on the backend's stream
/// so far.
#[derive(Clone, Default)]
pub(crate) struct QueueCount(Arc<AtomicU64>);

impl QueueCount {
    /// Counts one more queued item; call it for every item that may write device memory.
    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn now(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The form in which a product reads a producer's copy of its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyForm {
    /// Rounded for a tensor-core product taking these inputs (`Bf16` or `F16`).
    Rounded(ProductInputs),
    /// One token row as the 16-bit tiles of a one-token Q4_K or Q8_0 GEMV (640 bytes per 256
    /// values).
    Q4kTiles,
    /// Rounded to f16 for a tensor-core product of 2–128 token rows of Q4_K or Q8_0 weights
    /// (mmq.rs): the values of `Rounded(F16)`, made for products of fewer token rows.
    Mmq,
}

impl CopyForm {
    /// The copy's contents: forms with the same kind hold the same values.
    fn kind(self) -> i32 {
        match self {
            CopyForm::Rounded(ProductInputs::Bf16) => 1,
            CopyForm::Rounded(ProductInputs::F16) | CopyForm::Mmq => 2,
            CopyForm::Q4kTiles => ROUND_Q4K_TILES,
            CopyForm::Rounded(ProductInputs::F32) => 0,
        }
    }
}

/// The copy of `len` values at `src` in `form`, stored at `at`, made when the queue count was
/// `queued`.
struct Held {
    src: u64,
    len: usize,
    form: CopyForm,
    at: u64,
    queued: u64,
}

/// `RoundTarget::kind` of Q4_K tiles (`ROUND_Q4K_TILES` in common.cuh).
pub(crate) const ROUND_Q4K_TILES: i32 = 3;

/// A producer kernel's extra output: where to write the copy and how (`kind`: 0 none, 1 bf16,
/// 2 f16 — `store_rounded` in common.cuh — or 3 Q4_K tiles, `store_q4k_tiles`).
#[derive(Clone, Copy)]
pub(crate) struct RoundTarget {
    /// Device address of the copy (0 with kind 0).
    pub(crate) at: u64,
    /// The form the kernel writes.
    pub(crate) kind: i32,
    form: Option<CopyForm>,
}

impl RoundTarget {
    /// No copy.
    pub(crate) const NONE: RoundTarget = RoundTarget {
        at: 0,
        kind: 0,
        form: None,
    };
}

/// The one copy the backend holds (see the module's comment).
pub(crate) struct RoundedCopy {
    /// The form the last product that takes copies wanted (what a producer writes).
    last: Option<CopyForm>,
    held: Option<Held>,
    /// The copy the last `take` handed out, until `renew` holds it again.
    lent: Option<Held>,
    mem: Growable<u16>,
    /// Products that took a held copy.
    used: u64,
}

impl RoundedCopy {
    /// No copy held, no rounding seen yet.
    pub(crate) fn new(steps: &Steps) -> RoundedCopy {
        RoundedCopy {
            last: None,
            held: None,
            lent: None,
            mem: Growable::new(steps),
            used: 0,
        }
    }

    /// Products that took a held copy so far.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// Where a producer of `rows` token rows of `dim` values writes their copy: in the form
    /// the last product that takes copies wanted, if a product of that many rows would read
    /// it (`reads(form, rows)`) and the producer can write it (`tiles`: Q4_K tiles, for rows
    /// of a multiple of 256 values); else nowhere (kind 0).
    pub(crate) fn target(
        &mut self,
        stream: &Arc<CudaStream>,
        (rows, dim): (usize, usize),
        tiles: bool,
        reads: impl Fn(CopyForm, usize) -> bool,
    ) -> Result<RoundTarget> {
        self.held = None;
        self.lent = None;
        let Some(form) = self.last.filter(|&f| reads(f, rows)) else {
            return Ok(RoundTarget::NONE);
        };
        let (kind, len) = match form.kind() {
            1 | 2 => (form.kind(), rows * dim),
            ROUND_Q4K_TILES if tiles && dim.is_multiple_of(256) => {
                (ROUND_Q4K_TILES, rows * dim / 256 * 320)
            }
            _ => return Ok(RoundTarget::NONE),
        };
        let at = self.mem.get(stream, len)?;
        Ok(RoundTarget {
            at,
            kind,
            form: Some(form),
        })
    }

    /// Records that the kernel just queued wrote `t`'s rounded copy of the `len` values at
    /// `src`.
    pub(crate) fn hold(&mut self, t: RoundTarget, src: u64, len: usize, queue: &QueueCount) {
        if let Some(form) = t.form {
            self.held = Some(Held {
                src,
                len,
                form,
                at: t.at,
                queued: queue.now(),
            });
        }
    }

    /// For a product about to read the `len` values at `src` in `form`: the address of the
    /// held copy if it holds exactly those values so (a form of the same kind) and nothing was
    /// queued since it was made. Forgets the held copy either way and remembers `form` for the
    /// next producer.
    pub(crate) fn take(
        &mut self,
        src: u64,
        len: usize,
        form: CopyForm,
        queue: &QueueCount,
    ) -> Option<u64> {
        self.last = Some(form);
        self.lent = self.held.take().filter(|h| {
            (h.src, h.len, h.form.kind(), h.queued) == (src, len, form.kind(), queue.now())
        });
        self.used += self.lent.is_some() as u64;
        self.lent.as_ref().map(|h| h.at)
    }

    /// Holds again the copy the last `take` handed out, once the product that took it is
    /// queued: that product read the copy and wrote neither it nor its source, so the next
    /// product of the same activations may take it too if nothing else is queued first
    /// (llama.cpp's Q4_K_M keeps some layers' v in Q6_K: its launch reads the copy that q and
    /// k's launch took instead of rounding the values again).
    pub(crate) fn renew(&mut self, queue: &QueueCount) {
        if let Some(h) = self.lent.take() {
            self.held = Some(Held {
                queued: queue.now(),
                ..h
            });
        }
    }
}
