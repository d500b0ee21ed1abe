//! The generation loop on the real default model: cache reuse across turns, stop strings,
//! stop tokens and limits; sampled runs picked in the model as the host would pick them.

use markbase_core::tokenizer::ChatMessage;
use markbase_engine::{
    default_stop_tokens, generate, load, FinishReason, GenerateOptions, LoadedModel, Sampler,
    SamplingParams, Session,
};
use markbase_models::{LoadOptions, Logits};

fn loaded() -> LoadedModel {
    let path = markbase_engine::pull::default_model_path().expect("default model");
    load(&path, &LoadOptions::default()).expect("load")
}

fn chat_ids(m: &LoadedModel, msgs: &[ChatMessage]) -> Vec<u32> {
    let text = m.template.render(msgs, true, "<bos>", "<eos>").unwrap();
    m.tokenizer.encode(&text, false).unwrap()
}

fn greedy(max_tokens: usize, stop_strings: &[&str], m: &LoadedModel) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop_tokens: default_stop_tokens(&m.tokenizer),
        stop_strings: stop_strings.iter().map(|s| s.to_string()).collect(),
        sampling: SamplingParams::greedy(),
    }
}

#[test]
fn second_turn_reuses_the_cache_and_matches_a_fresh_run() {
    let m = loaded();
    let opts = greedy(10, &[], &m);
    let mut session = Session::new(&m.model, 512).unwrap();
    let mut msgs = vec![ChatMessage::new("user", "My name is Ada.")];
    let p1 = chat_ids(&m, &msgs);
    let g1 = session
        .generate(&m.tokenizer, &p1, &opts, &mut |_| {})
        .unwrap();
    assert_eq!(g1.timings.prefill_tokens, p1.len());
    msgs.push(ChatMessage::new("assistant", g1.text.clone()));
    msgs.push(ChatMessage::new("user", "What is my name?"));
    let p2 = chat_ids(&m, &msgs);
    let mut streamed = String::new();
    let g2 = session
        .generate(&m.tokenizer, &p2, &opts, &mut |s| streamed.push_str(s))
        .unwrap();
    // Only the new part of the conversation was run.
    assert!(
        g2.timings.prefill_tokens < p2.len() - p1.len() + 8,
        "{:?}",
        g2.timings
    );
    assert_eq!(streamed, g2.text);
    let fresh = generate(&m.model, &m.tokenizer, &p2, &opts, None, &mut |_| {}).unwrap();
    assert_eq!(g2.output_token_ids, fresh.output_token_ids);
}

#[test]
fn stop_string_ends_generation_and_is_not_output() {
    let m = loaded();
    let prompt = m
        .tokenizer
        .encode("The capital of France is", true)
        .unwrap();
    let free = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(12, &[], &m),
        None,
        &mut |_| {},
    )
    .unwrap();
    // Stop on a word in the middle of the free continuation.
    let word = "country";
    let at = free
        .text
        .find(word)
        .expect("fixture continuation mentions the country");
    let mut streamed = String::new();
    let g = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(12, &[word], &m),
        None,
        &mut |s| streamed.push_str(s),
    )
    .unwrap();
    assert_eq!(g.finish_reason, FinishReason::Stop);
    assert_eq!(g.text, free.text[..at]);
    assert_eq!(streamed, g.text);
    assert!(g.output_token_ids.len() < free.output_token_ids.len());
}

#[test]
fn limits_and_context() {
    let m = loaded();
    let prompt = m.tokenizer.encode("Once upon a time", true).unwrap();
    let g = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(3, &[], &m),
        None,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(g.output_token_ids.len(), 3);
    assert_eq!(g.finish_reason, FinishReason::Length);
    // A context one token longer than the prompt: one token, then the context is full.
    let g = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(50, &[], &m),
        Some(prompt.len() + 1),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(g.output_token_ids.len(), 2);
    assert_eq!(g.finish_reason, FinishReason::Length);
    let err = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(5, &[], &m),
        Some(prompt.len() - 1),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("does not fit the context"),
        "{err}"
    );
}

#[test]
fn stop_token_ends_generation_and_is_not_output() {
    let m = loaded();
    let prompt = m
        .tokenizer
        .encode("Once upon a time, in a small village,", true)
        .unwrap();
    let free = generate(
        &m.model,
        &m.tokenizer,
        &prompt,
        &greedy(8, &[], &m),
        None,
        &mut |_| {},
    )
    .unwrap();
    // Make the first token not seen before position 3 a stop token.
    let out = &free.output_token_ids;
    let k = (3..out.len())
        .find(|&k| !out[..k].contains(&out[k]))
        .expect("a fresh token");
    let mut opts = greedy(8, &[], &m);
    opts.stop_tokens.push(out[k]);
    let g = generate(&m.model, &m.tokenizer, &prompt, &opts, None, &mut |_| {}).unwrap();
    assert_eq!(g.finish_reason, FinishReason::Stop);
    assert_eq!(g.output_token_ids, out[..k]);
    assert_eq!(g.text, m.tokenizer.decode(&out[..k]));
    assert_eq!(default_stop_tokens(&m.tokenizer), vec![1, 106]);
}

/// A seeded sampled run picks its tokens in the model (`Model::forward_pick`, a draw a token
/// from the sampler's generator); by hand on the host — the last token's logits, then
/// `Sampler::sample` — the same seed gives the same tokens. With a repetition penalty the
/// session takes the logits path and still matches that loop.
#[test]
fn sampled_generation_picks_in_the_model_as_the_host_would() {
    let m = loaded();
    let prompt = chat_ids(&m, &[ChatMessage::new("user", "Name three colors.")]);
    for penalty in [1.0, 1.3] {
        let sampling = SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: penalty,
            seed: 7,
            ..SamplingParams::default()
        };
        let opts = GenerateOptions {
            max_tokens: 16,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            sampling: sampling.clone(),
        };
        let got = generate(&m.model, &m.tokenizer, &prompt, &opts, None, &mut |_| {}).unwrap();
        let mut cache = m.model.new_cache(prompt.len() + 16).unwrap();
        let mut sampler = Sampler::new(sampling).unwrap();
        let mut logits = m.model.forward(&mut cache, &prompt, Logits::Last).unwrap();
        let mut history = prompt.clone();
        let mut want = Vec::new();
        for i in 0..16 {
            let id = sampler.sample(&mut logits, &history);
            want.push(id);
            history.push(id);
            if i < 15 {
                logits = m.model.forward(&mut cache, &[id], Logits::Last).unwrap();
            }
        }
        assert_eq!(got.output_token_ids, want, "repetition penalty {penalty}");
    }
}
