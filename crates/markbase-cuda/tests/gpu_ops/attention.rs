//! RoPE, KV writes and attention (split-K, fused, flash) against the CPU reference.

use super::*;

#[test]
fn rope_write_kv_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("rope_write_kv");
    // (head_dim, rotated pairs, query heads, kv heads): Gemma 3 270M, Gemma 4 sliding, full.
    // Values stored as they are (Gemma 3) and through v_norm (Gemma 4).
    for ((hd, pairs, heads, kvh), v_norm) in [
        ((256, 128, 4, 1), false),
        ((256, 128, 8, 2), true),
        ((512, 64, 8, 1), true),
        ((512, 64, 8, 1), false),
    ] {
        let n = 3;
        let row = kvh * hd;
        let positions: Vec<u32> = (0..n).map(|_| r.random_range(0..8192)).collect();
        let slots_total = 2 * n + 1;
        let mut slots: Vec<u32> = (0..slots_total as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, r.random_range(0..=i));
        }
        slots.truncate(n);
        let q = uniform(&mut r, n * heads * hd, 2.0);
        let k = uniform(&mut r, n * row, 2.0);
        let v = uniform(&mut r, n * row, 2.0);
        let (qn, kn) = (uniform(&mut r, hd, 1.0), uniform(&mut r, hd, 1.0));
        let rope = Rope {
            theta: 1_000_000.0,
            linear_factor: 1.0,
            rotated_pairs: pairs,
        };
        let want_q = reference::head_norm_rope(&q, heads, hd, Some((&qn, 1e-6)), &rope, &positions);
        let want_k = reference::head_norm_rope(&k, kvh, hd, Some((&kn, 1e-6)), &rope, &positions);
        let want_v = if v_norm {
            reference::rms_norm(&v, None, 1e-6, hd)
        } else {
            v.clone()
        };
        let (mut qb, mut kb, vb) = (up(g, &q), up(g, &k), up(g, &v));
        let mut scratch = g.alloc(v.len()).unwrap();
        fn value_rows<'a>(
            v_norm: bool,
            raw: &'a CudaBuffer,
            scratch: &'a mut CudaBuffer,
        ) -> ValueRows<'a, CudaBuffer> {
            match v_norm {
                true => ValueRows::Normed { raw, scratch },
                false => ValueRows::AsIs(raw),
            }
        }
        let mut kc = poisoned(g, slots_total * row);
        let mut vc = poisoned(g, slots_total * row);
        let spec = AttnSpec {
            n_heads: heads,
            n_kv_heads: kvh,
            head_dim: hd,
            scale: 1.0,
            window: None,
            softcap: None,
        };
        let (qnb, knb) = (g.load_vector(&qn).unwrap(), g.load_vector(&kn).unwrap());
        g.rope_write_kv(
            &mut qb,
            &mut kb,
            value_rows(v_norm, &vb, &mut scratch),
            &spec,
            (&qnb, &knb, 1e-6),
            &rope,
            &positions,
            &slots,
            &mut kc,
            &mut vc,
        )
        .unwrap();
        let what = format!("rope_write_kv hd={hd} heads={heads}/{kvh} v_norm={v_norm}");
        assert_close(&what, &down(g, &qb, q.len()), &want_q, 1e-5);
        assert_close(&what, &down(g, &kb, k.len()), &want_k, 1e-5);
        let (kc, vc) = (
            down(g, &kc, slots_total * row),
            down(g, &vc, slots_total * row),
        );
        for (t, &s) in slots.iter().enumerate() {
            let cache_row = s as usize * row..(s as usize + 1) * row;
            let token_row = t * row..(t + 1) * row;
            assert_close(
                &what,
                &kc[cache_row.clone()],
                &want_k[token_row.clone()],
                1e-5,
            );
            assert_close(&what, &vc[cache_row], &want_v[token_row], 1e-5);
        }
        // A slot past the cache is refused.
        let mut bad = slots.clone();
        bad[0] = slots_total as u32;
        let mut kc2 = g.alloc(slots_total * row).unwrap();
        let mut vc2 = g.alloc(slots_total * row).unwrap();
        let err = g.rope_write_kv(
            &mut qb,
            &mut kb,
            value_rows(v_norm, &vb, &mut scratch),
            &spec,
            (&qnb, &knb, 1e-6),
            &rope,
            &positions,
            &bad,
            &mut kc2,
            &mut vc2,
        );
        assert!(
            err.is_err(),
            "{what}: a slot past the cache must be refused"
        );
    }
}

