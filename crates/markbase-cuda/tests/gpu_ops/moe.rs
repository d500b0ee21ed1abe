//! Mixture-of-experts routing and expert products against the CPU reference.

use super::*;

/// Rows `r0 .. r0 + count` of `m`, as stored.
fn rows_of(m: &HostMatrix, r0: usize, count: usize) -> HostMatrix {
    let rb = m.row_bytes();
    HostMatrix {
        name: format!("{} rows {r0}..{}", m.name, r0 + count),
        ty: m.ty,
        rows: count,
        cols: m.cols,
        bytes: HostBytes::Owned(Arc::from(&m.bytes.as_slice()[r0 * rb..(r0 + count) * rb])),
    }
}

/// Expert rows of one `moe_ffn` case: the stacked weights as stored and as loaded.
struct Experts {
    n_experts: usize,
    gate_up: HostMatrix,
    down: HostMatrix,
    gate_up_dev: CudaMatrix,
    down_dev: CudaMatrix,
}

impl Experts {
    /// Random experts stored as `ty`: gate/up rows `d` wide, down rows `f` wide.
    fn new(
        g: &CudaBackend,
        r: &mut StdRng,
        ty: GgmlType,
        n_experts: usize,
        d: usize,
        f: usize,
    ) -> Self {
        let gate_up = random_matrix(r, ty, n_experts * 2 * f, d);
        let down = random_matrix(r, ty, n_experts * d, f);
        Experts {
            n_experts,
            gate_up_dev: g.load_matrix(&gate_up).unwrap(),
            down_dev: g.load_matrix(&down).unwrap(),
            gate_up,
            down,
        }
    }

    /// `moe_ffn` on the reference twins: token t adds w · expert_e(x_t) for each (w, e) of its
    /// `top_k` routes (e = None: a bad id, which adds nothing). The products see their inputs
    /// as `g` takes them for `n` tokens: on the tensor cores (`moe_on_tensor_cores`: the down
    /// products, and the gate/up products of grouped pairs) activations rounded to 16 bits
    /// and weights as `moe_weights_as_seen`; otherwise as GEMVs, which take them as 16-bit
    /// integers where `gemv_takes_16_bit_activations`.
    fn reference(
        &self,
        g: &CudaBackend,
        x: &[f32],
        route: &[(f32, Option<usize>)],
        top_k: usize,
    ) -> Vec<f32> {
        let (d, f) = (self.gate_up.cols, self.down.cols);
        let n = x.len() / d;
        let tensor_cores = g.device().capability().0 >= 8
            && moe_on_tensor_cores(self.gate_up.ty, self.down.ty, d, f);
        // The down products run on the tensor cores on both paths, the gate/up products only
        // for grouped pairs (one pair's are GEMVs).
        let gate_up_mma =
            tensor_cores && moe_groups_pairs(n, self.n_experts, self.gate_up.ty, (d, f), true);
        let seen = |mma: bool, ty: GgmlType, v: &[f32]| {
            if mma {
                round_16(ty, v)
            } else if gemv_takes_16_bit_activations(ty, v.len()) {
                as_16_bit(v)
            } else {
                v.to_vec()
            }
        };
        let as_seen = |mma: bool, m: &HostMatrix| {
            if mma {
                moe_weights_as_seen(m)
            } else {
                m.clone()
            }
        };
        let (gate_up, down) = (
            as_seen(gate_up_mma, &self.gate_up),
            as_seen(tensor_cores, &self.down),
        );
        let mut want = vec![0f32; x.len()];
        for (t, routes) in route.chunks(top_k).enumerate() {
            let xt = seen(gate_up_mma, self.gate_up.ty, &x[t * d..(t + 1) * d]);
            for &(w, e) in routes {
                let Some(e) = e else { continue };
                let gate = reference::matmul(&xt, 1, &rows_of(&gate_up, e * 2 * f, f)).unwrap();
                let upv = reference::matmul(&xt, 1, &rows_of(&gate_up, e * 2 * f + f, f)).unwrap();
                let h = seen(
                    tensor_cores,
                    self.down.ty,
                    &reference::gelu_tanh_mul(&gate, &upv),
                );
                let y = reference::matmul(&h, 1, &rows_of(&down, e * d, d)).unwrap();
                for (o, v) in want[t * d..(t + 1) * d].iter_mut().zip(y) {
                    *o += w * v;
                }
            }
        }
        want
    }

