//! `Model::step` over many sequences at once equals each sequence run alone with
//! `Model::forward`: mixed prefill chunks and decode tokens in one step, blocks scattered over
//! the pool in random order, sliding-window blocks given back once they leave the window and
//! reused by other sequences. On the tiny Gemma 3 fixture and every f32 Gemma 4 fixture
//! structure (PLE + KV sharing, k_eq_v with per-kind head dims, MoE, unified).
//!
//! Tolerance: per row, `max |batched − alone| / max |alone| ≤ 1e-4`.

use std::path::PathBuf;

use markbase_core::config::LayerKind;
use markbase_core::sampling::{pick, Draw};
use markbase_models::{LoadOptions, Logits, Model, ModelSource, SeqStep, NO_BLOCK};

const REL_TOL: f32 = 1e-4;

fn load(rel: &str) -> Model {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel);
    let src = ModelSource::open(&path).unwrap();
    let opts = LoadOptions {
        threads: 2,
        progress: None,
        ..LoadOptions::default()
    };
    Model::load(&src, &opts).unwrap()
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn worst_rel(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    err / scale
}

/// One sequence of the scenario.
struct Seq {
    tokens: Vec<u32>,
    done: usize,
    full: Vec<u32>,
    sliding: Vec<u32>,
    want: Vec<f32>,
}

/// Runs `n_seqs` random sequences of up to `max_len` tokens in mixed steps and checks every
/// logit row against the sequence alone.
fn check_model(model: &Model, n_seqs: usize, max_len: usize, seed: u64) {
    let info = model.info().clone();
    let (nv, window, bs) = (info.n_vocab, info.sliding_window, 4);
    let mut rng = Rng(seed);
    let mut seqs: Vec<Seq> = (0..n_seqs)
        .map(|_| {
            let len = 2 + rng.below(max_len - 1);
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(nv) as u32).collect();
            let mut cache = model.new_cache(len).unwrap();
            let want = model.forward(&mut cache, &tokens, Logits::All).unwrap();
            Seq {
                tokens,
                done: 0,
                full: Vec::new(),
                sliding: Vec::new(),
                want,
            }
        })
        .collect();
    let full_total: usize = seqs.iter().map(|s| s.tokens.len().div_ceil(bs)).sum();
    let sliding_total = n_seqs * ((window + 8).div_ceil(bs) + 2);
    let mut pool = model.new_kv_pool(bs, full_total, sliding_total).unwrap();
    assert_eq!(pool.blocks(LayerKind::Full), full_total);
    let mut free_full: Vec<u32> = (0..full_total as u32).collect();
    let mut free_sliding: Vec<u32> = (0..sliding_total as u32).collect();
    let mut checked = 0;
    while seqs.iter().any(|s| s.done < s.tokens.len()) {
        // This step: a random chunk (1..=8 tokens, often 1 = decode) of some sequences.
        let mut plan = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            let left = s.tokens.len() - s.done;
            if left == 0 || rng.below(4) == 0 {
                continue;
            }
            let n = if rng.below(2) == 0 {
                1
            } else {
                1 + rng.below(8)
            }
            .min(left);
            let need = (s.done + n).div_ceil(bs);
            while s.full.len() < need {
                let k = rng.below(free_full.len());
                s.full.push(free_full.swap_remove(k));
                let k = rng.below(free_sliding.len());
                s.sliding.push(free_sliding.swap_remove(k));
            }
            // Every row's logits, or (one time in three) only the greedy pick of the last.
            let greedy = rng.below(3) == 0;
            plan.push((i, n, greedy));
        }
        let steps: Vec<SeqStep> = plan
            .iter()
            .map(|&(i, n, greedy)| {
                let s = &seqs[i];
                SeqStep {
                    tokens: &s.tokens[s.done..s.done + n],
                    start: s.done,
                    full_blocks: &s.full,
                    sliding_blocks: &s.sliding,
                    logits: Some(if greedy { Logits::Greedy } else { Logits::All }),
                }
            })
            .collect();
        let got = model.step(&mut pool, &steps).unwrap();
        let mut row = 0;
        let mut picks = got.ids.iter();
        for &(i, n, greedy) in &plan {
            let s = &mut seqs[i];
            if greedy {
                // The pick is the alone run's best token, up to the batched logits' error.
                let p = s.done + n - 1;
                let w = &s.want[p * nv..(p + 1) * nv];
                let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                let best = w.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let id = *picks.next().expect("a pick per greedy sequence") as usize;
                assert!(
                    w[id] >= best - 2.0 * REL_TOL * scale,
                    "{}: position {p}: picked {id} ({}) under the best {best}",
                    info.architecture,
                    w[id]
                );
                checked += 1;
            }
            for p in (s.done..s.done + n).filter(|_| !greedy) {
                let g = &got.logits[row * nv..(row + 1) * nv];
                let w = &s.want[p * nv..(p + 1) * nv];
                let err = worst_rel(g, w);
                assert!(err <= REL_TOL, "{}: position {p}: {err}", info.architecture);
                row += 1;
                checked += 1;
            }
            s.done += n;
            // Give back sliding blocks the next query no longer sees.
            let lo = (s.done + 1).saturating_sub(window);
            for b in 0..lo / bs {
                if s.sliding[b] != NO_BLOCK {
                    free_sliding.push(s.sliding[b]);
                    s.sliding[b] = NO_BLOCK;
                }
            }
        }
        assert_eq!(row * nv, got.logits.len());
        assert!(picks.next().is_none(), "one pick per greedy sequence");
    }
    assert!(checked > 0);
}

