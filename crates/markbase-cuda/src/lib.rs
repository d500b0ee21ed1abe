//! MarkBase CUDA backend: the [`markbase_core::backend::Backend`] operations as CUDA kernels on
//! one stream of one GPU.
//!
//! Kernels live in `kernels/*.cu` (embedded in the binary), are compiled with NVRTC for the
//! device's architecture at first use and cached on disk ([`nvrtc::compile_cached`]: key =
//! source hash, target, NVRTC version, options). The driver, NVRTC and cuBLAS are loaded
//! dynamically, so the crate builds and its non-GPU tests run on machines without CUDA;
//! [`CudaBackend::new`] says clearly what is missing on such a machine.
//!
//! Weights stay in their stored format on the device (GGUF blocks, BF16, F16, F32; Q8_0 rows
//! regrouped and Q5_K, Q6_K, Q4_0 and Q5_0 blocks laid out for their readers, `layout`); decode
//! products are warp-per-row GEMVs that read each weight row once for up to 8 token rows
//! (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 products of 2–64 token rows run on the tensor cores,
//! [`mma_suits`], and so do the grouped MoE expert products, [`moe_on_tensor_cores`]); products
//! of more than 64 token rows read an f16 copy of a quantized matrix made at its first such
//! product while the GPU has room (`f16_copies`), else dequantize tiles, and call cuBLAS;
//! prefill attention runs as batched products.
//! Activations are f32.

mod attention;
mod attention_flash;
mod backend;
mod blas;
mod buffer;
mod chain;
pub mod device;
mod device_wide;
mod elementwise;
mod f16_copies;
mod ffn;
mod gemv_walk;
mod graph;
mod kernels;
mod layout;
mod mmq;
mod moe;
mod moe_mma;
mod norms;
pub mod nvrtc;
mod products;
mod rounded;
mod sample;
pub mod sources;
mod tune;

pub use attention_flash::ATTN_FLASH_MIN_ROWS;
pub use backend::CudaBackend;
pub use buffer::{CudaBuffer, CudaMatrix};
pub use chain::{
    chain_format, Chain, ChainFormat, ChainLink, ChainOp, LinkInput, CHAIN_OP_WORDS, CHAIN_PHASES,
    CHAIN_ROWS,
};
pub use kernels::unit_images;
pub use layout::device_bytes;
pub use mmq::mma_suits;
pub use moe::moe_groups_pairs;
pub use moe_mma::moe_on_tensor_cores;
pub use products::{gemv_takes_16_bit_activations, product_inputs, ProductInputs, BF16_GEMV_UP_TO};
pub use sample::{SAMPLE_ROW_WORDS, SAMPLE_SHARED};
