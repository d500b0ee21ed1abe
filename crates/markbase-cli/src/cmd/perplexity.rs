//! `markbase perplexity`: NLL per token and perplexity on a text or a list of token ids.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::Global;

/// Default window when the model allows it.
const DEFAULT_CTX: usize = 2048;
/// `<bos>` in every Gemma vocabulary.
const GEMMA_BOS: u32 = 2;

/// Arguments of `perplexity`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["file", "tokens_file"])))]
pub struct Args {
    /// A UTF-8 text file (tokenized with BOS).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// A file of token ids separated by white space.
    #[arg(long = "tokens-file", value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Window size in tokens (default 2048, or the model's context if smaller).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Print {"nll": [...], "mean_nll": ..., "ppl": ...} and run details as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Parses white-space separated token ids; the error names the bad entry and its position.
pub fn parse_token_ids(text: &str) -> Result<Vec<u32>> {
    text.split_whitespace()
        .enumerate()
        .map(|(i, s)| {
            s.parse::<u32>()
                .with_context(|| format!("token #{} '{s}' is not a token id", i + 1))
        })
        .collect()
}

/// Runs `perplexity`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let (model, tokens, bos) = match (&args.file, &args.tokens_file) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?;
            let loaded = crate::model::load_model(global)?;
            let tokens = loaded.tokenizer.encode(&text, true)?;
            (loaded.model, tokens, loaded.tokenizer.bos_id())
        }
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?;
            let tokens = parse_token_ids(&text).with_context(|| f.display().to_string())?;
            // Token ids need no tokenizer; BOS (put in front of later windows) comes from it
            // when the model has one, else it is Gemma's <bos>.
            let bos = match global.synthetic {
                Some(_) => Some(GEMMA_BOS),
                None => crate::model::load_tokenizer(global)
                    .map_or(Some(GEMMA_BOS), |(t, _)| t.bos_id()),
            };
            (crate::model::load_weights(global)?, tokens, bos)
        }
        (None, None) => bail!("give -f FILE or --tokens-file FILE"),
    };
    let limit = model.info().context_length;
    let ctx = args.ctx.unwrap_or(DEFAULT_CTX.min(limit));
    if ctx > limit {
        bail!("--ctx {ctx} is larger than the model's context of {limit} tokens");
    }
    let windows = tokens
        .len()
        .saturating_sub(1)
        .div_ceil(ctx.saturating_sub(1).max(1));
    let bar = crate::progress::items("windows", windows as u64);
    let result = markbase_engine::perplexity(&model, &tokens, ctx, bos, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let r = result?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let obj = json!({
            "nll": r.nll,
            "mean_nll": r.mean_nll,
            "ppl": r.ppl,
            "n_tokens": tokens.len(),
            "ctx": r.ctx,
            "windows": r.windows,
            "seconds": r.seconds,
            "tokens_per_second": r.tokens_per_second,
        });
        writeln!(out, "{obj}")?;
    } else {
        writeln!(
            out,
            "perplexity {:.4} (mean NLL {:.4} nats over {} predicted tokens; {} windows of ≤ {} tokens; {:.1} s, {:.1} tokens/s)",
            r.ppl,
            r.mean_nll,
            r.nll.len(),
            r.windows,
            r.ctx,
            r.seconds,
            r.tokens_per_second
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_parse_and_errors_name_the_entry() {
        assert_eq!(parse_token_ids(" 2 10\n\t11 ").unwrap(), vec![2, 10, 11]);
        let e = format!("{:#}", parse_token_ids("2 x3 4").unwrap_err());
        assert!(e.contains("token #2 'x3'"), "{e}");
    }
}