#[test]
fn gemma3_batched_step_matches_alone() {
    check_model(&load("gemma3_tiny"), 6, 60, 1);
}

#[test]
fn gemma4_batched_step_matches_alone() {
    for (dir, seed) in [
        ("e2b_like", 2),
        ("e4b_like", 3),
        ("dense31b_like", 4),
        ("moe26b_like", 5),
        ("unified12b_like", 6),
    ] {
        check_model(&load(&format!("gemma4/{dir}")), 5, 48, seed);
    }
}

#[test]
fn long_sequence_through_the_sliding_ring_matches_the_pool() {
    // 200 tokens: a KvCache for chunks of 64 tokens has a sliding ring of 96 slots here, which
    // wraps (the 150-token prompt runs in three pieces); the pool keeps every block.
    let model = load("gemma4/e2b_like");
    let nv = model.info().n_vocab;
    let mut rng = Rng(7);
    let tokens: Vec<u32> = (0..200).map(|_| rng.below(nv) as u32).collect();
    let mut cache = model.new_cache_with_chunk(200, 64).unwrap();
    let mut ring = model
        .forward(&mut cache, &tokens[..150], Logits::All)
        .unwrap();
    for p in 150..200 {
        ring.extend(
            model
                .forward(&mut cache, &tokens[p..p + 1], Logits::All)
                .unwrap(),
        );
    }
    let mut pool = model.new_kv_pool(16, 13, 13).unwrap();
    let table: Vec<u32> = (0..13).rev().collect();
    let step = SeqStep {
        tokens: &tokens,
        start: 0,
        full_blocks: &table,
        sliding_blocks: &table,
        logits: Some(Logits::All),
    };
    let paged = model.step(&mut pool, &[step]).unwrap().logits;
    for p in 0..200 {
        let err = worst_rel(&ring[p * nv..(p + 1) * nv], &paged[p * nv..(p + 1) * nv]);
        assert!(err <= REL_TOL, "position {p}: {err}");
    }
    // Going back into the overwritten part of the ring is refused; a short step back is fine.
    assert!(cache.truncate(20).is_err());
    cache.truncate(190).unwrap();
    let again = model
        .forward(&mut cache, &tokens[190..], Logits::All)
        .unwrap();
    let err = worst_rel(&again, &paged[190 * nv..]);
    assert!(err <= REL_TOL, "after truncate: {err}");
}

