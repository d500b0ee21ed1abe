//! `markbase`: run, chat with, measure and inspect Gemma models from the command line.

mod cmd;
mod model;
mod progress;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use markbase_models::{Device, LmHeadMode};

/// MarkBase: an inference engine for Gemma models.
#[derive(Parser, Debug)]
#[command(name = "markbase", version, about, propagate_version = true)]
struct Cli {
    /// Model: a .gguf file or a Hugging Face directory (default: the pulled Gemma 3 270M Q4_K_M).
    #[arg(short = 'm', long = "model", global = true, value_name = "PATH")]
    model: Option<std::path::PathBuf>,
    /// Instead of -m: random weights at a released Gemma 4 variant's shapes, VARIANT[:FORMAT[:SEED]]
    /// (e2b, e4b, 12b, 26b-a4b, 31b; bf16, q8_0, q4_k, q5_k, q4_0, or q4_k_m / q5_k_m:
    /// llama.cpp's Q4_K_M / Q5_K_M mixes), for bench, inspect and perplexity --tokens-file.
    #[arg(long, global = true, value_name = "SPEC", conflicts_with = "model")]
    synthetic: Option<String>,
    /// Where the model runs: `cpu`, `cuda` (GPU 0) or `cuda:N`.
    #[arg(long, global = true, default_value = "cpu", value_name = "DEVICE", value_parser = parse_device)]
    device: Device,
    /// Worker threads of the CPU backend (0 = all cores).
    #[arg(
        short = 't',
        long = "threads",
        global = true,
        default_value_t = 0,
        value_name = "N"
    )]
    threads: usize,
    /// LM head: `auto` screens a huge ≥ 8-bit head on the CPU (a 4-bit copy ranks the
    /// vocabulary, the top 4096 logits are computed exactly; a greedy pick stops after the
    /// first 64–1024 when they leave no doubt); `exact` computes every logit from the stored
    /// weights.
    #[arg(long, global = true, default_value = "auto", value_name = "MODE", value_parser = parse_lm_head)]
    lm_head: LmHeadMode,
    /// On CUDA, keep quantized weights only as stored. By default each quantized matrix also
    /// gets an f16 copy at its first product of more than 64 token rows (batches of 65+
    /// sequences, prompt chunks) while the GPU keeps 2 GiB or a sixteenth of its memory free:
    /// such products run faster from the copy.
    #[arg(long = "no-f16-copies", global = true)]
    no_f16_copies: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Download the default model (Gemma 3 270M Q4_K_M) into the cache.
    Pull,
    /// Generate a reply to PROMPT, streamed to stdout.
    Run(cmd::run::Args),
    /// Chat interactively (one message per line; /exit to quit, /clear to start over).
    Chat(cmd::chat::Args),
    /// Perplexity of the model on a text or a list of token ids.
    Perplexity(cmd::perplexity::Args),
    /// Show the token ids of TEXT.
    Tokenize(cmd::tokenize::Args),
    /// Show a model's metadata, tensors, hyper-parameters and chat template.
    Inspect,
    /// Measure prompt processing (pp) and generation (tg) speed.
    Bench(cmd::bench::Args),
    /// Serve the OpenAI API over HTTP (chat and text completions, streaming, metrics).
    Serve(cmd::serve::Args),
    /// Load-test a running server: throughput, TTFT and inter-token latency per concurrency.
    BenchServe(cmd::bench_serve::Args),
}

/// Options shared by every subcommand.
pub struct Global {
    /// `-m`, if given.
    pub model: Option<std::path::PathBuf>,
    /// `--synthetic`, if given.
    pub synthetic: Option<String>,
    /// `--device`.
    pub device: Device,
    /// `-t`.
    pub threads: usize,
    /// `--lm-head`.
    pub lm_head: LmHeadMode,
    /// Not `--no-f16-copies`.
    pub f16_copies: bool,
}

/// Parses `--device`.
fn parse_device(s: &str) -> Result<Device, String> {
    s.parse().map_err(|e: markbase_core::Error| e.to_string())
}

/// Parses `--lm-head`.
fn parse_lm_head(s: &str) -> Result<LmHeadMode, String> {
    match s {
        "auto" => Ok(LmHeadMode::Auto),
        "exact" => Ok(LmHeadMode::Exact),
        _ => Err(format!("'{s}' is not an LM head mode (auto, exact)")),
    }
}

fn main() -> ExitCode {
    // A panic is a bug, but the user still gets one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("error: internal error{at}: {}", one_line(&msg));
    }));
    let cli = Cli::parse();
    let global = Global {
        model: cli.model,
        synthetic: cli.synthetic,
        device: cli.device,
        threads: cli.threads,
        lm_head: cli.lm_head,
        f16_copies: !cli.no_f16_copies,
    };
    let result = std::panic::catch_unwind(|| match cli.command {
        Command::Pull => cmd::pull::run(),
        Command::Run(a) => cmd::run::run(&global, a),
        Command::Chat(a) => cmd::chat::run(&global, a),
        Command::Perplexity(a) => cmd::perplexity::run(&global, a),
        Command::Tokenize(a) => cmd::tokenize::run(&global, a),
        Command::Inspect => cmd::inspect::run(&global),
        Command::Bench(a) => cmd::bench::run(&global, a),
        Command::Serve(a) => cmd::serve::run(&global, a),
        Command::BenchServe(a) => cmd::bench_serve::run(a),
    });
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("error: {}", one_line(&format!("{e:#}")));
            ExitCode::FAILURE
        }
        // The panic hook has already printed the message.
        Err(_) => ExitCode::FAILURE,
    }
}

/// Joins a possibly multi-line message into one line.
pub fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
