//! Perplexity: the negative log-likelihood of every token given the ones before it, computed
//! with a log-softmax in f64, over windows of at most `ctx` tokens.
//!
//! Windowing scores every token after the first exactly once, so `nll.len() == n - 1`:
//! - when the sequence starts with BOS, each window is BOS followed by the next `ctx - 1`
//!   tokens, and every token after that BOS is scored;
//! - otherwise windows overlap by one token: the first token of a window is context only.
//!
//! A sequence that fits one context is one window, scored at positions 1..n-1.

use std::time::Instant;

use markbase_core::{Error, Result};
use markbase_models::{Logits, Model};
use serde::Serialize;

/// Tokens run through the model per forward call (bounds the logits buffer: rows × n_vocab).
const BATCH: usize = 64;

/// Result of a perplexity run.
#[derive(Clone, Debug, Serialize)]
pub struct Perplexity {
    /// NLL (nats) of each predicted token, in order.
    pub nll: Vec<f64>,
    /// Mean of `nll`.
    pub mean_nll: f64,
    /// exp(mean_nll).
    pub ppl: f64,
    /// Context size (window length) used.
    pub ctx: usize,
    /// Number of windows evaluated.
    pub windows: usize,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Tokens evaluated per second (window tokens, BOS copies included).
    pub tokens_per_second: f64,
}

/// NLL of `target` under the distribution softmax(`logits`), in f64: logsumexp − logit.
pub fn token_nll(logits: &[f32], target: u32) -> Result<f64> {
    let t = logits.get(target as usize).ok_or_else(|| {
        Error::Invalid(format!(
            "token id {target} is outside the vocabulary of {} entries",
            logits.len()
        ))
    })?;
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    Ok(max + sum.ln() - *t as f64)
}

/// Splits `tokens` into windows of at most `ctx` tokens, as described in the module docs.
pub fn windows(tokens: &[u32], ctx: usize, bos: Option<u32>) -> Result<Vec<Vec<u32>>> {
    if ctx < 2 {
        return Err(Error::Invalid(format!(
            "perplexity needs a context of at least 2 tokens, got {ctx}"
        )));
    }
    if tokens.len() < 2 {
        return Err(Error::Invalid(format!(
            "perplexity needs at least 2 tokens, got {}",
            tokens.len()
        )));
    }
    let starts_with_bos = bos.is_some() && tokens.first().copied() == bos;
    Ok(if starts_with_bos {
        tokens[1..]
            .chunks(ctx - 1)
            .map(|c| {
                let mut w = Vec::with_capacity(c.len() + 1);
                w.push(tokens[0]);
                w.extend_from_slice(c);
                w
            })
            .collect()
    } else {
        let mut out = Vec::new();
        let mut start = 0;
        while start + 1 < tokens.len() {
            let end = (start + ctx).min(tokens.len());
            out.push(tokens[start..end].to_vec());
            start = end - 1;
        }
        out
    })
}

