//! Rounded copies and Q4_K tiles that producer kernels write for the next product.

use super::*;

/// Runs `attempt` (a producer, then a product of its output; returns the product's result)
/// until the product took the producer's rounded copy: other tests queue work on the shared
/// backend in between, and the copy is then rightly ignored.
fn with_rounded_copy(g: &CudaBackend, mut attempt: impl FnMut() -> Vec<f32>) -> Vec<f32> {
    for _ in 0..50 {
        let before = g.rounded_copies_used().unwrap();
        let got = attempt();
        if g.rounded_copies_used().unwrap() > before {
            return got;
        }
    }
    panic!("the product never took the producer's rounded copy");
}

#[test]
fn rounded_copies_feed_the_next_product_exactly_and_only_while_fresh() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("rounded_copies");
    let d = 256;
    // bf16 weights at 8 rows (tensor cores from 3), Q8_0 at 20 (f16 from 17) and Q4_K at 8
    // (its tensor-core kernel from 2).
    for (ty, n, ff) in [
        (GgmlType::BF16, 8, 96),
        (GgmlType::Q8_0, 20, 96),
        (GgmlType::Q4_K, 8, 256),
    ] {
        let wo = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let gate = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let upm = g.load_matrix(&random_matrix(&mut r, ty, ff, d)).unwrap();
        let down_m = g.load_matrix(&random_matrix(&mut r, ty, d, ff)).unwrap();
        let y = up(g, &uniform(&mut r, n * d, 3.0));
        let h0 = uniform(&mut r, n * d, 2.0);
        let w = g.load_vector(&vec![1.5; d]).unwrap();
        let mut h = up(g, &h0);
        let mut x = g.alloc(n * d).unwrap();
        let mut out = g.alloc(n * ff).unwrap();
        let mut product = |src: &CudaBuffer| {
            g.matmul(src, n, &wo, &mut out).unwrap();
            down(g, &out, n * ff)
        };
        // A product of this kind first, so producers know how the next one rounds.
        product(&y);

        // residual_norm's x, then its h (no next norm): the product equals one that rounds
        // the same values itself, bit for bit.
        for with_next in [true, false] {
            let taken = with_rounded_copy(g, || {
                g.write(&h0, &mut h).unwrap();
                let next = with_next.then_some((&w, &mut x));
                g.residual_norm(&y, &w, 1e-6, n, d, &mut h, 1.0, next)
                    .unwrap();
                product(if with_next { &x } else { &h })
            });
            let again = product(if with_next { &x } else { &h });
            assert_eq!(taken, again, "{ty} residual_norm next={with_next}");
        }

        // rms_norm's output likewise.
        let taken = with_rounded_copy(g, || {
            g.rms_norm(&y, Some(&w), 1e-6, n, d, &mut x, NormOut::Write)
                .unwrap();
            product(&x)
        });
        assert_eq!(taken, product(&x), "{ty} rms_norm");

        // Written between producer and product: the copy is stale and must not be used.
        g.write(&h0, &mut h).unwrap();
        g.residual_norm(&y, &w, 1e-6, n, d, &mut h, 1.0, Some((&w, &mut x)))
            .unwrap();
        g.scale(&mut x, -2.0, n * d).unwrap();
        let after_write = product(&x);
        assert_eq!(after_write, product(&x), "{ty}: a stale copy was used");

        // The gated feed-forward's activations feed the down projection.
        let (mut g_out, mut u_out) = (g.alloc(n * ff).unwrap(), g.alloc(n * ff).unwrap());
        let mut dn = g.alloc(n * d).unwrap();
        let taken = with_rounded_copy(g, || {
            g.gelu_gated_matmul(&x, n, &gate, &upm, ff, &mut g_out, &mut u_out)
                .unwrap();
            g.matmul(&g_out, n, &down_m, &mut dn).unwrap();
            down(g, &dn, n * d)
        });
        g.matmul(&g_out, n, &down_m, &mut dn).unwrap();
        assert_eq!(taken, down(g, &dn, n * d), "{ty} gelu_gated_matmul");
    }
}

