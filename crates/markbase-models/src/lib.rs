//! Model architectures written against the backend seam, and the loaded-model API.

pub mod gemma3;
pub mod gemma4;
pub mod gemma4_config;
pub mod lm_head;
mod model;
pub mod paged;
pub mod synthetic;
mod weights;

pub use lm_head::LmHeadMode;
pub use model::{KvCache, KvPool, LoadOptions, Logits, Model, ModelInfo, ModelSource};
pub use paged::{SeqStep, NO_BLOCK};
pub use weights::WeightStore;
