//! The serving Engine on the tiny Gemma 3 fixture (7 layers, window 8, context 64): every
//! request's output equals the same request run alone with `Model::forward` and a `Sampler`,
//! whatever else runs beside it; stop tokens, limits, log-probabilities, cancellation,
//! submission errors and shutdown.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use markbase_engine::{
    Engine, EngineConfig, Event, FinishReason, Request, RequestHandle, Sampler, SamplingParams,
    SubmitError,
};
use markbase_models::{LoadOptions, Logits, Model, ModelSource};

fn tiny() -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma3_tiny");
    let src = ModelSource::open(&dir).unwrap();
    let opts = LoadOptions {
        threads: 2,
        progress: None,
        ..LoadOptions::default()
    };
    Arc::new(Model::load(&src, &opts).unwrap())
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 64,
        ..EngineConfig::default()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 2 + (i * 37 + seed * 101 + (i * i * seed) % 13) % 290)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Request {
    Request {
        prompt,
        max_tokens,
        sampling,
        stop_tokens: Vec::new(),
        top_logprobs: None,
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplingParams::default()
    }
}

/// The request run alone: prefill, then one token at a time (stop tokens end it).
fn alone(model: &Model, req: &Request) -> (Vec<u32>, FinishReason) {
    let mut cache = model.new_cache(64).unwrap();
    let mut sampler = Sampler::new(req.sampling.clone()).unwrap();
    let mut history = req.prompt.clone();
    let mut logits = model
        .forward(&mut cache, &req.prompt, Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    let limit = req.max_tokens.min(64 - req.prompt.len());
    loop {
        let id = sampler.sample(&mut logits, &history);
        if req.stop_tokens.contains(&id) {
            return (out, FinishReason::Stop);
        }
        out.push(id);
        history.push(id);
        if out.len() >= limit {
            return (out, FinishReason::Length);
        }
        logits = model.forward(&mut cache, &[id], Logits::Last).unwrap();
    }
}

/// Every event of a handle, waiting for the last one.
fn drain(h: &mut RequestHandle) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(e) = h.events.blocking_recv() {
        let last = matches!(e, Event::Done { .. } | Event::Error(_));
        events.push(e);
        if last {
            break;
        }
    }
    events
}

