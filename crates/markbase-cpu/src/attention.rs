//! Causal / sliding-window attention with GQA over a paged KV cache.
//!
//! A task is a tile of up to four consecutive tokens and the query heads of one KV head (for
//! decode, a slice of those heads when whole groups would leave threads idle): its query
//! vectors — up to [`MAX_Q`] — visit the union of their visible keys (the window, for sliding
//! layers) in tiles of [`KEY_TILE`] with an online softmax, each query masking the keys it
//! does not see. A key or value row is fetched from memory once per tile for all the task's
//! queries, so prefill reads the cache a quarter as often as one token at a time would. On
//! AVX2 the scores take eight dot products (4 queries × 2 keys) per pass over the head
//! dimension and the weighted sum of values keeps a 16-wide slice of four queries' outputs in
//! registers while the tile's values stream past. The portable path does one query at a time.
//! A task's tokens belong to one sequence, whose block table maps key positions to cache slots.

use markbase_core::backend::{first_visible_key, AttnSpec, KvLayout};

use crate::kernels::Isa;
use crate::pool::{Pool, SendPtr};

/// Keys scored at a time.
const KEY_TILE: usize = 32;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 512;
/// Most query vectors in one task.
const MAX_Q: usize = 16;
/// Most tokens in one task.
const MAX_TOKENS: usize = 4;

/// Attention per [`AttnSpec`] and [`KvLayout`]; sizes and block ids are checked by the caller.
pub fn attention(
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    out: &mut [f32],
) {
    attention_with(Isa::detect(), pool, q, k_cache, v_cache, spec, layout, out)
}

/// [`attention`] with the kernels written for `isa` (portable ones if this CPU lacks it).
#[allow(clippy::too_many_arguments)]
fn attention_with(
    isa: Isa,
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    layout: &KvLayout<'_>,
    out: &mut [f32],
) {
    let positions = layout.positions;
    let (hd, n) = (spec.head_dim, positions.len());
    let group = spec.n_heads / spec.n_kv_heads;
    // Heads per task: the whole group, unless that leaves threads idle (decode).
    let parts = if n * spec.n_kv_heads >= 2 * pool.threads() {
        1
    } else {
        pool.threads().min(group)
    };
    let per_part = group.div_ceil(parts).min(MAX_Q);
    let parts = group.div_ceil(per_part);
    // Tokens per task: as many as fit in MAX_Q queries, while every thread still gets work.
    let mut tokens = (MAX_Q / per_part).clamp(1, MAX_TOKENS);
    while tokens > 1 && n.div_ceil(tokens) * spec.n_kv_heads * parts < 4 * pool.threads() {
        tokens /= 2;
    }
    let fast = cfg!(target_arch = "x86_64") && isa.runs_avx2();
    let fast = fast && hd.is_multiple_of(16);
    let (qp, op) = (SendPtr(q.as_ptr().cast_mut()), SendPtr(out.as_mut_ptr()));
    let tasks = n.div_ceil(tokens) * spec.n_kv_heads * parts;
    pool.run(tasks, &|c| {
        let (tile, rest) = (c / (spec.n_kv_heads * parts), c % (spec.n_kv_heads * parts));
        let (kvh, part) = (rest / parts, rest % parts);
        let first = kvh * group + part * per_part;
        let heads = per_part.min((kvh + 1) * group - first);
        let (t0, t1) = (tile * tokens, ((tile + 1) * tokens).min(n));
        // Tokens share a task only at consecutive positions of one sequence (a chunk).
        let seq_of = |t: usize| layout.seq_start.partition_point(|&st| st as usize <= t) - 1;
        let together =
            seq_of(t0) == seq_of(t1 - 1) && positions[t0..t1].windows(2).all(|w| w[1] == w[0] + 1);
        let runs: &[(usize, usize)] = &[(t0, t1)];
        let singles = (t0..t1).map(|t| (t, t + 1));
        let mut each = |(a, b): (usize, usize)| {
            let mut qs = Queries::default();
            for (t, &p) in positions.iter().enumerate().take(b).skip(a) {
                let p = p as usize;
                let lo = first_visible_key(p, spec.window);
                for h in first..first + heads {
                    let at = (t * spec.n_heads + h) * hd;
                    // SAFETY: `at + hd` is inside `q` and `out` (sizes checked by the
                    // caller); tasks cover disjoint (token, head) rows of `out`.
                    qs.push(
                        unsafe { qp.get().add(at) },
                        unsafe { op.get().add(at) },
                        lo,
                        p,
                    );
                }
            }
            let s = seq_of(a);
            let job = Job {
                k_cache,
                v_cache,
                spec,
                koff: kvh * hd,
                table: &layout.block_tables[s * layout.table_width..][..layout.table_width],
                block_size: layout.block_size,
            };
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: AVX2 and FMA are available; hd is a multiple of 16 and at most
                // MAX_HEAD_DIM; the query and output rows are valid (above).
                unsafe { avx2::run(&job, &qs) };
                return;
            }
            for i in 0..qs.n {
                // SAFETY: as above.
                unsafe { query_portable(&job, &qs, i) };
            }
        };
        if together {
            runs.iter().copied().for_each(&mut each);
        } else {
            singles.for_each(&mut each);
        }
    });
}

