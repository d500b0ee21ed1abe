//! [`CudaBackend`]: the [`Backend`] operations as kernels queued on one stream. Nothing waits
//! for the device except [`Backend::read`] (and the token choosers in `sample`), so a model
//! step costs one host wait. Host-side index arrays (tokens, positions, slots, sequence starts,
//! block tables) are copied to a device scratch array in stream order before the kernel that
//! reads them.
//!
//! This module holds the backend's state, its stream plumbing and the [`Backend`] methods,
//! which check their arguments and queue kernels; the larger paths live beside it: products
//! (`products`, `mmq`, `gemv_walk`, `ffn`), attention (`attention`, `attention_flash`),
//! mixture-of-experts (`moe`, `moe_mma`), norms (`norms`), elementwise kernels (`elementwise`)
//! and samplers (`sample`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use cudarc::driver::CudaFunction;
use markbase_core::backend::{
    rope_attention_in_steps, AttnSpec, Backend, HostMatrix, KvLayout, NewKv, NormOut, Rope,
    Strided, ValueRows,
};
use markbase_core::quant::GgmlType;
use markbase_core::sampling::Draw;
use markbase_core::{Error, Result};

use crate::attention::{check_rope, check_slots, value_rows, FusedRope, NewRows};
use crate::blas::{Blas, GemmCall};
use crate::buffer::{CudaBuffer, CudaMatrix, Growable};
use crate::device::{driver_err, Device};
use crate::device_wide::Pinned;
use crate::f16_copies::F16Copies;
use crate::graph::{DeviceCopy, Op, Steps};
use crate::kernels::{Arg, Grid, Kernels, Launch, MAX_PRODUCTS};
use crate::mmq::{Tuning as MmqTuning, TICKETS as MMQ_TICKETS};
use crate::moe::{moe_groups_pairs, MoeCall, MAX_EXPERTS, MAX_GRID_Y, MAX_TOP_K};
use crate::moe_mma::moe_on_tensor_cores;
use crate::norms::{norm_grid, EXTRA_NORMS, Q4K_TILES_MAX_DIM};
use crate::products::{gemv_suits, product_inputs, reads_copy, ProductInputs};
use crate::rounded::{QueueCount, RoundTarget, RoundedCopy};
use crate::sources::Module;

/// Threads per block of the embed and dequant kernels: `DEQUANT_THREADS` in ops.cu, which
/// sizes its shared staging by it.
pub(crate) const DEQUANT_THREADS: usize = 128;

/// Scratch space shared by operations (one operation uses it at a time; stream order makes
/// reuse safe).
pub(crate) struct Scratch {
    /// Float scratch: dequantized weight tiles, attention partials, rounded inputs, the
    /// grouped MoE path's intermediates.
    pub(crate) floats: Growable<f32>,
    /// The per-pair MoE path's intermediates, apart from `floats`: its first kernel may run
    /// beside the product ahead of it ([`CudaBackend::take_beside`]), which may use `floats`.
    pub(crate) moe_pairs: Growable<f32>,
    /// Weight tiles dequantized to f16 for the tensor cores.
    pub(crate) tiles: Growable<u16>,
    /// Chosen tokens of the samplers.
    pub(crate) picks: Growable<u32>,
    /// The sampled picks' per-row scratch: barriers, histograms, gathered tokens
    /// (sample.cu `SAMPLE_ROW_WORDS` a row).
    pub(crate) sample: Growable<u64>,
    /// The rounded copy of the activations a producer kernel made for the next product.
    pub(crate) rounded: RoundedCopy,
}

/// The CUDA backend: one GPU, one stream.
pub struct CudaBackend {
    pub(crate) dev: Device,
    /// Every stream operation goes through it (steps replayed as CUDA graphs, `graph`); it
    /// drops its graphs before the kernels they launch are unloaded.
    pub(crate) steps: Steps,
    pub(crate) kernels: Kernels,
    pub(crate) blas: Option<Arc<Blas>>,
    pub(crate) scratch: Mutex<Scratch>,
    /// Work items queued on the stream (see `rounded`).
    pub(crate) queue: QueueCount,
    /// Error word raised by kernels (see common.cuh), checked at each `read`.
    pub(crate) err: CudaBuffer,
    /// The tensor-core Q4_K / Q8_0 products' tickets, one a row tile, zero between launches
    /// (`mmq`).
    mmq_tickets: CudaBuffer,
    /// How the tensor-core products' launches of 33–64 token rows are shaped (`mmq`).
    pub(crate) mmq_tuning: MmqTuning,
    /// Pairs an expert past which MoE launches over quantized experts take tiles of 16 pairs
    /// (`moe::wide_tiles_from_env`; `None`: never).
    pub(crate) moe_wide_from: Option<usize>,
    /// Whether quantized matrices get f16 copies for products of many token rows, and their
    /// bytes (f16_copies.rs).
    pub(crate) f16_copies: F16Copies,
    err_host: Mutex<Pinned>,
    /// RoPE frequency tables by (θ bits, linear factor bits, head_dim, rotated pairs).
    pub(crate) rope_tables: Mutex<HashMap<(u32, u32, usize, usize), CudaBuffer>>,
    /// Held from a kernel's index uploads until the kernel is queued, and by a host wait before
    /// it starts the next step (which recycles the step's index arena): no other thread's wait
    /// can hand an uploaded array's place to another array before its reader is queued.
    uploads: Mutex<()>,
    /// Grids of the grid-stride kernels: resident blocks of (name prefix, format, variant,
    /// dynamic shared bytes a block) on the whole device, from the driver's occupancy.
    resident: Mutex<HashMap<ResidentKey, u32>>,
    /// Set by [`Backend::next_beside_previous`] to the calling thread: its next operation may
    /// run beside the one ahead of it. Taken by that thread's launches that can
    /// (`take_beside`), cleared by every launch (another thread's op becomes the one ahead).
    beside: Mutex<Option<ThreadId>>,
}