    /// Queues `moe_ffn` of the token rows `x` on the GPU with each token's `top_k` expert ids
    /// `ids` (as f32, the Backend contract); returns the output buffer.
    fn run(
        &self,
        g: &CudaBackend,
        x: &[f32],
        top_k: usize,
        weights: &[f32],
        ids: &[f32],
    ) -> CudaBuffer {
        let n = x.len() / self.gate_up.cols;
        let mut out = poisoned(g, n * self.gate_up.cols);
        g.moe_ffn(
            &up(g, x),
            n,
            &self.gate_up_dev,
            &self.down_dev,
            self.n_experts,
            top_k,
            &up(g, weights),
            &up(g, ids),
            &mut out,
        )
        .unwrap();
        out
    }
}

/// Routes of `n` tokens: each token's `top_k` distinct experts, consecutive (mod the count)
/// among those of `0..n_experts` other than `left_out`, with random weights.
fn moe_routes(
    r: &mut StdRng,
    n: usize,
    n_experts: usize,
    top_k: usize,
    left_out: Option<usize>,
) -> Vec<(f32, usize)> {
    let chosen: Vec<usize> = (0..n_experts).filter(|&e| Some(e) != left_out).collect();
    let mut route = Vec::new();
    for _ in 0..n {
        let first = r.random_range(0..chosen.len());
        for j in 0..top_k {
            route.push((
                r.random_range(0.1f32..1.0),
                chosen[(first + j) % chosen.len()],
            ));
        }
    }
    route
}

#[test]
fn moe_route_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_route");
    // 26B-A4B's 128 experts, top 8, for one token and a batch; 40 experts (a lane's last
    // slots partly past the count), top 3; 256 experts, top 32 (every lane keeps a choice).
    for (n, n_experts, top_k) in [(1, 128, 8), (37, 128, 8), (5, 40, 3), (3, 256, 32)] {
        let logits = uniform(&mut r, n * n_experts, 4.0);
        let scale: Vec<f32> = (0..n_experts)
            .map(|_| r.random_range(0.5f32..2.0))
            .collect();
        let (mut weights, mut ids) = (poisoned(g, n * top_k), poisoned(g, n * top_k));
        g.moe_route(
            &up(g, &logits),
            n,
            n_experts,
            top_k,
            &up(g, &scale),
            &mut weights,
            &mut ids,
        )
        .unwrap();
        let want = reference::moe_route(&logits, n_experts, top_k, &scale);
        let what = format!("moe_route n={n} experts={n_experts} top_k={top_k}");
        let got_ids: Vec<usize> = down(g, &ids, n * top_k)
            .iter()
            .map(|&e| e as usize)
            .collect();
        let want_ids: Vec<usize> = want.iter().map(|&(_, e)| e).collect();
        assert_eq!(got_ids, want_ids, "{what}: experts chosen");
        let want_w: Vec<f32> = want.iter().map(|&(w, _)| w).collect();
        assert_close(&what, &down(g, &weights, n * top_k), &want_w, 1e-5);
    }
    // More choices than lanes is a clear error, not a wrong answer.
    let (mut weights, mut ids) = (poisoned(g, 33), poisoned(g, 33));
    let err = g
        .moe_route(
            &up(g, &[0.0; 64]),
            1,
            64,
            33,
            &up(g, &[1.0; 64]),
            &mut weights,
            &mut ids,
        )
        .unwrap_err();
    assert!(err.to_string().contains("top 33 of 64"), "{err}");
}

