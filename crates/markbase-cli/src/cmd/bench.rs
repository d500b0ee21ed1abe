//! `markbase bench`: prompt processing and generation speed, like llama-bench.

use std::io::Write;

use anyhow::Result;
use markbase_engine::{bench, BenchOptions};
use serde_json::json;

use crate::Global;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prompt tokens of the pp test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens of the tg test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Timed repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Sequences decoded together in the tg test (its rate counts every sequence's tokens); a
    /// comma-separated list runs one tg test per value.
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1"
    )]
    pub batch: Vec<usize>,
    /// Also print, per test, how many times the host waited for the device per forward step
    /// (1 on a GPU: the step's one synchronisation; 0 on the CPU) and how long those waits
    /// took (a step's time minus its wait is the host queueing work).
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Print {"results": [{"test": "pp512", "tokens_per_second": ...}, ...]}.
    #[arg(long)]
    pub json: bool,
}

/// Runs `bench`.
pub fn run(global: &Global, args: Args) -> Result<()> {
    let model = crate::model::load_weights(global)?;
    let info = model.info();
    let threads = if global.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        global.threads
    };
    let size_mib = info.weight_bytes as f64 / (1024.0 * 1024.0);
    let opts = BenchOptions {
        prompt_tokens: args.n_prompt,
        gen_tokens: args.n_gen,
        repetitions: args.repetitions,
        batches: args.batch.clone(),
    };
    let mut out = std::io::stdout().lock();
    if !args.json {
        let (head, rule) = if args.verbose {
            (
                " host waits / step | wait ms / step | graph replays / step |",
                " ---: | ---: | ---: |",
            )
        } else {
            ("", "")
        };
        writeln!(out, "| model | size | device | test | t/s |{head}")?;
        writeln!(out, "| --- | ---: | --- | ---: | ---: |{rule}")?;
    }
    let mut write_err = None;
    let results = bench(&model, &opts, |r| {
        if args.json || write_err.is_some() {
            return;
        }
        let waits = if args.verbose {
            format!(
                " {:.2} | {:.3} | {:.2} |",
                r.host_waits_per_step, r.host_wait_ms_per_step, r.graph_replays_per_step
            )
        } else {
            String::new()
        };
        let line = writeln!(
            out,
            "| {} | {size_mib:.1} MiB | {} | {} | {:.2} ± {:.2} |{waits}",
            info.architecture, info.device, r.test, r.tokens_per_second, r.std_tokens_per_second
        );
        write_err = line.err();
    })?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    let copies = model.f16_copy_bytes();
    if args.json {
        let obj = json!({
            "model": info.architecture,
            "weight_bytes": info.weight_bytes,
            "f16_copy_bytes": copies,
            "device": info.device,
            "threads": threads,
            "repetitions": args.repetitions,
            "batch": args.batch,
            "results": results,
        });
        writeln!(out, "{obj}")?;
    } else if copies > 0 {
        writeln!(
            out,
            "\nf16 copies of quantized weights (read by products of 65+ token rows): {:.1} MiB",
            copies as f64 / (1024.0 * 1024.0)
        )?;
    }
    Ok(())
}