/// Token ids and the final event.
fn tokens_and_end(events: &[Event]) -> (Vec<u32>, Event) {
    let ids = events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    (ids, events.last().cloned().expect("an event"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn concurrent_requests_match_each_request_alone() {
    let model = tiny();
    let engine = Engine::start(model.clone(), config()).unwrap();
    let reqs: Vec<Request> = (0..12)
        .map(|i| {
            let sampling = if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                sampled(1000 + i as u64)
            };
            request(
                prompt(i, 3 + (i as usize * 5) % 30),
                4 + i as usize * 3,
                sampling,
            )
        })
        .collect();
    let mut handles: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    for (req, h) in reqs.iter().zip(&mut handles) {
        let (ids, end) = tokens_and_end(&drain(h));
        let (want, reason) = alone(&model, req);
        assert_eq!(ids, want, "prompt of {} tokens", req.prompt.len());
        assert_eq!(
            end,
            Event::Done {
                reason,
                prompt_tokens: req.prompt.len(),
                completion_tokens: want.len(),
                cached_prompt_tokens: 0,
            }
        );
    }
    let ids: Vec<u64> = handles.iter().map(|h| h.id).collect();
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(ids, unique);
    assert!(engine.stats().steps > 0);
}

#[test]
fn stop_tokens_and_context_limit_end_requests() {
    let model = tiny();
    let engine = Engine::start(model.clone(), config()).unwrap();
    let p = prompt(3, 10);
    let (free, _) = alone(&model, &request(p.clone(), 20, SamplingParams::greedy()));
    // Stop at the first appearance of the 5th token: it is not emitted.
    let mut req = request(p, 20, SamplingParams::greedy());
    req.stop_tokens = vec![free[4]];
    let first = free.iter().position(|&t| t == free[4]).unwrap();
    let (ids, end) = tokens_and_end(&drain(&mut engine.submit(req).unwrap()));
    assert_eq!(ids, free[..first]);
    assert!(
        matches!(end, Event::Done { reason: FinishReason::Stop, completion_tokens, .. } if completion_tokens == first)
    );
    // A long prompt is cut by the context (64 tokens): prompt + output = 64.
    let req = request(prompt(4, 60), 50, SamplingParams::greedy());
    let (ids, end) = tokens_and_end(&drain(&mut engine.submit(req).unwrap()));
    assert_eq!(ids.len(), 4);
    assert!(matches!(
        end,
        Event::Done {
            reason: FinishReason::Length,
            prompt_tokens: 60,
            completion_tokens: 4,
            ..
        }
    ));
}

#[test]
fn logprobs_are_the_models_log_softmax() {
    let model = tiny();
    let engine = Engine::start(model.clone(), config()).unwrap();
    let p = prompt(5, 7);
    let mut req = request(p.clone(), 3, sampled(9));
    req.top_logprobs = Some(4);
    req.sampling.repetition_penalty = 1.3;
    let events = drain(&mut engine.submit(req).unwrap());
    let mut cache = model.new_cache(64).unwrap();
    let mut logits = model.forward(&mut cache, &p, Logits::Last).unwrap();
    for e in &events[..3] {
        let Event::Token {
            id,
            logprob: Some(lp),
            top_logprobs,
        } = e
        else {
            panic!("{e:?}");
        };
        let z: f64 = logits.iter().map(|&v| f64::from(v).exp()).sum();
        let want = |t: u32| (f64::from(logits[t as usize]).exp() / z).ln();
        assert!((f64::from(*lp) - want(*id)).abs() < 1e-4);
        assert_eq!(top_logprobs.len(), 4);
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        for (k, &(t, l)) in top_logprobs.iter().enumerate() {
            assert_eq!(t, order[k]);
            assert!((f64::from(l) - want(t)).abs() < 1e-4);
        }
        logits = model.forward(&mut cache, &[*id], Logits::Last).unwrap();
    }
    assert!(matches!(events[3], Event::Done { .. }));
}

#[test]
fn dropping_the_handle_cancels_and_frees_the_sequence() {
    let model = tiny();
    let engine = Engine::start(model.clone(), config()).unwrap();
    let mut h = engine
        .submit(request(prompt(6, 20), 40, SamplingParams::greedy()))
        .unwrap();
    // Its first token: the sequence is running (polling the stats for its KV blocks missed a
    // request this short on a busy machine: it had finished between two polls).
    let first = h.events.blocking_recv();
    assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
    drop(h);
    wait_until("freed", || {
        let s = engine.stats();
        s.running == 0 && s.kv_blocks_used == 0
    });
    // The engine keeps serving.
    let req = request(prompt(7, 5), 3, SamplingParams::greedy());
    let (ids, _) = tokens_and_end(&drain(&mut engine.submit(req.clone()).unwrap()));
    assert_eq!(ids, alone(&model, &req).0);
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let model = tiny();
    let engine = Engine::start(model, config()).unwrap();
    let ok = request(prompt(1, 4), 2, SamplingParams::greedy());
    let refuse = |r: Request| engine.submit(r).expect_err("refused");
    let mut r = ok.clone();
    r.prompt.clear();
    assert!(matches!(refuse(r), SubmitError::Invalid(s) if s.contains("no tokens")));
    let mut r = ok.clone();
    r.prompt[1] = 300;
    assert!(matches!(refuse(r), SubmitError::Invalid(s) if s.contains("300")));
    let mut r = ok.clone();
    r.max_tokens = 0;
    assert!(matches!(refuse(r), SubmitError::Invalid(_)));
    let mut r = ok.clone();
    r.top_logprobs = Some(21);
    assert!(matches!(refuse(r), SubmitError::Invalid(_)));
    let mut r = ok.clone();
    r.sampling.top_p = 0.0;
    assert!(matches!(refuse(r), SubmitError::Invalid(s) if s.contains("top-p")));
    let r = request(prompt(1, 64), 2, SamplingParams::greedy());
    assert_eq!(
        refuse(r),
        SubmitError::TooLong {
            tokens: 64,
            limit: 64
        }
    );
    assert!(!SubmitError::QueueFull.to_string().is_empty());
    let mut bad = config();
    bad.max_context = 65;
    assert!(Engine::start(tiny(), bad).is_err());
    let mut bad = config();
    bad.max_step_tokens = bad.max_seqs - 1;
    assert!(Engine::start(tiny(), bad).is_err());
}

#[test]
fn full_queue_and_shutdown() {
    let model = tiny();
    let cfg = EngineConfig {
        max_queue: 0,
        ..config()
    };
    let engine = Engine::start(model.clone(), cfg).unwrap();
    let r = request(prompt(2, 4), 2, SamplingParams::greedy());
    assert_eq!(engine.submit(r.clone()).err(), Some(SubmitError::QueueFull));

    let engine = Engine::start(model, config()).unwrap();
    let mut h = engine
        .submit(request(prompt(2, 8), 56, SamplingParams::greedy()))
        .unwrap();
    engine.shutdown();
    let events = drain(&mut h);
    // It either finished before the shutdown or was told about it.
    assert!(matches!(
        events.last(),
        Some(Event::Error(_)) | Some(Event::Done { .. })
    ));
    assert_eq!(engine.submit(r).err(), Some(SubmitError::ShuttingDown));
}
