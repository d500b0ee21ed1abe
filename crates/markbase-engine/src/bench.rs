//! Speed tests in the manner of llama-bench: `ppN` runs a prompt of N tokens in one forward call;
//! `tgN` generates N tokens one step at a time, each step ending with the greedy pick of the next
//! token; with a batch of B sequences, `tgN@bB` generates N tokens for each of B sequences, one
//! step of B tokens at a time (the rate counts all B·N tokens). Each test starts from an empty
//! cache, runs once untimed as a warm-up, then `repetitions` timed runs.

use std::time::Instant;

use markbase_core::{Error, Result};
use markbase_models::{Logits, Model};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Prompt length of the `pp` test (0 skips it).
    pub prompt_tokens: usize,
    /// Tokens of the `tg` test (0 skips it).
    pub gen_tokens: usize,
    /// Timed runs per test.
    pub repetitions: usize,
    /// Sequences decoded together in the `tg` test, one test per entry (1: a single
    /// sequence, `tgN`; B > 1: `tgN@bB`).
    pub batches: Vec<usize>,
}

/// One test's result.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    /// `pp512`, `tg128`, …
    pub test: String,
    /// Tokens per run.
    pub n_tokens: usize,
    /// Mean tokens per second over the repetitions.
    pub tokens_per_second: f64,
    /// Sample standard deviation of tokens per second (0 for one repetition).
    pub std_tokens_per_second: f64,
    /// Tokens per second of each repetition.
    pub samples: Vec<f64>,
    /// Host waits for the device per forward step over the timed runs (0 on the CPU).
    pub host_waits_per_step: f64,
    /// Milliseconds per forward step the host spent waiting for the device (0 on the CPU);
    /// the rest of a step's time the host was queueing work.
    pub host_wait_ms_per_step: f64,
    /// Share of the timed steps that ran as one CUDA graph launch (0 on the CPU).
    pub graph_replays_per_step: f64,
}

/// Host waits and their time, read before and after timed runs.
#[derive(Clone, Copy)]
struct Waits {
    count: u64,
    time: std::time::Duration,
    replays: u64,
}

impl Waits {
    fn now(model: &Model) -> Waits {
        Waits {
            count: model.host_waits(),
            time: model.host_wait_time(),
            replays: model.graph_replays(),
        }
    }

    /// (waits, wait milliseconds, graph replays) per step since `self`, over `steps` steps.
    fn per_step(self, model: &Model, steps: usize) -> (f64, f64, f64) {
        let now = Waits::now(model);
        let steps = steps.max(1) as f64;
        (
            (now.count - self.count) as f64 / steps,
            (now.time - self.time).as_secs_f64() * 1e3 / steps,
            (now.replays - self.replays) as f64 / steps,
        )
    }
}

/// Mean and sample standard deviation.
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Runs the tests of `opts` on `model`; `on_result` sees each result as it is finished.
pub fn bench(
    model: &Model,
    opts: &BenchOptions,
    mut on_result: impl FnMut(&BenchResult),
) -> Result<Vec<BenchResult>> {
    if opts.repetitions == 0 {
        return Err(Error::Invalid("bench needs at least one repetition".into()));
    }
    if opts.batches.contains(&0) {
        return Err(Error::Invalid(
            "bench needs a batch of at least one sequence".into(),
        ));
    }
    let info = model.info();
    let limit = info.context_length;
    for (what, n) in [("-p", opts.prompt_tokens), ("-n", opts.gen_tokens)] {
        if n > limit {
            return Err(Error::Invalid(format!(
                "bench {what} {n}: longer than the model's context of {limit} tokens"
            )));
        }
    }
    // Random token ids, fixed by a seed so every run measures the same work: enough for the
    // prompt, and for each `tg` sequence to read its own run of them.
    let mut rng = ChaCha8Rng::seed_from_u64(1234);
    let most_b = opts.batches.iter().copied().max().unwrap_or(1);
    let max_n = opts
        .prompt_tokens
        .max(opts.gen_tokens + most_b.saturating_sub(1));
    let tokens: Vec<u32> = (0..max_n)
        .map(|_| rng.random_range(0..info.n_vocab as u32))
        .collect();
    let mut results = Vec::new();

    if opts.prompt_tokens > 0 {
        let prompt = &tokens[..opts.prompt_tokens];
        let mut cache = model.new_cache(prompt.len())?;
        let run = |cache: &mut markbase_models::KvCache| -> Result<f64> {
            cache.clear();
            let t = Instant::now();
            model.forward(cache, prompt, Logits::Last)?;
            Ok(t.elapsed().as_secs_f64())
        };
        run(&mut cache)?;
        let waits = Waits::now(model);
        let samples = (0..opts.repetitions)
            .map(|_| run(&mut cache).map(|s| prompt.len() as f64 / s))
            .collect::<Result<Vec<_>>>()?;
        let waits = waits.per_step(model, opts.repetitions);
        let test = format!("pp{}", prompt.len());
        results.push(result(test, prompt.len(), samples, waits));
        on_result(results.last().expect("just pushed"));
    }

    for &b in &opts.batches {
        if opts.gen_tokens == 0 {
            break;
        }
        let gen = &tokens[..opts.gen_tokens + b.saturating_sub(1)];
        results.push(tg(model, gen, opts.gen_tokens, b, opts.repetitions)?);
        on_result(results.last().expect("just pushed"));
    }
    Ok(results)
}

