//! `markbase inspect`: metadata (long values summarised), tensor table, hyper-parameters and
//! the chat template in use.

use std::io::Write;

use anyhow::Result;
use markbase_core::gguf::{GgufFile, MetaValue};
use markbase_models::synthetic::{SyntheticSpec, SyntheticWeights};
use markbase_models::ModelSource;

use crate::Global;

/// Items of an array shown before it is summarised.
const SHOWN_ITEMS: usize = 8;
/// Characters of a string shown before it is cut.
const SHOWN_CHARS: usize = 120;

/// A short, one-line rendering of a metadata value.
pub fn summarize(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) => summarize_str(s),
        MetaValue::Array(items) => {
            let ty = items.first().map_or("?", MetaValue::type_name);
            let shown: Vec<String> = items.iter().take(SHOWN_ITEMS).map(summarize).collect();
            let more = if items.len() > SHOWN_ITEMS {
                ", …"
            } else {
                ""
            };
            format!("[{} × {ty}] [{}{more}]", items.len(), shown.join(", "))
        }
        MetaValue::F32(x) => format!("{x}"),
        MetaValue::F64(x) => format!("{x}"),
        MetaValue::Bool(b) => format!("{b}"),
        other => other
            .as_i64()
            .map(|i| i.to_string())
            .or_else(|| other.as_u64().map(|u| u.to_string()))
            .unwrap_or_default(),
    }
}

fn summarize_str(s: &str) -> String {
    let n = s.chars().count();
    if n <= SHOWN_CHARS {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(SHOWN_CHARS).collect();
        format!("{head:?}… ({n} chars)")
    }
}

fn gguf_report(out: &mut impl Write, g: &GgufFile) -> Result<()> {
    writeln!(out, "file: {}", g.path().display())?;
    writeln!(
        out,
        "GGUF v{}, {} metadata entries, {} tensors, alignment {}, data at byte {}",
        g.version,
        g.metadata().len(),
        g.tensors().len(),
        g.alignment,
        g.data_offset
    )?;
    writeln!(out, "\nmetadata:")?;
    for (k, v) in g.metadata() {
        writeln!(out, "  {k} ({}) = {}", v.type_name(), summarize(v))?;
    }
    writeln!(out, "\ntensors:")?;
    writeln!(
        out,
        "  {:<40} {:>6} {:>22} {:>12}",
        "name", "type", "dims", "bytes"
    )?;
    let mut total = 0u64;
    for t in g.tensors() {
        let dims = t
            .dims
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" × ");
        writeln!(
            out,
            "  {:<40} {:>6} {:>22} {:>12}",
            t.name,
            t.dtype.name(),
            dims,
            t.n_bytes
        )?;
        total += t.n_bytes;
    }
    writeln!(
        out,
        "  {} tensors, {total} bytes ({:.1} MiB)",
        g.tensors().len(),
        total as f64 / (1024.0 * 1024.0)
    )?;
    Ok(())
}

/// The report of a `--synthetic` model, from its shapes alone (nothing is generated).
fn synthetic_report(out: &mut impl Write, spec: SyntheticSpec) -> Result<()> {
    let w = SyntheticWeights::new(spec)?;
    writeln!(
        out,
        "synthetic Gemma 4 {} (random weights, seed {})",
        spec.variant.name(),
        spec.seed
    )?;
    writeln!(out, "\nhyper-parameters:")?;
    for (k, v) in w.config().describe() {
        writeln!(out, "  {k}: {v}")?;
    }
    writeln!(out, "\ntensors:")?;
    writeln!(
        out,
        "  {:<44} {:>6} {:>22} {:>14}",
        "name", "type", "shape", "bytes"
    )?;
    for (name, t) in w.tensors() {
        let shape = t
            .shape
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(" × ");
        writeln!(
            out,
            "  {name:<44} {:>6} {shape:>22} {:>14}",
            t.ty.name(),
            t.n_bytes
        )?;
    }
    let total = w.weight_bytes();
    writeln!(
        out,
        "  {} tensors, {total} bytes ({:.2} GiB)",
        w.tensors().len(),
        total as f64 / (1u64 << 30) as f64
    )?;
    writeln!(out, "weight_bytes: {total}")?;
    Ok(())
}

/// Runs `inspect`.
pub fn run(global: &Global) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if let Some(spec) = crate::model::synthetic_spec(global)? {
        return synthetic_report(&mut out, spec);
    }
    let path = crate::model::model_path(global)?;
    let source = ModelSource::open(&path)?;
    match &source {
        ModelSource::Gguf(g) => gguf_report(&mut out, g)?,
        ModelSource::HfDir(dir) => {
            writeln!(out, "Hugging Face model directory: {}", dir.display())?;
            let cfg = std::fs::read_to_string(dir.join("config.json"))?;
            writeln!(out, "\nconfig.json:\n{cfg}")?;
        }
    }
    let model = crate::model::load_weights(global)?;
    writeln!(out, "\nhyper-parameters:")?;
    for line in model.info().describe().lines() {
        writeln!(out, "  {line}")?;
    }
    let (tok, template) = match crate::model::load_tokenizer(global) {
        Ok(t) => t,
        Err(e) => {
            writeln!(
                out,
                "\ntokenizer: none ({})",
                crate::one_line(&format!("{e:#}"))
            )?;
            return Ok(());
        }
    };
    let template = if template.is_builtin() {
        "built-in Gemma turn template (the model has none)"
    } else {
        match &source {
            ModelSource::Gguf(_) => "the model's own (GGUF tokenizer.chat_template)",
            ModelSource::HfDir(_) => {
                "the model's own (chat_template.jinja / tokenizer_config.json)"
            }
        }
    };
    writeln!(out, "\nchat template: {template}")?;
    writeln!(
        out,
        "tokenizer: {} tokens, bos {:?}, eos {:?}, stop tokens {:?}",
        tok.vocab_size(),
        tok.bos_id(),
        tok.eos_id(),
        markbase_engine::stop_tokens(&source, &tok)?
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_summarised() {
        let arr = MetaValue::Array((0..100).map(MetaValue::U32).collect());
        let s = summarize(&arr);
        assert!(s.starts_with("[100 × u32] [0, 1, 2"), "{s}");
        assert!(s.ends_with(", …]"), "{s}");
        let long = MetaValue::String("x".repeat(500));
        assert!(summarize(&long).ends_with("… (500 chars)"));
        assert_eq!(summarize(&MetaValue::String("ab".into())), "\"ab\"");
        assert_eq!(summarize(&MetaValue::I32(-3)), "-3");
    }
}
