//! The one error type of the library crates: each variant says what went wrong and where.

use std::path::PathBuf;

/// Errors raised while reading model files, tokenizing, or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error on a named file.
    #[error("{path}: {cause}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying error (shown in the message, so not repeated as a source).
        cause: std::io::Error,
    },
    /// A model file is malformed (bad magic, truncated, inconsistent sizes…).
    #[error("{0}")]
    Format(String),
    /// A file is well-formed but uses something MarkBase does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A tensor the architecture needs is absent from the weights.
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    /// A tensor exists but has the wrong shape or type.
    #[error("tensor '{name}': {problem}")]
    BadTensor {
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A model configuration is missing a field or is inconsistent.
    #[error("config: {0}")]
    Config(String),
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template could not be parsed or rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// A sequence does not fit the model's context.
    #[error("prompt of {tokens} tokens does not fit the context of {context} tokens")]
    ContextOverflow {
        /// Tokens requested (prompt plus generation where relevant).
        tokens: usize,
        /// The context size in use.
        context: usize,
    },
    /// A caller passed an invalid argument.
    #[error("{0}")]
    Invalid(String),
}

/// Result with the library error.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause: source,
        }
    }
}