impl Drop for CudaBackend {
    /// Waits for the stream's work before the fields go (kernel modules, cuBLASLt, buffers): a
    /// module unloaded under a kernel still running faults it, and the fault stays on the
    /// context that every backend of the process shares.
    fn drop(&mut self) {
        let _ = self.dev.stream.synchronize();
    }
}

/// A grid-stride kernel's occupancy key: its name prefix, format and variant, and the dynamic
/// shared memory of a block.
pub(crate) type ResidentKey = (&'static str, GgmlType, u32, u32);

/// Proof of holding the backend's upload lock ([`CudaBackend::uploads`]).
pub(crate) struct Uploads<'a> {
    _guard: MutexGuard<'a, ()>,
}

/// Errors, naming `what`, unless a buffer of `have` values holds the `want` an operation needs.
pub(crate) fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(Error::Invalid(format!(
            "cuda {what}: buffer of {have} values, needs {want}"
        )));
    }
    Ok(())
}

/// Blocks of `per` that cover `n`.
pub(crate) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// `v` as a kernel's `int` argument, or an error naming `what`.
pub(crate) fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Invalid(format!("cuda {what}: {v} is too large")))
}

/// The kernel-name suffix of a weight format (`sources::FORMATS`).
pub(crate) fn format_suffix(ty: GgmlType) -> Result<&'static str> {
    crate::sources::FORMATS
        .iter()
        .find(|&&(t, _)| t == ty)
        .map(|&(_, s)| s)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "{ty} weights on the CUDA backend (an activation format)"
            ))
        })
}

impl CudaBackend {
    /// Opens GPU `ordinal` and prepares its kernels (compiled with NVRTC for the device's
    /// architecture on first use, then taken from the disk cache). Errors clearly when there
    /// is no driver, no GPU or no NVRTC.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let dev = Device::open(ordinal)?;
        let (major, minor) = dev.capability();
        let kernels = Kernels::load(&dev.ctx, (major * 10 + minor) as u32)?;
        let queue = QueueCount::default();
        let blas = Blas::new(&dev.stream, queue.clone())?.map(Arc::new);
        let graphs = std::env::var("MARKBASE_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let steps = Steps::new(&dev.stream, blas.clone(), graphs)?;
        if let Some(blas) = &blas {
            blas.attach(&steps);
        }
        let err = CudaBuffer::zeroed(&dev.stream, &steps, 1)?;
        let mmq_tickets = CudaBuffer::zeroed(&dev.stream, &steps, MMQ_TICKETS)?;
        // Written only by copies from the device.
        let err_host = Pinned::alloc(&dev.ctx, 1)?;
        Ok(CudaBackend {
            dev,
            kernels,
            blas,
            scratch: Mutex::new(Scratch {
                floats: Growable::new(&steps),
                moe_pairs: Growable::new(&steps),
                tiles: Growable::new(&steps),
                picks: Growable::new(&steps),
                sample: Growable::new(&steps),
                rounded: RoundedCopy::new(&steps),
            }),
            steps,
            queue,
            err,
            mmq_tickets,
            mmq_tuning: MmqTuning::from_env()?,
            moe_wide_from: crate::moe::wide_tiles_from_env()?,
            f16_copies: F16Copies::new(),
            err_host: Mutex::new(err_host),
            rope_tables: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
            uploads: Mutex::new(()),
            beside: Mutex::new(None),
        })
    }

    /// How many products have taken the rounded copy of their activations that the kernel
    /// before them wrote, instead of rounding them in a pass of their own.
    pub fn rounded_copies_used(&self) -> Result<u64> {
        Ok(self.scratch()?.rounded.used())
    }

    /// The tensor-core products' tickets (`mmq`).
    pub(crate) fn mmq_tickets(&self) -> u64 {
        self.mmq_tickets.ptr
    }

    /// The opened device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Whether cuBLAS was found (prefill products use it; without it they run as GEMVs).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// Token-row counts whose first product of each shape is timed, one of each run that
    /// shares the timing (cuBLASLt, blas.rs): a server runs a step of each before it takes
    /// requests. Empty without cuBLAS or with timing off.
    pub fn timed_row_runs(&self) -> Vec<usize> {
        self.blas
            .as_ref()
            .map_or(Vec::new(), |b| b.timed_row_runs())
    }

    /// Product shapes whose cuBLASLt algorithm was chosen by timing so far (products of
    /// nearby token-row counts share one: `MARKBASE_CUBLASLT_TUNE`, blas.rs).
    pub fn cublaslt_timed_shapes(&self) -> Result<usize> {
        self.blas.as_ref().map_or(Ok(0), |b| b.timed_shapes())
    }

