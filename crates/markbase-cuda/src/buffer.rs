//! Device memory the backend hands out: f32 activation buffers / vectors, stored weight
//! matrices, and the grow-on-demand scratch space of operations.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::device::driver_err;
use crate::f16_copies::F16Copy;
use crate::graph::Steps;
use crate::layout;

/// The raw address of a device allocation.
pub(crate) fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A device allocation freed, when dropped, with the step recorder locked: operations held
/// back for a graph, which may still read it, are issued first (`Steps::free_after_held`).
pub(crate) struct DeviceMem<T> {
    mem: ManuallyDrop<CudaSlice<T>>,
    steps: Steps,
}

impl<T> DeviceMem<T> {
    /// Takes `mem`, to be freed under `steps`.
    pub(crate) fn new(mem: CudaSlice<T>, steps: &Steps) -> DeviceMem<T> {
        DeviceMem {
            mem: ManuallyDrop::new(mem),
            steps: steps.clone(),
        }
    }
}

impl<T> Deref for DeviceMem<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        &self.mem
    }
}

impl<T> DerefMut for DeviceMem<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.mem
    }
}

impl<T> Drop for DeviceMem<T> {
    fn drop(&mut self) {
        // SAFETY: `mem` is dropped once, here, and not used after.
        self.steps
            .free_after_held(|| unsafe { ManuallyDrop::drop(&mut self.mem) });
    }
}

/// An f32 buffer in device memory (activations, KV cache, norm weights).
pub struct CudaBuffer {
    pub(crate) mem: DeviceMem<f32>,
    pub(crate) ptr: u64,
    len: usize,
}

impl CudaBuffer {
    /// A zeroed buffer of `len` values (at least one element is allocated).
    pub(crate) fn zeroed(
        stream: &Arc<CudaStream>,
        steps: &Steps,
        len: usize,
    ) -> Result<CudaBuffer> {
        let mem = stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| driver_err(&format!("allocating {len} floats"), e))?;
        let ptr = addr(&mem, stream);
        Ok(CudaBuffer {
            mem: DeviceMem::new(mem, steps),
            ptr,
            len,
        })
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A weight matrix in device memory, blocks as stored (Q8_0 rows regrouped, Q6_K super-blocks
/// and Q4_0 / Q5_0 rows of whole 256-value units laid out for their readers: layout.rs).
pub struct CudaMatrix {
    _mem: DeviceMem<u8>,
    pub(crate) ptr: u64,
    /// Storage format.
    pub ty: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Weights per row.
    pub cols: usize,
    /// Bytes per row on the device (Q6_K's super-blocks take 224 there, layout.rs).
    pub row_bytes: usize,
    /// Name, for messages.
    pub name: String,
    /// The f16 copy of a quantized matrix for products of many token rows, once one was
    /// asked for (`None` inside: the device had no room; f16_copies.rs).
    pub(crate) f16: OnceLock<Option<F16Copy>>,
}

impl CudaMatrix {
    /// Copies `bytes` (rows × row_bytes, as stored) to the device, in the device's layout of
    /// `ty` (layout.rs).
    pub(crate) fn upload(
        stream: &Arc<CudaStream>,
        steps: &Steps,
        bytes: &[u8],
        ty: GgmlType,
        rows: usize,
        cols: usize,
        name: &str,
    ) -> Result<CudaMatrix> {
        let laid = layout::device_bytes(ty, bytes, rows);
        let mem = stream
            .clone_htod(laid.as_ref())
            .map_err(|e| driver_err(&format!("uploading '{name}'"), e))?;
        let ptr = addr(&mem, stream);
        Ok(CudaMatrix {
            _mem: DeviceMem::new(mem, steps),
            ptr,
            ty,
            rows,
            cols,
            row_bytes: laid.len() / rows.max(1),
            name: name.to_string(),
            f16: OnceLock::new(),
        })
    }
}

/// A device allocation of `T` that grows (never shrinks) on demand.
pub(crate) struct Growable<T> {
    mem: Option<CudaSlice<T>>,
    ptr: u64,
    cap: usize,
    steps: Steps,
}

impl<T: cudarc::driver::DeviceRepr> Growable<T> {
    pub(crate) fn new(steps: &Steps) -> Self {
        Growable {
            mem: None,
            ptr: 0,
            cap: 0,
            steps: steps.clone(),
        }
    }

    /// The address of at least `n` elements (contents unspecified).
    pub(crate) fn get(&mut self, stream: &Arc<CudaStream>, n: usize) -> Result<u64> {
        if n > self.cap || self.mem.is_none() {
            // Operations held back for a graph may use the old allocation: they go first; the
            // recorder stays locked so that no other thread captures a step meanwhile.
            let mut steps = self.steps.lock()?;
            steps.release()?;
            let cap = n.max(self.cap * 2).max(256);
            // SAFETY: the contents are written by the kernels before they are read.
            let mem = unsafe { stream.alloc::<T>(cap) }
                .map_err(|e| driver_err(&format!("allocating {cap} scratch elements"), e))?;
            self.ptr = addr(&mem, stream);
            // The old allocation is freed in stream order (or after the device is idle).
            self.mem = Some(mem);
            self.cap = cap;
            drop(steps);
        }
        Ok(self.ptr)
    }
}
