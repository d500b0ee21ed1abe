//! Sampling and stopping options shared by `run` and `chat`.

use markbase_engine::SamplingParams;

/// Sampling options.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Softmax temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0 = all).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this total probability (1 = all).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for repeating recent tokens (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many recent tokens the repeat penalty looks at.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: a new one each run, printed with --json).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most tokens to generate.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Stop when this text is generated (may be repeated; the text is not printed).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Context size in tokens (default: prompt + max tokens, up to the model's limit).
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl SamplingArgs {
    /// The engine's sampling parameters, with the seed resolved.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed.unwrap_or_else(fresh_seed),
        }
    }
}

/// A seed that differs between runs.
fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}