#[test]
fn a_cache_for_small_chunks_runs_long_inputs_in_pieces() {
    // 90 tokens through a cache for chunks of 16: six pieces, the last one's logits only
    // (`Last`) or every piece's (`All`), as one step of the whole input gives them.
    let model = load("gemma4/e2b_like");
    let nv = model.info().n_vocab;
    let mut rng = Rng(11);
    let tokens: Vec<u32> = (0..90).map(|_| rng.below(nv) as u32).collect();
    for logits in [Logits::Last, Logits::All] {
        let mut whole = model.new_cache(100).unwrap();
        let want = model.forward(&mut whole, &tokens, logits).unwrap();
        let mut pieces = model.new_cache_with_chunk(100, 16).unwrap();
        let got = model.forward(&mut pieces, &tokens, logits).unwrap();
        assert_eq!(got.len(), want.len(), "{logits:?}");
        let err = worst_rel(&got, &want);
        assert!(err <= REL_TOL, "{logits:?}: {err}");
        assert_eq!(pieces.len(), 90);
    }
    // A bad id in the last piece fails the call and keeps none of its tokens.
    let mut bad = tokens.clone();
    bad[85] = nv as u32;
    let mut pieces = model.new_cache_with_chunk(100, 16).unwrap();
    assert!(model.forward(&mut pieces, &bad, Logits::Last).is_err());
    assert_eq!(pieces.len(), 0);
}

/// Picks made in a step — greedy and sampled draws side by side, in sequence order — are the
/// host's picks (`markbase_core::sampling::pick`) of the logits the same step returns; a step
/// with a sampled draw is refused by `forward`, which returns logits.
#[test]
fn sampled_picks_are_the_host_picks_of_the_step_logits() {
    let model = load("gemma4/e2b_like");
    let tables = [[0u32, 1], [2, 3], [4, 5]];
    let prompts: [&[u32]; 3] = [&[5, 6, 7], &[9], &[11, 12]];
    let steps = |logits: [Logits; 3]| {
        let mut pool = model.new_kv_pool(4, 6, 6).unwrap();
        let seqs: Vec<SeqStep> = (0..3)
            .map(|i| SeqStep {
                tokens: prompts[i],
                start: 0,
                full_blocks: &tables[i],
                sliding_blocks: &tables[i],
                logits: Some(logits[i]),
            })
            .collect();
        model.step(&mut pool, &seqs).unwrap()
    };
    let rows = steps([Logits::Last; 3]);
    let nv = model.info().n_vocab;
    let draws = [
        Draw {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            u: 0.61,
        },
        Draw {
            temperature: 0.7,
            top_k: 8,
            top_p: 0.9,
            min_p: 0.05,
            u: 0.23,
        },
    ];
    let picked = steps([
        Logits::Sample(draws[0]),
        Logits::Greedy,
        Logits::Sample(draws[1]),
    ]);
    assert!(picked.logits.is_empty());
    let mut cand = Vec::new();
    let row = |i: usize| &rows.logits[i * nv..(i + 1) * nv];
    let want = [
        pick(&draws[0], &mut cand, row(0)),
        pick(&Draw::GREEDY, &mut cand, row(1)),
        pick(&draws[1], &mut cand, row(2)),
    ];
    assert_eq!(picked.ids, want);
    let mut cache = model.new_cache(3).unwrap();
    assert!(model
        .forward(&mut cache, &[5], Logits::Sample(draws[0]))
        .is_err());
}