/// The query vectors of one task, with their visible key ranges `lo..=p`.
struct Queries {
    n: usize,
    q: [*const f32; MAX_Q],
    out: [*mut f32; MAX_Q],
    lo: [usize; MAX_Q],
    p: [usize; MAX_Q],
}

impl Default for Queries {
    fn default() -> Self {
        Queries {
            n: 0,
            q: [std::ptr::null(); MAX_Q],
            out: [std::ptr::null_mut(); MAX_Q],
            lo: [0; MAX_Q],
            p: [0; MAX_Q],
        }
    }
}

impl Queries {
    fn push(&mut self, q: *const f32, out: *mut f32, lo: usize, p: usize) {
        let i = self.n;
        (self.q[i], self.out[i], self.lo[i], self.p[i]) = (q, out, lo, p);
        self.n += 1;
    }

    /// First and last key positions any query sees.
    fn span(&self) -> (usize, usize) {
        let lo = self.lo[..self.n].iter().copied().min().unwrap_or(0);
        let p = self.p[..self.n].iter().copied().max().unwrap_or(0);
        (lo, p)
    }
}

/// The cache side of a task: the KV head's rows of one sequence.
struct Job<'a> {
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    spec: &'a AttnSpec,
    /// Offset of the KV head within a cache slot.
    koff: usize,
    /// The sequence's block table.
    table: &'a [u32],
    /// Slots per block.
    block_size: usize,
}

impl Job<'_> {
    /// Cache slot of key position `j`.
    fn slot(&self, j: usize) -> usize {
        self.table[j / self.block_size] as usize * self.block_size + j % self.block_size
    }

    /// Key row of position `j`.
    fn key(&self, j: usize) -> &[f32] {
        let hd = self.spec.head_dim;
        &self.k_cache[self.slot(j) * self.spec.n_kv_heads * hd + self.koff..][..hd]
    }

    /// Value row of position `j`.
    fn value(&self, j: usize) -> &[f32] {
        let hd = self.spec.head_dim;
        &self.v_cache[self.slot(j) * self.spec.n_kv_heads * hd + self.koff..][..hd]
    }

    /// A raw score scaled and soft-capped.
    fn finish_score(&self, s: f32) -> f32 {
        let v = s * self.spec.scale;
        match self.spec.softcap {
            Some(cap) => cap * (v / cap).tanh(),
            None => v,
        }
    }
}

