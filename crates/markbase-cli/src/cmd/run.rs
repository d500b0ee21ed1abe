//! `markbase run PROMPT`: one reply, streamed to stdout (or one JSON object with --json).

use std::io::{IsTerminal, Write};

use anyhow::Result;
use markbase_core::tokenizer::ChatMessage;
use markbase_engine::{generate, GenerateOptions};
use serde_json::json;

use crate::cmd::sampling::SamplingArgs;
use crate::Global;

/// Arguments of `run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt.
    pub prompt: String,
    /// Use the prompt as is (BOS added), without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A system message placed before the prompt (chat template only).
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,
    /// Turn on the model's thinking mode (passes `enable_thinking` to the chat template).
    #[arg(long, conflicts_with = "raw")]
    pub think: bool,
    /// Print one JSON object (prompt_token_ids, output_token_ids, text, timings) at the end.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Runs `run`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let loaded = crate::model::load_model(global)?;
    let tok = &loaded.tokenizer;
    let prompt_ids = if args.raw {
        tok.encode(&args.prompt, true)?
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.as_str()));
        }
        messages.push(ChatMessage::new("user", args.prompt.as_str()));
        crate::cmd::chat::encode_conversation(&loaded, &messages, args.think)?
    };
    let params = args.sampling.params();
    let opts = GenerateOptions {
        max_tokens: args.sampling.max_tokens,
        stop_tokens: loaded.stop_tokens()?,
        stop_strings: args.sampling.stop.clone(),
        sampling: params.clone(),
    };
    let stdout = std::io::stdout();
    let mut write_err = None;
    let mut on_text = |s: &str| {
        if args.json || write_err.is_some() {
            return;
        }
        let mut out = stdout.lock();
        if let Err(e) = out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
            write_err = Some(e);
        }
    };
    let gen = generate(
        &loaded.model,
        tok,
        &prompt_ids,
        &opts,
        args.sampling.ctx,
        &mut on_text,
    )?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    let mut out = stdout.lock();
    if args.json {
        let obj = json!({
            "prompt_token_ids": prompt_ids,
            "output_token_ids": gen.output_token_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "timings": gen.timings,
            "sampling": params,
        });
        writeln!(out, "{obj}")?;
    } else {
        writeln!(out)?;
        if std::io::stderr().is_terminal() {
            let t = &gen.timings;
            eprintln!(
                "[prompt {} tokens, {:.1} tokens/s · generated {} tokens, {:.1} tokens/s]",
                t.prefill_tokens,
                t.prefill_tokens_per_second,
                gen.output_token_ids.len(),
                t.decode_tokens_per_second
            );
        }
    }
    Ok(())
}
