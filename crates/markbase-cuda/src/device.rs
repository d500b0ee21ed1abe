//! Opening a GPU: the driver library, the device, a context and the one stream every operation
//! is queued on — with an error that says which of them is missing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};
use markbase_core::{Error, Result};

/// An opened GPU with its stream.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    name: String,
    ordinal: usize,
    capability: (i32, i32),
    multiprocessors: i32,
    /// Shared memory a block may opt into (bytes).
    max_block_shared: u32,
    /// Times the host has waited for the stream ([`Device::wait`]).
    waits: AtomicU64,
    /// Nanoseconds the host has spent in those waits.
    wait_nanos: AtomicU64,
}

/// Wraps a driver error with what was being done.
pub(crate) fn driver_err(what: &str, e: DriverError) -> Error {
    Error::Invalid(format!("CUDA {what}: {e:?}"))
}

impl Device {
    /// Opens GPU `ordinal`. Errors (never panics) when the driver library is absent, the driver
    /// fails to start, there is no such GPU, or its architecture is older than Volta.
    pub fn open(ordinal: usize) -> Result<Device> {
        // SAFETY: only probes for the library by name.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver: libcuda.so.1 was not found (is an NVIDIA GPU driver installed?)"
                    .into(),
            ));
        }
        let count = CudaContext::device_count()
            .map_err(|e| Error::Unsupported(format!("the CUDA driver did not start: {e:?}")))?;
        if count <= 0 {
            return Err(Error::Unsupported(
                "the CUDA driver sees no GPU on this machine".into(),
            ));
        }
        if ordinal >= count as usize {
            return Err(Error::Invalid(format!(
                "no GPU cuda:{ordinal}: this machine has {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("context", e))?;
        // One stream orders everything, so cudarc's cross-stream event tracking is not needed.
        // SAFETY: no allocation has been made on this context yet.
        unsafe { ctx.disable_event_tracking() };
        let capability = ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?;
        if capability.0 < 7 {
            return Err(Error::Unsupported(format!(
                "GPU cuda:{ordinal} has compute capability {}.{}; MarkBase needs 7.0 or newer",
                capability.0, capability.1
            )));
        }
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("attribute", e))?;
        let max_block_shared = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| driver_err("attribute", e))?;
        let name = ctx.name().map_err(|e| driver_err("device name", e))?;
        let stream = ctx.new_stream().map_err(|e| driver_err("stream", e))?;
        Ok(Device {
            ctx,
            stream,
            name,
            ordinal,
            capability,
            multiprocessors,
            max_block_shared: max_block_shared.max(0) as u32,
            waits: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
        })
    }

    /// Host waits for the device so far (calls of `Device::wait`).
    pub fn host_waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// Time the host has spent waiting for the device so far: with a step's time, it tells a
    /// step bound by the GPU (most of it waiting) from one bound by the host queueing work.
    pub fn host_wait_time(&self) -> Duration {
        Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed))
    }

    /// The GPU's name (e.g. "NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device index.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Compute capability as (major, minor).
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Whether kernels launch early (programmatic dependent launch, compute capability 9.0
    /// and newer): each may start while the previous one finishes, and waits for it inside.
    pub(crate) fn early_launch(&self) -> bool {
        self.capability.0 >= 9
    }

    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> i32 {
        self.multiprocessors
    }

    /// Most shared memory one block may use (bytes, with the kernel's limit raised): 227 KiB
    /// on Hopper, 163 KiB on the A100, 99 KiB on most other sm_8x parts.
    pub fn max_block_shared(&self) -> u32 {
        self.max_block_shared
    }

    /// The device's free and total memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.bind_to_thread()?;
        cudarc::driver::result::mem_get_info()
            .map_err(|e| driver_err("reading the device's free memory", e))
    }

    /// Makes the device's context current on the calling thread. A thread must do this before
    /// it queues work: cudarc's own calls bind the context, raw kernel launches and cuBLAS do
    /// not.
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context to a thread", e))
    }

    /// Runs `copy` (a copy to host memory, which may block until the device gets to it), then
    /// waits until every queued operation has finished. Every host wait of the backend goes
    /// through here, so [`Device::host_waits`] counts them and [`Device::host_wait_time`]
    /// sums their time.
    pub(crate) fn wait<T>(&self, copy: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let out = copy();
        let done = self
            .stream
            .synchronize()
            .map_err(|e| driver_err("synchronize", e));
        self.waits.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.wait_nanos.fetch_add(nanos, Ordering::Relaxed);
        done?;
        out
    }
}
