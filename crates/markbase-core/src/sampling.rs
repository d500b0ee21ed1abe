//! Choosing the next token from a row of logits: greedy (temperature 0), or a draw — a given
//! uniform number in [0, 1) — from the probabilities left by temperature → top-k → top-p →
//! min-p. The reference that every backend's [`Backend::sample`](crate::backend::Backend::sample)
//! matches, and what the engine's seeded sampler runs on the host.

use crate::{Error, Result};

/// How one row's token is chosen: the filters and the uniform draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// Softmax temperature; 0 means greedy (the argmax; the other fields are not read).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1
    /// disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the most likely token's; 0 disables.
    pub min_p: f32,
    /// The uniform number in [0, 1) the pick walks the kept probabilities to.
    pub u: f32,
}

impl Draw {
    /// A greedy choice.
    pub const GREEDY: Draw = Draw {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.0,
    };

    /// Checks the ranges (temperature finite and ≥ 0, top-p in (0, 1], min-p in [0, 1], u in
    /// [0, 1)); the error names the draw.
    pub fn check(&self) -> Result<()> {
        let fine = self.temperature >= 0.0
            && self.temperature.is_finite()
            && self.top_p > 0.0
            && self.top_p <= 1.0
            && (0.0..=1.0).contains(&self.min_p)
            && (0.0..1.0).contains(&self.u);
        if fine {
            Ok(())
        } else {
            Err(Error::Invalid(format!("sampling: bad draw {self:?}")))
        }
    }
}

/// The token `d` picks from `logits` (`cand` is scratch): the argmax at temperature 0, else
/// the first kept candidate, in [`distribution`]'s order, at which the running sum of the
/// kept probabilities passes `u` × their total (sums in f64).
pub fn pick(d: &Draw, cand: &mut Vec<(u32, f32)>, logits: &[f32]) -> u32 {
    if d.temperature == 0.0 {
        return argmax(logits);
    }
    let probs = distribution(d, cand, logits);
    let r = d.u as f64 * probs.iter().map(|c| c.1 as f64).sum::<f64>();
    let mut acc = 0.0f64;
    for &(id, p) in probs {
        acc += p as f64;
        if r < acc {
            return id;
        }
    }
    probs.last().map(|c| c.0).unwrap_or_else(|| argmax(logits))
}

/// Candidates examined before falling back to a full sort for top-p.
const TOP_P_PARTIAL: usize = 1024;

/// The filtered distribution (token, probability before renormalisation), built in `cand`:
/// most likely first where top-k or top-p needs an order, else in token order (a draw walks
/// either; no order is made where none is needed, since sorting a 262 144-token vocabulary
/// cost ≈ 25 ms a token).
pub fn distribution<'c>(
    p: &Draw,
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
        let head: f64 = cand[..TOP_P_PARTIAL]
            .iter()
            .map(|c| (c.1 - max).exp() as f64)
            .sum();
        if head / sum >= p.top_p as f64 {
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
    to_probabilities(cand, max, sum);
    if p.top_p < 1.0 {
        let mut acc = 0.0f64;
        let mut keep = cand.len();
        for (i, c) in cand.iter().enumerate() {
            acc += c.1 as f64;
            if acc >= p.top_p as f64 {
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
    to_probabilities(cand, max, sum);
    if min_p > 0.0 {
        // The largest candidate's probability is exp(0) / sum, so it always stays.
        let floor = min_p * (1.0 / sum) as f32;
        cand.retain(|c| c.1 >= floor);
    }
    cand
}

/// Each candidate's value x as its probability exp(x − max) / sum.
fn to_probabilities(cand: &mut [(u32, f32)], max: f32, sum: f64) {
    for c in cand.iter_mut() {
        c.1 = ((c.1 - max).exp() as f64 / sum) as f32;
    }
}

/// Max and sum of exp(x - max) over the candidates' values (the sum in f64: summed in f32 over
/// a 262 144-token vocabulary it drifts by 1e-4, and so would top-p's cut).
fn softmax_stats(cand: &[(u32, f32)]) -> (f32, f64) {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let sum = cand.iter().map(|c| (c.1 - max).exp() as f64).sum();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> Draw {
        Draw {
            temperature,
            top_k,
            top_p,
            min_p,
            u: 0.5,
        }
    }

    /// Ids kept by the filters, in order.
    fn kept(p: Draw, logits: &[f32]) -> Vec<u32> {
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
    fn bad_draws_are_refused() {
        assert!(Draw::GREEDY.check().is_ok());
        assert!(params(0.8, 40, 0.95, 0.05).check().is_ok());
        for bad in [
            params(-1.0, 0, 1.0, 0.0),
            params(f32::NAN, 0, 1.0, 0.0),
            params(1.0, 0, 0.0, 0.0),
            params(1.0, 0, 1.0, 1.5),
            Draw {
                u: 1.0,
                ..params(1.0, 0, 1.0, 0.0)
            },
        ] {
            assert!(
                bad.check().unwrap_err().to_string().contains("bad draw"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_pick_walks_the_kept_probabilities_to_u() {
        // Token order (no top-k / top-p): 0.06, 0.5, 0.1, 0.3, 0.04 — running sums 0.06,
        // 0.56, 0.66, 0.96, 1.0.
        let l = logits_of(&[0.06, 0.5, 0.1, 0.3, 0.04]);
        let mut cand = Vec::new();
        let at = |u: f32, cand: &mut Vec<(u32, f32)>| {
            pick(
                &Draw {
                    u,
                    ..params(1.0, 0, 1.0, 0.0)
                },
                cand,
                &l,
            )
        };
        assert_eq!(at(0.0, &mut cand), 0);
        assert_eq!(at(0.3, &mut cand), 1);
        assert_eq!(at(0.6, &mut cand), 2);
        assert_eq!(at(0.9, &mut cand), 3);
        assert_eq!(at(0.99, &mut cand), 4);
        // Top-k ranks first: 0.5, 0.3 (k 2), renormalised to 0.625, 0.375.
        let ranked = Draw {
            u: 0.7,
            ..params(1.0, 2, 1.0, 0.0)
        };
        assert_eq!(pick(&ranked, &mut cand, &l), 3);
        assert_eq!(pick(&Draw { u: 0.6, ..ranked }, &mut cand, &l), 1);
        // Temperature 0 is the argmax whatever u is.
        assert_eq!(
            pick(
                &Draw {
                    u: 0.99,
                    ..Draw::GREEDY
                },
                &mut cand,
                &l
            ),
            1
        );
    }
}
