//! The kernel sources, embedded in the binary: each module is a `.cu` file with the shared
//! headers it needs prepended (NVRTC sees one self-contained translation unit).

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

    /// The full source NVRTC compiles.
    pub fn source(self) -> String {
        let (quant, body) = match self {
            Module::Ops => (true, include_str!("../kernels/ops.cu")),
            Module::Gemv => (true, include_str!("../kernels/gemv.cu")),
            Module::Attention => (false, include_str!("../kernels/attention.cu")),
            Module::Moe => (true, include_str!("../kernels/moe.cu")),
            Module::Sample => (false, include_str!("../kernels/sample.cu")),
        };
        let mut s = String::with_capacity(COMMON.len() + QUANT.len() + body.len() + 2);
        s.push_str(COMMON);
        if quant {
            s.push_str(QUANT);
        }
        s.push_str(body);
        s
    }
}