/// A norm's copy feeds each launch of a `matmul_many` over two formats (llama.cpp's Q4_K_M
/// keeps some layers' v in Q6_K beside Q4_K q and k): the second launch takes the copy the
/// first took instead of rounding the values again, and both give the bits of products that
/// round the values themselves.
#[test]
fn a_rounded_copy_feeds_each_format_of_one_matmul_many() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("rounded copy, two formats");
    let (d, n) = (512, 8);
    let shapes = [
        (GgmlType::Q4_K, 256),
        (GgmlType::Q4_K, 64),
        (GgmlType::Q6_K, 64),
    ];
    let mats: Vec<CudaMatrix> = shapes
        .iter()
        .map(|&(ty, rows)| g.load_matrix(&random_matrix(&mut r, ty, rows, d)).unwrap())
        .collect();
    let y = up(g, &uniform(&mut r, n * d, 3.0));
    let w = g.load_vector(&vec![1.5; d]).unwrap();
    let mut x = g.alloc(n * d).unwrap();
    let mut outs: Vec<CudaBuffer> = shapes
        .iter()
        .map(|&(_, rows)| g.alloc(n * rows).unwrap())
        .collect();
    let mut run = |src: &CudaBuffer| -> Vec<f32> {
        let [a, b, c] = &mut outs[..] else {
            unreachable!("three outputs")
        };
        let mut products = [(&mats[0], a), (&mats[1], b), (&mats[2], c)];
        g.matmul_many(src, n, &mut products).unwrap();
        outs.iter()
            .zip(shapes)
            .flat_map(|(o, (_, rows))| down(g, o, n * rows))
            .collect()
    };
    // Products of this kind first, so the norm knows how they round.
    run(&y);
    // Other tests queue work on the shared backend in between at times: retried until both
    // launches took the copy.
    let taken = (0..50)
        .find_map(|_| {
            let before = g.rounded_copies_used().unwrap();
            g.rms_norm(&y, Some(&w), 1e-6, n, d, &mut x, NormOut::Write)
                .unwrap();
            let got = run(&x);
            (g.rounded_copies_used().unwrap() >= before + 2).then_some(got)
        })
        .expect("both launches take the norm's rounded copy");
    assert_eq!(taken, run(&x), "the launches that took the copy");
}

/// Q4_K or Q8_0 weights for the one-token products a decode step runs on one activation row:
/// `matmul` (gemv), `matmul_many` (q, k, v-like), `gelu_gated_matmul` and `gelu_matmul_mul`,
/// with their CPU references on 16-bit activations. The outputs are allocated once: a
/// product queued right after its producer must find nothing queued in between.
struct TileProducts {
    host: Vec<HostMatrix>,
    dev: Vec<CudaMatrix>,
    other: Vec<f32>,
    other_dev: CudaBuffer,
    outs: Vec<CudaBuffer>,
}

impl TileProducts {
    /// Rows of the long product and the gated pair: more than the gated kernel's warps on
    /// tiles (2 resident blocks of 8 warps a multiprocessor: 2 112 on an H200), so its warps
    /// walk several row pairs.
    const MANY: usize = 3000;
    const ROWS: [usize; 6] = [Self::MANY, 37, 9, 9, Self::MANY, Self::MANY];

    fn new(g: &CudaBackend, r: &mut StdRng, ty: GgmlType, k: usize) -> TileProducts {
        let host: Vec<HostMatrix> = Self::ROWS
            .iter()
            .map(|&rows| random_matrix(r, ty, rows, k))
            .collect();
        let dev = host.iter().map(|m| g.load_matrix(m).unwrap()).collect();
        let other = uniform(r, Self::MANY, 2.0);
        let other_dev = up(g, &other);
        let outs = Self::ROWS.iter().map(|&n| poisoned(g, n)).collect();
        TileProducts {
            host,
            dev,
            other,
            other_dev,
            outs,
        }
    }

