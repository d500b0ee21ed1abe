//! Steps replayed as CUDA graphs.
//!
//! A step is everything queued between two host waits (a decode step ends with the wait for
//! its chosen tokens). The backend hands every stream operation of a step — kernel launch,
//! device copy, cuBLASLt product — to the [`Steps`] recorder as an [`Op`], which keeps it
//! with a key: the kernel (or copy, or product shape) and every argument by value. When a
//! step queues exactly the keys of the step before it, it is captured into a CUDA graph after
//! its wait (the recorded operations issued again under stream capture) and instantiated;
//! prefills are not ([`MAX_CAPTURED_OPS`]).
//!
//! While a step's operations so far are the first operations of some graph, the recorder
//! holds them back instead of issuing them, and launches the graph's part for each
//! [`SEGMENT_OPS`] operations as soon as they are matched (a graph is captured in such
//! segments, so the device starts on a step while the host is still checking the rest of it);
//! if the step ends (its host wait) with exactly a graph's operations, the last segment runs
//! too. At the first operation that no graph begins with — or anything the recorder cannot
//! hold (a host copy, an allocation, freeing memory) — everything held back is issued in order
//! and the step goes on as usual. A replayed step therefore runs exactly the operations it
//! asked for: keys hold every pointer and value.
//!
//! What differs between replays is the host's index arrays (tokens, positions, cache slots,
//! block tables, sampler draws). They go to a per-step arena ([`Steps::upload`]): each array
//! of a step takes the next place in it (one the step uploads again keeps its place), so equal
//! keys mean equal places, and a replay copies what the step placed so far to the device
//! before each segment.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream};
use markbase_core::{Error, Result};

use crate::blas::{Blas, GemmCall};
use crate::device::driver_err;
use crate::device_wide::{capturing, Pinned};
use crate::kernels::Launch;

/// Graphs kept; the one replayed longest ago goes first.
const MAX_GRAPHS: usize = 32;
/// First arena size in u32 (grows by doubling).
const ARENA_START: usize = 1 << 14;
/// Arena places are aligned to this many u32 (16 bytes).
const ARENA_ALIGN: usize = 4;
/// Operations per graph of a captured step. A step matching a graph launches each segment as
/// soon as its operations are matched, so the device starts on the step while the host is
/// still checking the rest (a whole-step graph made the device wait for all of it: E4B Q4_K
/// batch 1 ran 343.6 t/s against 345.7 without graphs, H200). Each segment boundary costs a
/// graph launch and a full dependency where programmatic launch would overlap two kernels.
const SEGMENT_OPS: usize = 64;
/// Longest step captured, in operations (with [`MAX_CAPTURED_ROWS`], what keeps prefills out).
/// A graph saves the host's launch work, which paces a decode step (E4B batch 64: ≈ 730
/// operations, products of 64 rows); a prefill is paced by its kernels, so a graph gains it
/// nothing, and capturing its operations cost more than the step: E4B bf16 pp4096 ran
/// 29 306 ± 10 422 t/s with its repetitions captured and replayed, 34 776 ± 69 with graphs
/// off; pp512 32 621 ± 12 929 against 39 957 ± 80 (H200, docs/perf.md, session 19). Captured
/// prefills would also push decode graphs out of the [`MAX_GRAPHS`] kept.
const MAX_CAPTURED_OPS: usize = 2048;
/// Most token rows of a product in a captured step (decode steps have one a sequence).
const MAX_CAPTURED_ROWS: usize = 256;

/// A device-to-device copy of `height` rows of `width` bytes, `src_pitch` / `dst_pitch`
/// bytes apart (one row: a plain copy).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceCopy {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) src_pitch: usize,
    pub(crate) dst_pitch: usize,
    pub(crate) width: usize,
    pub(crate) height: usize,
}