/// Scores each window with `eval` (which returns logits rows for a window's positions through
/// `on_rows(first_position, rows)`) and collects the NLL of positions 1.. of every window.
pub fn score_windows(
    windows: &[Vec<u32>],
    n_vocab: usize,
    mut eval: impl FnMut(&[u32], &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<f64>> {
    let mut nll = Vec::new();
    for (wi, w) in windows.iter().enumerate() {
        let mut next_pos = 0usize;
        eval(w, &mut |first, rows| {
            if first != next_pos || rows.len() % n_vocab != 0 {
                return Err(Error::Invalid(format!(
                    "perplexity: logits for position {first} arrived out of order or with a bad size"
                )));
            }
            for (i, row) in rows.chunks_exact(n_vocab).enumerate() {
                let pos = first + i;
                if pos + 1 < w.len() {
                    nll.push(token_nll(row, w[pos + 1])?);
                }
            }
            next_pos = first + rows.len() / n_vocab;
            Ok(())
        })?;
        if next_pos != w.len() {
            return Err(Error::Invalid(format!(
                "perplexity: got logits for {next_pos} of {} positions",
                w.len()
            )));
        }
        progress(wi + 1, windows.len());
    }
    Ok(nll)
}

/// Mean NLL and perplexity of a list of NLLs.
pub fn summarize(nll: &[f64]) -> (f64, f64) {
    let mean = nll.iter().sum::<f64>() / nll.len().max(1) as f64;
    (mean, mean.exp())
}

/// Perplexity of `model` on `tokens` with windows of `ctx` tokens. `progress(done, total)`
/// is called after each window.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    let info = model.info();
    let n_vocab = info.n_vocab;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(Error::Invalid(format!(
            "token id {bad} is outside the model's vocabulary of {n_vocab}"
        )));
    }
    let wins = windows(tokens, ctx, bos)?;
    let longest = wins.iter().map(Vec::len).max().unwrap_or(0);
    let mut cache = model.new_cache(longest)?;
    let start = Instant::now();
    let evaluated: usize = wins.iter().map(Vec::len).sum();
    let nll = score_windows(
        &wins,
        n_vocab,
        |w, on_rows| {
            cache.clear();
            for (i, chunk) in w.chunks(BATCH).enumerate() {
                let logits = model.forward(&mut cache, chunk, Logits::All)?;
                on_rows(i * BATCH, &logits)?;
            }
            Ok(())
        },
        progress,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let (mean_nll, ppl) = summarize(&nll);
    Ok(Perplexity {
        nll,
        mean_nll,
        ppl,
        ctx,
        windows: wins.len(),
        seconds,
        tokens_per_second: evaluated as f64 / seconds.max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_log_softmax_in_f64() {
        // Uniform over 4: -ln(1/4).
        let v = token_nll(&[0.0; 4], 2).unwrap();
        assert!((v - 4f64.ln()).abs() < 1e-12);
        // softmax([ln 0.5, ln 0.3, ln 0.2]) = [0.5, 0.3, 0.2].
        let l = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        assert!((token_nll(&l, 1).unwrap() + 0.3f64.ln()).abs() < 1e-6);
        // Large logits must not overflow.
        let v = token_nll(&[1000.0, 1000.0], 0).unwrap();
        assert!((v - 2f64.ln()).abs() < 1e-12);
        assert!(token_nll(&[0.0; 3], 3).is_err());
    }

    #[test]
    fn one_context_scores_positions_1_to_n_minus_1() {
        let w = windows(&[2, 10, 11, 12], 8, Some(2)).unwrap();
        assert_eq!(w, vec![vec![2, 10, 11, 12]]);
        let w = windows(&[10, 11, 12], 8, Some(2)).unwrap();
        assert_eq!(w, vec![vec![10, 11, 12]]);
    }

    #[test]
    fn bos_windows_repeat_bos_and_score_every_token() {
        let t = [2, 10, 11, 12, 13, 14];
        let w = windows(&t, 3, Some(2)).unwrap();
        assert_eq!(w, vec![vec![2, 10, 11], vec![2, 12, 13], vec![2, 14]]);
        let scored: usize = w.iter().map(|w| w.len() - 1).sum();
        assert_eq!(scored, t.len() - 1);
    }

    #[test]
    fn windows_without_bos_overlap_by_one() {
        let t = [5, 6, 7, 8, 9];
        let w = windows(&t, 3, None).unwrap();
        assert_eq!(w, vec![vec![5, 6, 7], vec![7, 8, 9]]);
        let w = windows(&t, 2, Some(2)).unwrap();
        assert_eq!(w, vec![vec![5, 6], vec![6, 7], vec![7, 8], vec![8, 9]]);
        assert!(windows(&t, 1, None).is_err());
        assert!(windows(&[5], 4, None).is_err());
    }

    /// A fake model over a vocabulary of 3 whose next-token distribution depends only on the
    /// current token: after token a it predicts (a + 1) % 3 with probability 0.5, others 0.25.
    fn fake_logits(tokens: &[u32]) -> Vec<f32> {
        let mut out = Vec::new();
        for &a in tokens {
            for v in 0..3u32 {
                out.push(if v == (a + 1) % 3 {
                    0.5f32.ln()
                } else {
                    0.25f32.ln()
                });
            }
        }
        out
    }

    #[test]
    fn scores_match_hand_computed_values_across_batches() {
        let tokens = [0u32, 1, 2, 2, 0, 1, 1];
        let wins = windows(&tokens, 4, None).unwrap();
        let mut seen = Vec::new();
        let nll = score_windows(
            &wins,
            3,
            |w, on_rows| {
                // Feed logits two positions at a time, as a batched forward would.
                for (i, c) in w.chunks(2).enumerate() {
                    on_rows(i * 2, &fake_logits(c))?;
                }
                Ok(())
            },
            |d, t| seen.push((d, t)),
        )
        .unwrap();
        let hit = -(0.5f64.ln());
        let miss = -(0.25f64.ln());
        // Transitions 0→1 hit, 1→2 hit, 2→2 miss, 2→0 hit, 0→1 hit, 1→1 miss.
        let want = [hit, hit, miss, hit, hit, miss];
        assert_eq!(nll.len(), want.len());
        for (a, b) in nll.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{nll:?}");
        }
        let (mean, ppl) = summarize(&nll);
        let m = (4.0 * hit + 2.0 * miss) / 6.0;
        assert!((mean - m).abs() < 1e-6 && (ppl - m.exp()).abs() < 1e-5);
        assert_eq!(seen.last(), Some(&(wins.len(), wins.len())));
    }

    #[test]
    fn missing_logits_are_an_error() {
        let wins = windows(&[0, 1, 2], 4, None).unwrap();
        let err = score_windows(
            &wins,
            3,
            |w, on_rows| on_rows(0, &fake_logits(&w[..1])),
            |_, _| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("1 of 3"), "{err}");
    }
}
