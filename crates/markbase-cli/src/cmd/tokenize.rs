//! `markbase tokenize TEXT`: token ids of a text.

use std::io::Write;

use anyhow::Result;
use serde_json::json;

use crate::Global;

/// Arguments of `tokenize`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The text.
    pub text: String,
    /// Do not add the BOS token.
    #[arg(long = "no-bos")]
    pub no_bos: bool,
    /// Print {"ids": [...]}.
    #[arg(long)]
    pub json: bool,
}

/// Runs `tokenize`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let (tok, _) = crate::model::load_tokenizer(global)?;
    let ids = tok.encode(&args.text, !args.no_bos)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", json!({ "ids": ids }))?;
    } else {
        for id in ids {
            let piece = tok.token_text(id).unwrap_or("");
            writeln!(out, "{id:>7} {piece:?}")?;
        }
    }
    Ok(())
}
