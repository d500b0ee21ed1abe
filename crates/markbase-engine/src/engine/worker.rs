//! The step loop: admits waiting requests, runs one step over every running sequence, hands
//! each its logits, and drops finished and cancelled sequences.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use markbase_core::Result;
use markbase_models::{KvCache, Logits, Model};

use super::api::{EngineConfig, EngineStats, Event};
use super::sequence::{Outcome, Sequence};
use super::Shared;

/// Tokens per KV block (the unit of the pool statistics).
const BLOCK_SIZE: usize = 16;

/// A sequence with its cache.
struct Running {
    seq: Sequence,
    cache: KvCache,
}

/// The state owned by the step-loop thread.
pub(super) struct Worker {
    model: Arc<Model>,
    max_seqs: usize,
    max_context: usize,
    running: Vec<Running>,
    stats: EngineStats,
}

impl Worker {
    /// A worker for `model` under `cfg`.
    pub fn new(model: Arc<Model>, cfg: &EngineConfig) -> Result<Self> {
        let total = cfg
            .kv_blocks
            .unwrap_or(cfg.max_seqs * cfg.max_context.div_ceil(BLOCK_SIZE));
        Ok(Worker {
            model,
            max_seqs: cfg.max_seqs,
            max_context: cfg.max_context,
            running: Vec::new(),
            stats: EngineStats {
                kv_blocks_total: total,
                ..EngineStats::default()
            },
        })
    }

    /// The current statistics.
    pub fn stats(&self) -> EngineStats {
        self.stats.clone()
    }

    /// Runs steps until shutdown.
    pub fn run(mut self, shared: &Shared) {
        loop {
            {
                let mut st = shared.lock();
                loop {
                    if st.shutdown {
                        let msg = "the engine shut down";
                        for s in st.queue.drain(..) {
                            let _ = s.tx.send(Event::Error(msg.into()));
                        }
                        for r in self.running.drain(..) {
                            let _ = r.seq.tx.send(Event::Error(msg.into()));
                        }
                        self.publish(&mut st.stats, 0);
                        return;
                    }
                    st.queue.retain(|s| !s.cancelled());
                    while self.running.len() < self.max_seqs {
                        let Some(seq) = st.queue.pop_front() else {
                            break;
                        };
                        match self.model.new_cache(self.max_context) {
                            Ok(cache) => self.running.push(Running { seq, cache }),
                            Err(e) => {
                                let _ = seq.tx.send(Event::Error(e.to_string()));
                            }
                        }
                    }
                    let waiting = st.queue.len();
                    self.publish(&mut st.stats, waiting);
                    if !self.running.is_empty() {
                        break;
                    }
                    st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            }
            let stepped = catch_unwind(AssertUnwindSafe(|| self.step()));
            if stepped.is_err() {
                for r in self.running.drain(..) {
                    let _ = r
                        .seq
                        .tx
                        .send(Event::Error("the engine step panicked".into()));
                }
            }
            self.stats.steps += 1;
            let mut st = shared.lock();
            let waiting = st.queue.len();
            self.publish(&mut st.stats, waiting);
        }
    }

    /// Copies the worker's statistics into the shared snapshot.
    fn publish(&mut self, out: &mut EngineStats, waiting: usize) {
        self.stats.waiting = waiting;
        self.stats.running = self.running.len();
        self.stats.kv_blocks_used = self
            .running
            .iter()
            .map(|r| r.cache.len().div_ceil(BLOCK_SIZE))
            .sum();
        *out = self.stats.clone();
    }

    /// One step: each running sequence runs its unseen tokens and samples its next one.
    fn step(&mut self) {
        self.running.retain_mut(|r| {
            if r.seq.cancelled() {
                return false;
            }
            let fed = r.cache.len();
            let logits = self
                .model
                .forward(&mut r.cache, &r.seq.tokens[fed..], Logits::Last);
            match logits {
                Ok(mut l) => r.seq.accept(&mut l) == Outcome::Continue,
                Err(e) => {
                    let _ = r.seq.tx.send(Event::Error(e.to_string()));
                    false
                }
            }
        });
    }
}