#[test]
fn head_norm_rope_matches_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("head_norm_rope");
    // (head_dim, rotated pairs, θ, linear factor): default, proportional (partial), linear.
    for (hd, pairs, theta, lf) in [
        (32, 16, 10_000.0, 1.0),
        (64, 8, 1_000_000.0, 1.0),
        (256, 128, 1_000_000.0, 8.0),
        (512, 64, 1_000_000.0, 1.0),
    ] {
        let (heads, n) = (4, 3);
        let positions: Vec<u32> = (0..n).map(|_| r.random_range(0..8192)).collect();
        let x = uniform(&mut r, n * heads * hd, 2.0);
        let w = uniform(&mut r, hd, 1.0);
        let wb = g.load_vector(&w).unwrap();
        let rope = Rope {
            theta,
            linear_factor: lf,
            rotated_pairs: pairs,
        };
        for normed in [false, true] {
            let norm = normed.then_some((&w[..], 1e-6f32));
            let want = reference::head_norm_rope(&x, heads, hd, norm, &rope, &positions);
            let mut xb = up(g, &x);
            g.head_norm_rope(
                &mut xb,
                heads,
                hd,
                normed.then_some((&wb, 1e-6)),
                &rope,
                &positions,
            )
            .unwrap();
            let got = down(g, &xb, x.len());
            assert_close(&format!("rope hd={hd} norm={normed}"), &got, &want, 1e-5);
        }
    }
}

#[test]
fn write_kv_then_attention_match_reference() {
    let g = gpu_or_skip!();
    let mut r = rng("attention");
    let cases: Vec<AttnCase> = vec![
        // Long decode over a full cache: several key splits.
        (256, 8, 2, None, None, 16, vec![vec![2999]]),
        // Sliding-window decode, one KV head (Gemma 3 270M-like); old blocks unmapped.
        (512, 8, 1, Some(512), None, 16, vec![vec![2000]]),
        // A prefill chunk with a score soft-cap beside an empty sequence and a second chunk.
        (
            32,
            4,
            2,
            Some(8),
            Some(50.0),
            4,
            vec![(100..120).collect(), vec![], vec![5, 6, 7]],
        ),
        // A causal prefill from position 0.
        (64, 4, 4, None, None, 32, vec![(0..40).collect()]),
        // Prefill chunks long enough for the batched products: a sliding window over a
        // GQA cache, two full-attention sequences of head dim 512, a soft-capped window that
        // starts inside the chunk.
        (256, 8, 2, Some(512), None, 16, vec![(600..700).collect()]),
        (
            512,
            8,
            1,
            None,
            None,
            16,
            vec![(0..48).collect(), (200..240).collect()],
        ),
        (
            128,
            4,
            2,
            Some(64),
            Some(30.0),
            16,
            vec![(10..90).collect()],
        ),
        // Head dim 128: a decode batch of four sequences of different lengths.
        (
            128,
            4,
            2,
            None,
            Some(30.0),
            16,
            vec![vec![150], vec![151], vec![7], vec![300]],
        ),
    ];
    for (hd, nh, nkv, window, softcap, bs, seqs) in cases {
        let row = nkv * hd;
        let (tables, width, n_blocks) = random_tables(&mut r, &seqs, bs, window);
        let slots_total = n_blocks * bs;
        let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
        let mut seq_start = vec![0u32];
        for p in &seqs {
            seq_start.push(seq_start.last().unwrap() + p.len() as u32);
        }
        let layout = KvLayout {
            block_size: bs,
            positions: &positions,
            seq_start: &seq_start,
            block_tables: &tables,
            table_width: width,
        };
        let n = positions.len();
        let kc = uniform(&mut r, slots_total * row, 1.0);
        let vc = uniform(&mut r, slots_total * row, 1.0);
        let q = uniform(&mut r, n * nh * hd, 1.0);
        let spec = AttnSpec {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
            softcap,
        };
        // Every other slot starts poisoned and is filled through write_kv.
        let slots: Vec<u32> = (0..slots_total as u32).step_by(2).collect();
        let (mut k0, mut v0) = (kc.clone(), vc.clone());
        for &s in &slots {
            k0[s as usize * row..][..row].fill(f32::NAN);
            v0[s as usize * row..][..row].fill(f32::NAN);
        }
        let (mut kb, mut vb) = (up(g, &k0), up(g, &v0));
        let ks: Vec<f32> = slots
            .iter()
            .flat_map(|&s| kc[s as usize * row..][..row].to_vec())
            .collect();
        let vs: Vec<f32> = slots
            .iter()
            .flat_map(|&s| vc[s as usize * row..][..row].to_vec())
            .collect();
        g.write_kv(&up(g, &ks), &up(g, &vs), row, &slots, &mut kb, &mut vb)
            .unwrap();
        assert_eq!(down(g, &kb, slots_total * row), kc, "write_kv K");
        assert_eq!(down(g, &vb, slots_total * row), vc, "write_kv V");
        let want = reference::attention(&q, &kc, &vc, &spec, &layout);
        let mut out = poisoned(g, n * nh * hd);
        g.attention(&up(g, &q), &kb, &vb, &spec, &layout, &mut out)
            .unwrap();
        let got = down(g, &out, n * nh * hd);
        // Steps whose sequences all bring many rows take the flash kernel (f16 inputs to the
        // tensor cores, 11-bit mantissas); the split-K kernel sums in f32.
        let products = seqs
            .iter()
            .all(|p| p.is_empty() || p.len() >= ATTN_FLASH_MIN_ROWS)
            && seqs.iter().any(|p| !p.is_empty());
        let tol = if products { 5e-3 } else { 1e-5 };
        assert_close(&format!("attention {spec:?} bs={bs}"), &got, &want, tol);
    }
}