impl DeviceCopy {
    fn issue(&self, stream: &CudaStream) -> Result<()> {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: self.src,
            srcArray: std::ptr::null_mut(),
            srcPitch: self.src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: self.dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: self.dst_pitch,
            WidthInBytes: self.width,
            Height: self.height,
        };
        // SAFETY: the backend checked both regions against live allocations when it made the
        // copy; it is queued on the backend's stream.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
            .result()
            .map_err(|e| driver_err("device copy", e))
    }
}

/// One stream operation of a step.
pub(crate) enum Op {
    /// A kernel launch.
    Kernel(Launch),
    /// A device-to-device copy.
    Copy(DeviceCopy),
    /// A cuBLASLt product.
    Gemm(GemmCall),
}

impl Op {
    /// Appends the words that identify the operation with all its arguments.
    fn key(&self, out: &mut Vec<u64>) {
        match self {
            Op::Kernel(l) => {
                out.push(1);
                l.key(out);
            }
            Op::Copy(c) => out.extend([
                2,
                c.src,
                c.dst,
                c.src_pitch as u64,
                c.dst_pitch as u64,
                c.width as u64,
                c.height as u64,
            ]),
            Op::Gemm(g) => {
                out.push(3);
                g.key(out);
            }
        }
    }

    /// Token rows of a product (0 for other operations).
    fn token_rows(&self) -> usize {
        match self {
            Op::Gemm(g) => g.token_rows(),
            Op::Kernel(_) | Op::Copy(_) => 0,
        }
    }

    fn issue(&self, stream: &CudaStream, blas: Option<&Blas>) -> Result<()> {
        match self {
            Op::Kernel(l) => l.issue(stream),
            Op::Copy(c) => c.issue(stream),
            Op::Gemm(g) => {
                let blas =
                    blas.ok_or_else(|| Error::Invalid("cuBLASLt product without cuBLASLt".into()))?;
                // SAFETY: the backend checked the operands when it made the call.
                unsafe { blas.issue(g) }
            }
        }
    }
}

/// The keys of a step's operations, one after another.
#[derive(Clone, Default, PartialEq, Debug)]
pub(crate) struct Keys {
    words: Vec<u64>,
    ends: Vec<usize>,
}

impl Keys {
    fn push(&mut self, op: &Op) {
        op.key(&mut self.words);
        self.ends.push(self.words.len());
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn op(&self, i: usize) -> &[u64] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.words[start..self.ends[i]]
    }

    /// Whether operation `i` of `self` has key `key`.
    fn has_at(&self, i: usize, key: &[u64]) -> bool {
        i < self.len() && self.op(i) == key
    }

    fn clear(&mut self) {
        self.words.clear();
        self.ends.clear();
    }
}

/// Graphs whose first `i + 1` operations match a step's, from `candidates` (graphs matching
/// its first `i`; `keys_of` gives a graph's keys), given the step's keys so far (`step`,
/// holding `i + 1` operations).
fn narrow<'a>(candidates: &mut Vec<usize>, keys_of: impl Fn(usize) -> &'a Keys, step: &Keys) {
    let i = step.len() - 1;
    let key = step.op(i);
    candidates.retain(|&g| keys_of(g).has_at(i, key));
}

/// A captured step: its keys and one graph per `SEGMENT_OPS` operations.
struct StepGraph {
    keys: Keys,
    segments: Vec<CudaGraph>,
    used: u64,
}

/// The host side of a step's index arrays and their device copy.
struct Arena {
    host: Pinned,
    host_ptr: *mut u32,
    _dev: CudaSlice<u32>,
    dev_ptr: u64,
    /// u32 used this step.
    used: usize,
    /// u32 already copied to the device this step.
    copied: usize,
    /// (host address of the caller's array, offset, length) of each array placed this step.
    places: Vec<(usize, usize, usize)>,
    /// Earlier host buffers, kept until the step's wait (copies from them may be queued).
    retired: Vec<Pinned>,
}

