//! The step loop: takes new requests, lets the scheduler plan a step, runs it as one batched
//! [`Model::step`] over every scheduled sequence, hands each sequence that reached its last
//! token its logits, and drops finished and cancelled sequences (freeing their blocks at once).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use markbase_core::config::LayerKind;
use markbase_core::{Error, Result};
use markbase_models::{KvPool, Logits, Model, SeqStep};

use super::api::{EngineConfig, EngineStats, Event};
use super::kv::{KvManager, SeqKv, BLOCK_SIZE};
use super::scheduler::Scheduler;
use super::sequence::{Outcome, Sequence};
use super::Shared;

/// Block counts of the two pools for `cfg`: (full-attention, sliding-window); 0 for a kind the
/// model does not have (see `block_counts`).
pub(super) fn pool_sizes(model: &Model, cfg: &EngineConfig) -> Result<(usize, usize)> {
    let bytes =
        [LayerKind::Full, LayerKind::Sliding].map(|k| model.kv_bytes_per_token(k) * BLOCK_SIZE);
    let (full, sliding) = block_counts(bytes, model.info().sliding_window.max(1), cfg)?;
    Ok((
        if bytes[0] > 0 { full } else { 0 },
        if bytes[1] > 0 { sliding } else { 0 },
    ))
}

/// Block counts (full-attention, sliding-window) for blocks of `block_bytes` bytes each and a
/// sliding window of `window` tokens.
///
/// Full: `kv_blocks`, or enough for `max_seqs` sequences of `max_context` tokens, and no more
/// than fit in `kv_memory` beside the sliding pool of `max_seqs` sequences; at least one
/// sequence of `max_context` tokens must fit. Sliding: what the sequences the full pool can
/// hold need at most — `ceil((window − 1) / B) + 3` each plus a step's chunk — capped at the
/// full pool (a sequence never holds more sliding than full blocks).
fn block_counts(
    block_bytes: [usize; 2],
    window: usize,
    cfg: &EngineConfig,
) -> Result<(usize, usize)> {
    let per_seq = cfg.max_context.div_ceil(BLOCK_SIZE);
    let sliding_for = |seqs: usize| {
        seqs * ((window - 1).div_ceil(BLOCK_SIZE) + 3) + cfg.max_step_tokens.div_ceil(BLOCK_SIZE)
    };
    let mut full = cfg.kv_blocks.unwrap_or(cfg.max_seqs * per_seq);
    let limit = cfg
        .kv_memory
        .filter(|_| cfg.kv_blocks.is_none() && block_bytes[0] > 0);
    if let Some(memory) = limit {
        let sliding = sliding_for(cfg.max_seqs) * block_bytes[1];
        full = full.min(memory.saturating_sub(sliding) / block_bytes[0]);
    }
    if full < per_seq {
        let within = match limit {
            Some(memory) => format!(
                " (what fits in the KV memory limit of {} MiB: lower the context or the sequences, or give the blocks)",
                memory >> 20
            ),
            None => String::new(),
        };
        return Err(Error::Invalid(format!(
            "{full} KV blocks of {BLOCK_SIZE} tokens cannot hold one sequence of max_context {} tokens (needs {per_seq}){within}",
            cfg.max_context
        )));
    }
    let seqs = cfg.max_seqs.min(full);
    Ok((full, sliding_for(seqs).min(full)))
}

/// The model's device wait time, waits and graph replays so far.
fn device_counters(model: &Model) -> (Duration, u64, u64) {
    (
        model.host_wait_time(),
        model.host_waits(),
        model.graph_replays(),
    )
}

/// The state owned by the step-loop thread.
pub(super) struct Worker {
    model: Arc<Model>,
    pool: KvPool,
    sched: Scheduler,
    steps: u64,
    /// Decode and prefill token rows run so far.
    rows: [u64; 2],
    /// Time in steps so far.
    step_time: Duration,
    /// The model's device wait time, waits and graph replays when the worker started (the
    /// model may have run before).
    wait_before: (Duration, u64, u64),
    /// Pool sizes and layer kinds, to rebuild the block manager after a failed step.
    sizes: (usize, usize),
    has: [bool; 2],
    max_seqs: usize,
    max_step_tokens: usize,
}

impl Worker {
    /// A worker for `model` under `cfg`, with its KV pool allocated.
    pub fn new(model: Arc<Model>, cfg: &EngineConfig) -> Result<Self> {
        let sizes = pool_sizes(&model, cfg)?;
        let has = [LayerKind::Full, LayerKind::Sliding].map(|k| model.kv_bytes_per_token(k) > 0);
        let pool = model.new_kv_pool(BLOCK_SIZE, sizes.0, sizes.1)?;
        let kv = KvManager::new(sizes.0, sizes.1, has, model.info().sliding_window);
        Ok(Worker {
            sched: Scheduler::new(kv, cfg.max_seqs, cfg.max_step_tokens),
            wait_before: device_counters(&model),
            model,
            pool,
            steps: 0,
            rows: [0; 2],
            step_time: Duration::ZERO,
            sizes,
            has,
            max_seqs: cfg.max_seqs,
            max_step_tokens: cfg.max_step_tokens,
        })
    }

