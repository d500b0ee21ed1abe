//! cuBLASLt for prefill-sized and batched-decode products: a row-major
//! `out[n, rows] = x[n, k] · w[rows, k]ᵀ`, in f32 (no TF32, so it matches the f32 reference) or
//! on the tensor cores with bf16 or f16 inputs and f32 accumulation (f32 output, or bf16 for a
//! product whose result the next one reads in bf16).
//!
//! Each product shape gets a plan once (descriptors and an algorithm, kept for the backend's
//! life), so a call is one `cublasLtMatmul`: a batch-64 decode step makes hundreds of these,
//! and choosing the algorithm per call cost ≈ 12 µs of host time each. A decode-sized shape's
//! algorithm is the fastest of the heuristic's candidates and their k splits, timed once
//! ([`tune`]); a prefill's is the heuristic's first.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use markbase_core::{Error, Result};
use sys::cublasLtMatmulAlgoConfigAttributes_t as ConfigAttr;

use crate::device_wide::device_wide;
use crate::graph::{Steps, WeakSteps};
use crate::nvrtc::ensure_library;
use crate::rounded::QueueCount;
use crate::tune;

/// Device workspace cuBLASLt may use per product.
const WORKSPACE_BYTES: usize = 32 << 20;
/// `cublasOperation_t::CUBLAS_OP_T` (cublas_api.h): the weights are used transposed.
const CUBLAS_OP_T: i32 = 1;
/// Plans kept before the table is emptied (shapes vary with the tokens of a step).
const MAX_PLANS: usize = 4096;
/// Candidates asked of the heuristic for a product whose algorithm is chosen by timing.
const TUNE_CANDIDATES: usize = 16;
/// Parts the k dimension of a timed product's candidates is also tried in.
const TUNE_SPLITS: [u32; 5] = [2, 4, 8, 16, 32];
/// Most token rows of a product whose algorithm is chosen by timing (decode steps; a
/// prefill's products are large enough for the heuristic's choice, and its many row counts
/// would each pay the timing).
const TUNE_MAX_ROWS: usize = 256;

/// The token rows whose products of one shape share the algorithm timed for the first of
/// them (`Blas::reuse_tuned`): up to 8, then runs of 16. Timing every row count apart stalled
/// a server whose steps' rows vary for ≈ 0.5 s at each new count (E4B Q8_0 at 128 requests:
/// TTFT p90 521 ms against 46 ms at 64, docs/perf.md session 53).
fn tuning_rows(rows: usize) -> usize {
    if rows <= 8 {
        8
    } else {
        rows.div_ceil(16) * 16
    }
}

/// The largest token-row count of each run of `tuning_rows` up to `TUNE_MAX_ROWS`.
fn tuning_runs() -> Vec<usize> {
    let mut rows = vec![tuning_rows(1)];
    while let Some(&last) = rows.last().filter(|&&r| r < TUNE_MAX_ROWS) {
        rows.push(tuning_rows(last + 1));
    }
    rows
}

/// How a product shape's algorithm is chosen (environment variable `MARKBASE_CUBLASLT_TUNE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tune {
    /// `0`: the heuristic's first choice.
    Off,
    /// The default: the fastest of the heuristic's candidates, timed, for decode-sized
    /// products ([`TUNE_MAX_ROWS`]).
    On,
    /// `report`: as `On`, and each timing printed on stderr.
    Report,
}

impl Tune {
    fn from_env() -> Tune {
        match std::env::var("MARKBASE_CUBLASLT_TUNE").as_deref() {
            Ok("0") => Tune::Off,
            Ok("report") => Tune::Report,
            _ => Tune::On,
        }
    }
}

/// Element type of a [`Blas::gemm_rows`] product's inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GemmInput {
    /// f32 weights and activations.
    F32,
    /// bf16 weights and activations (the tensor cores).
    Bf16,
    /// f16 weights and activations (the tensor cores).
    F16,
}

/// Element type of a [`Blas::gemm_rows`] product's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GemmOutput {
    /// f32.
    F32,
    /// bf16, rounded to nearest from the f32 sums.
    Bf16,
}

/// One column-major operand of a product: `rows × cols`, leading dimension `ld`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Operand {
    rows: usize,
    cols: usize,
    ld: usize,
}

