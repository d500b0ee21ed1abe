//! Aggregate generation speed of the serving Engine at several concurrencies.
//!
//! `cargo run --release -p markbase-engine --example engine_throughput -- [MODEL] [TOKENS]
//! [CONCURRENCY...]`: for each concurrency C, C requests (distinct prompts, greedy, no stop
//! tokens, TOKENS each, default 64) are submitted at once; prints the wall time and the
//! generated tokens per second over all of them. MODEL defaults to the default model.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use markbase_engine::{load, Engine, EngineConfig, Event, Request, SamplingParams};
use markbase_models::LoadOptions;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = match args.first().filter(|a| a.as_str() != "-") {
        Some(p) => PathBuf::from(p),
        None => markbase_engine::pull::default_model_path()?,
    };
    let tokens: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let mut levels: Vec<usize> = args[2.min(args.len())..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    if levels.is_empty() {
        levels = vec![1, 8];
    }
    let loaded = load(&path, &LoadOptions::default())?;
    let tok = loaded.tokenizer;
    let engine = Engine::start(Arc::new(loaded.model), EngineConfig::default())?;
    let topics = [
        "the sea",
        "mountains",
        "a city at night",
        "rain",
        "old books",
        "the moon",
        "a garden",
        "trains",
        "winter",
        "music",
        "bread",
        "a river",
    ];
    for &c in &levels {
        let reqs: Vec<Request> = (0..c)
            .map(|i| {
                let text = format!("Write a long story about {}.", topics[i % topics.len()]);
                let mut prompt = vec![tok.bos_id().unwrap_or(2)];
                prompt.extend(tok.encode(&text, false)?);
                Ok(Request {
                    prompt,
                    max_tokens: tokens,
                    sampling: SamplingParams::greedy(),
                    stop_tokens: Vec::new(),
                    top_logprobs: None,
                })
            })
            .collect::<Result<_, markbase_core::Error>>()?;
        let t0 = Instant::now();
        let steps0 = engine.stats().steps;
        let mut handles = reqs
            .into_iter()
            .map(|r| engine.submit(r))
            .collect::<Result<Vec<_>, _>>()?;
        let mut generated = 0;
        for h in &mut handles {
            while let Some(e) = h.events.blocking_recv() {
                match e {
                    Event::Token { .. } => generated += 1,
                    Event::Done { .. } => break,
                    Event::Error(e) => return Err(e.into()),
                }
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "concurrency {c:>3}: {generated} tokens in {secs:.2} s = {:.1} t/s aggregate ({} steps)",
            generated as f64 / secs,
            engine.stats().steps - steps0
        );
    }
    Ok(())
}