impl Arena {
    fn new(stream: &Arc<CudaStream>, cap: usize) -> Result<Arena> {
        // Plain page-locked memory (not write-combined: the host compares arrays in it).
        let mut host = Pinned::alloc(stream.context(), cap)?;
        let host_ptr = host
            .as_mut_ptr()
            .map_err(|e| driver_err("pinned allocation", e))?;
        // SAFETY: written (by copies from the host buffer) before any kernel reads it.
        let dev = unsafe { stream.alloc::<u32>(cap) }
            .map_err(|e| driver_err(&format!("allocating {cap} index slots"), e))?;
        let dev_ptr = crate::buffer::addr(&dev, stream);
        Ok(Arena {
            host,
            host_ptr,
            _dev: dev,
            dev_ptr,
            used: 0,
            copied: 0,
            places: Vec::new(),
            retired: Vec::new(),
        })
    }

    fn host(&self) -> &[u32] {
        // SAFETY: `host_ptr` points at `host.len()` u32 owned by `host`.
        unsafe { std::slice::from_raw_parts(self.host_ptr, self.host.len()) }
    }

    /// Queues the copy of everything placed since the last copy.
    fn copy_pending(&mut self, stream: &CudaStream) -> Result<()> {
        if self.copied < self.used {
            let src = &self.host()[self.copied..self.used];
            // SAFETY: the device arena holds `used` u32; the source is page-locked and is not
            // written again before the step's wait.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.dev_ptr + 4 * self.copied as u64,
                    src,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("index upload", e))?;
            self.copied = self.used;
        }
        Ok(())
    }
}

/// The recorder's state (see the module comment).
pub(crate) struct Recorder {
    stream: Arc<CudaStream>,
    blas: Option<Arc<Blas>>,
    /// Graphs are made and replayed (else every operation is issued as it comes).
    enabled: bool,
    ops: Vec<Op>,
    keys: Keys,
    /// `ops[..issued]` are on the stream.
    issued: usize,
    /// Operations are held back: the step so far begins every graph in `candidates`.
    holding: bool,
    candidates: Vec<usize>,
    /// The step queued something that is not recorded: it is not captured.
    foreign: bool,
    /// The step ran as a graph launch.
    replayed: bool,
    graphs: Vec<StepGraph>,
    /// Keys of the last step that ran eagerly.
    last: Keys,
    arena: Arena,
    tick: u64,
    replays: u64,
    /// An error of a flush that had nowhere to go (a buffer's drop), raised at the next call.
    pending: Option<Error>,
    /// Why graphs were turned off, if a capture failed.
    off_reason: Option<String>,
}

// SAFETY: the raw handles inside (kernel functions, cuBLASLt descriptors, the pinned buffer's
// address) are used only under the recorder's lock, on the backend's one stream.
unsafe impl Send for Recorder {}

/// The backend's step recorder, shared with the buffers it hands out (a buffer freed while
/// operations that may read it are held back issues them first).
#[derive(Clone)]
pub(crate) struct Steps(Arc<Mutex<Recorder>>);

/// A [`Steps`] that does not keep the recorder alive (for cuBLASLt, which the recorder holds).
pub(crate) struct WeakSteps(Weak<Mutex<Recorder>>);

impl WeakSteps {
    /// The recorder, if the backend still has it.
    pub(crate) fn upgrade(&self) -> Option<Steps> {
        self.0.upgrade().map(Steps)
    }
}

impl Steps {
    /// A reference that does not keep the recorder alive.
    pub(crate) fn downgrade(&self) -> WeakSteps {
        WeakSteps(Arc::downgrade(&self.0))
    }

