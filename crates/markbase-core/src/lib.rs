//! MarkBase core: file formats, weight formats and model facts, with no backend code.

pub mod backend;
pub mod config;
pub mod error;
pub mod gguf;
pub mod quant;
pub mod safetensors;
pub mod sampling;
pub mod tokenizer;

pub use error::{Error, Result};
