//! MarkBase core: file formats, weight formats and model facts, with no backend code.

pub mod error;
pub mod gguf;
pub mod quant;

pub use error::{Error, Result};
