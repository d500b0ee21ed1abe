//! MarkBase CPU backend: f32 activations, weights used in place from the mapped file, work
//! spread over a thread pool. Every fast operation has a plain twin in [`reference`](mod@reference).

mod attention;
pub mod backend;
pub mod kernels;
mod lm_head;
mod matmul;
mod moe;
mod ops;
pub mod pool;
pub mod reference;

pub use backend::{CpuBackend, CpuBuffer, CpuMatrix};
pub use matmul::{uses_quantized_activations, F32_FROM_TOKENS};