/// One product shape, in cuBLASLt's column-major terms: `C = op(A) · B` (`op(A) = Aᵀ` with
/// `transa`); output type; byte alignments of A, B and C.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Shape {
    input: GemmInput,
    output: GemmOutput,
    transa: bool,
    a: Operand,
    b: Operand,
    c: Operand,
    aligns: [u32; 3],
    /// Products in one call (1, or 2 for a pair) and the element offsets from each product's
    /// A, B and C to the next one's (B's 0: both read the same activations).
    batch: (i32, [i64; 3]),
}

/// One product to queue: its shape (planned) and the addresses of A, B and C.
pub(crate) struct GemmCall {
    shape: Shape,
    ptrs: [u64; 3],
}

impl Operand {
    fn key(&self, out: &mut Vec<u64>) {
        out.extend([self.rows, self.cols, self.ld].map(|v| v as u64));
    }
}

impl Shape {
    /// The shape whose timed algorithm this one reuses: its token rows (B's and C's columns)
    /// as `tuning_rows` groups them.
    fn tuning_key(&self) -> Shape {
        let rows = tuning_rows(self.b.cols);
        let mut key = *self;
        key.b.cols = rows;
        key.c.cols = rows;
        key
    }

    /// Bytes from the first output element to the last one's end, over the whole batch.
    fn output_bytes(&self) -> usize {
        let size = if self.output == GemmOutput::F32 { 4 } else { 2 };
        let c = self.c;
        let last_batch = (self.batch.0.max(1) as usize - 1) * self.batch.1[2].max(0) as usize;
        size * (c.ld * c.cols.saturating_sub(1) + c.rows + last_batch)
    }
}

impl GemmCall {
    /// Token rows of the product: the columns of its B operand (activations or query rows).
    pub(crate) fn token_rows(&self) -> usize {
        self.shape.b.cols
    }

    /// Appends the words that identify the product: shape, alignments and addresses.
    pub(crate) fn key(&self, out: &mut Vec<u64>) {
        let s = &self.shape;
        out.extend([s.input as u64, s.output as u64, u64::from(s.transa)]);
        for op in [s.a, s.b, s.c] {
            op.key(out);
        }
        out.extend(s.aligns.map(u64::from));
        out.push(s.batch.0 as u64);
        out.extend(s.batch.1.map(|v| v as u64));
        out.extend(self.ptrs);
    }
}

/// Descriptors and algorithm of one product shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by this plan and is destroyed once.
        unsafe {
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A u32 configuration attribute of `algo` (0 where cuBLASLt does not give it).
fn config_u32(algo: &sys::cublasLtMatmulAlgo_t, attr: ConfigAttr) -> u32 {
    let mut v = 0u32;
    let mut written = 0usize;
    // SAFETY: reads one attribute of a plain algorithm value into a u32.
    let _ = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            (&mut v as *mut u32).cast(),
            std::mem::size_of::<u32>(),
            &mut written,
        )
    };
    v
}

/// Sets a u32 configuration attribute of `algo`.
fn set_config_u32(
    algo: &mut sys::cublasLtMatmulAlgo_t,
    attr: ConfigAttr,
    v: u32,
) -> std::result::Result<(), lt::CublasError> {
    // SAFETY: writes one u32 attribute into a plain algorithm value.
    unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attr,
            (&v as *const u32).cast(),
            std::mem::size_of::<u32>(),
        )
        .result()
    }
}

/// The largest power of two (up to 256) dividing a device address: cuBLASLt's algorithms
/// each need some alignment of A, B, C and D, which the heuristic is told.
fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// The shape of `out[t·ldo + r] = Σ_i x[t·k + i] · w[r·k + i]` (`t < n`, `r < rows`) in
/// cuBLASLt's column-major terms, C(rows × n) = Wᵀ(rows × k) · X(k × n) with W stored k × rows;
/// `batch` as in [`Shape`].
fn rows_shape(
    (input, output): (GemmInput, GemmOutput),
    rows: usize,
    k: usize,
    n: usize,
    ldo: usize,
    aligns: [u32; 3],
    batch: (i32, [i64; 3]),
) -> Shape {
    let op = |rows, cols, ld| Operand { rows, cols, ld };
    Shape {
        input,
        output,
        transa: true,
        a: op(k, rows, k),
        b: op(k, n, k),
        c: op(rows, n, ldo),
        aligns,
        batch,
    }
}

