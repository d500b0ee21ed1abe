//! Plain reference versions of every CPU operation: single-threaded, obviously right, slow.
//! The fast kernels in this crate are tested against these on fresh random inputs.

use markbase_core::backend::{AttnSpec, HostMatrix, KvLayout, Rope};
use markbase_core::quant::dequantize_row;
use markbase_core::Result;

use crate::kernels::screen_copy::ScreenCopy;

/// All rows of a stored matrix as f32, row-major `[rows, cols]`.
pub fn dequantize_matrix(m: &HostMatrix) -> Result<Vec<f32>> {
    let mut out = vec![0f32; m.rows * m.cols];
    let rb = m.row_bytes();
    let bytes = m.bytes.as_slice();
    for r in 0..m.rows {
        dequantize_row(
            m.ty,
            &bytes[r * rb..(r + 1) * rb],
            &mut out[r * m.cols..(r + 1) * m.cols],
        )?;
    }
    Ok(out)
}

/// `out[t, r] = Σ_k x[t, k] · w[r, k]` accumulated in f64.
pub fn matmul(x: &[f32], n: usize, m: &HostMatrix) -> Result<Vec<f32>> {
    let w = dequantize_matrix(m)?;
    let mut out = vec![0f32; n * m.rows];
    for t in 0..n {
        for r in 0..m.rows {
            let mut s = 0f64;
            for k in 0..m.cols {
                s += x[t * m.cols + k] as f64 * w[r * m.cols + k] as f64;
            }
            out[t * m.rows + r] = s as f32;
        }
    }
    Ok(out)
}

/// [`matmul`] with the activations first quantized to 16-bit blocks and dequantized again
/// ([`QuantAct`]), as the backend's integer path sees them.
///
/// [`QuantAct`]: crate::kernels::act::QuantAct
pub fn matmul_quantized(x: &[f32], n: usize, m: &HostMatrix) -> Result<Vec<f32>> {
    let mut act = crate::kernels::act::QuantAct::new();
    act.quantize(x, n, m.cols);
    matmul_of_rows(n, m, |t| act.row(t).dequantize())
}

/// The screening pass's logits: the copy's dequantized rows (less the column means) times the
/// activations as the pass quantizes them ([`ScreenAct`], divided back by the column
/// magnitudes), plus each token's `x · μ`, in f64.
///
/// [`ScreenAct`]: crate::kernels::screen::ScreenAct
pub fn matmul_screen_copy(x: &[f32], n: usize, copy: &ScreenCopy) -> Vec<f32> {
    let mut act = crate::kernels::screen::ScreenAct::new();
    act.quantize(x, n, copy);
    let k = copy.cols;
    let rows: Vec<Vec<f32>> = (0..copy.rows).map(|r| copy.dequantize_row(r)).collect();
    let mut out = Vec::with_capacity(n * copy.rows);
    for t in 0..n {
        let xt: Vec<f64> = act
            .row(t)
            .dequantize()
            .iter()
            .zip(&copy.beta)
            .map(|(v, b)| v / f64::from(*b))
            .collect();
        let shift: f64 = x[t * k..(t + 1) * k]
            .iter()
            .zip(&copy.mean)
            .map(|(v, m)| f64::from(*v) * f64::from(*m))
            .sum();
        out.extend(rows.iter().map(|w| {
            (shift
                + w.iter()
                    .zip(&xt)
                    .map(|(a, b)| f64::from(*a) * b)
                    .sum::<f64>()) as f32
        }));
    }
    out
}

/// [`matmul`] of the `n` activation rows `row(t)` (dequantized values).
fn matmul_of_rows(n: usize, m: &HostMatrix, row: impl Fn(usize) -> Vec<f64>) -> Result<Vec<f32>> {
    let x: Vec<f32> = (0..n).flat_map(row).map(|v| v as f32).collect();
    matmul(&x, n, m)
}

/// Gathers token rows of the table and multiplies them by `scale`.
pub fn embed(table: &HostMatrix, tokens: &[u32], scale: f32) -> Result<Vec<f32>> {
    let w = dequantize_matrix(table)?;
    let mut out = Vec::with_capacity(tokens.len() * table.cols);
    for &t in tokens {
        let row = &w[t as usize * table.cols..(t as usize + 1) * table.cols];
        out.extend(row.iter().map(|v| v * scale));
    }
    Ok(out)
}

/// RMSNorm of each `dim`-wide row, times `weight` when given.
pub fn rms_norm(x: &[f32], weight: Option<&[f32]>, eps: f32, dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for (i, v) in row.iter().enumerate() {
            let w = weight.map_or(1.0, |w| w[i] as f64);
            out.push((*v as f64 * inv * w) as f32);
        }
    }
    out
}

/// Per-head RMSNorm (optional) then half-split RoPE at each token's position.
pub fn head_norm_rope(
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    norm: Option<(&[f32], f32)>,
    rope: &Rope,
    positions: &[u32],
) -> Vec<f32> {
    let mut out = match norm {
        Some((w, eps)) => rms_norm(x, Some(w), eps, head_dim),
        None => x.to_vec(),
    };
    let half = head_dim / 2;
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for i in 0..rope.rotated_pairs {
                let inv = 1.0 / rope.theta.powf((2 * i) as f32 / head_dim as f32);
                let angle = (p as f32) * (inv / rope.linear_factor);
                let (s, c) = (angle as f64).sin_cos();
                let (a, b) = (out[base + i] as f64, out[base + i + half] as f64);
                out[base + i] = (a * c - b * s) as f32;
                out[base + i + half] = (b * c + a * s) as f32;
            }
        }
    }
    out
}