#[test]
fn moe_ffn_matches_reference_for_every_format() {
    let g = gpu_or_skip!();
    let mut r = rng("moe_ffn");
    for ty in GgmlType::SUPPORTED {
        // Row widths of whole blocks: d for the gate/up rows, f for the down rows; plain rows
        // also at widths that are not multiples of 8 (which stay on the per-pair path).
        let mut shapes = vec![match ty.block_size() {
            1 => (264, 40),
            32 => (96, 64),
            _ => (768, 512),
        }];
        if ty.block_size() == 1 {
            // 260 × 36: not a multiple of 8; 256 × 192: whole 64-value units of the tensor
            // cores (bf16, f16).
            shapes.extend([(260, 36), (256, 192)]);
        }
        if ty == GgmlType::Q8_0 {
            // Rows of whole 256-value groups: the GEMVs on 16-bit activations, and on the
            // tensor cores 16-byte aligned quants. 320 × 192: a group and two blocks as stored
            // (quants 2- and 4-byte aligned), and blocks as stored only. 2 816 × 704: 26B-A4B's
            // experts.
            shapes.extend([(512, 256), (320, 192), (2_816, 704)]);
        }
        if ty == GgmlType::Q5_0 {
            // Whole 64-value units on the tensor cores, blocks as stored (2-byte aligned) or
            // laid out (rows of whole 8-block units, layout.rs): 26B-A4B's experts in
            // llama.cpp's Q4_K_M keep their down rows (704 wide) in Q5_0.
            shapes.extend([(320, 192), (512, 256), (2_816, 704)]);
        }
        if ty == GgmlType::Q4_0 {
            // Rows of whole 8-block units, laid out (the GEMVs on 16-bit activations), and on
            // the tensor cores as laid out or as stored (26B-A4B's experts).
            shapes.extend([(512, 256), (320, 192), (2_816, 704)]);
        }
        if ty == GgmlType::Q5_1 {
            // Whole 64-value units on the tensor cores (blocks as stored): llama.cpp's Q5_K_M
            // of 26B-A4B keeps its experts' down rows (704 wide) in Q5_1.
            shapes.extend([(320, 192), (2_816, 704)]);
        }
        for (d, f) in shapes {
            // (tokens, experts, top_k, an expert no token chooses): 3 tokens take the per-pair
            // path; 13 tokens over 3 experts of which one is left out, the grouped path with
            // two experts of 13 pairs each (a full tile of 8 and one of 5) and one of none; 16
            // tokens, 3 of 5 experts each, tiles of uneven sizes. Both crowd their experts
            // (Q4_K and Q5_K: the 64-value kernels); 12 tokens, 2 of 8 experts each, do not
            // (the super-block kernels).
            for (n, n_experts, top_k, leave_out) in [
                (3, 4, 2, false),
                (13, 3, 2, true),
                (16, 5, 3, false),
                (12, 8, 2, false),
            ] {
                let on_tensor_cores =
                    g.device().capability().0 >= 8 && moe_on_tensor_cores(ty, ty, d, f);
                let grouped = moe_groups_pairs(n, n_experts, ty, (d, f), on_tensor_cores);
                assert_eq!(
                    grouped,
                    n > 3 && d % 8 == 0 && f % 8 == 0,
                    "n = {n}: not the path this case is for"
                );
                let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
                let x = uniform(&mut r, n * d, 1.0);
                let left_out = leave_out.then(|| r.random_range(0..n_experts));
                let route = moe_routes(&mut r, n, n_experts, top_k, left_out);
                let weights: Vec<f32> = route.iter().map(|&(w, _)| w).collect();
                let ids: Vec<f32> = route.iter().map(|&(_, e)| e as f32).collect();
                let out = experts.run(g, &x, top_k, &weights, &ids);
                let got = down(g, &out, n * d);
                let route: Vec<_> = route.iter().map(|&(w, e)| (w, Some(e))).collect();
                let want = experts.reference(g, &x, &route, top_k);
                // With the down products on the tensor cores the gated activations are rounded
                // to 16 bits between the products, where a sum a rounding step apart flips one
                // (as in the gated feed-forward test).
                assert_close(
                    &format!("moe_ffn {ty} d={d} f={f} n={n} experts={n_experts} top_k={top_k}"),
                    &got,
                    &want,
                    if on_tensor_cores { 2e-3 } else { 5e-5 },
                );
                // The same inputs again give the same bits (the grouping's order is fixed).
                let again = down(g, &experts.run(g, &x, top_k, &weights, &ids), n * d);
                assert!(
                    got.iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "moe_ffn {ty} n={n}: a second run differs"
                );
            }
        }
    }
}

