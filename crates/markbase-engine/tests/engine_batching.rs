//! Continuous batching inside the Engine on tiny fixtures: preemption when the KV pool runs
//! out (the output does not change), prefix-cache hits (the same logits, counted in the stats
//! and the Done event), blocks freed at cancellation, and a Gemma 4 structure with KV-shared
//! layers and per-layer embeddings.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use markbase_engine::{
    Engine, EngineConfig, Event, Request, RequestHandle, Sampler, SamplingParams,
};
use markbase_models::{LoadOptions, Logits, Model, ModelSource};

fn load(rel: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel);
    let src = ModelSource::open(&dir).unwrap();
    let opts = LoadOptions {
        threads: 2,
        progress: None,
        ..LoadOptions::default()
    };
    Arc::new(Model::load(&src, &opts).unwrap())
}

fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 37 + seed * 101 + (i * i * seed) % 13) % (vocab - 3))
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, seed: Option<u64>) -> Request {
    let sampling = match seed {
        None => SamplingParams::greedy(),
        Some(seed) => SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..SamplingParams::default()
        },
    };
    Request {
        prompt,
        max_tokens,
        sampling,
        stop_tokens: Vec::new(),
        top_logprobs: None,
    }
}

/// The request alone: prefill, then one token at a time.
fn alone(model: &Model, req: &Request, context: usize) -> Vec<u32> {
    let mut cache = model.new_cache(context).unwrap();
    let mut sampler = Sampler::new(req.sampling.clone()).unwrap();
    let mut history = req.prompt.clone();
    let mut logits = model
        .forward(&mut cache, &req.prompt, Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    let limit = req.max_tokens.min(context - req.prompt.len());
    loop {
        let id = sampler.sample(&mut logits, &history);
        out.push(id);
        history.push(id);
        if out.len() >= limit {
            return out;
        }
        logits = model.forward(&mut cache, &[id], Logits::Last).unwrap();
    }
}

/// Every event up to the last one.
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

fn ids(events: &[Event]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(30), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `n` requests (prompts of 2..31 tokens, every third one sampled with a seed, the rest
/// greedy, outputs up to the context) with their outputs when run alone.
fn cases(model: &Model, n: u32, ctx: usize) -> Vec<(Request, Vec<u32>)> {
    let vocab = model.info().n_vocab as u32;
    (0..n)
        .map(|i| {
            let seed = (i % 3 == 1).then_some(77 + i as u64);
            let len = 2 + (i as usize * 7) % 30;
            let req = request(prompt(i, len, vocab), ctx, seed);
            let want = alone(model, &req, ctx);
            (req, want)
        })
        .collect()
}

/// The requests in two waves (the second joins while the first decodes) through an engine
/// with `cfg`; each output must equal the request alone. Returns the engine's stats at the end.
fn check_against_alone(
    model: &Arc<Model>,
    cfg: EngineConfig,
    cases: &[(Request, Vec<u32>)],
) -> markbase_engine::EngineStats {
    let engine = Engine::start(model.clone(), cfg).unwrap();
    let half = cases.len() / 2;
    let mut handles: Vec<RequestHandle> = cases[..half]
        .iter()
        .map(|r| engine.submit(r.0.clone()).unwrap())
        .collect();
    wait_until("first wave decoding", || engine.stats().steps >= 3);
    handles.extend(
        cases[half..]
            .iter()
            .map(|r| engine.submit(r.0.clone()).unwrap()),
    );
    for ((req, want), h) in cases.iter().zip(&mut handles) {
        let events = drain(h);
        assert!(
            matches!(events.last(), Some(Event::Done { .. })),
            "{:?}",
            events.last()
        );
        assert_eq!(&ids(&events), want, "prompt of {}", req.prompt.len());
    }
    // The stats are published after the step that sent the last Done.
    wait_until("idle", || engine.stats().running == 0);
    let stats = engine.stats();
    assert_eq!(stats.kv_blocks_used, 0);
    stats
}

#[test]
fn preemption_on_a_tiny_pool_changes_nothing() {
    let model = load("gemma3_tiny");
    // 4 blocks of 16: exactly one sequence of the 64-token context.
    let cfg = EngineConfig {
        max_context: 64,
        kv_blocks: Some(4),
        max_step_tokens: 24,
        max_seqs: 8,
        ..EngineConfig::default()
    };
    let stats = check_against_alone(&model, cfg, &cases(&model, 10, 64));
    assert!(stats.preemptions > 0, "{stats:?}");
    // A pool that cannot hold one whole sequence is refused.
    let cfg = EngineConfig {
        max_context: 64,
        kv_blocks: Some(3),
        ..EngineConfig::default()
    };
    assert!(Engine::start(model, cfg).is_err());
}

#[test]
fn gemma4_kv_sharing_and_ple_batched_and_preempted() {
    let model = load("gemma4/e2b_like");
    let roomy = EngineConfig {
        max_context: 64,
        max_step_tokens: 20,
        max_seqs: 8,
        ..EngineConfig::default()
    };
    let cases = cases(&model, 6, 64);
    let stats = check_against_alone(&model, roomy, &cases);
    assert_eq!(stats.preemptions, 0);
    // Every prompt token ran once as a prefill row and every generated token but the last
    // as a decode row; the CPU has no device to wait for.
    let prompts: usize = cases.iter().map(|(r, _)| r.prompt.len()).sum();
    let decodes: usize = cases.iter().map(|(_, out)| out.len() - 1).sum();
    let hits = stats.prefix_cache_hit_tokens as usize;
    assert_eq!(stats.prefill_rows as usize, prompts - hits, "{stats:?}");
    assert_eq!(stats.decode_rows as usize, decodes, "{stats:?}");
    assert!(stats.step_seconds > 0.0 && stats.device_wait_seconds == 0.0);
    assert_eq!((stats.device_waits, stats.graph_replays), (0, 0));
    let tight = EngineConfig {
        max_context: 64,
        kv_blocks: Some(5),
        max_step_tokens: 20,
        max_seqs: 8,
        ..EngineConfig::default()
    };
    let stats = check_against_alone(&model, tight, &cases);
    assert!(stats.preemptions > 0);
    // A preempted sequence's tokens run again as prefill rows, its next one among them.
    assert!(stats.decode_rows as usize <= decodes, "{stats:?}");
    assert!(stats.prefill_rows as usize > prompts, "{stats:?}");
}

#[test]
fn prefix_cache_hit_gives_the_same_logits_and_is_counted() {
    let model = load("gemma3_tiny");
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            max_context: 64,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let p = prompt(11, 40, 300);
    let mut req = request(p.clone(), 6, None);
    req.top_logprobs = Some(5);
    let first = drain(&mut engine.submit(req.clone()).unwrap());
    assert!(matches!(
        first.last(),
        Some(Event::Done {
            cached_prompt_tokens: 0,
            ..
        })
    ));
    // 40 tokens: two whole blocks (32 tokens) can come from the cache; the window (8) of
    // position 32 needs block 1, which is still cached after the first request ended.
    let second = drain(&mut engine.submit(req.clone()).unwrap());
    assert!(
        matches!(
            second.last(),
            Some(Event::Done {
                cached_prompt_tokens: 32,
                prompt_tokens: 40,
                completion_tokens: 6,
                ..
            })
        ),
        "{:?}",
        second.last()
    );
    assert_eq!(engine.stats().prefix_cache_hit_tokens, 32);
    for (a, b) in first.iter().zip(&second).take(6) {
        let (
            Event::Token {
                id: ia,
                logprob: Some(la),
                top_logprobs: ta,
            },
            Event::Token {
                id: ib,
                logprob: Some(lb),
                top_logprobs: tb,
            },
        ) = (a, b)
        else {
            panic!("{a:?} {b:?}");
        };
        assert_eq!(ia, ib);
        assert!((la - lb).abs() < 1e-5);
        for ((xa, ya), (xb, yb)) in ta.iter().zip(tb) {
            assert_eq!(xa, xb);
            assert!((ya - yb).abs() < 1e-5);
        }
    }
    // A prompt sharing only its first block hits 16 tokens; its output is its own.
    let mut q = p.clone();
    q[20] = 7;
    let r = request(q, 5, None);
    let third = drain(&mut engine.submit(r.clone()).unwrap());
    assert!(matches!(
        third.last(),
        Some(Event::Done {
            cached_prompt_tokens: 16,
            ..
        })
    ));
    assert_eq!(ids(&third), alone(&model, &r, 64));
    assert_eq!(engine.stats().prefix_cache_hit_tokens, 48);
}

#[test]
fn cancelling_frees_blocks_at_once_while_others_run() {
    let model = load("gemma4/e2b_like");
    let cfg = EngineConfig {
        max_context: 256,
        ..EngineConfig::default()
    };
    let engine = Engine::start(model.clone(), cfg).unwrap();
    let keep_req = request(prompt(1, 30, 512), 200, None);
    let mut keep = engine.submit(keep_req.clone()).unwrap();
    let mut handles: Vec<RequestHandle> = (2..8)
        .map(|i| {
            engine
                .submit(request(prompt(i, 30, 512), 200, None))
                .unwrap()
        })
        .collect();
    // Each has produced a token: all seven hold blocks.
    for h in &mut handles {
        assert!(matches!(
            h.events.blocking_recv(),
            Some(Event::Token { .. })
        ));
    }
    drop(handles);
    // Within a step only the kept request's blocks remain: at most 16 full-attention blocks
    // (256 tokens) and 2 sliding ones (window 8).
    wait_until("blocks freed", || {
        let s = engine.stats();
        s.running <= 1 && s.kv_blocks_used <= 18
    });
    assert_eq!(ids(&drain(&mut keep)), alone(&model, &keep_req, 256));
    wait_until("idle", || engine.stats().kv_blocks_used == 0);
}
