//! The serving Engine on the default model (Gemma 3 270M Q4_K_M): 32 concurrent greedy
//! requests (4 prompts, 8 copies each), joining in two waves so prefill chunks, prefix-cache
//! hits and decode tokens share steps, each give exactly the tokens of the same request run
//! alone.

use std::sync::Arc;

use markbase_engine::{Engine, EngineConfig, Event, Request, SamplingParams};
use markbase_models::{LoadOptions, Logits, Model};

const TOKENS: usize = 8;

fn alone(model: &Model, prompt: &[u32]) -> Vec<u32> {
    let mut cache = model.new_cache(prompt.len() + TOKENS).unwrap();
    let mut logits = model.forward(&mut cache, prompt, Logits::Last).unwrap();
    let mut out = Vec::new();
    loop {
        let id = markbase_engine::sampling::argmax(&logits);
        out.push(id);
        if out.len() == TOKENS {
            return out;
        }
        logits = model.forward(&mut cache, &[id], Logits::Last).unwrap();
    }
}

#[test]
fn thirty_two_concurrent_greedy_requests_match_each_alone() {
    let path = markbase_engine::pull::default_model_path().expect("default model");
    let loaded = markbase_engine::load(&path, &LoadOptions::default()).unwrap();
    let tok = &loaded.tokenizer;
    let texts = [
        "Question: what is the capital of France, and which river runs through it? Answer:",
        "Here is a short poem about the sea, the wind and the lighthouse on the hill:\n",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Once upon a time, in a small village at the edge of a dark forest, there lived",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let model = Arc::new(loaded.model);
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p)).collect();
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let submit = |i: usize| {
        engine
            .submit(Request {
                prompt: prompts[i % prompts.len()].clone(),
                max_tokens: TOKENS,
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                top_logprobs: None,
            })
            .unwrap()
    };
    let mut handles: Vec<_> = (0..16).map(submit).collect();
    // The second wave joins once every prompt of the first has run (its first token came), so
    // their blocks are in the prefix cache: the engine may have started on the first requests
    // before the rest were submitted.
    let firsts: Vec<u32> = handles
        .iter_mut()
        .map(|h| match h.events.blocking_recv() {
            Some(Event::Token { id, .. }) => id,
            other => panic!("expected a first token, got {other:?}"),
        })
        .collect();
    handles.extend((16..32).map(submit));
    for (i, h) in handles.iter_mut().enumerate() {
        let mut got: Vec<u32> = firsts.get(i).copied().into_iter().collect();
        while let Some(e) = h.events.blocking_recv() {
            match e {
                Event::Token { id, .. } => got.push(id),
                Event::Done { .. } => break,
                Event::Error(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, want[i % 4], "request {i}: {:?}", texts[i % 4]);
    }
    // The second wave found the first wave's prompts in the prefix cache.
    assert!(prompts.iter().all(|p| p.len() > 16));
    assert!(engine.stats().prefix_cache_hit_tokens >= 16 * 16);
}
