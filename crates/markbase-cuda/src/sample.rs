//! Choosing tokens on the device: greedy argmax and top-k / top-p sampling over rows of
//! logits, so only the chosen ids (not 262 144 logits) cross to the host.

use markbase_core::{Error, Result};

use crate::backend::CudaBackend;
use crate::buffer::CudaBuffer;
use crate::device::driver_err;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Logits per block of the argmax's first pass (a row of 262 144 takes 64 blocks).
const ARGMAX_SLICE: usize = 4096;
/// Most blocks per row of the argmax's first pass.
const ARGMAX_MAX_PARTS: usize = 64;

/// Most candidates top-k sampling keeps (the kernel's shared-memory table).
pub const MAX_TOP_K: usize = 256;

/// How `sample` picks a token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// Softmax temperature (> 0).
    pub temperature: f32,
    /// Candidates kept (1 ..= [`MAX_TOP_K`]).
    pub top_k: usize,
    /// Nucleus mass kept (0 < top_p ≤ 1).
    pub top_p: f32,
}

impl CudaBackend {
    fn check_rows(&self, logits: &CudaBuffer, rows: usize, n: usize) -> Result<()> {
        if n == 0 || rows == 0 || logits.len() < rows * n {
            return Err(Error::Invalid(format!(
                "cuda sampling: {rows} rows of {n} logits in a buffer of {}",
                logits.len()
            )));
        }
        Ok(())
    }

    /// Copies the `rows` picks back (the step's one wait) and checks the kernel error word.
    fn finish_picks(&self, picks: u64, rows: usize) -> Result<Vec<u32>> {
        let mut out = vec![0u32; rows];
        self.host_wait(|| {
            // SAFETY: `picks` holds `rows` u32 written by the kernel just queued.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut out,
                    picks,
                    self.dev.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("copying chosen tokens", e))
        })?;
        Ok(out)
    }

    /// The index of the largest of each of `rows` rows of `n` logits (ties: lowest index;
    /// NaN never wins): [`Backend::argmax`](markbase_core::backend::Backend::argmax).
    pub(crate) fn argmax_rows(
        &self,
        logits: &CudaBuffer,
        rows: usize,
        n: usize,
    ) -> Result<Vec<u32>> {
        self.check_rows(logits, rows, n)?;
        // The scratch stays locked until the picks are back (another thread may sample too).
        let mut s = self.scratch()?;
        let picks = s.picks.get(&self.dev.stream, rows)?;
        let parts = n.div_ceil(ARGMAX_SLICE).min(ARGMAX_MAX_PARTS);
        let part = s.floats.get(&self.dev.stream, 2 * rows * parts)?;
        self.run(
            Module::Sample,
            "argmax_part",
            Grid::new((rows as u32, parts as u32), 256),
            &[
                Arg::U64(logits.ptr),
                Arg::I32(n as i32),
                Arg::I32(parts as i32),
                Arg::U64(part),
            ],
        )?;
        self.run(
            Module::Sample,
            "argmax_join",
            Grid::new((rows as u32, 1), 32),
            &[
                Arg::U64(part),
                Arg::I32(parts as i32),
                Arg::I32(n as i32),
                Arg::U64(picks),
            ],
        )?;
        let out = self.finish_picks(picks, rows);
        drop(s);
        out
    }

    /// Top-k then top-p sampling of each row at `params.temperature`, with one uniform draw
    /// in [0, 1) per row (`draws`, e.g. from a seeded generator on the host).
    pub fn sample(
        &self,
        logits: &CudaBuffer,
        rows: usize,
        n: usize,
        params: &SampleParams,
        draws: &[f32],
    ) -> Result<Vec<u32>> {
        self.check_rows(logits, rows, n)?;
        if params.temperature.is_nan()
            || params.temperature <= 0.0
            || params.top_k == 0
            || params.top_k > MAX_TOP_K
            || !(0.0..=1.0).contains(&params.top_p)
            || params.top_p == 0.0
            || draws.len() != rows
            || draws.iter().any(|u| !(0.0..1.0).contains(u))
        {
            return Err(Error::Invalid(format!(
                "cuda sampling: bad parameters {params:?} or {} draws for {rows} rows",
                draws.len()
            )));
        }
        // The scratch stays locked until the picks are back (another thread may sample too).
        let mut s = self.scratch()?;
        let picks = s.picks.get(&self.dev.stream, rows)?;
        let bits: Vec<u32> = draws.iter().map(|u| u.to_bits()).collect();
        let held = self.uploads()?;
        let u = self.upload_idx(&held, &bits)?;
        self.run(
            Module::Sample,
            "sample_top_k_p",
            Grid::new((rows as u32, 1), 1024),
            &[
                Arg::U64(logits.ptr),
                Arg::I32(n as i32),
                Arg::I32(params.top_k as i32),
                Arg::F32(params.top_p),
                Arg::F32(params.temperature),
                Arg::U64(u),
                Arg::U64(picks),
            ],
        )?;
        drop(held);
        let out = self.finish_picks(picks, rows);
        drop(s);
        out
    }
}
