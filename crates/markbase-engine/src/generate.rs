//! The generation loop: prefill the prompt, then sample and decode one token at a time,
//! streaming text through a callback until a stop token, a stop string or the token limit.

use std::time::Instant;

use markbase_core::tokenizer::Tokenizer;
use markbase_core::{Error, Result};
use markbase_models::{KvCache, Logits, Model};
use serde::Serialize;

use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopFilter;

/// What to generate and when to stop.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (not part of the output).
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation (never part of the output text).
    pub stop_strings: Vec<String>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
}

/// End-of-turn tokens that stop generation when the vocabulary has them: Gemma 3's
/// `<end_of_turn>`, Gemma 4's `<turn|>` and `<|tool_response>` (gemma4.md §7.2).
const TURN_ENDS: [&str; 3] = ["<end_of_turn>", "<turn|>", "<|tool_response>"];

/// The stop tokens of a tokenizer: EOS and the end-of-turn tokens its vocabulary has.
pub fn default_stop_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = tokenizer.eos_id().into_iter().collect();
    for id in TURN_ENDS.iter().filter_map(|t| tokenizer.token_id(t)) {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// The token limit or the end of the context.
    Length,
}

/// Time spent, in milliseconds, and the rates that follow.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    /// Prompt tokens run through the model (those not reused from the cache).
    pub prefill_tokens: usize,
    /// Time to run the prompt and sample the first token.
    pub prefill_ms: f64,
    /// Tokens run one at a time after the prompt.
    pub decode_tokens: usize,
    /// Time of those steps, sampling included.
    pub decode_ms: f64,
    /// prefill_tokens per second.
    pub prefill_tokens_per_second: f64,
    /// decode_tokens per second.
    pub decode_tokens_per_second: f64,
}

/// The result of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated token ids (a final stop token excluded).
    pub output_token_ids: Vec<u32>,
    /// Generated text, stop strings excluded — exactly what was streamed.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Timings.
    pub timings: Timings,
}

/// A model with a KV cache that remembers which tokens it holds, so a later prompt that starts
/// with the same tokens (the next turn of a chat) only runs its new part.
pub struct Session<'m> {
    model: &'m Model,
    cache: KvCache,
    tokens: Vec<u32>,
}

impl<'m> Session<'m> {
    /// A session whose cache holds up to `context` tokens.
    pub fn new(model: &'m Model, context: usize) -> Result<Self> {
        Ok(Session {
            model,
            cache: model.new_cache(context)?,
            tokens: Vec::new(),
        })
    }

    /// Tokens the cache can hold.
    pub fn context(&self) -> usize {
        self.cache.capacity()
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each piece of text as soon
    /// as it is final.
    pub fn generate(
        &mut self,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt has no tokens".into()));
        }
        let capacity = self.cache.capacity();
        if prompt.len() > capacity {
            return Err(Error::ContextOverflow {
                tokens: prompt.len(),
                context: capacity,
            });
        }
        let mut sampler = Sampler::new(opts.sampling.clone())?;

        // Reuse the cached prefix, keeping at least one prompt token to produce logits.
        let mut common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        if self.cache.truncate(common).is_err() {
            // Sliding-window layers no longer hold that far back: start over.
            self.cache.clear();
            common = 0;
        }
        self.tokens.truncate(common);

        let mut timings = Timings {
            prefill_tokens: prompt.len() - common,
            ..Timings::default()
        };
        let t0 = Instant::now();
        let mut next = self.run(&mut sampler, &prompt[common..])?;
        self.tokens.extend_from_slice(&prompt[common..]);

        let mut history = prompt.to_vec();
        let mut output = Vec::new();
        let mut text = String::new();
        let mut decoder = tokenizer.stream_decoder();
        let mut stops = StopFilter::new(&opts.stop_strings);
        let mut emit = |s: String, text: &mut String| {
            if !s.is_empty() {
                on_text(&s);
                text.push_str(&s);
            }
        };
        let mut t_decode = None;
        let finish = loop {
            if output.len() >= opts.max_tokens {
                break FinishReason::Length;
            }
            let id = match &mut next {
                Next::Picked(id) => *id,
                Next::Logits(logits) => sampler.sample(logits, &history),
            };
            if t_decode.is_none() {
                timings.prefill_ms = ms(t0);
                t_decode = Some(Instant::now());
            }
            if opts.stop_tokens.contains(&id) {
                break FinishReason::Stop;
            }
            output.push(id);
            history.push(id);
            emit(stops.push(&decoder.push(id)), &mut text);
            if stops.stopped() {
                break FinishReason::Stop;
            }
            if output.len() >= opts.max_tokens || self.cache.len() >= capacity {
                break FinishReason::Length;
            }
            next = self.run(&mut sampler, &[id])?;
            self.tokens.push(id);
            timings.decode_tokens += 1;
        };
        if !stops.stopped() {
            emit(stops.push(&decoder.finish()), &mut text);
            emit(stops.finish(), &mut text);
        }
        match t_decode {
            Some(t) => timings.decode_ms = ms(t),
            None => timings.prefill_ms = ms(t0),
        }
        timings.prefill_tokens_per_second = rate(timings.prefill_tokens, timings.prefill_ms);
        timings.decode_tokens_per_second = rate(timings.decode_tokens, timings.decode_ms);
        Ok(Generation {
            output_token_ids: output,
            text,
            finish_reason: finish,
            timings,
        })
    }

    /// Runs `tokens` after the cache's and returns what the next token comes from
    /// ([`Sampler::choice`]): the model's pick (on a GPU only the token id comes back), or the
    /// last token's logits where the sampler needs them.
    fn run(&mut self, sampler: &mut Sampler, tokens: &[u32]) -> Result<Next> {
        match sampler.choice() {
            Logits::Last => Ok(Next::Logits(self.model.forward(
                &mut self.cache,
                tokens,
                Logits::Last,
            )?)),
            choice => Ok(Next::Picked(self.model.forward_pick(
                &mut self.cache,
                tokens,
                choice,
            )?)),
        }
    }
}

/// What a session's next token comes from.
enum Next {
    /// The model picked it.
    Picked(u32),
    /// The host picks it from these logits.
    Logits(Vec<f32>),
}

/// One generation with a fresh cache sized for the prompt plus `max_tokens` (capped at the
/// model's context; `context` overrides the size).
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    context: Option<usize>,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    let limit = model.info().context_length;
    let context = match context {
        Some(c) if c > limit => {
            return Err(Error::Invalid(format!(
                "context of {c} tokens is larger than the model's {limit}"
            )))
        }
        Some(c) => c,
        None => (prompt.len() + opts.max_tokens).min(limit),
    };
    if prompt.len() > context {
        return Err(Error::ContextOverflow {
            tokens: prompt.len(),
            context,
        });
    }
    Session::new(model, context)?.generate(tokenizer, prompt, opts, on_text)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn rate(tokens: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 / (ms / 1e3)
    } else {
        0.0
    }
}
