//! Choosing tokens on the device: greedy argmax and sampled picks (temperature, top-k, top-p,
//! min-p and a uniform draw a row) over rows of logits, so only the chosen ids (not 262 144
//! logits) cross to the host.

use markbase_core::sampling::Draw;
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

/// Words of a row's draw for `sample_rows` (sample.cu `SAMPLE_DRAW_WORDS`).
const DRAW_WORDS: usize = 5;
/// Dynamic shared bytes of an argmax block (sample.cu: 32 floats and 32 ints).
const ARGMAX_SHARED: u32 = 256;
/// Threads of a `sample_rows` block (sample.cu `SAMPLE_THREADS`).
const SAMPLE_THREADS: u32 = 1024;
/// Dynamic shared bytes of a `sample_rows` block (sample.cu `SAMPLE_SHARED_BYTES`).
pub const SAMPLE_SHARED: u32 = 40960;
/// Blocks a row of `sample_rows` is spread over, at most (sample.cu `SAMPLE_MAX_PARTS`).
const SAMPLE_MAX_PARTS: usize = 256;
/// Scratch words of a row of `sample_rows` (sample.cu `SAMPLE_ROW_WORDS`, with the default
/// window of 2 048 tokens).
pub const SAMPLE_ROW_WORDS: usize = 8 + 6 * 256 + 8 * SAMPLE_MAX_PARTS + 4 * 2048;

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
        let mut grid = Grid::new((rows as u32, parts as u32), 256);
        grid.shared = ARGMAX_SHARED;
        self.run(
            Module::Sample,
            "argmax_part",
            grid,
            &[
                Arg::U64(logits.ptr),
                Arg::I32(n as i32),
                Arg::I32(parts as i32),
                Arg::U64(part),
            ],
        )?;
        let mut grid = Grid::new((rows as u32, 1), 32);
        grid.shared = ARGMAX_SHARED;
        self.run(
            Module::Sample,
            "argmax_join",
            grid,
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

    /// The token each of `rows` rows of `n` logits picks under its draw
    /// ([`markbase_core::sampling::pick`];
    /// [`Backend::sample`](markbase_core::backend::Backend::sample)), every draw on the device
    /// (`sample_rows`: greedy, every token in index order, or top-k / top-p / min-p in rank
    /// order by rank searches), so only the picks cross to the host.
    pub(crate) fn sample_rows(
        &self,
        logits: &CudaBuffer,
        rows: usize,
        n: usize,
        draws: &[Draw],
    ) -> Result<Vec<u32>> {
        self.check_rows(logits, rows, n)?;
        if draws.len() != rows {
            return Err(Error::Invalid(format!(
                "cuda sampling: {} draws for {rows} rows",
                draws.len()
            )));
        }
        let mut words = Vec::with_capacity(DRAW_WORDS * rows);
        for d in draws {
            d.check()?;
            // A top-k of the row or more keeps every token, as none does.
            let k = d.top_k.min(n) as u32;
            words.extend([d.temperature.to_bits(), k, d.top_p.to_bits()]);
            words.extend([d.min_p.to_bits(), d.u.to_bits()]);
        }
        // The scratch stays locked until the picks are back (another thread may sample too).
        let mut s = self.scratch()?;
        let picks = s.picks.get(&self.dev.stream, rows)?;
        let scratch = s.sample.get(&self.dev.stream, rows * SAMPLE_ROW_WORDS)?;
        let held = self.uploads()?;
        let at = self.upload_idx(&held, &words)?;
        self.run(
            Module::Sample,
            "sample_reset",
            Grid::new((rows as u32, 1), 256),
            &[Arg::U64(scratch)],
        )?;
        // A row's blocks wait for each other: with one block a multiprocessor, every block of
        // the grid is resident at once.
        let sms = self.dev.multiprocessors().max(1) as usize;
        let parts = (sms / rows).clamp(1, SAMPLE_MAX_PARTS);
        let mut grid = Grid::new((parts as u32, rows as u32), SAMPLE_THREADS);
        grid.shared = SAMPLE_SHARED;
        self.run(
            Module::Sample,
            "sample_rows",
            grid,
            &[
                Arg::U64(logits.ptr),
                Arg::I32(n as i32),
                Arg::U64(at),
                Arg::U64(picks),
                Arg::U64(scratch),
                Arg::I32(parts as i32),
                Arg::U64(self.err.ptr),
            ],
        )?;
        drop(held);
        let out = self.finish_picks(picks, rows);
        drop(s);
        out
    }
}