/// `rope_attention` on `be` from host data (output poisoned with NaN first): the raw queries,
/// with `new_kv = Some(normed)` the raw keys and values (normed or as they are) going to cache
/// rows `slots`; returns the output and both caches.
#[allow(clippy::too_many_arguments)]
fn run_rope_attention<B: Backend>(
    be: &B,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (q_norm, k_norm): (&[f32], &[f32]),
    new_kv: Option<bool>,
    rope: &Rope,
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    slots: &[u32],
    (k_cache, v_cache): (&[f32], &[f32]),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let buf = |x: &[f32]| {
        let mut b = be.alloc(x.len()).unwrap();
        be.write(x, &mut b).unwrap();
        b
    };
    let get = |b: &B::Buffer, len: usize| {
        let mut h = vec![0f32; len];
        be.read(b, &mut h).unwrap();
        h
    };
    let (mut qb, mut kb, vb) = (buf(q), buf(k), buf(v));
    let mut scratch = be.alloc(v.len()).unwrap();
    let (mut kc, mut vc) = (buf(k_cache), buf(v_cache));
    let mut out = buf(&vec![f32::NAN; q.len()]);
    let (qn, kn) = (
        be.load_vector(q_norm).unwrap(),
        be.load_vector(k_norm).unwrap(),
    );
    let new = new_kv.map(|normed| NewKv {
        k: &mut kb,
        v: match normed {
            true => ValueRows::Normed {
                raw: &vb,
                scratch: &mut scratch,
            },
            false => ValueRows::AsIs(&vb),
        },
        k_norm: &kn,
        slots,
    });
    be.rope_attention(
        &mut qb, &qn, 1e-6, new, rope, spec, layout, &mut kc, &mut vc, &mut out,
    )
    .unwrap();
    (
        get(&out, q.len()),
        get(&kc, k_cache.len()),
        get(&vc, v_cache.len()),
    )
}