#[test]
fn bad_steps_are_errors() {
    let model = load("gemma3_tiny");
    let mut pool = model.new_kv_pool(4, 4, 4).unwrap();
    let table = [0u32, 1, 2, 3];
    let ok = SeqStep {
        tokens: &[5, 6, 7],
        start: 0,
        full_blocks: &table,
        sliding_blocks: &table,
        logits: Some(Logits::Last),
    };
    assert_eq!(model.step(&mut pool, &[ok]).unwrap().logits.len(), 300);
    let greedy = SeqStep {
        logits: Some(Logits::Greedy),
        ..ok
    };
    let out = model.step(&mut pool, &[greedy, ok]).unwrap();
    assert_eq!((out.ids.len(), out.logits.len()), (1, 300));
    let mut cache = model.new_cache(3).unwrap();
    assert!(model.forward(&mut cache, &[5], Logits::Greedy).is_err());
    // Beyond the table, a block outside the pool, no tokens, a token outside the vocabulary.
    let far = SeqStep { start: 15, ..ok };
    assert!(model.step(&mut pool, &[far]).is_err());
    let outside = [0u32, 9, 2, 3];
    let bad_block = SeqStep {
        start: 4,
        full_blocks: &outside,
        ..ok
    };
    assert!(model.step(&mut pool, &[bad_block]).is_err());
    assert!(model
        .step(&mut pool, &[SeqStep { tokens: &[], ..ok }])
        .is_err());
    assert!(model
        .step(
            &mut pool,
            &[SeqStep {
                tokens: &[300],
                ..ok
            }]
        )
        .is_err());
    // A pool of another model.
    let other = load("gemma4/e2b_like");
    let mut other_pool = other.new_kv_pool(4, 4, 4).unwrap();
    assert!(model.step(&mut other_pool, &[ok]).is_err());
    assert_eq!(model.step(&mut pool, &[]).unwrap(), Default::default());
}

/// `forward_batch` (the batched-decode benchmark's path) gives each sequence the logits it gets
/// decoding alone (or their best token), past the sliding ring's wrap; a wrong token count and
/// overflow are errors.
#[test]
fn batch_cache_matches_sequences_alone() {
    // 120 tokens: this fixture's sliding ring (96 slots) wraps.
    let model = load("gemma4/e2b_like");
    let (seqs, len) = (3, 120);
    let mut rng = Rng(0x5eed);
    let n_vocab = model.info().n_vocab;
    let streams: Vec<Vec<u32>> = (0..seqs)
        .map(|_| (0..len).map(|_| rng.below(n_vocab) as u32).collect())
        .collect();
    let mut batch = model.new_batch_cache(seqs, len).unwrap();
    let mut alone: Vec<_> = (0..seqs).map(|_| model.new_cache(len).unwrap()).collect();
    for i in 0..len {
        let step: Vec<u32> = streams.iter().map(|s| s[i]).collect();
        // Logits on even steps, greedy picks on odd ones (the cache advances either way).
        let greedy = i % 2 == 1;
        let how = if greedy { Logits::Greedy } else { Logits::Last };
        let got = model.forward_batch(&mut batch, &step, how).unwrap();
        assert_eq!(got.ids.len(), if greedy { seqs } else { 0 });
        for (s, cache) in alone.iter_mut().enumerate() {
            let want = model.forward(cache, &[step[s]], Logits::Last).unwrap();
            if greedy {
                let best = want.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let id = got.ids[s] as usize;
                assert!(
                    want[id] >= best - 2.0 * REL_TOL * scale,
                    "step {i} sequence {s}"
                );
                continue;
            }
            let row = &got.logits[s * n_vocab..(s + 1) * n_vocab];
            let err = worst_rel(row, &want);
            assert!(
                err <= REL_TOL,
                "step {i} sequence {s}: relative error {err}"
            );
        }
    }
    assert_eq!(batch.len(), len);
    assert!(
        model
            .forward_batch(&mut batch, &[1, 2, 3], Logits::Last)
            .is_err(),
        "past capacity"
    );
    batch.clear();
    assert!(
        model
            .forward_batch(&mut batch, &[1, 2], Logits::Last)
            .is_err(),
        "two tokens for three sequences"
    );
    assert!(model.new_batch_cache(0, 8).is_err());
}