    /// A recorder queueing on `stream`; graphs on if `enabled`.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        blas: Option<Arc<Blas>>,
        enabled: bool,
    ) -> Result<Steps> {
        Ok(Steps(Arc::new(Mutex::new(Recorder {
            stream: stream.clone(),
            blas,
            enabled,
            ops: Vec::new(),
            keys: Keys::default(),
            issued: 0,
            holding: false,
            candidates: Vec::new(),
            foreign: false,
            replayed: false,
            graphs: Vec::new(),
            last: Keys::default(),
            arena: Arena::new(stream, ARENA_START)?,
            tick: 0,
            replays: 0,
            pending: None,
            off_reason: None,
        }))))
    }

    /// The recorder, locked.
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, Recorder>> {
        self.0
            .lock()
            .map_err(|_| Error::Invalid("CUDA step recorder poisoned by an earlier panic".into()))
    }

    /// For a drop: issues whatever is held back (it may read the memory), then runs `free`,
    /// which frees device memory in stream order, with the recorder locked — so that no other
    /// thread is capturing a step meanwhile (the free would join its graph). An error waits
    /// for the recorder's next call.
    pub(crate) fn free_after_held(&self, free: impl FnOnce()) {
        match self.0.lock() {
            Ok(mut r) => {
                if let Err(e) = r.release() {
                    r.pending.get_or_insert(e);
                }
                free();
            }
            // A poisoned recorder no longer captures anything.
            Err(_) => free(),
        }
    }
}

impl Recorder {
    fn check_pending(&mut self) -> Result<()> {
        self.pending.take().map_or(Ok(()), Err)
    }

    fn issue_range(&mut self, end: usize) -> Result<()> {
        let blas = self.blas.as_deref();
        for op in &self.ops[self.issued..end] {
            op.issue(&self.stream, blas)?;
        }
        self.issued = end;
        Ok(())
    }

    /// Stops holding back: queues the arena's new arrays and every held operation.
    pub(crate) fn release(&mut self) -> Result<()> {
        if self.holding {
            self.holding = false;
            self.candidates.clear();
            self.arena.copy_pending(&self.stream)?;
            self.issue_range(self.ops.len())?;
        }
        Ok(())
    }

    /// Queues `op` (or holds it back while the step matches a graph).
    pub(crate) fn queue(&mut self, op: Op) -> Result<()> {
        self.check_pending()?;
        if !self.enabled {
            return op.issue(&self.stream, self.blas.as_deref());
        }
        if self.ops.is_empty() && !self.foreign && !self.graphs.is_empty() {
            // A new step: it may be one of the graphs.
            self.holding = true;
            self.candidates = (0..self.graphs.len()).collect();
        }
        self.keys.push(&op);
        self.ops.push(op);
        if self.holding {
            let graphs = &self.graphs;
            narrow(&mut self.candidates, |g| &graphs[g].keys, &self.keys);
            let Some(&g) = self.candidates.first() else {
                return self.release();
            };
            let n = self.ops.len();
            if n.is_multiple_of(SEGMENT_OPS) {
                // Every candidate's segment n / SEGMENT_OPS − 1 is these operations.
                self.launch_segment(g, n / SEGMENT_OPS - 1)?;
            }
            return Ok(());
        }
        self.issue_range(self.ops.len())
    }

    /// Launches segment `i` of graph `g` (the step's arrays placed so far copied first).
    fn launch_segment(&mut self, g: usize, i: usize) -> Result<()> {
        self.arena.copy_pending(&self.stream)?;
        self.graphs[g].segments[i]
            .launch()
            .map_err(|e| driver_err("graph launch", e))?;
        self.issued = ((i + 1) * SEGMENT_OPS).min(self.graphs[g].keys.len());
        Ok(())
    }

