//! The kernel sources, embedded in the binary: each module is a `.cu` file with the shared
//! headers it needs prepended (NVRTC sees one self-contained translation unit), after any
//! `#define`s given in `MARKBASE_CUDA_DEFINES` (kernel variants under evaluation, e.g.
//! `GEMV_PLAIN_MIN_BLOCKS=2`; the disk cache keys on the whole source, so each set compiles once).
//! Modules with kernels per weight format compile in units of one format each ([`Unit`]).

use markbase_core::quant::GgmlType;
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

/// The value the `#define` lines `lines` (`define_lines`) give `name` ("1" for a bare
/// `NAME`), if they name it: the last wins, as it would in the source.
pub fn define_value<'a>(lines: &'a str, name: &str) -> Option<&'a str> {
    lines.lines().rev().find_map(|l| {
        l.strip_prefix("#define ")?
            .strip_prefix(name)?
            .strip_prefix(' ')
    })
}

/// The whole number from `lo` to `hi` the `#define` lines `lines` give `name`, or `default`
/// where they do not name it; another value is an error naming it.
pub(crate) fn define_number(
    lines: &str,
    name: &str,
    (lo, hi): (usize, usize),
    default: usize,
) -> Result<usize> {
    let Some(v) = define_value(lines, name) else {
        return Ok(default);
    };
    v.parse::<usize>()
        .ok()
        .filter(|n| (lo..=hi).contains(n))
        .ok_or_else(|| {
            Error::Invalid(format!(
                "{DEFINES_VAR}: {name}={v} is not a whole number from {lo} to {hi}"
            ))
        })
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
/// Tensor-core and packed-f16 helpers of the GEMV and MoE modules' tensor-core products.
const MMA: &str = include_str!("../kernels/mma.cuh");
/// The GEMV module's one-token walks over Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 rows, appended to
/// gemv.cu.
const GEMV_WALK: &str = include_str!("../kernels/gemv_walk.cu");
/// The GEMV module's tensor-core products of a few token rows (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0
/// weights), appended after GEMV_WALK.
const MMQ: &str = include_str!("../kernels/mmq.cu");
/// The MoE module's grouped expert products on the tensor cores, appended to moe.cu.
const MOE_MMA: &str = include_str!("../kernels/moe_mma.cu");

/// A kernel module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// Element-wise and row-wise operations, embedding, dequantization.
    Ops,
    /// Decode GEMV over every weight format.
    Gemv,
    /// Split-K attention and its combine step.
    Attention,
    /// Prefill attention, flash style, and its f16 key gather.
    FlashAttention,
    /// MoE routing and grouped expert products.
    Moe,
    /// Argmax and top-k / top-p sampling.
    Sample,
    /// A chain of one-token products in one persistent launch (an experiment, chain.rs).
    Chain,
}

impl Module {
    /// Every module.
    pub const ALL: [Module; 7] = [
        Module::Ops,
        Module::Gemv,
        Module::Attention,
        Module::FlashAttention,
        Module::Moe,
        Module::Sample,
        Module::Chain,
    ];

    /// The module's name (its `.cu` file stem).
    pub fn name(self) -> &'static str {
        match self {
            Module::Ops => "ops",
            Module::Gemv => "gemv",
            Module::Attention => "attention",
            Module::FlashAttention => "flash_attention",
            Module::Moe => "moe",
            Module::Sample => "sample",
            Module::Chain => "chain",
        }
    }

    /// Whether the module instantiates kernels per weight format (`FOR_EACH_FORMAT`), compiled
    /// one format a unit.
    pub fn per_format(self) -> bool {
        matches!(self, Module::Ops | Module::Gemv | Module::Moe)
    }

    /// The parts its units hold: per-format modules a shared part (where they have
    /// format-independent kernels: all but the GEMV module) and one part a format.
    pub fn parts(self) -> Vec<Part> {
        if !self.per_format() {
            return vec![Part::Whole];
        }
        let shared = (self != Module::Gemv).then_some(Part::Shared);
        shared
            .into_iter()
            .chain(FORMATS.iter().map(|&(_, s)| Part::Format(s)))
            .collect()
    }

    /// The full source NVRTC compiles, after `defines` (`#define` lines, see
    /// [`define_lines`]): every kernel of the module.
    pub fn source(self, defines: &str) -> String {
        assemble(self, defines, Part::Whole)
    }
}

/// The source of `part` of module `m`: `defines`, then for a per-format module the switches
/// quant.cuh reads — `FORMAT_<suffix>` 1 or 0 for every format, `SHARED_KERNELS` 1 or 0 (the
/// format-independent kernels) — then the headers and the module's `.cu` file.
fn assemble(m: Module, defines: &str, part: Part) -> String {
    let body = match m {
        Module::Ops => include_str!("../kernels/ops.cu"),
        Module::Gemv => include_str!("../kernels/gemv.cu"),
        Module::Attention => include_str!("../kernels/attention.cu"),
        Module::FlashAttention => include_str!("../kernels/flash_attention.cu"),
        Module::Moe => include_str!("../kernels/moe.cu"),
        Module::Sample => include_str!("../kernels/sample.cu"),
        Module::Chain => include_str!("../kernels/chain.cu"),
    };
    // The per-format modules' switches and headers (formats, FOR_EACH_FORMAT).
    let quant = m.per_format();
    let mut s = String::with_capacity(
        defines.len() + COMMON.len() + QUANT.len() + MMA.len() + body.len() + 512,
    );
    s.push_str(defines);
    if quant {
        for (_, f) in FORMATS {
            let on = matches!(part, Part::Whole) || part == Part::Format(f);
            s.push_str(&format!("#define FORMAT_{f} {}\n", u8::from(on)));
        }
        let shared = !matches!(part, Part::Format(_));
        s.push_str(&format!("#define SHARED_KERNELS {}\n", u8::from(shared)));
    }
    s.push_str(COMMON);
    // quant.cuh: what the per-format modules need; the chain takes its Q4_K products.
    if quant || m == Module::Chain {
        s.push_str(QUANT);
    }
    if matches!(m, Module::Gemv | Module::Moe) {
        s.push_str(MMA);
    }
    s.push_str(body);
    if m == Module::Gemv {
        s.push_str(GEMV_WALK);
        s.push_str(MMQ);
    }
    if m == Module::Moe {
        s.push_str(MOE_MMA);
    }
    s
}