    /// Runs product `which` (0 matmul, 1 matmul_many, 2 gated, 3 gelu_matmul_mul, 4 matmul of
    /// a short matrix) of the one row at `x`; returns its outputs.
    fn run(&mut self, g: &CudaBackend, which: usize, x: &CudaBuffer) -> Vec<f32> {
        let d = &self.dev;
        let [o0, o1, o2, o3, o4, o5] = &mut self.outs[..] else {
            unreachable!("six outputs")
        };
        match which {
            0 => {
                g.matmul(x, 1, &d[0], o0).unwrap();
                down(g, o0, Self::MANY)
            }
            1 => {
                let mut products = [(&d[1], &mut *o1), (&d[2], &mut *o2), (&d[3], &mut *o3)];
                g.matmul_many(x, 1, &mut products).unwrap();
                [(&*o1, 37), (&*o2, 9), (&*o3, 9)]
                    .iter()
                    .flat_map(|&(o, n)| down(g, o, n))
                    .collect()
            }
            2 => {
                g.gelu_gated_matmul(x, 1, &d[4], &d[5], Self::MANY, o4, o5)
                    .unwrap();
                down(g, o4, Self::MANY)
            }
            4 => {
                g.matmul(x, 1, &d[1], o1).unwrap();
                down(g, o1, 37)
            }
            _ => {
                let from = Strided {
                    offset: 0,
                    stride: Self::MANY,
                };
                g.gelu_matmul_mul(x, 1, &d[0], Self::MANY, &self.other_dev, from, o0, o1)
                    .unwrap();
                down(g, o0, Self::MANY)
            }
        }
    }

    /// The CPU reference of `run(which)` for the activation row `x`.
    fn want(&self, which: usize, x: &[f32]) -> Vec<f32> {
        let xs = as_16_bit(x);
        let mm = |i: usize| reference::matmul(&xs, 1, &self.host[i]).unwrap();
        match which {
            0 => mm(0),
            1 => (1..4).flat_map(mm).collect(),
            2 => reference::gelu_tanh_mul(&mm(4), &mm(5)),
            3 => reference::gelu_tanh_mul(&mm(0), &self.other),
            _ => mm(1),
        }
    }
}

#[test]
fn q4k_tiles_from_norms_feed_one_token_products() {
    let g = gpu_or_skip!();
    let mut r = rng("q4k_tiles");
    // One unit; 17 and 32 (the short matrix's rows shared by 2 and 4 warps; 32 the widest row
    // a norm writes as tiles). Q4_K and Q8_0 products read the same tiles.
    let cases = [256, 4352, 8192]
        .into_iter()
        .flat_map(|k| [(GgmlType::Q4_K, k), (GgmlType::Q8_0, k)]);
    for (ty, k) in cases {
        let mut p = TileProducts::new(g, &mut r, ty, k);
        let y = up(g, &uniform(&mut r, k, 3.0));
        let h0 = uniform(&mut r, k, 2.0);
        let w = g.load_vector(&uniform(&mut r, k, 1.0)).unwrap();
        let (mut h, mut x) = (up(g, &h0), g.alloc(k).unwrap());
        for which in 0..5 {
            // A product of this kind first, so producers know how the next one reads.
            p.run(g, which, &x);
            // residual_norm's x and rms_norm's output (residual_norm without a next norm
            // writes no tiles): the product that takes the tiles equals the one that stages
            // the same values itself, and the CPU reference on them.
            for with_residual in [true, false] {
                let what = format!("{ty} k={k} product {which} residual_norm {with_residual}");
                let mut normed = Vec::new();
                let taken = with_rounded_copy(g, || {
                    g.write(&h0, &mut h).unwrap();
                    if with_residual {
                        g.residual_norm(&y, &w, 1e-6, 1, k, &mut h, 1.0, Some((&w, &mut x)))
                    } else {
                        g.rms_norm(&y, Some(&w), 1e-6, 1, k, &mut x, NormOut::Write)
                    }
                    .unwrap();
                    let got = p.run(g, which, &x);
                    normed = down(g, &x, k);
                    got
                });
                let staged = p.run(g, which, &x);
                assert_close(&format!("{what}: tiles vs staged"), &taken, &staged, 1e-6);
                assert_close(&what, &taken, &p.want(which, &normed), 2e-5);
            }
        }
    }
}

