//! Turning logits into the next token: repetition penalty, then greedy (temperature 0) or
//! temperature → top-k → top-p → min-p → a draw from a seeded generator (reproducible).

pub use markbase_core::sampling::argmax;
use markbase_core::sampling::{pick, Draw};
use markbase_core::{Error, Result};
use markbase_models::Logits;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    #[serde(serialize_with = "short_f32")]
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 disables.
    #[serde(serialize_with = "short_f32")]
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the most likely token's; 0 disables.
    #[serde(serialize_with = "short_f32")]
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens by this; 1 disables.
    #[serde(serialize_with = "short_f32")]
    pub repetition_penalty: f32,
    /// How many of the latest context tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the random generator: the same seed, model and prompt give the same output.
    pub seed: u64,
}

/// Writes an f32 as the shortest decimal that reads back to it (0.8, not 0.800000011920929).
fn short_f32<S: serde::Serializer>(x: &f32, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(x.to_string().parse().unwrap_or(f64::from(*x)))
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Self::default()
        }
    }

    /// Checks the ranges; the error names the bad parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Invalid(what.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number ≥ 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repeat penalty must be a finite number > 0");
        }
        Ok(())
    }
}

/// Draws tokens according to [`SamplingParams`] with its own seeded generator.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch: (token, value) candidates.
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler; fails if the parameters are out of range.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Sampler {
            params,
            rng,
            cand: Vec::new(),
        })
    }

    /// The parameters in use.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (modified in place by the repetition penalty), given
    /// the tokens of the context so far (`history`: prompt and generated tokens).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        apply_repetition_penalty(
            logits,
            history,
            self.params.repeat_last_n,
            self.params.repetition_penalty,
        );
        let d = self.next_draw();
        pick(&d, &mut self.cand, logits)
    }

    /// What a step asks the model for to choose the next token: the last token's logits
    /// ([`Logits::Last`], then [`Sampler::sample`]) where a repetition penalty needs them; else
    /// the pick itself, made where the model runs ([`Logits::Greedy`], or [`Logits::Sample`]
    /// with the next draw, taken now so the generator runs as on the host).
    pub fn choice(&mut self) -> Logits {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            Logits::Last
        } else if p.temperature == 0.0 {
            Logits::Greedy
        } else {
            Logits::Sample(self.next_draw())
        }
    }

    /// The filters and, above temperature 0, the generator's next uniform number: what
    /// [`Sampler::sample`] picks with, for a pick made elsewhere (on the device) without a
    /// repetition penalty.
    pub fn next_draw(&mut self) -> Draw {
        let p = &self.params;
        if p.temperature == 0.0 {
            return Draw::GREEDY;
        }
        Draw {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            u: self.rng.random::<f32>(),
        }
    }
}

/// The repetition penalty of the CTRL paper as llama.cpp applies it: each distinct token of the
/// last `last_n` history tokens has its logit divided by `penalty` if positive, multiplied if not.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], last_n: usize, penalty: f32) {
    if penalty == 1.0 || last_n == 0 {
        return;
    }
    let recent = &history[history.len().saturating_sub(last_n)..];
    let mut seen: Vec<u32> = recent.to_vec();
    seen.sort_unstable();
    seen.dedup();
    for id in seen {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 7,
        }
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn greedy_takes_argmax_and_first_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[]), 1);
        assert_eq!(s.sample(&mut [5.0, 1.0, 5.0], &[]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
    }

    #[test]
    fn repetition_penalty_divides_positive_multiplies_negative() {
        let mut l = [2.0, -2.0, 1.0, 4.0];
        apply_repetition_penalty(&mut l, &[0, 1, 1, 3], 3, 2.0);
        // Only the last 3 history tokens (1, 1, 3) count, each once.
        assert_eq!(l, [2.0, -4.0, 1.0, 2.0]);
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 3.0,
            ..SamplingParams::greedy()
        })
        .unwrap();
        // 3.0 / 3 = 1.0 < 2.0: the penalised favourite loses to token 2.
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[1]), 2);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let l: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..SamplingParams::default()
            })
            .unwrap();
            (0..64)
                .map(|_| s.sample(&mut l.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn draws_follow_the_distribution() {
        let l = logits_of(&[0.7, 0.2, 0.1]);
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0)).unwrap();
        let mut counts = [0usize; 3];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&mut l.clone(), &[]) as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.7, 0.2, 0.1]) {
            let f = *c as f64 / n as f64;
            assert!((f - p).abs() < 0.02, "{counts:?}");
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = Sampler::new(params(-1.0, 0, 1.0, 0.0)).err().unwrap();
        assert!(e.to_string().contains("temperature"));
        let e = Sampler::new(params(1.0, 0, 0.0, 0.0)).err().unwrap();
        assert!(e.to_string().contains("top-p"));
        let e = Sampler::new(params(1.0, 0, 1.0, 2.0)).err().unwrap();
        assert!(e.to_string().contains("min-p"));
    }
}
