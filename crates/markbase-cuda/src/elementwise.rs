//! Elementwise kernels of ops.cu: gelu_tanh(gate) · up with its rounded copy, add, scale,
//! softcap.

use markbase_core::backend::Strided;
use markbase_core::Result;

use crate::backend::{blocks, need, CudaBackend};
use crate::buffer::CudaBuffer;
use crate::kernels::{Arg, Grid};
use crate::rounded::RoundTarget;
use crate::sources::Module;

impl CudaBackend {
    /// `gate[t, r] = gelu_tanh(gate[t, r]) · up[up_rows.at(t) + r]` for `n` rows of `rows`
    /// values, with the rounded copy for the next product.
    pub(crate) fn gelu_mul_rows(
        &self,
        gate: &mut CudaBuffer,
        up: &CudaBuffer,
        up_rows: Strided,
        n: usize,
        rows: usize,
    ) -> Result<()> {
        need("gelu_tanh_mul", gate.len(), n * rows)?;
        if n > 0 {
            need("gelu_tanh_mul", up.len(), up_rows.at(n - 1) + rows)?;
        }
        let mut s = self.scratch()?;
        let round = self.round_target(&mut s, (n, rows), false)?;
        self.gelu_mul_launch(gate, up, up_rows, n * rows, rows, round)?;
        s.rounded.hold(round, gate.ptr, n * rows, &self.queue);
        Ok(())
    }

    /// Queues `gelu_tanh_mul` over `len` values in rows of `rows` (sizes checked by the
    /// caller).
    pub(crate) fn gelu_mul_launch(
        &self,
        gate: &mut CudaBuffer,
        up: &CudaBuffer,
        up_rows: Strided,
        len: usize,
        rows: usize,
        round: RoundTarget,
    ) -> Result<()> {
        let aligned = [gate.ptr, up.ptr + 4 * up_rows.offset as u64, round.at]
            .iter()
            .all(|p| p % 16 == 0);
        if up_rows.stride == rows && len.is_multiple_of(4) && aligned {
            return self.elementwise(
                "gelu_tanh_mul4",
                &[
                    Arg::U64(gate.ptr),
                    Arg::U64(up.ptr + 4 * up_rows.offset as u64),
                    Arg::U64(len as u64 / 4),
                    Arg::U64(round.at),
                    Arg::I32(round.kind),
                ],
                len / 4,
            );
        }
        self.elementwise(
            "gelu_tanh_mul",
            &[
                Arg::U64(gate.ptr),
                Arg::U64(up.ptr + 4 * up_rows.offset as u64),
                Arg::U64(len as u64),
                Arg::U64(rows.max(1) as u64),
                Arg::U64(up_rows.stride as u64),
                Arg::U64(round.at),
                Arg::I32(round.kind),
            ],
            len,
        )
    }

    /// Queues elementwise kernel `name` of ops.cu over `len` values, 256 threads a block.
    pub(crate) fn elementwise(&self, name: &'static str, args: &[Arg], len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.run(
            Module::Ops,
            name,
            Grid::new((blocks(len, 256), 1), 256),
            args,
        )
    }
}