/// Attention with an explicit mask over every position of the row's sequence, softmax in f64.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
) -> Vec<f32> {
    let positions = layout.positions;
    let bs = layout.block_size;
    let hd = spec.head_dim;
    let kv_w = spec.n_kv_heads * hd;
    let group = spec.n_heads / spec.n_kv_heads;
    let mut out = vec![0f32; positions.len() * spec.n_heads * hd];
    for (t, &p) in positions.iter().enumerate() {
        let p = p as usize;
        let seq = (0..layout.n_seqs())
            .find(|&s| (layout.seq_start[s]..layout.seq_start[s + 1]).contains(&(t as u32)))
            .expect("every row belongs to a sequence");
        let table = &layout.block_tables[seq * layout.table_width..][..layout.table_width];
        for h in 0..spec.n_heads {
            let kvh = h / group;
            let qrow = &q[(t * spec.n_heads + h) * hd..][..hd];
            let mut scores = Vec::new();
            for j in 0..=p {
                let visible = spec.window.is_none_or(|w| j + w > p);
                if !visible {
                    continue;
                }
                let slot = table[j / bs] as usize * bs + j % bs;
                let krow = &k_cache[slot * kv_w + kvh * hd..][..hd];
                let mut s: f64 = qrow
                    .iter()
                    .zip(krow)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * spec.scale as f64;
                if let Some(cap) = spec.softcap {
                    s = cap as f64 * (s / cap as f64).tanh();
                }
                scores.push((slot, s));
            }
            let max = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s.1 - max).exp()).sum();
            let o = &mut out[(t * spec.n_heads + h) * hd..][..hd];
            for d in 0..hd {
                let mut acc = 0f64;
                for &(slot, s) in &scores {
                    acc += (s - max).exp() / sum * v_cache[slot * kv_w + kvh * hd + d] as f64;
                }
                o[d] = acc as f32;
            }
        }
    }
    out
}

/// `gelu_tanh(g) · u` element-wise.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = g as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            (0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u as f64) as f32
        })
        .collect()
}

/// `cap · tanh(x / cap)` element-wise.
pub fn softcap(x: &[f32], cap: f32) -> Vec<f32> {
    x.iter()
        .map(|&v| (cap as f64 * (v as f64 / cap as f64).tanh()) as f32)
        .collect()
}

/// Mixture-of-experts routing in f64: softmax over each `n_experts`-wide row, the `top_k`
/// largest (ties: lower id first), renormalised, times `expert_scale`. Returns per row the
/// `top_k` (weight, expert id) pairs.
pub fn moe_route(
    logits: &[f32],
    n_experts: usize,
    top_k: usize,
    expert_scale: &[f32],
) -> Vec<(f32, usize)> {
    let mut out = Vec::new();
    for row in logits.chunks(n_experts) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut order: Vec<usize> = (0..n_experts).collect();
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
        let kept: f64 = order[..top_k].iter().map(|&i| e[i] / sum).sum();
        for &i in &order[..top_k] {
            out.push(((e[i] / sum / kept * expert_scale[i] as f64) as f32, i));
        }
    }
    out
}

/// Routed expert MLPs: `out[t] = Σ_j w_j · down_e(gelu_tanh(gate_e x_t) ⊙ up_e x_t)` for the
/// `top_k` (weight, expert) pairs of each token; `gate_up` is `[E·2F, D]`, `down` `[E·D, F]`.
pub fn moe_ffn(
    x: &[f32],
    n: usize,
    gate_up: &HostMatrix,
    down: &HostMatrix,
    top_k: usize,
    route: &[(f32, usize)],
) -> Result<Vec<f32>> {
    let (d, f) = (gate_up.cols, down.cols);
    let gu = dequantize_matrix(gate_up)?;
    let dn = dequantize_matrix(down)?;
    let mut out = vec![0f32; n * d];
    for t in 0..n {
        let xt = &x[t * d..(t + 1) * d];
        let mut acc = vec![0f64; d];
        for &(w, e) in &route[t * top_k..(t + 1) * top_k] {
            let dot = |row: usize, v: &[f32]| -> f32 {
                let r = &gu[row * d..(row + 1) * d];
                r.iter()
                    .zip(v)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>() as f32
            };
            let g: Vec<f32> = (0..f).map(|i| dot(e * 2 * f + i, xt)).collect();
            let u: Vec<f32> = (0..f).map(|i| dot(e * 2 * f + f + i, xt)).collect();
            let h = gelu_tanh_mul(&g, &u);
            for (r, a) in acc.iter_mut().enumerate() {
                let row = &dn[(e * d + r) * f..(e * d + r + 1) * f];
                let s: f64 = row.iter().zip(&h).map(|(a, b)| *a as f64 * *b as f64).sum();
                *a += w as f64 * s;
            }
        }
        for (o, a) in out[t * d..(t + 1) * d].iter_mut().zip(acc) {
            *o = a as f32;
        }
    }
    Ok(out)
}
