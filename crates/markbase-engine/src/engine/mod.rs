//! The serving engine: a background step loop that runs every admitted request together,
//! admitting new requests and finishing or cancelling sequences between steps.
//!
//! [`Engine::submit`] queues a [`Request`] and returns a [`RequestHandle`] whose channel
//! carries the request's [`Event`]s. Dropping the handle cancels the request.

mod api;
mod blocks;
mod kv;
mod scheduler;
mod sequence;
mod worker;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use markbase_core::{Error, Result};
use markbase_models::Model;

pub use api::{
    EngineConfig, EngineStats, Event, Request, RequestHandle, SubmitError, MAX_TOP_LOGPROBS,
};
pub use kv::BLOCK_SIZE as KV_BLOCK_TOKENS;

use crate::sampling::Sampler;
use sequence::Sequence;

/// What the submitting side and the step loop share.
struct Shared {
    state: Mutex<State>,
    /// Signalled when a request arrives or shutdown is asked for.
    wake: Condvar,
}

/// The mutable shared state.
struct State {
    queue: VecDeque<Sequence>,
    shutdown: bool,
    stats: EngineStats,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (plain fields); keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The serving engine; owns a background step-loop thread.
pub struct Engine {
    shared: Arc<Shared>,
    next_id: AtomicU64,
    max_queue: usize,
    max_context: usize,
    /// The model, to check prompts.
    model: Arc<Model>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Starts the step loop on its own thread, after a step of each of the model's warm-up
    /// row counts (`Model::warm_up_rows`: none on the CPU; on the CUDA backend one of every
    /// 16 up to 256, a few seconds once).
    pub fn start(model: Arc<Model>, cfg: EngineConfig) -> Result<Engine> {
        let info = model.info();
        if cfg.max_context == 0 || cfg.max_context > info.context_length {
            return Err(Error::Invalid(format!(
                "engine max_context {} must be between 1 and the model's context of {}",
                cfg.max_context, info.context_length
            )));
        }
        if cfg.max_seqs == 0 || cfg.max_step_tokens < cfg.max_seqs {
            return Err(Error::Invalid(format!(
                "engine max_seqs ({}) must be at least 1 and max_step_tokens ({}) at least max_seqs, so that every running sequence decodes in every step",
                cfg.max_seqs, cfg.max_step_tokens
            )));
        }
        let mut worker = worker::Worker::new(model.clone(), &cfg)?;
        worker.warm_up()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                shutdown: false,
                stats: worker.stats(0),
            }),
            wake: Condvar::new(),
        });
        let loop_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("markbase-engine".into())
            .spawn(move || worker.run(&loop_shared))
            .map_err(|e| Error::Invalid(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            shared,
            next_id: AtomicU64::new(1),
            max_queue: cfg.max_queue,
            max_context: cfg.max_context,
            model,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues a request. Never blocks (beyond a short lock).
    pub fn submit(&self, req: Request) -> std::result::Result<RequestHandle, SubmitError> {
        let sampler = self.validate(&req)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let seq = Sequence::new(req, sampler, tx, self.max_context);
        let mut st = self.shared.lock();
        if st.shutdown {
            return Err(SubmitError::ShuttingDown);
        }
        if st.queue.len() >= self.max_queue {
            return Err(SubmitError::QueueFull);
        }
        st.queue.push_back(seq);
        st.stats.waiting = st.queue.len();
        drop(st);
        self.shared.wake.notify_all();
        Ok(RequestHandle { id, events: rx })
    }

    /// Checks a request and builds its sampler.
    fn validate(&self, req: &Request) -> std::result::Result<Sampler, SubmitError> {
        let invalid = |s: String| Err(SubmitError::Invalid(s));
        if req.prompt.is_empty() {
            return invalid("the prompt has no tokens".into());
        }
        if req.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if let Err(e) = self.model.check_tokens(&req.prompt) {
            return invalid(format!("prompt: {e}"));
        }
        if let Some(n) = req.top_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return invalid(format!("top_logprobs {n} is more than {MAX_TOP_LOGPROBS}"));
        }
        if req.prompt.len() >= self.max_context {
            return Err(SubmitError::TooLong {
                tokens: req.prompt.len(),
                limit: self.max_context,
            });
        }
        Sampler::new(req.sampling.clone()).map_err(|e| SubmitError::Invalid(e.to_string()))
    }

    /// A snapshot for /metrics and /health.
    pub fn stats(&self) -> EngineStats {
        self.shared.lock().stats.clone()
    }

    /// Stops the loop: waiting and running requests get [`Event::Error`]; later submissions
    /// get [`SubmitError::ShuttingDown`]. Returns once the loop has ended.
    pub fn shutdown(&self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
