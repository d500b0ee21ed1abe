//! Turning logits into the next token: repetition penalty, then greedy (temperature 0) or
//! temperature → top-k → top-p → min-p → a draw from a seeded generator (reproducible).

use markbase_core::{Error, Result};
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

/// Candidates examined before falling back to a full sort for top-p.
const TOP_P_PARTIAL: usize = 1024;

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
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let probs = distribution(&self.params, &mut self.cand, logits);
        let r: f32 = self.rng.random::<f32>() * probs.iter().map(|c| c.1).sum::<f32>();
        let mut acc = 0.0f32;
        for &(id, p) in probs {
            acc += p;
            if r < acc {
                return id;
            }
        }
        probs.last().map(|c| c.0).unwrap_or_else(|| argmax(logits))
    }
}

/// The filtered distribution (token, probability before renormalisation), built in `cand`:
/// most likely first where top-k or top-p needs an order, else in token order (a draw walks
/// either; no order is made where none is needed, since sorting a 262 144-token vocabulary
/// cost ≈ 25 ms a token).
fn distribution<'c>(
    p: &SamplingParams,
    cand: &'c mut Vec<(u32, f32)>,
    logits: &[f32],
) -> &'c [(u32, f32)] {
    let inv_t = 1.0 / p.temperature;
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l * inv_t)),
    );
    if (p.top_k == 0 || p.top_k >= cand.len()) && p.top_p >= 1.0 {
        return unordered(p.min_p, cand);
    }
    let by_value_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, by_value_desc);
        cand.truncate(p.top_k);
    }
    // Sort (partially when there are many candidates and top-p allows it).
    let sorted = if p.top_p < 1.0 && cand.len() > TOP_P_PARTIAL {
        let (max, sum) = softmax_stats(cand);
        cand.select_nth_unstable_by(TOP_P_PARTIAL - 1, by_value_desc);
        cand[..TOP_P_PARTIAL].sort_unstable_by(by_value_desc);
        let head: f32 = cand[..TOP_P_PARTIAL]
            .iter()
            .map(|c| (c.1 - max).exp())
            .sum();
        if head / sum >= p.top_p {
            cand.truncate(TOP_P_PARTIAL);
            Some((max, sum))
        } else {
            cand.sort_unstable_by(by_value_desc);
            None
        }
    } else {
        cand.sort_unstable_by(by_value_desc);
        None
    };
    let (max, sum) = sorted.unwrap_or_else(|| softmax_stats(cand));
    for c in cand.iter_mut() {
        c.1 = (c.1 - max).exp() / sum;
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0f32;
        let mut keep = cand.len();
        for (i, c) in cand.iter().enumerate() {
            acc += c.1;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep);
    }
    if p.min_p > 0.0 {
        if let Some(&(_, top)) = cand.first() {
            let floor = p.min_p * top;
            let keep = cand.iter().take_while(|c| c.1 >= floor).count().max(1);
            cand.truncate(keep);
        }
    }
    cand
}

/// Every candidate's probability, in token order, less those under `min_p` × the largest
/// (`distribution` without top-k or top-p).
fn unordered(min_p: f32, cand: &mut Vec<(u32, f32)>) -> &[(u32, f32)] {
    let (max, sum) = softmax_stats(cand);
    for c in cand.iter_mut() {
        c.1 = (c.1 - max).exp() / sum;
    }
    if min_p > 0.0 {
        // The largest candidate's probability is exp(0) / sum, so it always stays.
        let floor = min_p * (1.0 / sum);
        cand.retain(|c| c.1 >= floor);
    }
    cand
}

/// Max and sum of exp(x - max) over the candidates' values.
fn softmax_stats(cand: &[(u32, f32)]) -> (f32, f32) {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let sum = cand.iter().map(|c| (c.1 - max).exp()).sum();
    (max, sum)
}