/// Query `i` of `qs`, one key at a time (the portable path).
///
/// # Safety
/// The query's input and output rows hold `head_dim` values and the output is not aliased.
unsafe fn query_portable(job: &Job, qs: &Queries, i: usize) {
    let hd = job.spec.head_dim;
    let qrow = std::slice::from_raw_parts(qs.q[i], hd);
    let o = std::slice::from_raw_parts_mut(qs.out[i], hd);
    let mut acc = [0f32; MAX_HEAD_DIM];
    let acc = &mut acc[..hd];
    let mut scores = [0f32; KEY_TILE];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for j0 in (qs.lo[i]..=qs.p[i]).step_by(KEY_TILE) {
        let nk = KEY_TILE.min(qs.p[i] + 1 - j0);
        let mut tile_max = f32::NEG_INFINITY;
        for (jj, s) in scores[..nk].iter_mut().enumerate() {
            *s = job.finish_score(dot(qrow, job.key(j0 + jj)));
            tile_max = tile_max.max(*s);
        }
        if tile_max > max {
            let r = (max - tile_max).exp();
            sum *= r;
            acc.iter_mut().for_each(|a| *a *= r);
            max = tile_max;
        }
        for (jj, s) in scores[..nk].iter().enumerate() {
            let e = (s - max).exp();
            sum += e;
            let vrow = job.value(j0 + jj);
            acc.iter_mut().zip(vrow).for_each(|(a, v)| *a += e * v);
        }
    }
    let inv = 1.0 / sum;
    o.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = a * inv);
}

