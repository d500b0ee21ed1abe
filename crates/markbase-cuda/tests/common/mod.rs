//! What the GPU test binaries share: starting the backend, or skipping where CUDA is absent.

use markbase_core::Error;
use markbase_cuda::CudaBackend;

/// The backend on GPU 0, or `None` (with the reason printed) where CUDA is absent: no driver,
/// GPU or NVRTC (`Error::Unsupported`). Anything else — a kernel unit that does not compile, a
/// driver error on a present GPU — panics, failing the test instead of passing as skipped.
pub fn backend_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ Error::Unsupported(_)) => {
            eprintln!("GPU tests skipped: {e}");
            None
        }
        Err(e) => panic!("the CUDA backend did not start on a machine with CUDA: {e}"),
    }
}