    /// Runs `f`, which queues something the recorder does not hold (a host copy, a memset,
    /// an allocation), after everything held back; the step is not captured.
    pub(crate) fn foreign<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.check_pending()?;
        self.release()?;
        self.foreign = true;
        f()
    }

    /// The device address of a copy of the index array `v` in this step's arena. The same
    /// array uploaded again in the step (the same host slice, unchanged: the positions every
    /// layer passes) keeps its place; an equal array from elsewhere takes a new one, so where
    /// things go never depends on the values (tokens that happen to equal positions would
    /// otherwise change a step's keys).
    pub(crate) fn upload(&mut self, v: &[u32]) -> Result<u64> {
        self.check_pending()?;
        let arena = &self.arena;
        let from = v.as_ptr() as usize;
        if let Some(&(_, off, _)) = arena.places.iter().find(|&&(at, off, len)| {
            at == from && len == v.len() && &arena.host()[off..off + len] == v
        }) {
            return Ok(arena.dev_ptr + 4 * off as u64);
        }
        let off = self.arena.used.next_multiple_of(ARENA_ALIGN);
        if off + v.len() > self.arena.host.len() {
            self.grow(off + v.len())?;
            return self.upload(v);
        }
        // SAFETY: `off + v.len()` is inside the host buffer (checked above); no queued copy
        // reads this part before the step's wait (places only grow within a step).
        unsafe { std::slice::from_raw_parts_mut(self.arena.host_ptr.add(off), v.len()) }
            .copy_from_slice(v);
        self.arena.places.push((from, off, v.len()));
        self.arena.used = off + v.len();
        if !self.holding {
            self.arena.copy_pending(&self.stream)?;
        }
        Ok(self.arena.dev_ptr + 4 * off as u64)
    }

    /// A larger arena holding at least `need` u32; what this step placed so far stays (its
    /// copies and the operations reading it were queued against the old one).
    fn grow(&mut self, need: usize) -> Result<()> {
        self.release()?;
        let cap = need.max(2 * self.arena.host.len());
        let mut arena = Arena::new(&self.stream, cap)?;
        arena.retired = std::mem::take(&mut self.arena.retired);
        let old = std::mem::replace(&mut self.arena, arena);
        // The old device arena is freed in stream order, after the operations reading it.
        self.arena.retired.push(old.host);
        Ok(())
    }

    /// Before the step's host wait: runs the step as a graph if it queued exactly a graph's
    /// operations, else issues whatever is held back.
    pub(crate) fn finish_queueing(&mut self) -> Result<()> {
        self.check_pending()?;
        if self.holding {
            let n = self.keys.len();
            if let Some(&g) = self
                .candidates
                .iter()
                .find(|&&g| self.graphs[g].keys.len() == n)
            {
                self.holding = false;
                if self.issued < n {
                    self.launch_segment(g, n.div_ceil(SEGMENT_OPS) - 1)?;
                }
                self.tick += 1;
                self.graphs[g].used = self.tick;
                self.replays += 1;
                self.replayed = true;
                return Ok(());
            }
        }
        self.release()
    }

    /// After the step's host wait: captures the step if it repeated the one before, then
    /// starts the next step.
    pub(crate) fn start_next_step(&mut self) {
        let new = !self.replayed && !self.graphs.iter().any(|g| g.keys == self.keys);
        if self.enabled && !self.foreign && new && self.capturable() {
            if self.keys == self.last {
                self.capture();
            } else {
                std::mem::swap(&mut self.keys, &mut self.last);
            }
        }
        self.ops.clear();
        self.keys.clear();
        self.issued = 0;
        self.holding = false;
        self.candidates.clear();
        self.foreign = false;
        self.replayed = false;
        self.arena.used = 0;
        self.arena.copied = 0;
        self.arena.places.clear();
        self.arena.retired.clear();
    }

    /// Whether the step's operations may become a graph: some, and no prefill
    /// ([`MAX_CAPTURED_OPS`], [`MAX_CAPTURED_ROWS`]).
    fn capturable(&self) -> bool {
        !self.ops.is_empty()
            && self.ops.len() <= MAX_CAPTURED_OPS
            && self
                .ops
                .iter()
                .all(|op| op.token_rows() <= MAX_CAPTURED_ROWS)
    }

    /// Captures the step's operations (issued again under stream capture, not run) into
    /// graphs. A failure turns graphs off (the step itself has run) and is kept as the
    /// reason ([`Recorder::off_reason`]).
    fn capture(&mut self) {
        let made = self.record_segments();
        match made {
            Ok(segments) => {
                if self.graphs.len() >= MAX_GRAPHS {
                    let oldest = (0..self.graphs.len())
                        .min_by_key(|&g| self.graphs[g].used)
                        .expect("a graph");
                    self.graphs.swap_remove(oldest);
                }
                self.tick += 1;
                self.graphs.push(StepGraph {
                    keys: std::mem::take(&mut self.keys),
                    segments,
                    used: self.tick,
                });
                self.last.clear();
            }
            Err(e) => {
                self.off_reason = Some(format!("capturing a step failed: {e}"));
                self.enabled = false;
                self.graphs.clear();
            }
        }
    }

    fn record_segments(&mut self) -> Result<Vec<CudaGraph>> {
        self.issued = 0;
        let mut segments = Vec::new();
        let _capturing = capturing();
        while self.issued < self.ops.len() {
            let end = (self.issued + SEGMENT_OPS).min(self.ops.len());
            let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            self.stream
                .begin_capture(mode)
                .map_err(|e| driver_err("stream capture", e))?;
            let issued = self.issue_range(end);
            let graph = self
                .stream
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| driver_err("graph capture", e));
            issued?;
            segments
                .push(graph?.ok_or_else(|| {
                    Error::Invalid("CUDA graph capture returned no graph".into())
                })?);
        }
        Ok(segments)
    }

    /// Steps run as graph launches so far.
    pub(crate) fn replays(&self) -> u64 {
        self.replays
    }

    /// Turns graphs on or off (off: every operation is issued as it comes; graphs made so far
    /// are dropped).
    pub(crate) fn set_enabled(&mut self, on: bool) -> Result<()> {
        self.release()?;
        self.enabled = on;
        self.off_reason = None;
        if !on {
            self.graphs.clear();
            self.last.clear();
        }
        Ok(())
    }

    /// Whether graphs are on.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Why graphs went off by themselves (a capture failed), if they did.
    pub(crate) fn off_reason(&self) -> Option<String> {
        self.off_reason.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Grid;

    fn copy(src: u64, height: usize) -> Op {
        Op::Copy(DeviceCopy {
            src,
            dst: 4096,
            src_pitch: 64,
            dst_pitch: 64,
            width: 64,
            height,
        })
    }

    fn keys(ops: &[Op]) -> Keys {
        let mut k = Keys::default();
        for op in ops {
            k.push(op);
        }
        k
    }

    #[test]
    fn keys_tell_operations_apart_by_every_argument() {
        let a = keys(&[copy(0, 1), copy(64, 2)]);
        assert_eq!(a, keys(&[copy(0, 1), copy(64, 2)]));
        assert_ne!(a, keys(&[copy(0, 1), copy(64, 3)]));
        assert_ne!(a, keys(&[copy(0, 1), copy(128, 2)]));
        assert_ne!(a, keys(&[copy(0, 1)]));
        let launch = |threads, x: f32| {
            let mut grid = Grid::new((4, 1), threads);
            grid.shared = 0;
            Op::Kernel(Launch {
                func: std::ptr::null_mut(),
                grid,
                args: vec![crate::kernels::Arg::F32(x)],
                early: true,
            })
        };
        assert_eq!(keys(&[launch(64, 1.0)]), keys(&[launch(64, 1.0)]));
        assert_ne!(keys(&[launch(64, 1.0)]), keys(&[launch(128, 1.0)]));
        assert_ne!(keys(&[launch(64, 0.0)]), keys(&[launch(64, -0.0)]));
    }

    #[test]
    fn candidates_narrow_to_the_graphs_a_step_begins() {
        let g0 = keys(&[copy(0, 1), copy(64, 1), copy(128, 1)]);
        let g1 = keys(&[copy(0, 1), copy(64, 2)]);
        let g2 = keys(&[copy(32, 1)]);
        let graphs = [&g0, &g1, &g2];
        let keys_of = |g: usize| graphs[g];
        let mut candidates = vec![0, 1, 2];
        let mut step = keys(&[copy(0, 1)]);
        narrow(&mut candidates, keys_of, &step);
        assert_eq!(candidates, [0, 1]);
        step.push(&copy(64, 2));
        narrow(&mut candidates, keys_of, &step);
        assert_eq!(candidates, [1]);
        step.push(&copy(128, 1));
        narrow(&mut candidates, keys_of, &step);
        assert!(
            candidates.is_empty(),
            "a step longer than every graph matches none"
        );
    }
}