    /// Runs a step of `n` one-token sequences for each of the model's warm-up row counts
    /// (`Model::warm_up_rows`) up to the step's token budget, so that the one-off plans of
    /// those steps' products (the CUDA backend's cuBLASLt timings) are made before any request
    /// waits for them. A count the pool cannot hold ends it; the blocks go back at once and
    /// nothing enters the prefix cache.
    pub fn warm_up(&mut self) -> Result<()> {
        let token = [0u32];
        for n in self.model.warm_up_rows() {
            if n > self.max_step_tokens {
                break;
            }
            let mut kvs: Vec<SeqKv> = (0..n).map(|_| SeqKv::default()).collect();
            let held = kvs.iter_mut().all(|kv| self.sched.kv.reserve(kv, 1));
            let stepped = if held {
                let seqs: Vec<SeqStep> = kvs
                    .iter()
                    .map(|kv| SeqStep {
                        tokens: &token,
                        start: 0,
                        full_blocks: &kv.full,
                        sliding_blocks: &kv.sliding,
                        logits: Some(Logits::Greedy),
                    })
                    .collect();
                self.model.step(&mut self.pool, &seqs).map(|_| ())
            } else {
                Ok(())
            };
            for kv in &mut kvs {
                self.sched.kv.free(kv);
            }
            stepped?;
            if !held {
                break;
            }
        }
        // The warm-up's waits are not the served steps'.
        self.wait_before = device_counters(&self.model);
        Ok(())
    }

    /// A fresh block manager and scheduler (every block free), keeping the counters.
    fn reset_blocks(&mut self) {
        let (full, sliding) = self.sizes;
        let window = self.model.info().sliding_window;
        let kv = KvManager::new(full, sliding, self.has, window);
        let (p, h) = (self.sched.preemptions, self.sched.hit_tokens);
        self.sched = Scheduler::new(kv, self.max_seqs, self.max_step_tokens);
        self.sched.preemptions = p;
        self.sched.hit_tokens = h;
    }

    /// The current statistics, with `waiting` requests in the shared queue.
    pub fn stats(&self, waiting: usize) -> EngineStats {
        EngineStats {
            waiting: waiting + self.sched.preempted.len(),
            running: self.sched.running.len(),
            kv_blocks_total: self.sched.kv.total(),
            kv_blocks_used: self.sched.kv.used(),
            steps: self.steps,
            preemptions: self.sched.preemptions,
            prefix_cache_hit_tokens: self.sched.hit_tokens,
            decode_rows: self.rows[0],
            prefill_rows: self.rows[1],
            step_seconds: self.step_time.as_secs_f64(),
            device_wait_seconds: self
                .model
                .host_wait_time()
                .saturating_sub(self.wait_before.0)
                .as_secs_f64(),
            device_waits: self.model.host_waits().saturating_sub(self.wait_before.1),
            graph_replays: self
                .model
                .graph_replays()
                .saturating_sub(self.wait_before.2),
            f16_copy_bytes: self.model.f16_copy_bytes() as u64,
        }
    }