/// `rope_attention` (one fused kernel on a decode step) against the CPU backend's steps
/// (`rope_write_kv` or `head_norm_rope`, then `attention`): decode steps of several sequences
/// (one at position 0, an empty one, one in the first splits and one long enough for several
/// key splits) over a cache of random rows, head dims 256 and 512 (proportional RoPE), 8 query
/// heads over 2 or 1 KV heads, full causal, a sliding window with a soft-cap and a window of
/// one key (only the new key), values normed and as they are, and a KV-shared layer (no new
/// keys); a prefill step beside a decode row takes the unfused path. The cache rows the new
/// keys go to start as NaN, so a block that read them from the cache fails; every other row
/// must come back unchanged.
#[test]
fn rope_attention_matches_cpu_backend() {
    let g = gpu_or_skip!();
    let cpu = markbase_cpu::CpuBackend::new(2).unwrap();
    let mut r = rng("rope_attention");
    let bs = 16;
    let decode = vec![vec![0], vec![], vec![r.random_range(1..700)], vec![2999]];
    let prefill = vec![vec![40, 41, 42], vec![r.random_range(1..300)]];
    for (hd, pairs) in [(256, 128), (512, 64)] {
        for kvh in [2, 1] {
            for window in [None, Some(512), Some(1)] {
                for new_kv in [Some(true), Some(false), None] {
                    let mut steps = vec![&decode];
                    if kvh == 2 && window.is_none() {
                        steps.push(&prefill);
                    }
                    for seqs in steps {
                        let row = kvh * hd;
                        let (tables, width, n_blocks) = random_tables(&mut r, seqs, bs, window);
                        let slots_total = n_blocks * bs;
                        let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
                        let mut seq_start = vec![0u32];
                        let mut slots = Vec::new();
                        for (s, ps) in seqs.iter().enumerate() {
                            seq_start.push(seq_start.last().unwrap() + ps.len() as u32);
                            for &p in ps {
                                let block = tables[s * width + p as usize / bs];
                                slots.push(block * bs as u32 + p % bs as u32);
                            }
                        }
                        let layout = KvLayout {
                            block_size: bs,
                            positions: &positions,
                            seq_start: &seq_start,
                            block_tables: &tables,
                            table_width: width,
                        };
                        let n = positions.len();
                        let spec = AttnSpec {
                            n_heads: 8,
                            n_kv_heads: kvh,
                            head_dim: hd,
                            scale: 1.0 / (hd as f32).sqrt(),
                            window,
                            softcap: window.filter(|&w| w > 1).map(|_| 30.0),
                        };
                        let rope = Rope {
                            theta: 1_000_000.0,
                            linear_factor: 1.0,
                            rotated_pairs: pairs,
                        };
                        let mut kc = uniform(&mut r, slots_total * row, 1.0);
                        let mut vc = uniform(&mut r, slots_total * row, 1.0);
                        let written: &[u32] = if new_kv.is_some() { &slots } else { &[] };
                        for &s in written {
                            kc[s as usize * row..][..row].fill(f32::NAN);
                            vc[s as usize * row..][..row].fill(f32::NAN);
                        }
                        let q = uniform(&mut r, n * spec.n_heads * hd, 2.0);
                        let k = uniform(&mut r, n * row, 2.0);
                        let v = uniform(&mut r, n * row, 2.0);
                        let (qn, kn) = (uniform(&mut r, hd, 1.0), uniform(&mut r, hd, 1.0));
                        let what = format!(
                            "rope_attention hd={hd} heads=8/{kvh} window={window:?} \
                             new_kv(v_norm)={new_kv:?} rows={seqs:?}"
                        );
                        let one_row_each = seqs.iter().all(|p| p.len() <= 1);
                        assert_eq!(
                            g.fuses_rope_attention(
                                &spec,
                                &rope,
                                &layout,
                                new_kv.map(|_| &slots[..])
                            ),
                            one_row_each,
                            "{what}: fused exactly on decode steps"
                        );
                        let inputs = (&q[..], &k[..], &v[..]);
                        let caches = (&kc[..], &vc[..]);
                        let want = run_rope_attention(
                            &cpu,
                            inputs,
                            (&qn, &kn),
                            new_kv,
                            &rope,
                            &spec,
                            &layout,
                            &slots,
                            caches,
                        );
                        let got = run_rope_attention(
                            g,
                            inputs,
                            (&qn, &kn),
                            new_kv,
                            &rope,
                            &spec,
                            &layout,
                            &slots,
                            caches,
                        );
                        assert_close(&what, &got.0, &want.0, 1e-4);
                        for (name, got_c, want_c) in
                            [("K", &got.1, &want.1), ("V", &got.2, &want.2)]
                        {
                            for &s in written {
                                let rows = s as usize * row..(s as usize + 1) * row;
                                assert_close(
                                    &format!("{what}: {name} cache row {s}"),
                                    &got_c[rows.clone()],
                                    &want_c[rows],
                                    1e-5,
                                );
                            }
                            let others = |c: &[f32]| -> Vec<u32> {
                                c.chunks(row)
                                    .enumerate()
                                    .filter(|(i, _)| !written.contains(&(*i as u32)))
                                    .flat_map(|(_, x)| x.iter().map(|v| v.to_bits()))
                                    .collect()
                            };
                            assert!(
                                others(got_c) == others(want_c),
                                "{what}: {name} cache rows other than the new ones changed"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Cached keys and values beyond f16's range (±65 504): the flash kernel rounds them to f16
/// saturating, so a prefill's output stays finite and equals the result for values clamped to
/// that range (an infinity would have turned its rows into NaN).
#[test]
fn flash_attention_saturates_values_beyond_f16() {
    let g = gpu_or_skip!();
    let mut r = rng("attention_f16_range");
    let (hd, nh, nkv, bs) = (256, 8, 2, 16);
    let seqs = vec![(0..64).collect::<Vec<u32>>()];
    let row = nkv * hd;
    let (tables, width, n_blocks) = random_tables(&mut r, &seqs, bs, None);
    let slots_total = n_blocks * bs;
    let positions = seqs[0].clone();
    let seq_start = [0, positions.len() as u32];
    let layout = KvLayout {
        block_size: bs,
        positions: &positions,
        seq_start: &seq_start,
        block_tables: &tables,
        table_width: width,
    };
    let n = positions.len();
    let spec = AttnSpec {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let q = uniform(&mut r, n * nh * hd, 1.0);
    let kc = uniform(&mut r, slots_total * row, 1.0);
    let mut vc = uniform(&mut r, slots_total * row, 1.0);
    // One value in 37 far past f16's range, either sign.
    for (i, v) in vc.iter_mut().enumerate().step_by(37) {
        *v = if i % 2 == 0 { 1.0e5 } else { -3.0e6 };
    }
    let clamped: Vec<f32> = vc.iter().map(|v| v.clamp(-65_504.0, 65_504.0)).collect();
    let want = reference::attention(&q, &kc, &clamped, &spec, &layout);
    let attend = |k: &[f32], v: &[f32]| {
        let mut out = poisoned(g, n * nh * hd);
        g.attention(&up(g, &q), &up(g, k), &up(g, v), &spec, &layout, &mut out)
            .unwrap();
        down(g, &out, n * nh * hd)
    };
    assert_close(
        "flash attention, values past f16",
        &attend(&kc, &vc),
        &want,
        5e-3,
    );
    // Keys past the range as well: scores stay finite, so every output does.
    let mut kbig = kc.clone();
    for k in kbig.iter_mut().step_by(41) {
        *k = 2.0e5;
    }
    let got = attend(&kbig, &vc);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "flash attention with keys past f16: non-finite outputs"
    );
}

#[test]
fn attention_rejects_bad_specs_and_layouts() {
    let g = gpu_or_skip!();
    let b = g.alloc(1024).unwrap();
    let mut o = g.alloc(1024).unwrap();
    let layout = |positions: &'static [u32], tables: &'static [u32]| KvLayout {
        block_size: 4,
        positions,
        seq_start: &[0, 1],
        block_tables: tables,
        table_width: tables.len(),
    };
    // Unsupported head dims are an error, not a wrong answer.
    let mut spec = AttnSpec {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 48,
        scale: 1.0,
        window: None,
        softcap: None,
    };
    assert!(g
        .attention(&b, &b, &b, &spec, &layout(&[0], &[0]), &mut o)
        .is_err());
    // A 1024-float cache of 32-wide slots holds 8 blocks of 4.
    spec.head_dim = 32;
    g.attention(&b, &b, &b, &spec, &layout(&[5], &[0, 7]), &mut o)
        .unwrap();
    // A block outside the cache, a position beyond its table, bad sequence starts.
    for bad in [layout(&[5], &[0, 8]), layout(&[9], &[0, 1])] {
        assert!(g.attention(&b, &b, &b, &spec, &bad, &mut o).is_err());
    }
    let mut split = layout(&[1], &[0]);
    split.seq_start = &[0, 2];
    assert!(g.attention(&b, &b, &b, &spec, &split, &mut o).is_err());
    g.read(&o, &mut [0f32; 1]).unwrap();
}
