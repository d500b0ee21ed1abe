//! cuBLAS for prefill-sized products: a handle bound to the backend's stream and a row-major
//! `out[n, rows] = x[n, k] · w[rows, k]ᵀ`, in f32 (no TF32, so it matches the f32 reference) or,
//! for bf16 weights, on the tensor cores with bf16 activations and f32 accumulation.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys};
use cudarc::driver::CudaStream;
use markbase_core::{Error, Result};

use crate::nvrtc::ensure_library;

/// A cuBLAS handle on the backend's stream.
pub(crate) struct Blas {
    handle: sys::cublasHandle_t,
    _stream: Arc<CudaStream>,
}

// SAFETY: the handle is only used under the backend's operations, which queue on one stream;
// cuBLAS handles may be used from any thread as long as calls do not overlap, and the backend
// serialises its calls through `&self` methods that each complete the enqueue before returning.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    /// A handle on `stream`, or `None` when cuBLAS 13 is not installed.
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Option<Blas>> {
        if !ensure_library("libcublas.so.13", &["libcublasLt.so.13"], None)
            // SAFETY: only probes for the library by name.
            || !unsafe { sys::is_culib_present() }
        {
            return Ok(None);
        }
        let handle = blas::create_handle()
            .map_err(|e| Error::Unsupported(format!("cuBLAS handle: {e:?}")))?;
        // SAFETY: a live handle and stream.
        unsafe { blas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| Error::Unsupported(format!("cuBLAS stream: {e:?}")))?;
        Ok(Some(Blas {
            handle,
            _stream: stream.clone(),
        }))
    }

    /// `out[t·ldo + r] = Σ_i x[t·k + i] · w[r·k + i]` for `t < n`, `r < rows`: column-major
    /// `C(rows × n) = Wᵀ(rows × k) · X(k × n)` with leading dimension `ldo` for C; `w` and `x`
    /// hold elements of `input`, C is f32, accumulation in f32 (no TF32).
    ///
    /// # Safety
    /// The pointers must be live device allocations of at least the sizes implied.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm_rows(
        &self,
        input: GemmInput,
        w: u64,
        rows: usize,
        k: usize,
        x: u64,
        n: usize,
        out: u64,
        ldo: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| Error::Invalid(format!("GEMM size {v} too large")))
        };
        let ty = match input {
            GemmInput::F32 => sys::cudaDataType::CUDA_R_32F,
            GemmInput::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        };
        blas::gemm_ex(
            self.handle,
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            int(rows)?,
            int(n)?,
            int(k)?,
            (&alpha as *const f32).cast(),
            w as *const std::ffi::c_void,
            ty,
            int(k)?,
            x as *const std::ffi::c_void,
            ty,
            int(k)?,
            (&beta as *const f32).cast(),
            out as *mut std::ffi::c_void,
            sys::cudaDataType::CUDA_R_32F,
            int(ldo)?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| Error::Invalid(format!("cuBLAS {input:?} gemm: {e:?}")))
    }
}

/// Element type of a [`Blas::gemm_rows`] product's inputs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GemmInput {
    /// f32 weights and activations.
    F32,
    /// bf16 weights and activations (the tensor cores).
    Bf16,
}
