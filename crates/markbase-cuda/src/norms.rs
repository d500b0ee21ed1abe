//! The fused residual add and RMSNorm of a layer's boundaries (`residual_norm` in ops.cu),
//! with the next norm, extra norms and the copy of its output that the next product reads.

use markbase_core::{Error, Result};

use crate::backend::{int, need, CudaBackend};
use crate::buffer::CudaBuffer;
use crate::kernels::{Arg, Grid};
use crate::rounded::{RoundTarget, ROUND_Q4K_TILES};
use crate::sources::Module;

/// Widest row `residual_norm` holds in registers: 1 024 threads of
/// `RESIDUAL_NORM_PER_THREAD` (8) values (ops.cu).
const RESIDUAL_NORM_MAX_DIM: usize = 8 * 1024;

/// Most extra norms `residual_norm` writes beside its next norm (w3 / x3, w4 / x4 in ops.cu).
pub(crate) const EXTRA_NORMS: usize = 2;

/// Row counts up to which `residual_norm` takes more threads a row (decode steps).
const RESIDUAL_NORM_FEW_ROWS: usize = 64;

/// Widest row a norm writes as Q4_K tiles (common.cuh, `store_q4k_tiles`): the row passes
/// through 4 bytes a value of shared memory (32 KB here; a launch may ask for 48 KB with the
/// kernels' static arrays).
pub(crate) const Q4K_TILES_MAX_DIM: usize = 8 * 1024;

/// The grid of a norm over `n` rows of `dim` values in blocks of `threads`: a row a block,
/// with the row's 4·dim bytes of shared memory where it writes Q4_K tiles.
pub(crate) fn norm_grid(n: usize, threads: u32, dim: usize, round: RoundTarget) -> Result<Grid> {
    let mut grid = Grid::new((int("rows", n)? as u32, 1), threads);
    if round.kind == ROUND_Q4K_TILES {
        grid.shared = 4 * dim as u32;
    }
    Ok(grid)
}

impl CudaBackend {
    /// `residual_norm` (ops.cu) of `y` with up to [`EXTRA_NORMS`] `extra` norms of the new `h`
    /// (gains and outputs, beside `next`), or with `mix = Some((w_y, experts, w_experts))`
    /// `moe_residual_norm` of rms_norm(y) · w_y + rms_norm(experts) · w_experts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn residual_norm_launch(
        &self,
        y: &CudaBuffer,
        mix: Option<(&CudaBuffer, &CudaBuffer, &CudaBuffer)>,
        weight: &CudaBuffer,
        eps: f32,
        (n, dim): (usize, usize),
        h: &mut CudaBuffer,
        scale: f32,
        next: Option<(&CudaBuffer, &mut CudaBuffer)>,
        extra: &[(u64, u64)],
    ) -> Result<()> {
        need("residual_norm input", y.len(), n * dim)?;
        need("residual_norm residual", h.len(), n * dim)?;
        need("residual_norm weight", weight.len(), dim)?;
        if let Some((w2, x)) = &next {
            need("residual_norm next weight", w2.len(), dim)?;
            need("residual_norm output", x.len(), n * dim)?;
        }
        if dim > RESIDUAL_NORM_MAX_DIM {
            return Err(Error::Unsupported(format!(
                "cuda residual_norm: rows of {dim} values (at most {RESIDUAL_NORM_MAX_DIM})"
            )));
        }
        if n == 0 || dim == 0 {
            return Ok(());
        }
        // A few rows (decode): about four values a thread, the row's latency being the cost;
        // many rows (prefill): about eight, so more blocks share a multiprocessor.
        let per_thread = if n <= RESIDUAL_NORM_FEW_ROWS { 4 } else { 8 };
        let threads = (dim.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let (w2, x) = next.map_or((0, 0), |(w2, x)| (w2.ptr, x.ptr));
        let out = if w2 == 0 { h.ptr } else { x };
        let mut s = self.scratch()?;
        // Q4_K tiles only of a next norm's output (q/k/v, gate/up ahead): the product after a
        // bare residual (Gemma 4's PLE gate, 32 blocks) stages its row cheaply (docs/perf.md,
        // session 24).
        let tiles = w2 != 0 && dim <= Q4K_TILES_MAX_DIM;
        let round = self.round_target(&mut s, (n, dim), tiles)?;
        // Every variant's arguments: its inputs, then these, [its extra norms,] the copy.
        let norm = [
            Arg::U64(weight.ptr),
            Arg::F32(eps),
            Arg::I32(int("dim", dim)?),
            Arg::U64(h.ptr),
            Arg::F32(scale),
            Arg::U64(w2),
            Arg::U64(x),
        ];
        let copy = [Arg::U64(round.at), Arg::I32(round.kind)];
        let grid = norm_grid(n, threads, dim, round)?;
        let (w3, x3) = extra.first().copied().unwrap_or((0, 0));
        let (w4, x4) = extra.get(1).copied().unwrap_or((0, 0));
        let mixed = mix.map(|(w_y, e, w_e)| [y.ptr, w_y.ptr, e.ptr, w_e.ptr]);
        let (name, inputs, extras): (_, &[u64], &[u64]) = match &mixed {
            None if extra.is_empty() => ("residual_norm", &[y.ptr], &[]),
            None => ("residual_norm_extra", &[y.ptr], &[w3, x3, w4, x4]),
            Some(inputs) => ("moe_residual_norm", inputs, &[]),
        };
        let args: Vec<Arg> = (inputs.iter().copied().map(Arg::U64))
            .chain(norm)
            .chain(extras.iter().copied().map(Arg::U64))
            .chain(copy)
            .collect();
        self.run(Module::Ops, name, grid, &args)?;
        s.rounded.hold(round, out, n * dim, &self.queue);
        Ok(())
    }
}