/// The weight formats the kernels instantiate and their kernel-name suffixes (quant.cuh's
/// `FOR_EACH_FORMAT`, in its order).
pub const FORMATS: [(GgmlType, &str); 13] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q2_K, "q2_k"),
    (GgmlType::Q3_K, "q3_k"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::Q6_K, "q6_k"),
];

/// Which kernels of a module a compilation unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// All of them (a module without per-format kernels).
    Whole,
    /// The format-independent kernels.
    Shared,
    /// The kernels of one weight format (its name suffix, e.g. "q4_k").
    Format(&'static str),
}

/// One NVRTC compilation: a module's per-format kernels compile one format a unit, so that
/// the units compile in parallel (the GEMV module whole took ≈ 40 s on one core).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Unit {
    /// The module.
    pub module: Module,
    /// Its kernels in this unit.
    pub part: Part,
}

impl Unit {
    /// Every unit: the per-format modules in a shared unit (where they have format-independent
    /// kernels) and one unit a format, the others whole.
    pub fn all() -> Vec<Unit> {
        let mut units = Vec::new();
        for module in Module::ALL {
            let parts = module.parts();
            units.extend(parts.into_iter().map(|part| Unit { module, part }));
        }
        units
    }

    /// The unit of `module` holding its kernels of format `suffix` (None: its
    /// format-independent kernels).
    pub fn holding(module: Module, suffix: Option<&'static str>) -> Unit {
        let part = match (module.per_format(), suffix) {
            (false, _) => Part::Whole,
            (true, None) => Part::Shared,
            (true, Some(s)) => Part::Format(s),
        };
        Unit { module, part }
    }

    /// A name for logs and cache files: "gemv-q4_k", "ops-shared", "attention".
    pub fn name(&self) -> String {
        match self.part {
            Part::Whole => self.module.name().to_string(),
            Part::Shared => format!("{}-shared", self.module.name()),
            Part::Format(s) => format!("{}-{s}", self.module.name()),
        }
    }

    /// The source NVRTC compiles: the unit's kernels of the module, after `defines`.
    pub fn source(&self, defines: &str) -> String {
        assemble(self.module, defines, self.part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_cover_each_module_once_and_name_their_part() {
        let all = Unit::all();
        let names: std::collections::HashSet<_> = all.iter().map(Unit::name).collect();
        assert_eq!(
            names.len(),
            all.len(),
            "unit names are unique (cache files)"
        );
        // attention, flash attention, sample, chain whole; ops and moe shared + 13 formats;
        // gemv 13 formats.
        assert_eq!(all.len(), 4 + 2 * 14 + 13);
        let q4k = Unit::holding(Module::Gemv, Some("q4_k"));
        assert_eq!(q4k.name(), "gemv-q4_k");
        assert!(all.contains(&q4k));
        let src = q4k.source("");
        assert!(src.contains("#define FORMAT_q4_k 1\n") && src.contains("#define FORMAT_bf16 0\n"));
        assert!(src.contains("#define SHARED_KERNELS 0\n"));
        assert!(Module::Gemv.source("").contains("#define FORMAT_q4_k 1\n"));
        assert_eq!(Unit::holding(Module::Ops, None).name(), "ops-shared");
        assert_eq!(Unit::holding(Module::Attention, None).part, Part::Whole);
        assert_eq!(
            Unit::holding(Module::FlashAttention, None).name(),
            "flash_attention"
        );
        assert_eq!(Unit::holding(Module::Sample, Some("f32")).name(), "sample");
        let d = define_lines("X=2").unwrap();
        assert!(q4k.source(&d).starts_with(&d));
    }

    #[test]
    fn defines_come_first_and_bad_entries_are_named() {
        let d = define_lines("GEMV_PLAIN_MIN_BLOCKS=4  FAST").unwrap();
        assert_eq!(d, "#define GEMV_PLAIN_MIN_BLOCKS 4\n#define FAST 1\n");
        let src = Module::Gemv.source(&d);
        assert!(src.starts_with(&d));
        assert_ne!(src, Module::Gemv.source(""));
        let d = define_lines("MMQ_WIDE=2 MMQ_WIDE_BLOCKS=1 MMQ_WIDE_BLOCKS=2 B").unwrap();
        assert_eq!(define_value(&d, "MMQ_WIDE_BLOCKS"), Some("2"));
        assert_eq!(define_value(&d, "MMQ_WIDE"), Some("2"));
        assert_eq!(define_value(&d, "B"), Some("1"));
        assert_eq!(define_value(&d, "MMQ"), None);
        for bad in ["4X=1", "A=b;c", "A=", "=3", "A.B=1"] {
            let e = define_lines(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(DEFINES_VAR), "{bad}: {e}");
        }
    }
}
