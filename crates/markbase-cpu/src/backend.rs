//! [`CpuBackend`]: f32 activations in host memory, weights used in place from the mapped file,
//! work spread over a persistent thread pool ([`Pool`]).

use markbase_core::backend::{AttnSpec, Backend, HostMatrix, KvLayout, NormOut, Rope};
use markbase_core::quant::dequantize_row;
use markbase_core::{Error, Result};
use std::sync::Mutex;

use crate::attention::{self, MAX_HEAD_DIM};
use crate::kernels::screen_copy::{ScreenCopy, CHUNK};
use crate::pool::Pool;
use crate::{lm_head, matmul, moe, ops};

/// The CPU backend.
pub struct CpuBackend {
    pool: Pool,
    /// Scratch of the matmuls (reused: no allocation per call).
    scratch: Mutex<matmul::Scratch>,
    /// Scratch of the screened LM head (activations and leader selections).
    screen: Mutex<lm_head::Scratch>,
    /// RoPE angles of the last chunks' positions.
    rope: Mutex<ops::RopeCache>,
}

/// An activation buffer: f32 values in host memory.
pub struct CpuBuffer(Vec<f32>);

impl CpuBuffer {
    /// The values.
    pub fn as_slice(&self) -> &[f32] {
        &self.0
    }
}

/// A weight matrix used in place (mapped bytes, or bytes made at load), or an LM head's
/// screening copy.
pub struct CpuMatrix(Weights);

/// What a [`CpuMatrix`] holds.
enum Weights {
    /// A stored matrix, any format.
    Stored(HostMatrix),
    /// An LM head's screening copy ([`Backend::load_screen`]).
    Screen(ScreenCopy),
}

impl CpuMatrix {
    /// The stored matrix, for operation `op`; a screening copy is refused.
    fn stored(&self, op: &str) -> Result<&HostMatrix> {
        match &self.0 {
            Weights::Stored(m) => Ok(m),
            Weights::Screen(c) => Err(Error::Invalid(format!(
                "cpu {op}: '{}' is a screening copy, usable only by matmul_screened",
                c.name
            ))),
        }
    }
}

impl CpuBackend {
    /// A backend running on `threads` threads (0 = one per core).
    pub fn new(threads: usize) -> Result<Self> {
        Ok(CpuBackend {
            pool: Pool::new(threads)?,
            scratch: Mutex::new(matmul::Scratch::default()),
            screen: Mutex::default(),
            rope: Mutex::default(),
        })
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
}

fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(Error::Invalid(format!(
            "cpu {what}: buffer of {have} values, needs {want}"
        )));
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn load_matrix(&self, m: &HostMatrix) -> Result<CpuMatrix> {
        m.check()?;
        // Touch every page so the first forward does not fault the weights in.
        let bytes = m.bytes.as_slice();
        let mut sum = 0u8;
        for i in (0..bytes.len()).step_by(4096) {
            sum = sum.wrapping_add(bytes[i]);
        }
        std::hint::black_box(sum);
        Ok(CpuMatrix(Weights::Stored(m.clone())))
    }

