//! Graph captures against driver calls that synchronize the whole device or context.
//!
//! A stream capture fails (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`) when, meanwhile, another
//! thread makes a call that waits for every stream of the context: loading or unloading a
//! module, creating or destroying a cuBLASLt handle, allocating or freeing page-locked host
//! memory, looking a kernel up (which may load its code). One backend never does both at once
//! (its recorder's lock orders them), but a process may hold several backends on one device,
//! all on its primary context, each driven from its own thread (the GPU tests do;
//! docs/perf.md, sessions 24–27). So captures hold [`capturing`] (shared: captures of several
//! backends may overlap) and those calls hold [`device_wide`] (exclusive): neither starts
//! while the other runs. Nothing that holds one takes the other.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use cudarc::driver::{CudaContext, PinnedHostSlice};
use markbase_core::Result;

use crate::device::driver_err;

static CAPTURES: RwLock<()> = RwLock::new(());

/// Held while a stream captures a graph.
pub(crate) fn capturing() -> RwLockReadGuard<'static, ()> {
    CAPTURES.read().unwrap_or_else(|e| e.into_inner())
}

/// Held around a call that synchronizes the whole device or context.
pub(crate) fn device_wide() -> RwLockWriteGuard<'static, ()> {
    CAPTURES.write().unwrap_or_else(|e| e.into_inner())
}

/// Page-locked host memory, freed under [`device_wide`].
pub(crate) struct Pinned(ManuallyDrop<PinnedHostSlice<u32>>);

impl Pinned {
    /// `len` u32 of page-locked memory (plain, not write-combined), allocated under
    /// [`device_wide`] (allocating it synchronizes the context too).
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned> {
        let _held = device_wide();
        // SAFETY: plain page-locked host memory; its users write it before they read it.
        let slice = unsafe { ctx.alloc_pinned_with_flags::<u32>(len, 0) }
            .map_err(|e| driver_err("pinned allocation", e))?;
        Ok(Pinned(ManuallyDrop::new(slice)))
    }
}

impl Deref for Pinned {
    type Target = PinnedHostSlice<u32>;

    fn deref(&self) -> &PinnedHostSlice<u32> {
        &self.0
    }
}

impl DerefMut for Pinned {
    fn deref_mut(&mut self) -> &mut PinnedHostSlice<u32> {
        &mut self.0
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _held = device_wide();
        // SAFETY: dropped once, here, and not used after.
        unsafe { ManuallyDrop::drop(&mut self.0) }
    }
}