    /// Runs steps until shutdown.
    pub fn run(mut self, shared: &Shared) {
        loop {
            let plan = {
                let mut st = shared.lock();
                loop {
                    if st.shutdown {
                        let msg = "the engine shut down";
                        let s = &mut self.sched;
                        let all = st.queue.drain(..).chain(s.preempted.drain(..));
                        for seq in all.chain(s.running.drain(..)) {
                            let _ = seq.tx.send(Event::Error(msg.into()));
                        }
                        return;
                    }
                    st.queue.retain(|s| !s.cancelled());
                    self.sched.drop_cancelled();
                    let plan = self.sched.schedule(&mut st.queue);
                    if plan.is_empty() && self.sched.running.is_empty() {
                        // Nothing runs: a request that cannot be admitted into an empty pool
                        // would wait forever (pool sizing rules this out; never hang anyway).
                        let stuck = match self.sched.preempted.pop_front() {
                            Some(s) => Some(s),
                            None => st.queue.pop_front(),
                        };
                        if let Some(s) = stuck {
                            let _ = s.tx.send(Event::Error(
                                "the request does not fit in the KV cache pool".into(),
                            ));
                            continue;
                        }
                    }
                    st.stats = self.stats(st.queue.len());
                    if !plan.is_empty() {
                        break plan;
                    }
                    st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            let t0 = Instant::now();
            let stepped = catch_unwind(AssertUnwindSafe(|| self.step(&plan)));
            self.step_time += t0.elapsed();
            match stepped {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.fail_running(&e.to_string()),
                Err(_) => self.fail_running("the engine step panicked"),
            }
            self.steps += 1;
            let mut st = shared.lock();
            st.stats = self.stats(st.queue.len());
        }
    }

    /// After a failed step: every running and preempted sequence gets `msg`, and the block
    /// manager starts over.
    fn fail_running(&mut self, msg: &str) {
        let s = &mut self.sched;
        for seq in s.running.drain(..).chain(s.preempted.drain(..)) {
            let _ = seq.tx.send(Event::Error(msg.into()));
        }
        self.reset_blocks();
    }

    /// Runs the planned tokens in one batched model step and hands out the logits.
    fn step(&mut self, plan: &[(usize, usize)]) -> Result<()> {
        for &(i, n) in plan {
            let decode = self.sched.running[i].is_decoding();
            self.rows[usize::from(!decode)] += n as u64;
        }
        // What each sequence that reaches its next token asks for (`Sequence::choice`).
        let choices: Vec<Option<Logits>> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &mut self.sched.running[i];
                (n == s.pending()).then(|| s.choice())
            })
            .collect();
        let running = &self.sched.running;
        let seqs: Vec<SeqStep> = plan
            .iter()
            .zip(&choices)
            .map(|(&(i, n), &logits)| {
                let s = &running[i];
                let start = s.kv.computed;
                SeqStep {
                    tokens: &s.tokens[start..start + n],
                    start,
                    full_blocks: &s.kv.full,
                    sliding_blocks: &s.kv.sliding,
                    logits,
                }
            })
            .collect();
        let mut out = self.model.step(&mut self.pool, &seqs)?;
        drop(seqs);
        let nv = self.model.info().n_vocab;
        let mut rows = out.logits.chunks_mut(nv);
        let mut picks = out.ids.into_iter();
        let mut done = Vec::new();
        for (&(i, n), choice) in plan.iter().zip(choices) {
            let seq: &mut Sequence = &mut self.sched.running[i];
            self.sched.kv.advance(&mut seq.kv, &seq.tokens, n);
            if let Some(choice) = choice {
                let outcome = if choice == Logits::Last {
                    seq.accept(rows.next().expect("one logits row per host choice"))
                } else {
                    seq.accept_pick(picks.next().expect("one pick per model choice"))
                };
                if outcome != Outcome::Continue {
                    done.push(i);
                }
            }
        }
        for &i in done.iter().rev() {
            self.sched.remove(i);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_seqs: usize, kv_blocks: Option<usize>, kv_memory: Option<usize>) -> EngineConfig {
        EngineConfig {
            max_seqs,
            max_step_tokens: 512,
            kv_blocks,
            kv_memory,
            max_queue: 16,
            max_context: 4096,
        }
    }

    #[test]
    fn the_kv_memory_limit_caps_the_full_pool_beside_the_sliding_one() {
        let b = BLOCK_SIZE;
        let per_seq = 4096usize.div_ceil(b);
        let sliding_seq = 511usize.div_ceil(b) + 3;
        let step = 512usize.div_ceil(b);
        let bytes = [1000, 300];
        // No limit: every sequence's full context.
        let (full, sliding) = block_counts(bytes, 512, &cfg(8, None, None)).unwrap();
        assert_eq!(full, 8 * per_seq);
        assert_eq!(sliding, 8 * sliding_seq + step);
        // A limit: the sliding pool of 8 sequences first, full blocks in the rest.
        let memory = 3 * per_seq * 1000 + (8 * sliding_seq + step) * 300 + 999;
        let (full, sliding) = block_counts(bytes, 512, &cfg(8, None, Some(memory))).unwrap();
        assert_eq!(full, 3 * per_seq);
        assert_eq!(sliding, 8 * sliding_seq + step);
        // A roomy limit changes nothing; given blocks ignore it.
        let roomy = block_counts(bytes, 512, &cfg(8, None, Some(usize::MAX))).unwrap();
        assert_eq!(roomy.0, 8 * per_seq);
        let given = block_counts(bytes, 512, &cfg(8, Some(per_seq), Some(1))).unwrap();
        assert_eq!(given.0, per_seq);
        // Less than one sequence: an error that names the limit.
        let e = block_counts(bytes, 512, &cfg(8, None, Some(per_seq * 1000)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("KV memory limit"), "{e}");
        let e = block_counts(bytes, 512, &cfg(8, Some(per_seq - 1), None))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot hold one sequence") && !e.contains("limit"),
            "{e}"
        );
    }
}
