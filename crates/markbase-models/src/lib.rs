//! Model architectures written against the backend seam, and the loaded-model API.

pub mod gemma3;
pub mod gemma4;
pub mod gemma4_config;
mod model;
pub mod synthetic;
mod weights;

pub use model::{KvCache, LoadOptions, Logits, Model, ModelInfo, ModelSource};
pub use weights::WeightStore;
