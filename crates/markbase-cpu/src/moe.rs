//! Mixture-of-experts routing and routed expert MLPs (Gemma 4 26B-A4B), weights read in place.

use markbase_core::backend::HostMatrix;

use crate::kernels::dot::dot_row;
use crate::pool::Pool;

/// Softmax → top-k → renormalise → per-expert scale for each `n_experts`-wide row of
/// `logits`; writes `top_k` weights and ids (as f32) per row. Sizes are checked by the caller.
pub fn route(
    logits: &[f32],
    n_experts: usize,
    top_k: usize,
    expert_scale: &[f32],
    weights: &mut [f32],
    ids: &mut [f32],
) {
    let mut order: Vec<usize> = Vec::with_capacity(n_experts);
    let mut probs = vec![0f32; n_experts];
    for ((row, w), id) in logits
        .chunks_exact(n_experts)
        .zip(weights.chunks_exact_mut(top_k))
        .zip(ids.chunks_exact_mut(top_k))
    {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        probs.iter_mut().for_each(|p| *p /= sum);
        order.clear();
        order.extend(0..n_experts);
        // Stable: equal probabilities keep the lower id first.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let kept: f32 = order[..top_k].iter().map(|&e| probs[e]).sum();
        for (j, &e) in order[..top_k].iter().enumerate() {
            w[j] = probs[e] / kept * expert_scale[e];
            id[j] = e as f32;
        }
    }
}

/// Routed expert MLPs for `n` tokens of width `d = gate_up.cols`: every (token, chosen expert)
/// pair runs on its own, then each token sums its weighted expert outputs into `out`.
/// `ids` hold valid expert ids (checked by the caller).
#[allow(clippy::too_many_arguments)]
pub fn ffn(
    pool: &Pool,
    x: &[f32],
    n: usize,
    gate_up: &HostMatrix,
    down: &HostMatrix,
    top_k: usize,
    weights: &[f32],
    ids: &[f32],
    out: &mut [f32],
) {
    let d = gate_up.cols;
    let f = down.cols;
    let (gu_rb, dn_rb) = (gate_up.row_bytes(), down.row_bytes());
    let (gu, dn) = (gate_up.bytes.as_slice(), down.bytes.as_slice());
    let mut partial = vec![0f32; n * top_k * d];
    pool.par_chunks_mut(&mut partial, d, |pair, o| {
        let t = pair / top_k;
        let e = ids[pair] as usize;
        let xt = &x[t * d..(t + 1) * d];
        let mut h = vec![0f32; f];
        for (i, hv) in h.iter_mut().enumerate() {
            let g = e * 2 * f + i;
            let u = g + f;
            let gv = dot_row(gate_up.ty, &gu[g * gu_rb..(g + 1) * gu_rb], xt);
            let uv = dot_row(gate_up.ty, &gu[u * gu_rb..(u + 1) * gu_rb], xt);
            *hv = gelu_tanh(gv) * uv;
        }
        let w = weights[pair];
        for (r, ov) in o.iter_mut().enumerate() {
            let row = e * d + r;
            *ov = w * dot_row(down.ty, &dn[row * dn_rb..(row + 1) * dn_rb], &h);
        }
    });
    pool.par_chunks_mut(&mut out[..n * d], d, |t, o| {
        o.copy_from_slice(&partial[t * top_k * d..(t * top_k + 1) * d]);
        for j in 1..top_k {
            let p = &partial[(t * top_k + j) * d..(t * top_k + j + 1) * d];
            o.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
    });
}

/// PyTorch's `gelu_pytorch_tanh`.
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}