/// Plain f32 dot product (the compiler vectorises it).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    s.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Safety contract: the CPU has AVX2 and FMA; the head dimension is a multiple of 16 and
    //! at most [`MAX_HEAD_DIM`]; the query and output rows of the task are valid.

    use std::arch::x86_64::*;

    use super::{Job, Queries, KEY_TILE, MAX_HEAD_DIM, MAX_Q};
    use crate::kernels::vmath::avx2::{exp, hsum};

    /// Raw scores of queries `q` (H of them) against keys `k0` and `k1`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores<const H: usize>(
        q: &[*const f32; H],
        k0: *const f32,
        k1: *const f32,
        hd: usize,
    ) -> [[f32; 2]; H] {
        let mut a = [[_mm256_setzero_ps(); 2]; H];
        for d in (0..hd).step_by(8) {
            let kv0 = _mm256_loadu_ps(k0.add(d));
            let kv1 = _mm256_loadu_ps(k1.add(d));
            for (a, q) in a.iter_mut().zip(q) {
                let qv = _mm256_loadu_ps(q.add(d));
                a[0] = _mm256_fmadd_ps(qv, kv0, a[0]);
                a[1] = _mm256_fmadd_ps(qv, kv1, a[1]);
            }
        }
        let mut s = [[0f32; 2]; H];
        for (s, a) in s.iter_mut().zip(&a) {
            *s = [hsum(a[0]), hsum(a[1])];
        }
        s
    }

    /// `acc[i][d..d + 16] += Σ_jj w[i][jj] · v[jj][d..d + 16]` for the H queries from `i0`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_values<const H: usize>(
        acc: &mut [[f32; MAX_HEAD_DIM]; MAX_Q],
        w: &[[f32; KEY_TILE]; MAX_Q],
        i0: usize,
        v: &[*const f32],
        d: usize,
    ) {
        let mut a: [[__m256; 2]; H] = std::array::from_fn(|h| {
            let p = acc[i0 + h][d..].as_ptr();
            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
        });
        for (jj, v) in v.iter().enumerate() {
            let (v0, v1) = (_mm256_loadu_ps(v.add(d)), _mm256_loadu_ps(v.add(d + 8)));
            for (h, a) in a.iter_mut().enumerate() {
                let wv = _mm256_set1_ps(w[i0 + h][jj]);
                a[0] = _mm256_fmadd_ps(wv, v0, a[0]);
                a[1] = _mm256_fmadd_ps(wv, v1, a[1]);
            }
        }
        for (h, a) in a.iter().enumerate() {
            let p = acc[i0 + h][d..].as_mut_ptr();
            _mm256_storeu_ps(p, a[0]);
            _mm256_storeu_ps(p.add(8), a[1]);
        }
    }

    /// Every query of `qs`, with an online softmax over the key tiles of their joint span.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run(job: &Job, qs: &Queries) {
        let (hd, nq) = (job.spec.head_dim, qs.n);
        let mut acc = [[0f32; MAX_HEAD_DIM]; MAX_Q];
        let mut max = [f32::NEG_INFINITY; MAX_Q];
        let mut sum = [0f32; MAX_Q];
        // Scores, then weights, of a tile; keys not seen hold -inf until they weigh 0.
        let mut s = [[0f32; KEY_TILE]; MAX_Q];
        let (lo, hi) = qs.span();
        let scale = _mm256_set1_ps(job.spec.scale);
        let kv_w = job.spec.n_kv_heads * hd;
        let (kc, vc) = (
            job.k_cache.as_ptr().add(job.koff),
            job.v_cache.as_ptr().add(job.koff),
        );
        for j0 in (lo..=hi).step_by(KEY_TILE) {
            let nk = KEY_TILE.min(hi + 1 - j0);
            // Cache rows of the tile's keys (the last one repeated as padding).
            let mut keys = [kc; KEY_TILE];
            let mut values = [vc; KEY_TILE];
            for jj in 0..KEY_TILE {
                if jj < nk {
                    let slot = job.slot(j0 + jj);
                    keys[jj] = kc.add(slot * kv_w);
                    values[jj] = vc.add(slot * kv_w);
                } else {
                    (keys[jj], values[jj]) = (keys[nk - 1], values[nk - 1]);
                }
            }
            // Raw scores, two keys at a time.
            for jj in (0..nk).step_by(2) {
                let (k0, k1) = (keys[jj], keys[jj + 1]);
                let mut i = 0;
                while i < nq {
                    let q = &qs.q[i..];
                    let r: &[[f32; 2]] = match nq - i {
                        1 => &scores::<1>(&[q[0]], k0, k1, hd),
                        2 => &scores::<2>(&[q[0], q[1]], k0, k1, hd),
                        3 => &scores::<3>(&[q[0], q[1], q[2]], k0, k1, hd),
                        _ => &scores::<4>(&[q[0], q[1], q[2], q[3]], k0, k1, hd),
                    };
                    for (h, r) in r.iter().enumerate() {
                        s[i + h][jj] = r[0];
                        s[i + h][jj + 1] = r[1];
                    }
                    i += 4;
                }
            }
            // Online softmax: keys a query does not see get -inf; new maxima rescale the
            // running sums; weights = exp(s - max).
            for i in 0..nq {
                let row = &mut s[i];
                let a = qs.lo[i].max(j0) - j0;
                let b = (qs.p[i] + 1).clamp(j0, j0 + nk) - j0;
                if a >= b {
                    row.fill(0.0);
                    continue;
                }
                for c in row.chunks_exact_mut(8) {
                    let v = _mm256_mul_ps(scale, _mm256_loadu_ps(c.as_ptr()));
                    _mm256_storeu_ps(c.as_mut_ptr(), v);
                }
                row[..a].fill(f32::NEG_INFINITY);
                row[b..].fill(f32::NEG_INFINITY);
                if let Some(cap) = job.spec.softcap {
                    for v in &mut row[a..b] {
                        *v = cap * (*v / cap).tanh();
                    }
                }
                let tile_max = row[a..b].iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                if tile_max > max[i] {
                    let r = _mm256_set1_ps((max[i] - tile_max).exp());
                    sum[i] *= (max[i] - tile_max).exp();
                    for a in acc[i][..hd].chunks_exact_mut(8) {
                        let v = _mm256_mul_ps(r, _mm256_loadu_ps(a.as_ptr()));
                        _mm256_storeu_ps(a.as_mut_ptr(), v);
                    }
                    max[i] = tile_max;
                }
                let m = _mm256_set1_ps(max[i]);
                let mut tot = _mm256_setzero_ps();
                for c in row.chunks_exact_mut(8) {
                    let x = _mm256_loadu_ps(c.as_ptr());
                    // exp clamps its input, so -inf lanes are zeroed explicitly.
                    let seen = _mm256_cmp_ps(x, _mm256_set1_ps(f32::NEG_INFINITY), _CMP_NEQ_OQ);
                    let e = _mm256_and_ps(exp(_mm256_sub_ps(x, m)), seen);
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                    tot = _mm256_add_ps(tot, e);
                }
                sum[i] += hsum(tot);
            }
            // acc += weights · values, 16 dimensions of four queries at a time.
            let v = &values[..nk];
            for d in (0..hd).step_by(16) {
                let mut i = 0;
                while i < nq {
                    match nq - i {
                        1 => weighted_values::<1>(&mut acc, &s, i, v, d),
                        2 => weighted_values::<2>(&mut acc, &s, i, v, d),
                        3 => weighted_values::<3>(&mut acc, &s, i, v, d),
                        _ => weighted_values::<4>(&mut acc, &s, i, v, d),
                    }
                    i += 4;
                }
            }
        }
        for i in 0..nq {
            let inv = _mm256_set1_ps(1.0 / sum[i]);
            for d in (0..hd).step_by(8) {
                let a = _mm256_loadu_ps(acc[i][d..].as_ptr());
                _mm256_storeu_ps(qs.out[i].add(d), _mm256_mul_ps(inv, a));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::reference;

    /// Both kernel sets against the f64 reference, on shapes the backend test does not reach:
    /// groups of 1–6 heads per KV head, long windows that span several key tiles, chunks of
    /// consecutive and of scattered positions in one to three sequences with random block
    /// tables (blocks that left every query's window unmapped), one and two threads.
    #[test]
    fn both_paths_match_reference() {
        let seed: u64 = rand::rng().random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (block_size, n_blocks) = (16, 40);
        for case in 0..16 {
            let hd = [16, 32, 48, 256][case % 4];
            let kv = rng.random_range(1..3);
            let heads = kv * rng.random_range(1..7);
            let window = [None, Some(1), Some(70)][case % 3];
            let spec = AttnSpec {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
                scale: 0.1,
                window,
                softcap: if case % 5 == 0 { Some(10.0) } else { None },
            };
            let rand = |rng: &mut rand::rngs::StdRng, len| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect()
            };
            let n_seqs = rng.random_range(1..4);
            let table_width = 20;
            let (mut positions, mut seq_start, mut tables) = (Vec::new(), vec![0u32], Vec::new());
            for _ in 0..n_seqs {
                let n = rng.random_range(1..11u32);
                let p0 = rng.random_range(0..(table_width * block_size) as u32 - 3 * n);
                // Consecutive positions (a chunk), or scattered ones.
                let seq: Vec<u32> = if case % 4 == 3 {
                    (0..n).map(|i| p0 + (i * 7) % (3 * n)).collect()
                } else {
                    (p0..p0 + n).collect()
                };
                let lo = seq
                    .iter()
                    .map(|&p| window.map_or(0, |w| (p as usize + 1).saturating_sub(w)))
                    .min()
                    .unwrap();
                for b in 0..table_width {
                    let live = (b + 1) * block_size > lo;
                    tables.push(if live {
                        rng.random_range(0..n_blocks as u32)
                    } else {
                        u32::MAX
                    });
                }
                positions.extend(seq);
                seq_start.push(positions.len() as u32);
            }
            let layout = KvLayout {
                block_size,
                positions: &positions,
                seq_start: &seq_start,
                block_tables: &tables,
                table_width,
            };
            layout.check(window, n_blocks).unwrap();
            let n = positions.len();
            let q = rand(&mut rng, n * heads * hd);
            let kc = rand(&mut rng, n_blocks * block_size * kv * hd);
            let vc = rand(&mut rng, n_blocks * block_size * kv * hd);
            let want = reference::attention(&q, &kc, &vc, &spec, &layout);
            for isa in [Isa::Portable, Isa::Avx2] {
                for threads in [1, 2] {
                    let pool = Pool::new(threads).unwrap();
                    let mut out = vec![f32::NAN; want.len()];
                    attention_with(isa, &pool, &q, &kc, &vc, &spec, &layout, &mut out);
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5,
                            "{isa:?} {spec:?} {layout:?} [{i}]: {a} vs {b}; seed {seed}"
                        );
                    }
                }
            }
        }
    }
}
