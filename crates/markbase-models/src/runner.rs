//! The object-safe face of an architecture on a backend, so that [`crate::Model`] and
//! [`crate::KvPool`] need no backend parameter: a loaded model is a `Box<dyn Runner>`, its
//! pools hold a [`PagedKv`] of the same backend behind `dyn Any`.

use std::time::Duration;

use markbase_core::config::LayerKind;
use markbase_core::{Error, Result};

use crate::device::DeviceBackend;
use crate::model::KvPool;
use crate::paged::{self, kind_index, PagedKv, SeqStep, StepModel, StepOutput};

/// What [`crate::Model`] does with its architecture, whatever the backend.
pub(crate) trait Runner: Send + Sync {
    /// Kind and K/V row width of each layer that owns a cache.
    fn caches(&self) -> Vec<(LayerKind, usize)>;
    /// Most token rows run through the layers at once.
    fn max_rows(&self) -> usize;
    /// Checks that the model can run every token id.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()>;
    /// A pool on the model's backend.
    fn new_pool(&self, block_size: usize, blocks: [usize; 2]) -> Result<KvPool>;
    /// One step over several sequences (as [`crate::Model::step`]).
    fn step(&self, pool: &mut KvPool, seqs: &[SeqStep]) -> Result<StepOutput>;
    /// Times the host has waited for the model's device so far.
    fn host_waits(&self) -> u64;
    /// Time the host has spent in those waits.
    fn host_wait_time(&self) -> Duration;
    /// Steps that ran as one CUDA graph launch so far.
    fn graph_replays(&self) -> u64;
    /// Token-row counts whose first step makes one-off plans.
    fn warm_up_rows(&self) -> Vec<usize>;
    /// Device bytes held by f16 copies of quantized weights.
    fn f16_copy_bytes(&self) -> usize;
    /// The device's free and total memory, where the model runs on a GPU.
    fn device_memory(&self) -> Result<Option<(usize, usize)>>;
}

impl<M> Runner for M
where
    M: StepModel + Send + Sync,
    M::Backend: DeviceBackend,
{
    fn caches(&self) -> Vec<(LayerKind, usize)> {
        StepModel::caches(self)
    }

    fn max_rows(&self) -> usize {
        StepModel::max_rows(self)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        StepModel::check_tokens(self, tokens)
    }

    fn new_pool(&self, block_size: usize, blocks: [usize; 2]) -> Result<KvPool> {
        self.backend().enter_thread()?;
        let kv = PagedKv::new(self.backend(), &self.caches(), block_size, blocks)?;
        Ok(KvPool {
            block_size,
            n_blocks: blocks,
            n_caches: kv.layers.len(),
            has_sliding: kv.has_kind(kind_index(LayerKind::Sliding)),
            kv: Box::new(kv),
        })
    }

    fn step(&self, pool: &mut KvPool, seqs: &[SeqStep]) -> Result<StepOutput> {
        let kv = pool
            .kv
            .downcast_mut::<PagedKv<M::Backend>>()
            .ok_or_else(|| {
                Error::Invalid("the KV pool was made on another device than the model's".into())
            })?;
        self.backend().enter_thread()?;
        paged::step(self, kv, seqs)
    }

    fn host_waits(&self) -> u64 {
        self.backend().host_waits()
    }

    fn host_wait_time(&self) -> Duration {
        self.backend().host_wait_time()
    }

    fn warm_up_rows(&self) -> Vec<usize> {
        self.backend().warm_up_rows()
    }

    fn graph_replays(&self) -> u64 {
        self.backend().graph_replays()
    }

    fn f16_copy_bytes(&self) -> usize {
        self.backend().f16_copy_bytes()
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        self.backend().device_memory()
    }
}