    pub(crate) fn scratch(&self) -> Result<MutexGuard<'_, Scratch>> {
        self.scratch
            .lock()
            .map_err(|_| Error::Invalid("CUDA scratch poisoned by an earlier panic".into()))
    }

    /// Queues kernel `f`.
    pub(crate) fn launch_fn(&self, f: &CudaFunction, grid: Grid, args: &[Arg]) -> Result<()> {
        self.queue.bump();
        self.clear_beside();
        let launch = Launch::new(f, grid, args, self.dev.early_launch());
        self.steps.lock()?.queue(Op::Kernel(launch))
    }

    /// Queues the cuBLASLt product `call`.
    pub(crate) fn queue_gemm(&self, call: Result<GemmCall>) -> Result<()> {
        self.clear_beside();
        self.steps.lock()?.queue(Op::Gemm(call?))
    }

    /// Queues a device-to-device copy.
    fn queue_copy(&self, copy: DeviceCopy) -> Result<()> {
        self.queue.bump();
        self.clear_beside();
        self.steps.lock()?.queue(Op::Copy(copy))
    }

    /// Whether the launch about to be queued may run beside the kernel ahead of it
    /// ([`Backend::next_beside_previous`] was called since the last launch, and kernels launch
    /// early on this device): its kernel then takes `beside` = 1 (`start_step` in common.cuh).
    /// Taking it clears it.
    pub(crate) fn take_beside(&self) -> bool {
        let Ok(mut b) = self.beside.lock() else {
            return false;
        };
        let mine = *b == Some(std::thread::current().id());
        if mine {
            *b = None;
        }
        mine && self.dev.early_launch()
    }

    /// Forgets a [`Backend::next_beside_previous`] hint: an operation was queued.
    fn clear_beside(&self) {
        if let Ok(mut b) = self.beside.lock() {
            *b = None;
        }
    }

    /// Runs `f`, which queues work that steps do not record (host copies, memsets,
    /// allocations), after any operations held back for a graph.
    pub(crate) fn foreign<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.steps.lock()?.foreign(f)
    }

    /// A step's host wait, the only one: queues the step (as graph segments where it repeats
    /// a recorded one), then a copy of the kernel error word and `copy` (a copy to host
    /// memory); waits for the device; starts the next step (capturing this one if it repeated
    /// the step before); then raises any error a kernel flagged. The recorder stays locked
    /// until the next step has started, so no other thread queues work or waits on the stream
    /// while a step is captured.
    pub(crate) fn host_wait<T>(&self, copy: impl FnOnce() -> Result<T>) -> Result<T> {
        let _uploads = self.uploads()?;
        let (out, flag) = {
            let mut steps = self.steps.lock()?;
            steps.finish_queueing()?;
            let mut host = self
                .err_host
                .lock()
                .map_err(|_| Error::Invalid("CUDA error word poisoned".into()))?;
            // SAFETY: the error word is one u32 (stored in an f32 slot); copy its bits.
            let word = unsafe { self.err.mem.transmute::<u32>(1) }
                .ok_or_else(|| Error::Invalid("CUDA error word".into()))?;
            self.dev
                .stream
                .memcpy_dtoh(&word, &mut **host)
                .map_err(|e| driver_err("error word copy", e))?;
            let out = self.dev.wait(copy);
            let flag = host.as_slice().map(|w| w[0]);
            steps.start_next_step();
            (out, flag)
        };
        let out = out?;
        self.take_kernel_error(flag.map_err(|e| driver_err("error word read", e))?)?;
        Ok(out)
    }

    /// Steps run as CUDA graph launches so far.
    pub fn graph_replays(&self) -> Result<u64> {
        Ok(self.steps.lock()?.replays())
    }

    /// Turns replaying steps as CUDA graphs on or off (on by default; off with the
    /// environment variable `MARKBASE_CUDA_GRAPHS=0`).
    pub fn set_graphs(&self, on: bool) -> Result<()> {
        self.steps.lock()?.set_enabled(on)
    }

    /// Whether steps are replayed as CUDA graphs.
    pub fn graphs_enabled(&self) -> Result<bool> {
        Ok(self.steps.lock()?.enabled())
    }

    /// Why graphs turned themselves off, if they did: capturing a step failed (the step still
    /// ran, and later steps run as queued).
    pub fn graphs_off_reason(&self) -> Result<Option<String>> {
        Ok(self.steps.lock()?.off_reason())
    }

    /// Waits until everything queued has run (a host wait, as at the end of a step).
    pub fn synchronize(&self) -> Result<()> {
        self.host_wait(|| Ok(()))
    }

    /// Queues kernel `name` of module `m`.
    pub(crate) fn run(
        &self,
        m: Module,
        name: &'static str,
        grid: Grid,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_fn(&self.kernels.func(m, name)?, grid, args)
    }

    /// The right to upload index arrays (`upload_idx`) until the kernels reading them are
    /// queued: hold it from the first upload to the last launch, and drop it before any read.
    pub(crate) fn uploads(&self) -> Result<Uploads<'_>> {
        self.uploads
            .lock()
            .map(|g| Uploads { _guard: g })
            .map_err(|_| Error::Invalid("CUDA upload lock poisoned".into()))
    }

    /// Copies the `dst.len()` values of `x` from `at` on to the host (a host wait).
    pub(crate) fn read_range(&self, x: &CudaBuffer, at: usize, dst: &mut [f32]) -> Result<()> {
        need("read", x.len(), at + dst.len())?;
        self.host_wait(|| {
            if !dst.is_empty() {
                let from = x.mem.slice(at..at + dst.len());
                self.dev
                    .stream
                    .memcpy_dtoh(&from, dst)
                    .map_err(|e| driver_err("device-to-host copy", e))?;
            }
            Ok(())
        })
    }

    /// Copies `v` into the step's index arena; returns its device address, valid until the
    /// step's host wait.
    pub(crate) fn upload_idx(&self, _held: &Uploads<'_>, v: &[u32]) -> Result<u64> {
        self.queue.bump();
        self.steps.lock()?.upload(v)
    }

    /// Raises any error a kernel flagged since the last check (after a synchronisation).
    fn take_kernel_error(&self, flag: u32) -> Result<()> {
        if flag == 0 {
            return Ok(());
        }
        // SAFETY: the error word is a live 4-byte device allocation.
        self.foreign(|| {
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    self.err.ptr,
                    0,
                    4,
                    self.dev.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("error word reset", e))
        })?;
        Err(Error::Invalid(if flag & 1 != 0 {
            "cuda moe_ffn: an expert id was not a whole number below the expert count".into()
        } else if flag & 2 != 0 {
            "cuda sample_rows: a row's blocks waited over a second for each other (the GPU did \
             not hold them all at once: is another process sharing it?)"
                .into()
        } else {
            format!("cuda kernel error flag {flag:#x}")
        }))
    }

    /// Blocks of `threads` threads of `f` (kernel `key`: name prefix, format, variant, and the
    /// dynamic shared bytes of a block) the whole device holds at once: the grid of a kernel
    /// whose warps walk its rows grid-stride.
    pub(crate) fn resident_blocks(
        &self,
        key: ResidentKey,
        f: &CudaFunction,
        threads: u32,
    ) -> Result<u32> {
        let mut cache = self
            .resident
            .lock()
            .map_err(|_| Error::Invalid("CUDA occupancy table poisoned".into()))?;
        if let Some(&b) = cache.get(&key) {
            return Ok(b);
        }
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, key.3 as usize, None)
            .map_err(|e| driver_err(&format!("occupancy of {}", key.0), e))?;
        let b = per_sm.max(1) * self.dev.multiprocessors().max(1) as u32;
        cache.insert(key, b);
        Ok(b)
    }

    /// Where a producer of `n` token rows of `dim` values writes their copy for the next
    /// product (see `rounded`); `tiles`: the producer can write Q4_K tiles.
    pub(crate) fn round_target(
        &self,
        s: &mut Scratch,
        (n, dim): (usize, usize),
        tiles: bool,
    ) -> Result<RoundTarget> {
        s.rounded
            .target(&self.dev.stream, (n, dim), tiles, reads_copy)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Matrix = CudaMatrix;
    type Vector = CudaBuffer;

    fn name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal())
    }

    fn load_matrix(&self, m: &HostMatrix) -> Result<CudaMatrix> {
        m.check()?;
        format_suffix(m.ty)?;
        self.foreign(|| {
            CudaMatrix::upload(
                &self.dev.stream,
                &self.steps,
                m.bytes.as_slice(),
                m.ty,
                m.rows,
                m.cols,
                &m.name,
            )
        })
    }

    fn load_vector(&self, v: &[f32]) -> Result<CudaBuffer> {
        let mut b = self.alloc(v.len())?;
        self.write(v, &mut b)?;
        Ok(b)
    }

    fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        // A new buffer may reuse the address of a freed one that a rounded copy was made of.
        self.queue.bump();
        self.foreign(|| CudaBuffer::zeroed(&self.dev.stream, &self.steps, len))
    }

    fn embed(
        &self,
        table: &CudaMatrix,
        tokens: &[u32],
        scale: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        need("embed", out.len(), tokens.len() * table.cols)?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::Invalid(format!(
                "token id {id} is outside the {} rows of '{}'",
                table.rows, table.name
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let held = self.uploads()?;
        let ids = self.upload_idx(&held, tokens)?;
        let spans = blocks(table.cols.div_ceil(32), DEQUANT_THREADS);
        self.launch_fn(
            &self.kernels.func_for(Module::Ops, "embed", table.ty, 0)?,
            Grid::new(
                (int("tokens", tokens.len())? as u32, spans),
                DEQUANT_THREADS as u32,
            ),
            &[
                Arg::U64(table.ptr),
                Arg::U64(table.row_bytes as u64),
                Arg::U64(ids),
                Arg::I32(int("cols", table.cols)?),
                Arg::F32(scale),
                Arg::U64(out.ptr),
            ],
        )
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        weight: Option<&CudaBuffer>,
        eps: f32,
        n: usize,
        dim: usize,
        out: &mut CudaBuffer,
        mode: NormOut,
    ) -> Result<()> {
        need("rms_norm input", x.len(), n * dim)?;
        need("rms_norm output", out.len(), n * dim)?;
        if let Some(w) = weight {
            need("rms_norm weight", w.len(), dim)?;
        }
        if n == 0 || dim == 0 {
            return Ok(());
        }
        // One value (or float4) per thread where the row allows, up to 1024 threads.
        let per_thread = if dim.is_multiple_of(4) { 4 } else { 1 };
        let threads = (dim.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        // A copy for the next product only of values written, not added; none beside the
        // kernel ahead, which may read the copy that kernel's producer made.
        let beside = self.take_beside();
        let mut s = self.scratch()?;
        let round = match mode {
            NormOut::Write if !beside => {
                self.round_target(&mut s, (n, dim), dim <= Q4K_TILES_MAX_DIM)?
            }
            _ => RoundTarget::NONE,
        };
        self.run(
            Module::Ops,
            "rms_norm",
            norm_grid(n, threads, dim, round)?,
            &[
                Arg::U64(x.ptr),
                Arg::U64(weight.map_or(0, |w| w.ptr)),
                Arg::F32(eps),
                Arg::I32(int("dim", dim)?),
                Arg::U64(out.ptr),
                Arg::I32((mode == NormOut::AddTo) as i32),
                Arg::U64(round.at),
                Arg::I32(round.kind),
                Arg::I32(beside as i32),
            ],
        )?;
        s.rounded.hold(round, out.ptr, n * dim, &self.queue);
        Ok(())
    }

    fn residual_norm(
        &self,
        y: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
    ) -> Result<()> {
        self.residual_norm_launch(y, None, weight, eps, (n, dim), h, scale, next, &[])
    }

    fn residual_norms(
        &self,
        y: &CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: (&CudaBuffer, &mut CudaBuffer),
        extra: &mut [(&CudaBuffer, &mut CudaBuffer)],
    ) -> Result<()> {
        if extra.len() > EXTRA_NORMS {
            return Err(Error::Unsupported(format!(
                "cuda residual_norms: {} extra norms (at most {EXTRA_NORMS})",
                extra.len()
            )));
        }
        for (w, x) in extra.iter() {
            need("residual_norm extra weight", w.len(), dim)?;
            need("residual_norm extra output", x.len(), n * dim)?;
        }
        let ptrs: Vec<(u64, u64)> = extra.iter().map(|(w, x)| (w.ptr, x.ptr)).collect();
        self.residual_norm_launch(y, None, weight, eps, (n, dim), h, scale, Some(next), &ptrs)
    }

    fn next_beside_previous(&self) {
        if let Ok(mut b) = self.beside.lock() {
            *b = Some(std::thread::current().id());
        }
    }

    fn moe_residual_norm(
        &self,
        (dense, w_dense): (&CudaBuffer, &CudaBuffer),
        (experts, w_experts): (&CudaBuffer, &CudaBuffer),
        _mix: &mut CudaBuffer,
        weight: &CudaBuffer,
        eps: f32,
        n: usize,
        dim: usize,
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
    ) -> Result<()> {
        need("moe_residual_norm experts", experts.len(), n * dim)?;
        need("moe_residual_norm dense weight", w_dense.len(), dim)?;
        need("moe_residual_norm experts weight", w_experts.len(), dim)?;
        let mix = Some((w_dense, experts, w_experts));
        self.residual_norm_launch(dense, mix, weight, eps, (n, dim), h, scale, next, &[])
    }

    fn matmul(&self, x: &CudaBuffer, n: usize, w: &CudaMatrix, out: &mut CudaBuffer) -> Result<()> {
        need("matmul input", x.len(), n * w.cols)?;
        need("matmul output", out.len(), n * w.rows)?;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        match &self.blas {
            Some(blas) if !gemv_suits(n, w.ty, w.cols) => self.gemm(blas, x.ptr, n, w, out.ptr),
            _ => self.gemv(x.ptr, n, w, out.ptr, None),
        }
    }

    fn matmul_many(
        &self,
        x: &CudaBuffer,
        n: usize,
        products: &mut [(&CudaMatrix, &mut CudaBuffer)],
    ) -> Result<()> {
        for (w, out) in products.iter() {
            need("matmul input", x.len(), n * w.cols)?;
            need("matmul output", out.len(), n * w.rows)?;
        }
        // Matrices of one storage (format and row bytes) share a launch, up to MAX_PRODUCTS
        // of them, in order of their first member (llama.cpp's Q4_K_M keeps some layers' v in
        // Q6_K beside Q4_K q and k: two launches there, not three).
        let key = |w: &CudaMatrix| (w.ty, w.cols, w.row_bytes);
        let mut done = vec![false; products.len()];
        for i in 0..products.len() {
            if done[i] {
                continue;
            }
            let group: Vec<usize> = (i..products.len())
                .filter(|&j| !done[j] && key(products[j].0) == key(products[i].0))
                .take(MAX_PRODUCTS)
                .collect();
            group.iter().for_each(|&j| done[j] = true);
            if n > 0 && group.len() > 1 {
                let ptrs: Vec<(&CudaMatrix, u64)> = group
                    .iter()
                    .map(|&j| (products[j].0, products[j].1.ptr))
                    .collect();
                if self.matmul_shared(x.ptr, n, &ptrs)? {
                    continue;
                }
            }
            for &j in &group {
                let (w, out) = &mut products[j];
                self.matmul(x, n, w, out)?;
            }
        }
        Ok(())
    }

    fn gated_ffn(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        down: &CudaMatrix,
        ff: usize,
        gate_out: &mut CudaBuffer,
        up_out: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if self.gated_ffn_mma(x, n, (gate, up, down), ff, gate_out, out)? {
            return Ok(());
        }
        if let Some(blas) = &self.blas {
            let bf16 = [gate.ty, up.ty, down.ty]
                .iter()
                .all(|&t| t == GgmlType::BF16);
            let tensor_cores = [gate.cols, ff]
                .iter()
                .all(|&k| product_inputs(GgmlType::BF16, k, n) == ProductInputs::Bf16);
            if bf16 && tensor_cores && (n * ff).is_multiple_of(8) {
                let mats = (gate, up, down);
                return self.gated_ffn_bf16(blas, x, n, mats, ff, gate_out, up_out, out);
            }
        }
        self.gelu_gated_matmul(x, n, gate, up, ff, gate_out, up_out)?;
        self.matmul(gate_out, n, down, out)
    }

    fn gelu_gated_matmul(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate: &CudaMatrix,
        up: &CudaMatrix,
        ff: usize,
        gate_out: &mut CudaBuffer,
        up_out: &mut CudaBuffer,
    ) -> Result<()> {
        if (gate.rows, gate.cols, gate.ty) != (ff, up.cols, up.ty) || up.rows != ff {
            return Err(Error::Invalid(format!(
                "cuda gated matmul: gate [{}, {}] {} and up [{}, {}] {} for {ff} outputs",
                gate.rows, gate.cols, gate.ty, up.rows, up.cols, up.ty
            )));
        }
        if self.blas.is_some() && !gemv_suits(n, gate.ty, gate.cols) {
            self.matmul_many(x, n, &mut [(gate, &mut *gate_out), (up, &mut *up_out)])?;
            let all = Strided {
                offset: 0,
                stride: ff,
            };
            return self.gelu_mul_rows(gate_out, up_out, all, n, ff);
        }
        need("gated matmul input", x.len(), n * gate.cols)?;
        need("gated matmul output", gate_out.len(), n * ff)?;
        self.gemv_gelu(x.ptr, n, (gate, up), gate_out.ptr)
    }

    fn gelu_matmul_mul(
        &self,
        x: &CudaBuffer,
        n: usize,
        w: &CudaMatrix,
        rows: usize,
        other: &CudaBuffer,
        from: Strided,
        out: &mut CudaBuffer,
        _scratch: &mut CudaBuffer,
    ) -> Result<()> {
        if rows != w.rows {
            return Err(Error::Invalid(format!(
                "cuda gated matmul: '{}' has {} rows, not {rows}",
                w.name, w.rows
            )));
        }
        need("gated matmul input", x.len(), n * w.cols)?;
        need("gated matmul output", out.len(), n * rows)?;
        if n > 0 {
            need("gated matmul gate", other.len(), from.at(n - 1) + rows)?;
        }
        if self.blas.is_some() && !gemv_suits(n, w.ty, w.cols) {
            // The product, then the gate read in place, rounded for the next product.
            self.matmul(x, n, w, out)?;
            return self.gelu_mul_rows(out, other, from, n, rows);
        }
        let mul = other.ptr + 4 * from.offset as u64;
        self.gemv(x.ptr, n, w, out.ptr, Some((mul, from.stride)))
    }

    fn head_norm_rope(
        &self,
        x: &mut CudaBuffer,
        n_heads: usize,
        head_dim: usize,
        norm: Option<(&CudaBuffer, f32)>,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()> {
        check_rope(rope, head_dim)?;
        let heads = positions.len() * n_heads;
        need("rope", x.len(), heads * head_dim)?;
        if let Some((w, _)) = norm {
            need("head norm weight", w.len(), head_dim)?;
        }
        if heads == 0 {
            return Ok(());
        }
        let freqs = self.rope_table(rope, head_dim)?;
        let held = self.uploads()?;
        let pos = self.upload_idx(&held, positions)?;
        let mut grid = Grid::new((int("heads", heads)? as u32, 1), 32);
        grid.shared = (head_dim * 4) as u32;
        self.run(
            Module::Ops,
            "head_norm_rope",
            grid,
            &[
                Arg::U64(x.ptr),
                Arg::I32(n_heads as i32),
                Arg::I32(head_dim as i32),
                Arg::U64(norm.map_or(0, |(w, _)| w.ptr)),
                Arg::F32(norm.map_or(0.0, |(_, e)| e)),
                Arg::U64(freqs),
                Arg::I32(rope.rotated_pairs as i32),
                Arg::U64(pos),
            ],
        )
    }

    fn rope_write_kv(
        &self,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: ValueRows<'_, CudaBuffer>,
        spec: &AttnSpec,
        norms: (&CudaBuffer, &CudaBuffer, f32),
        rope: &Rope,
        positions: &[u32],
        slots: &[u32],
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<()> {
        let (q_norm, k_norm, eps) = norms;
        let (v, v_norm) = value_rows(v);
        let (hd, kvh, n) = (spec.head_dim, spec.n_kv_heads, positions.len());
        check_rope(rope, hd)?;
        need("rope_write_kv queries", q.len(), n * spec.n_heads * hd)?;
        need("rope_write_kv keys", k.len().min(v.len()), n * kvh * hd)?;
        need(
            "rope_write_kv norm weights",
            q_norm.len().min(k_norm.len()),
            hd,
        )?;
        if slots.len() != n {
            return Err(Error::Invalid(format!(
                "rope_write_kv: {} cache slots for {n} tokens",
                slots.len()
            )));
        }
        check_slots(slots, kvh * hd, k_cache, v_cache)?;
        let heads = n * (spec.n_heads + kvh);
        if heads == 0 {
            return Ok(());
        }
        let freqs = self.rope_table(rope, hd)?;
        let held = self.uploads()?;
        let pos = self.upload_idx(&held, positions)?;
        let sl = self.upload_idx(&held, slots)?;
        let mut grid = Grid::new((int("heads", heads)? as u32, 1), 32);
        grid.shared = (hd * 4) as u32;
        self.run(
            Module::Ops,
            "rope_write_kv",
            grid,
            &[
                Arg::U64(q.ptr),
                Arg::U64(k.ptr),
                Arg::U64(v.ptr),
                Arg::I32(spec.n_heads as i32),
                Arg::I32(kvh as i32),
                Arg::I32(hd as i32),
                Arg::U64(q_norm.ptr),
                Arg::U64(k_norm.ptr),
                Arg::F32(eps),
                Arg::U64(freqs),
                Arg::I32(rope.rotated_pairs as i32),
                Arg::U64(pos),
                Arg::U64(sl),
                Arg::U64(k_cache.ptr),
                Arg::U64(v_cache.ptr),
                Arg::I32(v_norm),
            ],
        )
    }

    fn write_kv(
        &self,
        k: &CudaBuffer,
        v: &CudaBuffer,
        row: usize,
        slots: &[u32],
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<()> {
        need("write_kv input", k.len().min(v.len()), slots.len() * row)?;
        check_slots(slots, row, k_cache, v_cache)?;
        if slots.is_empty() || row == 0 {
            return Ok(());
        }
        let held = self.uploads()?;
        let sl = self.upload_idx(&held, slots)?;
        self.run(
            Module::Ops,
            "write_kv",
            Grid::new((blocks(row, 256), int("tokens", slots.len())? as u32), 256),
            &[
                Arg::U64(k.ptr),
                Arg::U64(v.ptr),
                Arg::I32(int("row", row)?),
                Arg::U64(sl),
                Arg::U64(k_cache.ptr),
                Arg::U64(v_cache.ptr),
            ],
        )
    }

    fn rope_attention(
        &self,
        q: &mut CudaBuffer,
        q_norm: &CudaBuffer,
        eps: f32,
        new_kv: Option<NewKv<'_, Self>>,
        rope: &Rope,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if !self.fuses_rope_attention(spec, rope, layout, new_kv.as_ref().map(|kv| kv.slots)) {
            return rope_attention_in_steps(
                self, q, q_norm, eps, new_kv, rope, spec, layout, k_cache, v_cache, out,
            );
        }
        let (hd, kvh, n) = (spec.head_dim, spec.n_kv_heads, layout.positions.len());
        need("rope_attention query norm", q_norm.len(), hd)?;
        let new = match new_kv {
            Some(NewKv {
                k,
                v,
                k_norm,
                slots,
            }) => {
                let (v, v_norm) = value_rows(v);
                need("rope_attention keys", k.len().min(v.len()), n * kvh * hd)?;
                need("rope_attention key norm", k_norm.len(), hd)?;
                check_slots(slots, kvh * hd, k_cache, v_cache)?;
                Some(NewRows {
                    k: k.ptr,
                    v: v.ptr,
                    k_norm: k_norm.ptr,
                    v_norm,
                    slots,
                })
            }
            None => None,
        };
        let fused = FusedRope {
            q_norm: q_norm.ptr,
            eps,
            freqs: self.rope_table(rope, hd)?,
            pairs: rope.rotated_pairs as i32,
            new,
        };
        self.attention_checked(q, k_cache, v_cache, spec, layout, out, Some(fused))
    }

    fn attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.attention_checked(q, k_cache, v_cache, spec, layout, out, None)
    }

    fn moe_route(
        &self,
        logits: &CudaBuffer,
        n: usize,
        n_experts: usize,
        top_k: usize,
        expert_scale: &CudaBuffer,
        weights: &mut CudaBuffer,
        ids: &mut CudaBuffer,
    ) -> Result<()> {
        if top_k == 0 || top_k > n_experts || n_experts > MAX_EXPERTS || top_k > MAX_TOP_K {
            return Err(Error::Invalid(format!(
                "cuda moe_route: top {top_k} of {n_experts} experts (at most top {MAX_TOP_K} of \
                 {MAX_EXPERTS})"
            )));
        }
        need("moe_route logits", logits.len(), n * n_experts)?;
        need("moe_route expert scales", expert_scale.len(), n_experts)?;
        need("moe_route weights", weights.len(), n * top_k)?;
        need("moe_route ids", ids.len(), n * top_k)?;
        if n == 0 {
            return Ok(());
        }
        self.run(
            Module::Moe,
            "moe_route",
            Grid::new((blocks(n, 4), 1), 128),
            &[
                Arg::U64(logits.ptr),
                Arg::I32(int("tokens", n)?),
                Arg::I32(n_experts as i32),
                Arg::I32(top_k as i32),
                Arg::U64(expert_scale.ptr),
                Arg::U64(weights.ptr),
                Arg::U64(ids.ptr),
            ],
        )
    }

    fn moe_ffn(
        &self,
        x: &CudaBuffer,
        n: usize,
        gate_up: &CudaMatrix,
        down: &CudaMatrix,
        n_experts: usize,
        top_k: usize,
        weights: &CudaBuffer,
        ids: &CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let d = gate_up.cols;
        let f = down.cols;
        if n_experts == 0 || gate_up.rows != n_experts * 2 * f || down.rows != n_experts * d {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: '{}' [{}, {}] and '{}' [{}, {}] do not stack {n_experts} experts",
                gate_up.name, gate_up.rows, gate_up.cols, down.name, down.rows, down.cols
            )));
        }
        need("moe_ffn input", x.len(), n * d)?;
        need("moe_ffn output", out.len(), n * d)?;
        need("moe_ffn weights", weights.len().min(ids.len()), n * top_k)?;
        let pairs = n * top_k;
        if pairs == 0 {
            return Ok(());
        }
        if n > MAX_GRID_Y {
            return Err(Error::Invalid(format!(
                "cuda moe_ffn: {n} tokens in one call (at most {MAX_GRID_Y}: a grid row each)"
            )));
        }
        let tensor_cores =
            self.dev.capability().0 >= 8 && moe_on_tensor_cores(gate_up.ty, down.ty, d, f);
        let call = MoeCall {
            x,
            n,
            gate_up,
            down,
            n_experts,
            top_k,
            tensor_cores,
            weights,
            ids,
        };
        if moe_groups_pairs(n, n_experts, gate_up.ty, (d, f), tensor_cores) {
            self.moe_ffn_grouped(call, out)
        } else {
            self.moe_ffn_per_pair(call, out)
        }
    }

    fn copy(
        &self,
        src: &CudaBuffer,
        src_off: usize,
        dst: &mut CudaBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        need("copy source", src.len(), src_off + len)?;
        need("copy destination", dst.len(), dst_off + len)?;
        if len == 0 {
            return Ok(());
        }
        const F32: usize = std::mem::size_of::<f32>();
        self.queue_copy(DeviceCopy {
            src: src.ptr + (src_off * F32) as u64,
            dst: dst.ptr + (dst_off * F32) as u64,
            src_pitch: len * F32,
            dst_pitch: len * F32,
            width: len * F32,
            height: 1,
        })
    }

    fn copy_rows(
        &self,
        src: &CudaBuffer,
        from: Strided,
        dst: &mut CudaBuffer,
        to: Strided,
        rows: usize,
        len: usize,
    ) -> Result<()> {
        if rows == 0 || len == 0 {
            return Ok(());
        }
        if from.stride < len || to.stride < len {
            return Err(Error::Invalid(format!(
                "cuda copy_rows: rows of {len} values {} and {} apart overlap",
                from.stride, to.stride
            )));
        }
        need("copy_rows source", src.len(), from.at(rows - 1) + len)?;
        need("copy_rows destination", dst.len(), to.at(rows - 1) + len)?;
        const F32: usize = std::mem::size_of::<f32>();
        self.queue_copy(DeviceCopy {
            src: src.ptr + (from.offset * F32) as u64,
            dst: dst.ptr + (to.offset * F32) as u64,
            src_pitch: from.stride * F32,
            dst_pitch: to.stride * F32,
            width: len * F32,
            height: rows,
        })
    }

    fn gelu_tanh_mul(&self, gate: &mut CudaBuffer, up: &CudaBuffer, len: usize) -> Result<()> {
        need("gelu_tanh_mul", gate.len().min(up.len()), len)?;
        let all = Strided {
            offset: 0,
            stride: len,
        };
        self.gelu_mul_launch(gate, up, all, len, len, RoundTarget::NONE)
    }

    fn add(&self, x: &mut CudaBuffer, y: &CudaBuffer, len: usize) -> Result<()> {
        need("add", x.len().min(y.len()), len)?;
        self.elementwise(
            "add",
            &[Arg::U64(x.ptr), Arg::U64(y.ptr), Arg::U64(len as u64)],
            len,
        )
    }

    fn scale(&self, x: &mut CudaBuffer, s: f32, len: usize) -> Result<()> {
        need("scale", x.len(), len)?;
        self.elementwise(
            "scale",
            &[Arg::U64(x.ptr), Arg::F32(s), Arg::U64(len as u64)],
            len,
        )
    }

    fn softcap(&self, x: &mut CudaBuffer, cap: f32, len: usize) -> Result<()> {
        need("softcap", x.len(), len)?;
        self.elementwise(
            "softcap",
            &[Arg::U64(x.ptr), Arg::F32(cap), Arg::U64(len as u64)],
            len,
        )
    }

    fn write(&self, src: &[f32], dst: &mut CudaBuffer) -> Result<()> {
        need("write", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut to = dst.mem.slice_mut(0..src.len());
        self.queue.bump();
        self.foreign(|| {
            self.dev
                .stream
                .memcpy_htod(src, &mut to)
                .map_err(|e| driver_err("host-to-device copy", e))
        })
    }

    fn argmax(&self, x: &CudaBuffer, rows: usize, n: usize) -> Result<Vec<u32>> {
        self.argmax_rows(x, rows, n)
    }

    fn sample(&self, x: &CudaBuffer, rows: usize, n: usize, draws: &[Draw]) -> Result<Vec<u32>> {
        self.sample_rows(x, rows, n, draws)
    }

    fn read(&self, x: &CudaBuffer, dst: &mut [f32]) -> Result<()> {
        self.read_range(x, 0, dst)
    }
}