/// Operations queued after `next_beside_previous` run beside the product ahead of them (an
/// rms_norm; the per-pair experts' first kernel; the grouped experts, which ignore the hint)
/// and give the bits they give in order, also to the product after them that reads them.
#[test]
fn operations_beside_the_previous_give_their_ordered_bits() {
    let g = gpu_or_skip!();
    let mut r = rng("beside");
    // A long one-token product ahead (26B-A4B's width), which the next operation does not
    // touch.
    let (d, rows) = (2816, 8192);
    let long = g
        .load_matrix(&random_matrix(&mut r, GgmlType::BF16, rows, d))
        .unwrap();
    let (x, h) = (
        up(g, &uniform(&mut r, d, 1.0)),
        up(g, &uniform(&mut r, d, 2.0)),
    );
    let gain = g.load_vector(&uniform(&mut r, d, 1.0)).unwrap();
    let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let norm_then_product = |beside: bool| {
        let (mut ahead, mut normed, mut after) =
            (poisoned(g, rows), poisoned(g, d), poisoned(g, rows));
        g.matmul(&x, 1, &long, &mut ahead).unwrap();
        if beside {
            g.next_beside_previous();
        }
        g.rms_norm(&h, Some(&gain), 1e-6, 1, d, &mut normed, NormOut::Write)
            .unwrap();
        g.matmul(&normed, 1, &long, &mut after).unwrap();
        [
            down(g, &ahead, rows),
            down(g, &normed, d),
            down(g, &after, rows),
        ]
        .concat()
    };
    assert_eq!(
        bits(norm_then_product(true)),
        bits(norm_then_product(false)),
        "rms_norm beside a product"
    );
    // 3 tokens: the per-pair path; 16 tokens of 5 experts: grouped.
    for (ty, n, n_experts, top_k, f) in [
        (GgmlType::BF16, 3, 4, 2, 704),
        (GgmlType::Q8_0, 3, 8, 4, 704),
        (GgmlType::BF16, 16, 5, 3, 704),
    ] {
        let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
        let route = moe_routes(&mut r, n, n_experts, top_k, None);
        let weights = up(g, &route.iter().map(|&(w, _)| w).collect::<Vec<_>>());
        let ids = up(g, &route.iter().map(|&(_, e)| e as f32).collect::<Vec<_>>());
        let xs = up(g, &uniform(&mut r, n * d, 1.0));
        let experts_after_product = |beside: bool| {
            let (mut ahead, mut out) = (poisoned(g, rows), poisoned(g, n * d));
            g.matmul(&x, 1, &long, &mut ahead).unwrap();
            if beside {
                g.next_beside_previous();
            }
            let (gu, dn) = (&experts.gate_up_dev, &experts.down_dev);
            g.moe_ffn(&xs, n, gu, dn, n_experts, top_k, &weights, &ids, &mut out)
                .unwrap();
            [down(g, &ahead, rows), down(g, &out, n * d)].concat()
        };
        assert_eq!(
            bits(experts_after_product(true)),
            bits(experts_after_product(false)),
            "moe_ffn {ty} n={n} beside a product"
        );
    }
}

#[test]
fn moe_ffn_reports_a_bad_expert_id_on_both_paths() {
    if gpu().is_none() {
        eprintln!("skipped: no usable GPU");
        return;
    }
    // A backend of its own: the error word is the backend's, and a test sharing one would
    // see this test's error at its next read.
    let g = &CudaBackend::new(0).unwrap();
    let mut r = rng("moe_ffn bad id");
    let (ty, n_experts, top_k) = (GgmlType::BF16, 4, 2);
    // 264 × 40: GEMVs on both paths; 256 × 192: the tensor cores (the down products on both
    // paths), where a bad id's tile gives outputs of 0.
    for (d, f) in [(264, 40), (256, 192)] {
        let tensor_cores = g.device().capability().0 >= 8 && moe_on_tensor_cores(ty, ty, d, f);
        let experts = Experts::new(g, &mut r, ty, n_experts, d, f);
        for n in [3, 13] {
            assert_eq!(
                moe_groups_pairs(n, n_experts, ty, (d, f), tensor_cores),
                n == 13
            );
            for bad in [n_experts as f32, 1.5, -1.0, f32::NAN] {
                let x = uniform(&mut r, n * d, 1.0);
                let mut route: Vec<_> = moe_routes(&mut r, n, n_experts, top_k, None)
                    .into_iter()
                    .map(|(w, e)| (w, Some(e)))
                    .collect();
                let which = r.random_range(0..n * top_k);
                route[which].1 = None;
                let weights: Vec<f32> = route.iter().map(|&(w, _)| w).collect();
                let ids: Vec<f32> = route
                    .iter()
                    .map(|&(_, e)| e.map_or(bad, |e| e as f32))
                    .collect();
                let out = experts.run(g, &x, top_k, &weights, &ids);
                // The read reports the bad id, after copying the output: the pair added
                // nothing.
                let mut got = vec![0f32; n * d];
                let err = g
                    .read(&out, &mut got)
                    .expect_err("a bad expert id must be reported");
                assert!(err.to_string().contains("expert id"), "{err}");
                let want = experts.reference(g, &x, &route, top_k);
                assert_close(
                    &format!("moe_ffn {d} × {f} n={n} with id {bad} at pair {which}"),
                    &got,
                    &want,
                    if tensor_cores { 2e-3 } else { 5e-5 },
                );
                // Reported once: the next read is clean.
                g.read(&out, &mut got).unwrap();
            }
        }
    }
}
