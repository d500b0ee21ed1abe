//! Deciding what one step runs: every running sequence's next decode token first, then
//! prefill chunks of running sequences, then newly admitted requests, all within the step's
//! token budget; KV blocks are reserved as tokens are scheduled, and when a pool runs out the
//! most recently admitted sequence is preempted (its blocks given back, to be recomputed later
//! from its tokens) — never an error.

use std::collections::VecDeque;

use super::kv::KvManager;
use super::sequence::Sequence;

/// Running and preempted sequences and the KV blocks they hold.
pub(crate) struct Scheduler {
    /// Running sequences, in admission order.
    pub running: Vec<Sequence>,
    /// Preempted sequences, readmitted before new requests (front first).
    pub preempted: VecDeque<Sequence>,
    /// The block manager.
    pub kv: KvManager,
    max_seqs: usize,
    max_step_tokens: usize,
    /// Sequences preempted so far.
    pub preemptions: u64,
    /// Tokens found in the prefix cache at admissions so far.
    pub hit_tokens: u64,
}

impl Scheduler {
    /// A scheduler running at most `max_seqs` sequences and `max_step_tokens` tokens a step.
    pub fn new(kv: KvManager, max_seqs: usize, max_step_tokens: usize) -> Self {
        Scheduler {
            running: Vec::new(),
            preempted: VecDeque::new(),
            kv,
            max_seqs,
            max_step_tokens,
            preemptions: 0,
            hit_tokens: 0,
        }
    }

    /// Drops running and preempted sequences whose owner went away, freeing their blocks.
    pub fn drop_cancelled(&mut self) {
        let kv = &mut self.kv;
        self.running.retain_mut(|s| {
            if s.cancelled() {
                kv.free(&mut s.kv);
                return false;
            }
            true
        });
        self.preempted.retain(|s| !s.cancelled());
    }

    /// Plans one step, admitting from `queue` when there is room: returns (index in
    /// `running`, tokens to run) in running order; blocks for them are reserved.
    pub fn schedule(&mut self, queue: &mut VecDeque<Sequence>) -> Vec<(usize, usize)> {
        let mut sched = vec![0usize; self.running.len()];
        let mut budget = self.max_step_tokens;
        let preemptions_before = self.preemptions;
        // Decode tokens first, then prefill chunks.
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let pending = self.running[i].pending();
                if sched[i] > 0 || (pending == 1) != decode_pass {
                    i += 1;
                    continue;
                }
                let n = pending.min(budget);
                if self.reserve_or_preempt(i, n, &mut sched, &mut budget) {
                    sched[i] = n;
                    budget -= n;
                    i += 1;
                } else {
                    // running[i] itself gave way: it was the last one.
                    break;
                }
            }
        }
        // New work only when nothing had to give way.
        let preempted_now = self.preemptions > preemptions_before;
        while !preempted_now && budget > 0 && self.running.len() < self.max_seqs {
            let from_preempted = !self.preempted.is_empty();
            let Some(mut seq) = (if from_preempted {
                self.preempted.pop_front()
            } else {
                queue.pop_front()
            }) else {
                break;
            };
            let hit = self.kv.admit_cached(&mut seq.kv, &seq.tokens);
            let n = seq.pending().min(budget);
            if !self.kv.reserve(&mut seq.kv, n) {
                self.kv.free(&mut seq.kv);
                if from_preempted {
                    self.preempted.push_front(seq);
                } else {
                    queue.push_front(seq);
                }
                break;
            }
            self.hit_tokens += hit as u64;
            seq.cached_prompt_tokens = hit.min(seq.prompt_len);
            self.running.push(seq);
            sched.push(n);
            budget -= n;
        }
        sched
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, &n)| (i, n))
            .collect()
    }

    /// Reserves blocks for `n` tokens of `running[i]`, preempting the latest sequences while
    /// the pools are short. `false` if `i` itself had to go.
    fn reserve_or_preempt(
        &mut self,
        i: usize,
        n: usize,
        sched: &mut Vec<usize>,
        budget: &mut usize,
    ) -> bool {
        loop {
            if self.kv.reserve(&mut self.running[i].kv, n) {
                return true;
            }
            let victim = self.running.len() - 1;
            let mut seq = self.running.pop().expect("running[i] exists");
            *budget += sched.pop().expect("one entry per running sequence");
            self.kv.free(&mut seq.kv);
            self.preempted.push_front(seq);
            self.preemptions += 1;
            if victim == i {
                return false;
            }
        }
    }

    /// Frees the blocks of `running[i]` and removes it.
    pub fn remove(&mut self, i: usize) -> Sequence {
        let mut seq = self.running.remove(i);
        self.kv.free(&mut seq.kv);
        seq
    }
}
