//! One request while it runs: its tokens, sampler and event channel, and what happens when the
//! model hands it the logits of its next token.

use markbase_models::Logits;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{Event, Request};
use super::kv::SeqKv;
use crate::generate::FinishReason;
use crate::sampling::Sampler;

/// A running (or waiting) request.
pub(crate) struct Sequence {
    /// Prompt, then every generated token (the tokens the KV cache will hold).
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Most tokens to generate: the request's limit, cut to the context limit.
    pub max_new: usize,
    pub stop_tokens: Vec<u32>,
    pub top_logprobs: Option<usize>,
    pub sampler: Sampler,
    pub tx: UnboundedSender<Event>,
    /// Prompt tokens found in the prefix cache at the last admission.
    pub cached_prompt_tokens: usize,
    /// The KV blocks it holds.
    pub kv: SeqKv,
}

/// What became of a sequence after a token was sampled.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Keep running.
    Continue,
    /// Finished (the `Done` event was sent or the receiver is gone).
    Finished,
    /// The receiver was dropped: cancelled.
    Cancelled,
}

impl Sequence {
    /// A sequence for `req` whose prompt + output may not exceed `max_context` tokens.
    /// The request must have been validated.
    pub fn new(
        req: Request,
        sampler: Sampler,
        tx: UnboundedSender<Event>,
        max_context: usize,
    ) -> Self {
        let room = max_context.saturating_sub(req.prompt.len());
        Sequence {
            prompt_len: req.prompt.len(),
            max_new: req.max_tokens.min(room),
            tokens: req.prompt,
            stop_tokens: req.stop_tokens,
            top_logprobs: req.top_logprobs,
            sampler,
            tx,
            cached_prompt_tokens: 0,
            kv: SeqKv::default(),
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run before the next token can be sampled (at least 1 while running).
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.kv.computed
    }

    /// Whether its next step runs only its last generated token (a decode row; otherwise
    /// the step runs prompt tokens, or tokens recomputed after a preemption).
    pub fn is_decoding(&self) -> bool {
        self.pending() == 1 && self.generated() > 0
    }

    /// Whether the owner dropped its handle.
    pub fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    /// Samples the next token from `logits` (the model's output after the last token), sends
    /// its event, and finishes the sequence at a stop token or the token limit.
    pub fn accept(&mut self, logits: &mut [f32]) -> Outcome {
        if self.cancelled() {
            return Outcome::Cancelled;
        }
        // Log-probabilities are those of the model: taken before the sampler's penalty.
        let lse = self.top_logprobs.map(|_| log_sum_exp(logits));
        let raw = match lse {
            Some(_) if self.sampler.params().repetition_penalty != 1.0 => Some(logits.to_vec()),
            _ => None,
        };
        let top = match (self.top_logprobs, lse) {
            (Some(n), Some(lse)) => top_n(logits, n, lse),
            _ => Vec::new(),
        };
        let id = self.sampler.sample(logits, &self.tokens);
        let logprob = lse.map(|lse| raw.as_deref().unwrap_or(logits)[id as usize] - lse);
        self.emit(id, logprob, top)
    }

    /// What a step asks the model for to choose the next token: the logits on the host
    /// ([`Logits::Last`], then [`Sequence::accept`]) where a repetition penalty or
    /// log-probabilities need them; else the pick itself, made where the model runs
    /// ([`Logits::Greedy`], or [`Logits::Sample`] with the sampler's next draw, taken now so
    /// the generator runs as on the host), then [`Sequence::accept_pick`].
    pub fn choice(&mut self) -> Logits {
        if self.top_logprobs.is_some() {
            Logits::Last
        } else {
            self.sampler.choice()
        }
    }

    /// [`Sequence::accept`] for a choice made by the model (see [`Sequence::choice`]).
    pub fn accept_pick(&mut self, id: u32) -> Outcome {
        if self.cancelled() {
            return Outcome::Cancelled;
        }
        self.emit(id, None, Vec::new())
    }

    /// Takes token `id` as the next one: sends its event, and finishes the sequence at a stop
    /// token or the token limit.
    fn emit(&mut self, id: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) -> Outcome {
        if self.stop_tokens.contains(&id) {
            return self.finish(FinishReason::Stop);
        }
        self.tokens.push(id);
        let event = Event::Token {
            id,
            logprob,
            top_logprobs: top,
        };
        if self.tx.send(event).is_err() {
            return Outcome::Cancelled;
        }
        if self.generated() >= self.max_new {
            return self.finish(FinishReason::Length);
        }
        Outcome::Continue
    }

    /// Sends `Done`.
    pub fn finish(&mut self, reason: FinishReason) -> Outcome {
        let done = Event::Done {
            reason,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_prompt_tokens: self.cached_prompt_tokens,
        };
        let _ = self.tx.send(done);
        Outcome::Finished
    }
}

/// `ln Σ exp(x)`, computed stably (NaN entries are skipped).
fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x
        .iter()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f64 = x
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from(v - max).exp())
        .sum();
    max + sum.ln() as f32
}

/// The `n` largest logits as (id, log-probability), most likely first (lower id on ties).
fn top_n(logits: &[f32], n: usize, lse: f32) -> Vec<(u32, f32)> {
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| (i as u32, v))
        .collect();
    let by_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n == 0 {
        return Vec::new();
    }
    if n < cand.len() {
        cand.select_nth_unstable_by(n - 1, by_desc);
        cand.truncate(n);
    }
    cand.sort_unstable_by(by_desc);
    cand.into_iter().map(|(i, v)| (i, v - lse)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_helpers_match_a_direct_computation() {
        let l = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = l.iter().map(|&v| f64::from(v).exp()).sum();
        let lse = log_sum_exp(&l);
        assert!((f64::from(lse) - z.ln()).abs() < 1e-6);
        let top = top_n(&l, 3, lse);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0]);
        for (id, lp) in top {
            let want = (f64::from(l[id as usize]).exp() / z).ln();
            assert!((f64::from(lp) - want).abs() < 1e-6);
        }
        assert!(top_n(&l, 0, lse).is_empty());
        assert_eq!(top_n(&l, 9, lse).len(), 5);
    }
}
