//! The kernel sources, embedded in the binary: each module is a `.cu` file with the shared
//! headers it needs prepended (NVRTC sees one self-contained translation unit), after any
//! `#define`s given in `MARKBASE_CUDA_DEFINES` (kernel variants under evaluation, e.g.
//! `GEMV_PLAIN_MIN_BLOCKS=2`; the disk cache keys on the whole source, so each set compiles once).

use markbase_core::{Error, Result};

/// The environment variable holding extra kernel `#define`s: `NAME` or `NAME=VALUE` entries
/// separated by spaces.
pub const DEFINES_VAR: &str = "MARKBASE_CUDA_DEFINES";

/// The `#define` lines for `MARKBASE_CUDA_DEFINES` (empty when unset); an entry that is not an
/// identifier with an optional plain value, or a value that is not Unicode, is an error
/// naming it.
pub fn defines_from_env() -> Result<String> {
    match std::env::var(DEFINES_VAR) {
        Ok(v) => define_lines(&v),
        Err(std::env::VarError::NotPresent) => Ok(String::new()),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Invalid(format!(
            "{DEFINES_VAR}: {v:?} is not Unicode"
        ))),
    }
}

/// `#define` lines for the space-separated `NAME[=VALUE]` entries of `spec`: a name is
/// letters, digits and '_', not starting with a digit; a value is letters, digits, '_' and '.'.
pub fn define_lines(spec: &str) -> Result<String> {
    let word = |s: &str, extra: char| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == extra)
    };
    let mut out = String::new();
    for entry in spec.split_whitespace() {
        let (name, value) = entry.split_once('=').unwrap_or((entry, "1"));
        let name_ok = word(name, '_') && !name.starts_with(|c: char| c.is_ascii_digit());
        if !name_ok || !word(value, '.') {
            return Err(Error::Invalid(format!(
                "{DEFINES_VAR}: '{entry}' is not NAME or NAME=VALUE (NAME: letters, digits, '_', \
                 not starting with a digit; VALUE: letters, digits, '_', '.')"
            )));
        }
        out.push_str(&format!("#define {name} {value}\n"));
    }
    Ok(out)
}

const COMMON: &str = include_str!("../kernels/common.cuh");
const QUANT: &str = include_str!("../kernels/quant.cuh");

/// A kernel module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// Element-wise and row-wise operations, embedding, dequantization.
    Ops,
    /// Decode GEMV over every weight format.
    Gemv,
    /// Split-K attention and its combine step.
    Attention,
    /// MoE routing and grouped expert products.
    Moe,
    /// Argmax and top-k / top-p sampling.
    Sample,
}

impl Module {
    /// Every module.
    pub const ALL: [Module; 5] = [
        Module::Ops,
        Module::Gemv,
        Module::Attention,
        Module::Moe,
        Module::Sample,
    ];

    /// The module's name (its `.cu` file stem).
    pub fn name(self) -> &'static str {
        match self {
            Module::Ops => "ops",
            Module::Gemv => "gemv",
            Module::Attention => "attention",
            Module::Moe => "moe",
            Module::Sample => "sample",
        }
    }

    /// The full source NVRTC compiles, after `defines` (`#define` lines, see
    /// [`define_lines`]).
    pub fn source(self, defines: &str) -> String {
        let (quant, body) = match self {
            Module::Ops => (true, include_str!("../kernels/ops.cu")),
            Module::Gemv => (true, include_str!("../kernels/gemv.cu")),
            Module::Attention => (false, include_str!("../kernels/attention.cu")),
            Module::Moe => (true, include_str!("../kernels/moe.cu")),
            Module::Sample => (false, include_str!("../kernels/sample.cu")),
        };
        let mut s =
            String::with_capacity(defines.len() + COMMON.len() + QUANT.len() + body.len() + 2);
        s.push_str(defines);
        s.push_str(COMMON);
        if quant {
            s.push_str(QUANT);
        }
        s.push_str(body);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_come_first_and_bad_entries_are_named() {
        let d = define_lines("GEMV_PLAIN_MIN_BLOCKS=4  FAST").unwrap();
        assert_eq!(d, "#define GEMV_PLAIN_MIN_BLOCKS 4\n#define FAST 1\n");
        let src = Module::Gemv.source(&d);
        assert!(src.starts_with(&d));
        assert_ne!(src, Module::Gemv.source(""));
        for bad in ["4X=1", "A=b;c", "A=", "=3", "A.B=1"] {
            let e = define_lines(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(DEFINES_VAR), "{bad}: {e}");
        }
    }
}
