//! Activations written twice by the kernel that makes them: in f32 and rounded the way the
//! next tensor-core product reads them (bf16 or f16), so that product skips its own rounding
//! pass. In a batch-64 decode step of E4B the rounding passes were 254 launches and 0.73 of
//! 6.4 ms (Nsight Compute, session 12).
//!
//! A producer (a norm, the gated activation) asks [`RoundedCopy::target`] where to write the
//! rounded copy, queues its kernel and [`RoundedCopy::hold`]s the copy. A product's rounding
//! ([`RoundedCopy::take`]) uses it only if it rounds the same values the same way and nothing
//! at all was queued on the stream in between — any kernel, copy, allocation or cuBLAS product
//! counts ([`QueueCount`]), so a copy is never stale; otherwise the product rounds as before.
//! The state lives in the backend's scratch, whose lock both sides hold from asking to
//! queueing: another thread's producer cannot overwrite the copy between a product's take and
//! its launch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use markbase_core::Result;

use crate::backend::ProductInputs;
use crate::buffer::Growable;
use crate::graph::Steps;

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

/// The rounded copy of `len` values at `src`, stored at `at`, made when the queue count was
/// `queued`.
struct Held {
    src: u64,
    len: usize,
    inputs: ProductInputs,
    at: u64,
    queued: u64,
}

/// A producer kernel's extra output: where to write the rounded values and how (`kind`:
/// 0 none, 1 bf16, 2 f16 — `store_rounded` in ops.cu).
#[derive(Clone, Copy)]
pub(crate) struct RoundTarget {
    /// Device address of the rounded values (0 with kind 0).
    pub(crate) at: u64,
    /// Rounding the kernel applies.
    pub(crate) kind: i32,
    inputs: Option<ProductInputs>,
}

impl RoundTarget {
    /// No rounded copy.
    pub(crate) const NONE: RoundTarget = RoundTarget {
        at: 0,
        kind: 0,
        inputs: None,
    };
}

/// The one rounded copy the backend holds (see the module's comment).
pub(crate) struct RoundedCopy {
    /// How the last product that rounded its activations took them (what a producer writes).
    last: Option<ProductInputs>,
    held: Option<Held>,
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
            mem: Growable::new(steps),
            used: 0,
        }
    }

    /// Products that took a held copy so far.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// Where a producer of `len` values in `rows` token rows writes their rounded copy: the
    /// way the last rounding product took its inputs, if a product of that many rows would
    /// round them too (`rounds(inputs, rows)`); else nowhere (kind 0).
    pub(crate) fn target(
        &mut self,
        stream: &Arc<CudaStream>,
        rows: usize,
        len: usize,
        rounds: impl Fn(ProductInputs, usize) -> bool,
    ) -> Result<RoundTarget> {
        self.held = None;
        let Some(inputs) = self.last.filter(|&i| rounds(i, rows)) else {
            return Ok(RoundTarget::NONE);
        };
        let kind = match inputs {
            ProductInputs::Bf16 => 1,
            ProductInputs::F16 => 2,
            ProductInputs::F32 => return Ok(RoundTarget::NONE),
        };
        let at = self.mem.get(stream, len)?;
        Ok(RoundTarget {
            at,
            kind,
            inputs: Some(inputs),
        })
    }

    /// Records that the kernel just queued wrote `t`'s rounded copy of the `len` values at
    /// `src`.
    pub(crate) fn hold(&mut self, t: RoundTarget, src: u64, len: usize, queue: &QueueCount) {
        if let Some(inputs) = t.inputs {
            self.held = Some(Held {
                src,
                len,
                inputs,
                at: t.at,
                queued: queue.now(),
            });
        }
    }

    /// For a product about to round the `len` values at `src` as `inputs`: the address of
    /// the held copy if it is exactly that and nothing was queued since it was made. Forgets
    /// the held copy either way and remembers `inputs` for the next producer.
    pub(crate) fn take(
        &mut self,
        src: u64,
        len: usize,
        inputs: ProductInputs,
        queue: &QueueCount,
    ) -> Option<u64> {
        self.last = Some(inputs);
        let at = self
            .held
            .take()
            .filter(|h| (h.src, h.len, h.inputs, h.queued) == (src, len, inputs, queue.now()))
            .map(|h| h.at);
        self.used += at.is_some() as u64;
        at
    }
}