/// Decode attention (one query row a sequence, split-K) writes the rounded copy of its output
/// that the o product then takes, for bf16 weights (cuBLAS from 3 rows) and Q8_0 / Q4_K ones
/// (their tensor-core kernel): the same bits as the product rounding the output itself. Short
/// contexts take one split (the partial kernel writes the output), a long one several (the
/// combine kernel does).
#[test]
fn decode_attention_output_feeds_the_o_product_rounded_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("decode_attention_rounded");
    for (ty, context) in [
        (GgmlType::BF16, 20),
        (GgmlType::Q8_0, 20),
        (GgmlType::Q4_K, 20),
        (GgmlType::BF16, 3_000),
    ] {
        // Eight sequences at positions near `context`, one query row each.
        let seqs: Vec<Vec<u32>> = (0..8).map(|i| vec![(context + 7 * i) as u32]).collect();
        let what = format!("{ty} context {context}");
        o_product_takes_attention_copy(g, &mut r, &seqs, ty, 512, &what);
    }
}

#[test]
fn flash_attention_output_feeds_the_o_product_rounded_exactly() {
    let g = gpu_with_cublas_or_skip!();
    let mut r = rng("flash_rounded");
    let seqs: Vec<Vec<u32>> = vec![(0..40).collect(), (100..150).collect()];
    assert!(seqs.iter().all(|s| s.len() >= ATTN_FLASH_MIN_ROWS));
    o_product_takes_attention_copy(g, &mut r, &seqs, GgmlType::BF16, 384, "flash");
}

/// Attention (head dim 256, GQA 8/2, blocks of 16) of random queries at the positions `seqs`
/// over random caches, then the o product with a random `[d, 2 048]` matrix stored as `ty` on
/// its output: the product takes the attention's rounded copy and gets the bits it gets
/// rounding the output itself.
fn o_product_takes_attention_copy(
    g: &CudaBackend,
    r: &mut StdRng,
    seqs: &[Vec<u32>],
    ty: GgmlType,
    d: usize,
    what: &str,
) {
    let (hd, nh, nkv, bs) = (256, 8, 2, 16);
    let (tables, width, n_blocks) = random_tables(r, seqs, bs, None);
    let positions: Vec<u32> = seqs.iter().flatten().copied().collect();
    let mut seq_start = vec![0u32];
    for s in seqs {
        seq_start.push(seq_start.last().unwrap() + s.len() as u32);
    }
    let layout = KvLayout {
        block_size: bs,
        positions: &positions,
        seq_start: &seq_start,
        block_tables: &tables,
        table_width: width,
    };
    let n = positions.len();
    let row = nkv * hd;
    let kc = up(g, &uniform(r, n_blocks * bs * row, 1.0));
    let vc = up(g, &uniform(r, n_blocks * bs * row, 1.0));
    let q = up(g, &uniform(r, n * nh * hd, 1.0));
    let spec = AttnSpec {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let wo = g.load_matrix(&random_matrix(r, ty, d, nh * hd)).unwrap();
    let mut attn = g.alloc(n * nh * hd).unwrap();
    let mut proj = g.alloc(n * d).unwrap();
    // A product of this kind first, so the attention knows how the next one rounds.
    g.matmul(&q, n, &wo, &mut proj).unwrap();
    let taken = with_rounded_copy(g, || {
        g.attention(&q, &kc, &vc, &spec, &layout, &mut attn)
            .unwrap();
        g.matmul(&attn, n, &wo, &mut proj).unwrap();
        down(g, &proj, n * d)
    });
    g.matmul(&attn, n, &wo, &mut proj).unwrap();
    assert_eq!(
        taken,
        down(g, &proj, n * d),
        "{what}: o product from the rounded copy"
    );
}