/// Index of the largest logit (the lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
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

    /// Ids kept by the filters, in order.
    fn kept(p: SamplingParams, logits: &[f32]) -> Vec<u32> {
        let mut cand = Vec::new();
        distribution(&p, &mut cand, logits)
            .iter()
            .map(|c| c.0)
            .collect()
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
    fn top_k_keeps_the_k_largest() {
        let l = [0.0, 5.0, 1.0, 4.0, 3.0, -2.0];
        assert_eq!(kept(params(1.0, 3, 1.0, 0.0), &l), vec![1, 3, 4]);
        assert_eq!(kept(params(1.0, 1, 1.0, 0.0), &l), vec![1]);
        assert_eq!(kept(params(1.0, 0, 1.0, 0.0), &l).len(), 6);
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_p() {
        let l = logits_of(&[0.1, 0.5, 0.25, 0.15]);
        // 0.5 < 0.6 → add 0.25 → 0.75 ≥ 0.6.
        assert_eq!(kept(params(1.0, 0, 0.6, 0.0), &l), vec![1, 2]);
        assert_eq!(kept(params(1.0, 0, 0.5, 0.0), &l), vec![1]);
        assert_eq!(kept(params(1.0, 0, 0.95, 0.0), &l), vec![1, 2, 3, 0]);
    }

    #[test]
    fn top_p_partial_sort_matches_full_sort() {
        // Many candidates: the partial path must give the same set as a plain computation.
        let n = 5000;
        let l: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 50.0).collect();
        for &top_p in &[0.3f32, 0.9, 0.999] {
            let got = kept(params(1.0, 0, top_p, 0.0), &l);
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
            let max = l[order[0]] as f64;
            let sum: f64 = l.iter().map(|&x| (x as f64 - max).exp()).sum();
            let mut acc = 0.0;
            let mut want = Vec::new();
            for &i in &order {
                want.push(i as u32);
                acc += (l[i] as f64 - max).exp() / sum;
                if acc >= top_p as f64 {
                    break;
                }
            }
            // f32 vs f64 accumulation may move the cut by a token of equal value at most.
            assert!(
                (got.len() as i64 - want.len() as i64).abs() <= 1,
                "top_p {top_p}: {} vs {}",
                got.len(),
                want.len()
            );
            let common = got.len().min(want.len());
            assert_eq!(&got[..common], &want[..common]);
        }
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_top() {
        let l = logits_of(&[0.5, 0.3, 0.1, 0.06, 0.04]);
        // floor = 0.19 × 0.5 = 0.095 → keeps 0.5, 0.3, 0.1.
        assert_eq!(kept(params(1.0, 0, 1.0, 0.19), &l), vec![0, 1, 2]);
        assert_eq!(kept(params(1.0, 0, 1.0, 0.7), &l), vec![0]);
    }

    #[test]
    fn without_top_k_or_top_p_candidates_stay_in_token_order() {
        // Nothing asks for an order: every token (min-p 0) or those at or above the floor
        // (0.19 × 0.5 = 0.095: 0.5, 0.1 and 0.3), by id, with their probabilities.
        let l = logits_of(&[0.06, 0.5, 0.1, 0.3, 0.04]);
        assert_eq!(kept(params(1.0, 0, 1.0, 0.0), &l), vec![0, 1, 2, 3, 4]);
        assert_eq!(kept(params(1.0, 0, 1.0, 0.19), &l), vec![1, 2, 3]);
        // A top-k as large as the vocabulary asks for no order either.
        assert_eq!(kept(params(1.0, 5, 1.0, 0.19), &l), vec![1, 2, 3]);
        let mut cand = Vec::new();
        let probs = distribution(&params(1.0, 0, 1.0, 0.0), &mut cand, &l);
        for (&(id, p), want) in probs.iter().zip([0.06f32, 0.5, 0.1, 0.3, 0.04]) {
            assert!((p - want).abs() < 1e-6, "token {id}: {p} vs {want}");
        }
        // Top-k below the vocabulary still ranks: most likely first.
        assert_eq!(kept(params(1.0, 4, 1.0, 0.19), &l), vec![1, 3, 2]);
    }

    #[test]
    fn temperature_sharpens_before_filters() {
        let l = logits_of(&[0.5, 0.3, 0.2]);
        // At T=1, min-p 0.5 keeps 0.5 and 0.3; at T=0.5 the ratio 0.3/0.5 squares to 0.36.
        assert_eq!(kept(params(1.0, 0, 1.0, 0.5), &l), vec![0, 1]);
        assert_eq!(kept(params(0.5, 0, 1.0, 0.5), &l), vec![0]);
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
