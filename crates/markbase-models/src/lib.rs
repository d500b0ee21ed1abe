//! Model architectures written against the backend seam, and the loaded-model API.

mod device;
pub mod gemma3;
pub mod gemma4;
pub mod gemma4_config;
pub mod lm_head;
mod model;
pub mod paged;
mod runner;
pub mod synthetic;
mod weights;

pub use device::Device;
pub use lm_head::LmHeadMode;
pub use model::{BatchCache, KvCache, KvPool, LoadOptions, Logits, Model, ModelInfo, ModelSource};
pub use paged::{PagedKv, SeqStep, StepOutput, NO_BLOCK};
pub use weights::WeightStore;