/// A cuBLASLt handle, its workspace and the plans made so far, on the backend's stream.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    _workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: Mutex<HashMap<Shape, Plan>>,
    /// Timed algorithms by `Shape::tuning_key`.
    tuned: Mutex<HashMap<Shape, sys::cublasLtMatmulAlgo_t>>,
    stream: Arc<CudaStream>,
    queue: QueueCount,
    tune: Tune,
    /// The backend's step recorder (which holds this), held while a shape is timed (`call`).
    steps: OnceLock<WeakSteps>,
}

// SAFETY: the handle and plans are only used under the backend's operations, which queue on
// one stream; cuBLASLt handles may be used from any thread, and plans are read-only once made
// (the map is behind a mutex).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        let _held = device_wide();
        // SAFETY: the handle was created by `new` and is destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn blas_err(what: &str, e: lt::CublasError) -> Error {
    Error::Invalid(format!("cuBLASLt {what}: {e:?}"))
}

impl Blas {
    /// A handle on `stream`, or `None` when cuBLASLt 13 is not installed.
    pub(crate) fn new(stream: &Arc<CudaStream>, queue: QueueCount) -> Result<Option<Blas>> {
        if !ensure_library("libcublasLt.so.13", &[], None)
            // SAFETY: only probes for the library by name.
            || !unsafe { sys::is_culib_present() }
        {
            return Ok(None);
        }
        let handle = {
            let _held = device_wide();
            lt::create_handle().map_err(|e| Error::Unsupported(format!("cuBLASLt: {e:?}")))?
        };
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| Error::Unsupported(format!("cuBLASLt workspace: {e:?}")))?;
        let workspace_ptr = workspace.device_ptr(stream).0;
        Ok(Some(Blas {
            handle,
            _workspace: workspace,
            workspace_ptr,
            plans: Mutex::new(HashMap::new()),
            tuned: Mutex::new(HashMap::new()),
            stream: stream.clone(),
            queue,
            tune: Tune::from_env(),
            steps: OnceLock::new(),
        }))
    }

    /// The descriptors and algorithm for `shape`: with `tune` (the product's `[A, B, C]`) the
    /// fastest of its candidates, timed; else the one timed for its `tuning_key` where
    /// cuBLASLt accepts it for this shape, or the heuristic's first choice.
    fn plan(&self, shape: Shape, tune: Option<[u64; 3]>) -> Result<Plan> {
        let ty = match shape.input {
            GemmInput::F32 => sys::cudaDataType::CUDA_R_32F,
            GemmInput::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            GemmInput::F16 => sys::cudaDataType::CUDA_R_16F,
        };
        let f32_ty = sys::cudaDataType::CUDA_R_32F;
        let out_ty = match shape.output {
            GemmOutput::F32 => f32_ty,
            GemmOutput::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        };
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let mut plan = Plan {
            desc: lt::create_matmul_desc(compute, f32_ty)
                .map_err(|e| blas_err("matmul descriptor", e))?,
            layouts: Vec::with_capacity(3),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let (count, strides) = shape.batch;
        for (i, (t, op)) in [(ty, shape.a), (ty, shape.b), (out_ty, shape.c)]
            .into_iter()
            .enumerate()
        {
            let layout = lt::create_matrix_layout(t, op.rows as u64, op.cols as u64, op.ld as i64)
                .map_err(|e| blas_err("matrix layout", e))?;
            plan.layouts.push(layout);
            if count > 1 {
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                // SAFETY: a live layout; the count is an int32, the offset an int64.
                unsafe {
                    lt::set_matrix_layout_attribute(
                        layout,
                        L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&count as *const i32).cast(),
                        std::mem::size_of::<i32>(),
                    )
                    .and_then(|()| {
                        lt::set_matrix_layout_attribute(
                            layout,
                            L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            (&strides[i] as *const i64).cast(),
                            std::mem::size_of::<i64>(),
                        )
                    })
                }
                .map_err(|e| blas_err("batch of a matrix layout", e))?;
            }
        }
        if shape.transa {
            // SAFETY: a live descriptor; the attribute value is a cublasOperation_t (a C int).
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    (&CUBLAS_OP_T as *const i32).cast(),
                    std::mem::size_of::<i32>(),
                )
            }
            .map_err(|e| blas_err("transpose attribute", e))?;
        }
        plan.algo = match tune {
            Some(ptrs) => {
                let found = self.candidates(&plan, shape, TUNE_CANDIDATES)?;
                let found = self.with_splits(&plan, &found);
                let algo = self.fastest(&plan, shape, &found, ptrs)?;
                self.tuned()?.insert(shape.tuning_key(), algo);
                algo
            }
            None => match self.reuse_tuned(&plan, shape)? {
                Some(algo) => algo,
                None => self.candidates(&plan, shape, 1)?[0],
            },
        };
        Ok(plan)
    }

    /// The timed algorithms.
    fn tuned(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, HashMap<Shape, sys::cublasLtMatmulAlgo_t>>> {
        self.tuned
            .lock()
            .map_err(|_| Error::Invalid("cuBLASLt timings poisoned by an earlier panic".into()))
    }

    /// The algorithm timed for `shape`'s `tuning_key`, where cuBLASLt accepts it for `plan`
    /// (`cublasLtMatmulAlgoCheck`) within the workspace.
    fn reuse_tuned(&self, plan: &Plan, shape: Shape) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
        let algo = self.tuned()?.get(&shape.tuning_key()).copied();
        Ok(algo.filter(|a| self.accepts(plan, a)))
    }

    /// Whether cuBLASLt runs `algo` for `plan`'s shape within the workspace
    /// (`cublasLtMatmulAlgoCheck`).
    fn accepts(&self, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        let l = &plan.layouts;
        // SAFETY: the check reads live descriptors of `plan` and a plain algorithm value and
        // writes one result (an all-zero one is a valid value of the plain C struct).
        unsafe {
            let mut check = std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>();
            sys::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                l[0],
                l[1],
                l[2],
                l[2],
                algo,
                &mut check,
            )
            .result()
            .is_ok_and(|()| check.workspaceSize <= WORKSPACE_BYTES)
        }
    }

    /// One token-row count of each run that shares a timed algorithm (`tuning_rows`), up to
    /// `TUNE_MAX_ROWS`; none when timing is off.
    pub(crate) fn timed_row_runs(&self) -> Vec<usize> {
        if self.tune == Tune::Off {
            return Vec::new();
        }
        tuning_runs()
    }

    /// Shapes whose algorithm was chosen by timing so far.
    pub(crate) fn timed_shapes(&self) -> Result<usize> {
        Ok(self.tuned()?.len())
    }

    /// Up to `count` algorithms for `plan`'s shape, the heuristic's first choice first.
    fn candidates(
        &self,
        plan: &Plan,
        shape: Shape,
        count: usize,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>> {
        let pref = lt::create_matmul_pref().map_err(|e| blas_err("preference", e))?;
        let workspace = WORKSPACE_BYTES as u64;
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let [align_w, align_x, align_out] = shape.aligns;
        // SAFETY: an all-zero heuristic result is a valid value of the plain C struct.
        let mut results =
            vec![unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() }; count];
        let mut returned = 0;
        // SAFETY: live descriptors; each attribute value has the type the attribute takes
        // (u64 for the workspace, u32 for alignments); the results array holds `count`
        // entries; the preference is destroyed after the query.
        let found = unsafe {
            let set =
                |attr, v: *const c_void, size| lt::set_matmul_pref_attribute(pref, attr, v, size);
            let u32_size = std::mem::size_of::<u32>();
            let found = set(
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                set(
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    (&align_w as *const u32).cast(),
                    u32_size,
                )
            })
            .and_then(|()| {
                set(
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    (&align_x as *const u32).cast(),
                    u32_size,
                )
            })
            .and_then(|()| {
                set(
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    (&align_out as *const u32).cast(),
                    u32_size,
                )
            })
            .and_then(|()| {
                set(
                    Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    (&align_out as *const u32).cast(),
                    u32_size,
                )
            })
            .and_then(|()| {
                let l = &plan.layouts;
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    l[0],
                    l[1],
                    l[2],
                    l[2],
                    pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        let algos: Vec<_> = results
            .iter()
            .take(returned.max(0) as usize)
            .filter(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= WORKSPACE_BYTES
            })
            .map(|r| r.algo)
            .collect();
        match found {
            Ok(()) if !algos.is_empty() => Ok(algos),
            Ok(()) => Err(Error::Invalid(format!(
                "cuBLASLt: no algorithm for {shape:?}"
            ))),
            Err(e) => Err(blas_err(&format!("no algorithm for {shape:?}"), e)),
        }
    }

    /// `algos` and each of them with its k split in [`TUNE_SPLITS`] parts (summed in place,
    /// or in f32 scratch and then summed), where cuBLASLt accepts the split for the plan and
    /// its scratch fits the workspace; no algorithm twice. The heuristic seldom splits k for a
    /// decode step's products, which leaves most multiprocessors idle where a matrix has few
    /// rows (E4B's o: 20 tiles of 128 rows).
    fn with_splits(
        &self,
        plan: &Plan,
        algos: &[sys::cublasLtMatmulAlgo_t],
    ) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtReductionScheme_t as Reduce;
        let mut out: Vec<sys::cublasLtMatmulAlgo_t> = Vec::new();
        for base in algos {
            if !out.contains(base) {
                out.push(*base);
            }
            for split in TUNE_SPLITS {
                for scheme in [
                    Reduce::CUBLASLT_REDUCTION_SCHEME_INPLACE,
                    Reduce::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                ] {
                    let mut algo = *base;
                    let set = set_config_u32(
                        &mut algo,
                        ConfigAttr::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                        split,
                    )
                    .and_then(|()| {
                        set_config_u32(
                            &mut algo,
                            ConfigAttr::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                            scheme as u32,
                        )
                    });
                    let fits = set.is_ok() && self.accepts(plan, &algo);
                    if fits && !out.contains(&algo) {
                        out.push(algo);
                    }
                }
            }
        }
        out
    }

    /// The fastest of `algos` for `shape` on the weights and activations of `[A, B, _]`, timed
    /// into scratch output (`tune::fastest`); reported on stderr with
    /// `MARKBASE_CUBLASLT_TUNE=report`.
    fn fastest(
        &self,
        plan: &Plan,
        shape: Shape,
        algos: &[sys::cublasLtMatmulAlgo_t],
        [a, b, _]: [u64; 3],
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let started = std::time::Instant::now();
        let (best, times) =
            tune::fastest(&self.stream, algos.len(), shape.output_bytes(), |i, c| {
                // SAFETY: A and B are the product's own live operands (only read); `c` is
                // scratch of the output's size.
                unsafe { self.matmul(plan, &algos[i], shape.input, [a, b, c]) }
            })?;
        if self.tune == Tune::Report {
            let ran = times.iter().flatten().count();
            let first = times[0].map_or("failed".into(), |t| format!("{t:.1} µs"));
            let best_time = times[best].unwrap_or(f32::NAN);
            let (split, scheme) = (
                config_u32(&algos[best], ConfigAttr::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                config_u32(
                    &algos[best],
                    ConfigAttr::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                ),
            );
            eprintln!(
                "cuBLASLt tuning: {} rows × k {} × {} tokens (batch {}): heuristic's first \
                 {first}, fastest {best_time:.1} µs (candidate {best} of {ran} timed: k in \
                 {split} parts, reduction {scheme}); {:.0} ms",
                shape.a.cols,
                shape.a.rows,
                shape.b.cols,
                shape.batch.0,
                started.elapsed().as_secs_f64() * 1e3,
            );
        }
        Ok(algos[best])
    }

    /// The product `out[t·ldo + r] = Σ_i x[t·k + i] · w[r·k + i]` for `t < n`, `r < rows`:
    /// `w` and `x` hold elements of `input`, `out` elements of `output`, accumulation in f32
    /// (no TF32).
    ///
    /// # Safety
    /// The pointers must be live device allocations of at least the sizes implied when the
    /// call is issued.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_rows(
        &self,
        (input, output): (GemmInput, GemmOutput),
        w: u64,
        rows: usize,
        k: usize,
        x: u64,
        n: usize,
        out: u64,
        ldo: usize,
    ) -> Result<GemmCall> {
        let aligns = [alignment(w), alignment(x), alignment(out)];
        let shape = rows_shape((input, output), rows, k, n, ldo, aligns, (1, [0; 3]));
        self.call(shape, [w, x, out])
    }

    /// Two products of one shape on the same activations in one call: [`Blas::gemm_rows`]
    /// with `w[0]` into `out[0]` and `w[1]` into `out[1]` (gate and up, or k and v);
    /// `None` where the second matrix or output lies below the first (a batch steps forward)
    /// or cuBLASLt has no algorithm for the pair.
    ///
    /// # Safety
    /// As [`Blas::gemm_rows`], for both products.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_rows_pair(
        &self,
        (input, output): (GemmInput, GemmOutput),
        w: [u64; 2],
        rows: usize,
        k: usize,
        x: u64,
        n: usize,
        out: [u64; 2],
        ldo: usize,
    ) -> Result<Option<GemmCall>> {
        let in_size = if input == GemmInput::F32 { 4 } else { 2 };
        let out_size = if output == GemmOutput::F32 { 4 } else { 2 };
        let step = |p: [u64; 2], size: u64| {
            p[1].checked_sub(p[0])
                .filter(|d| d % size == 0)
                .and_then(|d| i64::try_from(d / size).ok())
        };
        let (Some(w_step), Some(out_step)) = (step(w, in_size), step(out, out_size)) else {
            return Ok(None);
        };
        let aligns = [
            alignment(w[0] | w[1]),
            alignment(x),
            alignment(out[0] | out[1]),
        ];
        let batch = (2, [w_step, 0, out_step]);
        let shape = rows_shape((input, output), rows, k, n, ldo, aligns, batch);
        // A batch the heuristic has no algorithm for runs as two calls.
        Ok(self.call(shape, [w[0], x, out[0]]).ok())
    }

    /// Gives the backend's step recorder, which timing a shape holds (`call`).
    pub(crate) fn attach(&self, steps: &Steps) {
        let _ = self.steps.set(steps.downgrade());
    }

    /// The product of `shape` on `[A, B, C]`, planned now if it is the shape's first.
    fn call(&self, shape: Shape, ptrs: [u64; 3]) -> Result<GemmCall> {
        // A shape not planned yet is timed unless its run of row counts was (the timings only
        // looked up for new shapes, not on every step's products).
        let timed = self.tune != Tune::Off
            && shape.b.cols <= TUNE_MAX_ROWS
            && !self.plans()?.contains_key(&shape)
            && !self.tuned()?.contains_key(&shape.tuning_key());
        let plan = || {
            self.plan_in(&mut *self.plans()?, shape, timed.then_some(ptrs))
                .map(|_| ())
        };
        match self.steps.get().and_then(WeakSteps::upgrade) {
            // Timing queues products, copies and waits on the backend's stream outside the
            // recorder: with it locked (before the plans: the recorder's issuing takes them
            // in that order) no other thread captures a step meanwhile — its capture would
            // take in the timing's work, or fail — and whatever it held back for a graph
            // goes first.
            Some(steps) if timed => steps.lock()?.foreign(plan)?,
            _ => plan()?,
        }
        // Counted when asked for (it may be issued later, or again under capture).
        self.queue.bump();
        Ok(GemmCall { shape, ptrs })
    }

    fn plans(&self) -> Result<std::sync::MutexGuard<'_, HashMap<Shape, Plan>>> {
        self.plans
            .lock()
            .map_err(|_| Error::Invalid("cuBLASLt plans poisoned by an earlier panic".into()))
    }

    /// The plan of `shape` in `plans`, made now if it is not there (a full table is emptied
    /// first), timed on `tune`'s operands if given.
    fn plan_in<'a>(
        &self,
        plans: &'a mut HashMap<Shape, Plan>,
        shape: Shape,
        tune: Option<[u64; 3]>,
    ) -> Result<&'a Plan> {
        if !plans.contains_key(&shape) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let plan = self.plan(shape, tune)?;
            plans.insert(shape, plan);
        }
        Ok(&plans[&shape])
    }

    /// Queues `call` (planned again, untimed — the stream may be capturing — if its plan was
    /// dropped since).
    ///
    /// # Safety
    /// The call's pointers must be live device allocations of the sizes its maker implied.
    pub(crate) unsafe fn issue(&self, call: &GemmCall) -> Result<()> {
        let mut plans = self.plans()?;
        let plan = self.plan_in(&mut plans, call.shape, None)?;
        self.matmul(plan, &plan.algo, call.shape.input, call.ptrs)
    }

    /// Queues `plan`'s product with `algo` on `[A, B, C]`.
    ///
    /// # Safety
    /// As [`Blas::issue`].
    unsafe fn matmul(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        input: GemmInput,
        [a, b, c]: [u64; 3],
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        lt::matmul(
            self.handle,
            plan.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            a as *const c_void,
            plan.layouts[0],
            b as *const c_void,
            plan.layouts[1],
            c as *const c_void,
            plan.layouts[2],
            c as *mut c_void,
            plan.layouts[2],
            algo,
            self.workspace_ptr as *mut c_void,
            WORKSPACE_BYTES,
            self.stream.cu_stream() as _,
        )
        .map_err(|e| blas_err(&format!("{input:?} product"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use half::bf16;
    use rand::Rng;

    #[test]
    fn row_counts_share_a_timing_in_runs_of_16_past_8() {
        let runs: Vec<usize> = [1, 3, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256]
            .map(tuning_rows)
            .to_vec();
        assert_eq!(runs, [8, 8, 8, 16, 16, 32, 32, 48, 64, 80, 128, 144, 256]);
        // A row count of each run, its largest: 8, 16, 32, …, 256.
        let each = tuning_runs();
        assert_eq!(each.len(), 17);
        assert!(each.iter().all(|&r| tuning_rows(r) == r));
        let mut seen: Vec<usize> = (1..=TUNE_MAX_ROWS).map(tuning_rows).collect();
        seen.dedup();
        assert_eq!(seen, each);
    }

    /// Every algorithm the tuner may choose for a product — the heuristic's candidates and
    /// their k splits, in-place or through scratch — gives the product of bf16 inputs to f32
    /// rounding, on fresh random inputs at decode shapes (E4B's PLE gate and o at 8 and 64
    /// tokens, where splits are accepted) and a ragged one. Skipped where CUDA is absent.
    #[test]
    fn every_timed_candidate_gives_the_product() {
        let dev = match Device::open(0) {
            Ok(d) => d,
            Err(e @ Error::Unsupported(_)) => return eprintln!("GPU test skipped: {e}"),
            Err(e) => panic!("CUDA present but the device did not open: {e}"),
        };
        let blas = Blas::new(&dev.stream, QueueCount::default())
            .unwrap()
            .expect("cuBLASLt 13 beside a working GPU");
        let mut rng = rand::rng();
        for (rows, k, n) in [(256, 2560, 8), (2560, 2048, 64), (97, 328, 5)] {
            let mut random = |len: usize| -> Vec<bf16> {
                (0..len)
                    .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
                    .collect()
            };
            let (w, x) = (random(rows * k), random(n * k));
            let expect: Vec<f64> = (0..n * rows)
                .map(|i| {
                    let (t, r) = (i / rows, i % rows);
                    (0..k)
                        .map(|j| {
                            f64::from(w[r * k + j].to_f32()) * f64::from(x[t * k + j].to_f32())
                        })
                        .sum()
                })
                .collect();
            let s = &dev.stream;
            let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
            let (w_d, x_d) = (
                s.clone_htod(&bits(&w)).unwrap(),
                s.clone_htod(&bits(&x)).unwrap(),
            );
            let mut out = s.alloc_zeros::<f32>(n * rows).unwrap();
            let ptrs = [
                w_d.device_ptr(s).0,
                x_d.device_ptr(s).0,
                out.device_ptr(s).0,
            ];
            let shape = rows_shape(
                (GemmInput::Bf16, GemmOutput::F32),
                rows,
                k,
                n,
                rows,
                ptrs.map(alignment),
                (1, [0; 3]),
            );
            let plan = blas.plan(shape, None).unwrap();
            let base = blas.candidates(&plan, shape, TUNE_CANDIDATES).unwrap();
            let algos = blas.with_splits(&plan, &base);
            assert!(
                algos.len() > base.len(),
                "{rows}×{k}×{n}: no split accepted"
            );
            for (i, algo) in algos.iter().enumerate() {
                s.memset_zeros(&mut out).unwrap();
                // SAFETY: the three live allocations above, of the shape's sizes.
                unsafe { blas.matmul(&plan, algo, GemmInput::Bf16, ptrs) }.unwrap();
                let got = s.clone_dtoh(&out).unwrap();
                let split = config_u32(algo, ConfigAttr::CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
                for (j, (g, e)) in got.iter().zip(&expect).enumerate() {
                    let tol = 1e-4 * (k as f64).sqrt() + 1e-5 * e.abs();
                    assert!(
                        (f64::from(*g) - e).abs() <= tol,
                        "{rows}×{k}×{n}, candidate {i} (k in {split} parts): out[{j}] = {g}, \
                         expected {e}"
                    );
                }
            }
        }
    }
}