    fn load_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn alloc(&self, len: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer(vec![0.0; len]))
    }

    fn embed(
        &self,
        table: &CpuMatrix,
        tokens: &[u32],
        scale: f32,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let m = table.stored("embed")?;
        need("embed", out.0.len(), tokens.len() * m.cols)?;
        let rb = m.row_bytes();
        let bytes = m.bytes.as_slice();
        for (t, &id) in tokens.iter().enumerate() {
            let id = id as usize;
            if id >= m.rows {
                return Err(Error::Invalid(format!(
                    "token id {id} is outside the {} rows of '{}'",
                    m.rows, m.name
                )));
            }
            let dst = &mut out.0[t * m.cols..(t + 1) * m.cols];
            dequantize_row(m.ty, &bytes[id * rb..(id + 1) * rb], dst)?;
            dst.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuBuffer,
        weight: Option<&Vec<f32>>,
        eps: f32,
        n: usize,
        dim: usize,
        out: &mut CpuBuffer,
        mode: NormOut,
    ) -> Result<()> {
        need("rms_norm input", x.0.len(), n * dim)?;
        need("rms_norm output", out.0.len(), n * dim)?;
        if let Some(w) = weight {
            need("rms_norm weight", w.len(), dim)?;
        }
        ops::rms_norm(
            &self.pool,
            &x.0[..n * dim],
            weight.map(|w| &w[..dim]),
            eps,
            dim,
            &mut out.0[..n * dim],
            mode == NormOut::AddTo,
        );
        Ok(())
    }

    fn matmul(&self, x: &CpuBuffer, n: usize, w: &CpuMatrix, out: &mut CpuBuffer) -> Result<()> {
        let m = w.stored("matmul")?;
        need("matmul input", x.0.len(), n * m.cols)?;
        need("matmul output", out.0.len(), n * m.rows)?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        matmul::matmul(&self.pool, &mut scratch, &x.0, n, m, &mut out.0);
        Ok(())
    }

    fn load_screen(&self, head: &HostMatrix) -> Result<Option<CpuMatrix>> {
        if !head.cols.is_multiple_of(CHUNK) {
            return Ok(None);
        }
        Ok(Some(CpuMatrix(Weights::Screen(ScreenCopy::build(head)?))))
    }

    fn matmul_screened(
        &self,
        x: &CpuBuffer,
        n: usize,
        coarse: &CpuMatrix,
        exact: &CpuMatrix,
        top_k: usize,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (c, e) = screened_pair("matmul_screened", coarse, exact)?;
        need("matmul input", x.0.len(), n * e.cols)?;
        need("matmul output", out.0.len(), n * e.rows)?;
        // Scratch only holds reusable buffers, so a poisoned lock is still safe to use.
        let mut screen = self.screen.lock().unwrap_or_else(|e| e.into_inner());
        lm_head::screened(&self.pool, &x.0, n, c, e, top_k, &mut screen, &mut out.0);
        Ok(())
    }

    fn argmax_screened(
        &self,
        x: &CpuBuffer,
        n: usize,
        coarse: &CpuMatrix,
        exact: &CpuMatrix,
        top_k: usize,
        n_vocab: usize,
        logits: &mut CpuBuffer,
    ) -> Result<Vec<u32>> {
        let (c, e) = screened_pair("argmax_screened", coarse, exact)?;
        if top_k == 0 {
            return Err(Error::Invalid(
                "cpu argmax_screened: a pick needs at least one exact leader (top_k 0)".into(),
            ));
        }
        if n_vocab != e.rows {
            return Err(Error::Invalid(format!(
                "cpu argmax_screened: {n_vocab} logits per row asked of a {}-row head",
                e.rows
            )));
        }
        need("argmax_screened input", x.0.len(), n * e.cols)?;
        need("argmax_screened scratch", logits.0.len(), n * e.rows)?;
        let mut screen = self.screen.lock().unwrap_or_else(|e| e.into_inner());
        Ok(lm_head::greedy(
            &self.pool,
            &x.0,
            n,
            c,
            e,
            top_k,
            &mut screen,
            &mut logits.0,
        ))
    }

    fn head_norm_rope(
        &self,
        x: &mut CpuBuffer,
        n_heads: usize,
        head_dim: usize,
        norm: Option<(&Vec<f32>, f32)>,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2)
            || head_dim > MAX_HEAD_DIM
            || rope.rotated_pairs > head_dim / 2
        {
            return Err(Error::Invalid(format!(
                "cpu rope: head_dim {head_dim} with {} rotated pairs",
                rope.rotated_pairs
            )));
        }
        let len = positions.len() * n_heads * head_dim;
        need("rope", x.0.len(), len)?;
        if let Some((w, _)) = norm {
            need("head norm weight", w.len(), head_dim)?;
        }
        // The cache only holds tables that are rebuilt when they do not match, so a poisoned
        // lock is still safe to use.
        let mut cache = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        ops::head_norm_rope(
            &self.pool,
            &mut cache,
            &mut x.0[..len],
            n_heads,
            head_dim,
            norm.map(|(w, e)| (&w[..head_dim], e)),
            rope,
            positions,
        );
        Ok(())
    }

    fn write_kv(
        &self,
        k: &CpuBuffer,
        v: &CpuBuffer,
        row: usize,
        slots: &[u32],
        k_cache: &mut CpuBuffer,
        v_cache: &mut CpuBuffer,
    ) -> Result<()> {
        need(
            "write_kv input",
            k.0.len().min(v.0.len()),
            slots.len() * row,
        )?;
        for (t, &s) in slots.iter().enumerate() {
            let s = s as usize;
            need(
                "kv cache",
                k_cache.0.len().min(v_cache.0.len()),
                (s + 1) * row,
            )?;
            k_cache.0[s * row..(s + 1) * row].copy_from_slice(&k.0[t * row..(t + 1) * row]);
            v_cache.0[s * row..(s + 1) * row].copy_from_slice(&v.0[t * row..(t + 1) * row]);
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        k_cache: &CpuBuffer,
        v_cache: &CpuBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        if spec.head_dim > MAX_HEAD_DIM
            || spec.head_dim == 0
            || spec.n_kv_heads == 0
            || !spec.n_heads.is_multiple_of(spec.n_kv_heads)
            || spec.window == Some(0)
        {
            return Err(Error::Invalid(format!("cpu attention: bad spec {spec:?}")));
        }
        let len = layout.positions.len() * spec.n_heads * spec.head_dim;
        need("attention query", q.0.len(), len)?;
        need("attention output", out.0.len(), len)?;
        let block = layout.block_size * spec.n_kv_heads * spec.head_dim;
        let n_blocks = k_cache.0.len().min(v_cache.0.len()) / block.max(1);
        layout.check(spec.window, n_blocks)?;
        attention::attention(
            &self.pool, &q.0, &k_cache.0, &v_cache.0, spec, layout, &mut out.0,
        );
        Ok(())
    }

    fn moe_route(
        &self,
        logits: &CpuBuffer,
        n: usize,
        n_experts: usize,
        top_k: usize,
        expert_scale: &Vec<f32>,
        weights: &mut CpuBuffer,
        ids: &mut CpuBuffer,
    ) -> Result<()> {
        if top_k == 0 || top_k > n_experts {
            return Err(Error::Invalid(format!(
                "cpu moe_route: top {top_k} of {n_experts} experts"
            )));
        }
        need("moe_route logits", logits.0.len(), n * n_experts)?;
        need("moe_route expert scales", expert_scale.len(), n_experts)?;
        need("moe_route weights", weights.0.len(), n * top_k)?;
        need("moe_route ids", ids.0.len(), n * top_k)?;
        moe::route(
            &logits.0[..n * n_experts],
            n_experts,
            top_k,
            expert_scale,
            &mut weights.0[..n * top_k],
            &mut ids.0[..n * top_k],
        );
        Ok(())
    }

    fn moe_ffn(
        &self,
        x: &CpuBuffer,
        n: usize,
        gate_up: &CpuMatrix,
        down: &CpuMatrix,
        n_experts: usize,
        top_k: usize,
        weights: &CpuBuffer,
        ids: &CpuBuffer,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (gu, dn) = (gate_up.stored("moe_ffn")?, down.stored("moe_ffn")?);
        let d = gu.cols;
        let f = dn.cols;
        if n_experts == 0 || gu.rows != n_experts * 2 * f || dn.rows != n_experts * d {
            return Err(Error::Invalid(format!(
                "cpu moe_ffn: '{}' [{}, {}] and '{}' [{}, {}] do not stack {n_experts} experts",
                gu.name, gu.rows, gu.cols, dn.name, dn.rows, dn.cols
            )));
        }
        need("moe_ffn input", x.0.len(), n * d)?;
        need("moe_ffn output", out.0.len(), n * d)?;
        need(
            "moe_ffn weights",
            weights.0.len().min(ids.0.len()),
            n * top_k,
        )?;
        if let Some(bad) = ids.0[..n * top_k]
            .iter()
            .find(|&&e| !(e >= 0.0 && (e as usize) < n_experts && e.fract() == 0.0))
        {
            return Err(Error::Invalid(format!(
                "cpu moe_ffn: expert id {bad} of {n_experts} experts"
            )));
        }
        moe::ffn(
            &self.pool,
            &x.0[..n * d],
            n,
            gu,
            dn,
            top_k,
            &weights.0[..n * top_k],
            &ids.0[..n * top_k],
            &mut out.0,
        );
        Ok(())
    }

    fn copy(
        &self,
        src: &CpuBuffer,
        src_off: usize,
        dst: &mut CpuBuffer,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        need("copy source", src.0.len(), src_off + len)?;
        need("copy destination", dst.0.len(), dst_off + len)?;
        dst.0[dst_off..dst_off + len].copy_from_slice(&src.0[src_off..src_off + len]);
        Ok(())
    }

    fn gelu_tanh_mul(&self, gate: &mut CpuBuffer, up: &CpuBuffer, len: usize) -> Result<()> {
        need("gelu_tanh_mul", gate.0.len().min(up.0.len()), len)?;
        ops::gelu_tanh_mul(&self.pool, &mut gate.0[..len], &up.0[..len]);
        Ok(())
    }

    fn add(&self, x: &mut CpuBuffer, y: &CpuBuffer, len: usize) -> Result<()> {
        need("add", x.0.len().min(y.0.len()), len)?;
        x.0[..len]
            .iter_mut()
            .zip(&y.0[..len])
            .for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn scale(&self, x: &mut CpuBuffer, s: f32, len: usize) -> Result<()> {
        need("scale", x.0.len(), len)?;
        x.0[..len].iter_mut().for_each(|a| *a *= s);
        Ok(())
    }

    fn softcap(&self, x: &mut CpuBuffer, cap: f32, len: usize) -> Result<()> {
        need("softcap", x.0.len(), len)?;
        x.0[..len]
            .iter_mut()
            .for_each(|a| *a = cap * (*a / cap).tanh());
        Ok(())
    }

    fn write(&self, src: &[f32], dst: &mut CpuBuffer) -> Result<()> {
        need("write", dst.0.len(), src.len())?;
        dst.0[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn argmax(&self, x: &CpuBuffer, rows: usize, n: usize) -> Result<Vec<u32>> {
        need("argmax", x.0.len(), rows * n)?;
        Ok(ops::argmax_rows(&self.pool, &x.0, rows, n))
    }

    fn read(&self, x: &CpuBuffer, dst: &mut [f32]) -> Result<()> {
        need("read", x.0.len(), dst.len())?;
        dst.copy_from_slice(&x.0[..dst.len()]);
        Ok(())
    }
}

/// A screening copy and its exact head, checked to be that and of one shape (`op` names the
/// caller in errors).
fn screened_pair<'a>(
    op: &str,
    coarse: &'a CpuMatrix,
    exact: &'a CpuMatrix,
) -> Result<(&'a ScreenCopy, &'a HostMatrix)> {
    let e = exact.stored(op)?;
    let c = match &coarse.0 {
        Weights::Screen(c) => c,
        Weights::Stored(m) => {
            return Err(Error::Invalid(format!(
                "cpu {op}: '{}' is not a screening copy (Backend::load_screen)",
                m.name
            )))
        }
    };
    if (c.rows, c.cols) != (e.rows, e.cols) {
        return Err(Error::Invalid(format!(
            "cpu {op}: coarse [{}, {}] and exact [{}, {}] differ",
            c.rows, c.cols, e.rows, e.cols
        )));
    }
    Ok((c, e))
}
