//! The gated feed-forward of prefill-sized steps over bf16 weights, with its `n × ff`
//! activations kept in bf16: the gate and up products write bf16 (cuBLASLt rounds the f32 sums),
//! `gelu_tanh_mul_bf16` combines them into the bf16 rows the down product reads; no f32 copy
//! of the activations is made. On the H200 (E4B, 1 024 rows, docs/perf.md session 20) the
//! elementwise pass took 18.5 µs against 33.9 for the f32 one, the gate/up products 73.6 µs
//! against 79.3. The gate and up values are rounded once more, to bf16, before the activation.
//! Gate and up run as one batched cuBLASLt call (two products on the same activations) where
//! the up weights lie above the gate weights in device memory: E4B bf16 on the H200 (session
//! 22) tg32@b64 12 002.77 / 12 021.03 → 12 290.31 / 12 248.16 t/s, tg32@b8 1 705.89 /
//! 1 712.75 → 1 748.05 / 1 741.16, pp4096 unchanged.
//!
//! Decode-sized steps over Q4_K weights take our tensor-core kernel (mmq.rs) where it suits:
//! one launch computes gate and up and stores gelu_tanh(gate) · up as the f16 activations the
//! down product (a second launch) reads. E4B Q4_K on the H200 (docs/perf.md session 32, with
//! the split parts' faster addition): 8 / 16 / 32 sequences 2 196 / 3 567 / 4 838 →
//! 2 434 / 3 918 / 5 564 t/s.

use markbase_core::{Error, Result};

use crate::backend::{blocks, need, CudaBackend};
use crate::blas::{Blas, GemmInput, GemmOutput};
use crate::buffer::{CudaBuffer, CudaMatrix};
use crate::kernels::{Arg, Grid};
use crate::mmq::{mma_suits, Job};
use crate::products::{product_inputs, rounded_form, ProductInputs};
use crate::rounded::CopyForm;
use crate::sources::Module;

impl CudaBackend {
    /// [`markbase_core::backend::Backend::gated_ffn`] as two tensor-core launches (mmq.rs): the
    /// gated pair, storing gelu_tanh(gate) · up rounded into `gate_out`, then the down product
    /// on them (on cuBLAS where the kernels decline it). False (nothing queued) where gate and
    /// up are not of one format, down is not of a format the kernels take (which all read the
    /// f16 activations the pair stores; llama.cpp's Q4_K_M and Q5_K_M keep some layers' down
    /// in Q6_K), the kernels do not take the gated pair for `n` rows, or they decline the down
    /// product and cuBLAS is absent.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gated_ffn_mma(
        &self,
        x: &CudaBuffer,
        n: usize,
        (gate, up, down): (&CudaMatrix, &CudaMatrix, &CudaMatrix),
        ff: usize,
        gate_out: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<bool> {
        let (k, d) = (gate.cols, down.rows);
        let formats = gate.ty == up.ty && mma_suits(down.ty, down.cols, n);
        let shapes = (gate.rows, up.rows, up.cols, down.cols) == (ff, ff, k, ff);
        let fused = Job::Gated {
            gate,
            up,
            out: gate_out.ptr,
        };
        let downs = [(down, out.ptr)];
        let down_job = Job::Products(&downs);
        let copies = self.f16_copy_applies(gate.ty, n);
        if copies || !(formats && shapes && self.mmq_takes(&fused, n)) {
            return Ok(false);
        }
        // Where the kernels decline the down product (one matrix of 49–64 rows, or a run of
        // them past 64, `mmq::plan`),
        // cuBLAS multiplies it from the pair's f16 outputs.
        let down_on_blas = match (self.mmq_takes(&down_job, n), &self.blas) {
            (true, _) => None,
            (false, Some(blas)) => Some(blas),
            (false, None) => return Ok(false),
        };
        need("feed-forward input", x.len(), n * k)?;
        need("feed-forward gate scratch", gate_out.len(), n * ff)?;
        need("feed-forward output", out.len(), n * d)?;
        let mut s = self.scratch()?;
        let form = rounded_form(gate.ty, k, n, product_inputs(gate.ty, k, n));
        let xh = self.round_inputs(&mut s, form, x.ptr, n * k)?;
        self.mmq(&mut s, xh, n, fused)?;
        match down_on_blas {
            Some(blas) => self.gemm_half(blas, &mut s, gate_out.ptr, n, down, out.ptr)?,
            None => {
                self.mmq(&mut s, gate_out.ptr, n, down_job)?;
            }
        }
        Ok(true)
    }

    /// [`markbase_core::backend::Backend::gated_ffn`] with bf16 activations between the
    /// products (the caller checked: bf16 weights, tensor-core products for `n` rows, and
    /// `n · ff` a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gated_ffn_bf16(
        &self,
        blas: &Blas,
        x: &CudaBuffer,
        n: usize,
        (gate, up, down): (&CudaMatrix, &CudaMatrix, &CudaMatrix),
        ff: usize,
        gate_out: &mut CudaBuffer,
        up_out: &mut CudaBuffer,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (k, d) = (gate.cols, down.rows);
        if (gate.rows, up.rows, up.cols, down.cols) != (ff, ff, k, ff) {
            return Err(Error::Invalid(format!(
                "cuda gated feed-forward: gate [{}, {}], up [{}, {}], down [{}, {}] for {ff}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols
            )));
        }
        need("feed-forward input", x.len(), n * k)?;
        need("feed-forward gate scratch", gate_out.len(), n * ff)?;
        need("feed-forward up scratch", up_out.len(), n * ff)?;
        need("feed-forward output", out.len(), n * d)?;
        let mut s = self.scratch()?;
        let xh = self.round_inputs(&mut s, CopyForm::Rounded(ProductInputs::Bf16), x.ptr, n * k)?;
        // Gate and up in bf16 share up_out (2 · n·ff bf16 values in n·ff floats); the
        // activations go to gate_out as bf16.
        let (gh, uh) = (up_out.ptr, up_out.ptr + 2 * (n * ff) as u64);
        let bf16 = (GemmInput::Bf16, GemmOutput::Bf16);
        // Gate and up as one batched call where the up weights lie above the gate weights;
        // else one call each.
        // SAFETY: `xh` holds n·k bf16 values, gate and up ff·k each, `gh` and `uh` room for
        // n·ff bf16 values each.
        let pair =
            unsafe { blas.gemm_rows_pair(bf16, [gate.ptr, up.ptr], ff, k, xh, n, [gh, uh], ff)? };
        match pair {
            Some(call) => self.queue_gemm(Ok(call))?,
            None => {
                for (w, at) in [(gate, gh), (up, uh)] {
                    // SAFETY: as above, for one product.
                    self.queue_gemm(unsafe { blas.gemm_rows(bf16, w.ptr, ff, k, xh, n, at, ff) })?;
                }
            }
        }
        let groups = n * ff / 8;
        self.run(
            Module::Ops,
            "gelu_tanh_mul_bf16",
            Grid::new((blocks(groups, 256), 1), 256),
            &[
                Arg::U64(gh),
                Arg::U64(uh),
                Arg::U64(gate_out.ptr),
                Arg::U64(groups as u64),
            ],
        )?;
        // SAFETY: gate_out holds the n·ff bf16 activations, `down` d·ff, `out` n·d floats.
        self.queue_gemm(unsafe {
            blas.gemm_rows(
                (GemmInput::Bf16, GemmOutput::F32),
                down.ptr,
                d,
                ff,
                gate_out.ptr,
                n,
                out.ptr,
                d,
            )
        })
    }
}