/// `tgN` (one sequence) or `tgN@bB` (`b` sequences): `n` steps of one token per sequence,
/// each step ending with the greedy pick of every sequence's next token (made where the model
/// runs: only the ids come back, as in the server's greedy decoding). `gen` holds n + b − 1
/// ids: sequence s reads ids s .. s + n, so no two sequences are fed the same ids (which,
/// for a mixture-of-experts model, would route the same tokens twice).
fn tg(model: &Model, gen: &[u32], n: usize, b: usize, repetitions: usize) -> Result<BenchResult> {
    let mut cache = model.new_batch_cache(b, n)?;
    let step_tokens = |i: usize| step_ids(gen, i, b);
    let run = |cache: &mut markbase_models::BatchCache| -> Result<f64> {
        cache.clear();
        let t = Instant::now();
        for i in 0..n {
            model.forward_batch(cache, &step_tokens(i), Logits::Greedy)?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    run(&mut cache)?;
    let waits = Waits::now(model);
    let samples = (0..repetitions)
        .map(|_| run(&mut cache).map(|s| (b * n) as f64 / s))
        .collect::<Result<Vec<_>>>()?;
    let waits = waits.per_step(model, repetitions * n);
    let test = if b == 1 {
        format!("tg{n}")
    } else {
        format!("tg{n}@b{b}")
    };
    Ok(result(test, b * n, samples, waits))
}

/// The ids of step `i` of `b` sequences over `gen`: sequence s's is `gen[i + s]`.
fn step_ids(gen: &[u32], i: usize, b: usize) -> Vec<u32> {
    gen[i..i + b].to_vec()
}

/// `waits`: host waits, wait milliseconds and graph replays per step.
fn result(test: String, n_tokens: usize, samples: Vec<f64>, waits: (f64, f64, f64)) -> BenchResult {
    let (mean, std) = mean_std(&samples);
    BenchResult {
        test,
        n_tokens,
        tokens_per_second: mean,
        std_tokens_per_second: std,
        samples,
        host_waits_per_step: waits.0,
        host_wait_ms_per_step: waits.1,
        graph_replays_per_step: waits.2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_sequences_read_ids_of_their_own() {
        // 4 steps of 6 sequences over 4 + 6 − 1 distinct ids: each sequence's run of ids
        // differs from every other's (with 6 > 4 steps, reading modulo the steps would
        // repeat sequences 0 and 4).
        let gen: Vec<u32> = (100..109).collect();
        let runs: Vec<Vec<u32>> = (0..6)
            .map(|s| (0..4).map(|i| step_ids(&gen, i, 6)[s]).collect())
            .collect();
        for a in 0..6 {
            for b in a + 1..6 {
                assert_ne!(runs[a], runs[b], "sequences {a} and {b}");
            }
        }
        assert_eq!(step_ids(&gen, 3, 6), vec![103, 104, 105, 106, 107, 108]);
    }

    #[test]
    fn mean_and_sample_std() {
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!((m - 5.0).abs() < 1e-12);
        // Sample variance: 32 / 7.
        assert!((s - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_std(&[3.0]), (3.0, 0.0));
        assert_eq!(mean_std(&[]), (0.0, 0.0));
    }
}
