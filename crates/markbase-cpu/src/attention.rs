//! Causal / sliding-window attention with GQA over a slot-addressed KV cache.
//!
//! A task is one token and a group of query heads that share a KV head: keys are visited in
//! tiles with an online softmax, so the only scratch is on the stack and only the visible keys
//! (the window, for sliding layers) are touched. On AVX2 the heads of a group are processed
//! together, up to four at a time, so each key and value row is loaded once for all of them:
//! scores take eight dot products (4 heads × 2 keys) per pass over the head dimension, and
//! the weighted sum of values keeps a 16-wide slice of every head's output in registers while
//! the tile's values stream past. The portable path does one head at a time.

use markbase_core::backend::AttnSpec;

use crate::kernels::Isa;
use crate::pool::{Pool, SendPtr};

/// Keys scored at a time.
const KEY_TILE: usize = 32;
/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 512;

/// Attention per [`AttnSpec`]; sizes are checked by the caller.
pub fn attention(
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    spec: &AttnSpec,
    positions: &[u32],
    out: &mut [f32],
) {
    attention_with(
        Isa::detect(),
        pool,
        q,
        k_cache,
        v_cache,
        spec,
        positions,
        out,
    )
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
    positions: &[u32],
    out: &mut [f32],
) {
    let hd = spec.head_dim;
    let group = spec.n_heads / spec.n_kv_heads;
    // Heads per task: the whole group, unless that leaves threads idle (decode).
    let tasks_per_group = if positions.len() * spec.n_kv_heads >= 2 * pool.threads() {
        1
    } else {
        pool.threads().min(group)
    };
    let per_task = group.div_ceil(tasks_per_group);
    let tasks_per_group = group.div_ceil(per_task);
    let fast = cfg!(target_arch = "x86_64") && isa == Isa::Avx2 && Isa::Avx2.available();
    let fast = fast && hd.is_multiple_of(16);
    let out = SendPtr(out.as_mut_ptr());
    let tasks = positions.len() * spec.n_kv_heads * tasks_per_group;
    pool.run(tasks, &|c| {
        let (tg, part) = (c / tasks_per_group, c % tasks_per_group);
        let (t, kvh) = (tg / spec.n_kv_heads, tg % spec.n_kv_heads);
        let first = kvh * group + part * per_task;
        let heads = per_task.min((kvh + 1) * group - first);
        let at = (t * spec.n_heads + first) * hd;
        // SAFETY: tasks cover disjoint heads of `out`, whose size the caller checked.
        let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(at), heads * hd) };
        let p = positions[t] as usize;
        let job = Job {
            q: &q[at..at + heads * hd],
            k_cache,
            v_cache,
            spec,
            koff: kvh * hd,
            lo: spec.window.map_or(0, |w| (p + 1).saturating_sub(w)),
            p,
        };
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: AVX2 and FMA are available; sizes were checked by the caller.
            unsafe { avx2::heads(&job, o) };
            return;
        }
        for (i, o) in o.chunks_exact_mut(hd).enumerate() {
            head_portable(&job, i, o);
        }
    });
}

/// One task: query rows of consecutive heads of one token that share a KV head.
struct Job<'a> {
    /// `heads · head_dim` query values.
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    spec: &'a AttnSpec,
    /// Offset of the KV head within a cache slot.
    koff: usize,
    /// First and last visible key positions.
    lo: usize,
    p: usize,
}

impl Job<'_> {
    /// Key row of position `j`.
    fn key(&self, j: usize) -> &[f32] {
        let (hd, slot) = (self.spec.head_dim, j % self.spec.ring);
        &self.k_cache[slot * self.spec.n_kv_heads * hd + self.koff..][..hd]
    }

    /// Value row of position `j`.
    fn value(&self, j: usize) -> &[f32] {
        let (hd, slot) = (self.spec.head_dim, j % self.spec.ring);
        &self.v_cache[slot * self.spec.n_kv_heads * hd + self.koff..][..hd]
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

/// Head `i` of the job, one key at a time (the portable path).
fn head_portable(job: &Job, i: usize, o: &mut [f32]) {
    let hd = job.spec.head_dim;
    let qrow = &job.q[i * hd..(i + 1) * hd];
    let mut acc = [0f32; MAX_HEAD_DIM];
    let acc = &mut acc[..hd];
    let mut scores = [0f32; KEY_TILE];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    for j0 in (job.lo..=job.p).step_by(KEY_TILE) {
        let nk = KEY_TILE.min(job.p + 1 - j0);
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
    //! at most [`MAX_HEAD_DIM`]; the job's slices hold what its fields say.

    use std::arch::x86_64::*;

    use super::{Job, KEY_TILE, MAX_HEAD_DIM};
    use crate::kernels::vmath::avx2::exp;

    /// All heads of the job into `out` (`heads · head_dim`), four at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn heads(job: &Job, out: &mut [f32]) {
        let hd = job.spec.head_dim;
        let mut h = 0;
        let heads = out.len() / hd;
        while h < heads {
            let o = &mut out[h * hd..];
            match heads - h {
                1 => group::<1>(job, h, o),
                2 => group::<2>(job, h, o),
                3 => group::<3>(job, h, o),
                _ => group::<4>(job, h, o),
            }
            h += 4;
        }
    }

    /// Sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Heads `h0..h0 + H` of the job, with an online softmax over key tiles.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group<const H: usize>(job: &Job, h0: usize, out: &mut [f32]) {
        let hd = job.spec.head_dim;
        let q: [*const f32; H] = std::array::from_fn(|i| job.q[(h0 + i) * hd..].as_ptr());
        let mut acc = [[0f32; MAX_HEAD_DIM]; H];
        let mut max = [f32::NEG_INFINITY; H];
        let mut sum = [0f32; H];
        // Scores of a tile, padded to whole vectors with -inf (weight 0 after exp).
        let mut s = [[f32::NEG_INFINITY; KEY_TILE]; H];
        for j0 in (job.lo..=job.p).step_by(KEY_TILE) {
            let nk = KEY_TILE.min(job.p + 1 - j0);
            // Scores, two keys at a time.
            let mut jj = 0;
            while jj < nk {
                let k0 = job.key(j0 + jj).as_ptr();
                let k1 = if jj + 1 < nk {
                    job.key(j0 + jj + 1).as_ptr()
                } else {
                    k0
                };
                let mut a = [[_mm256_setzero_ps(); 2]; H];
                for d in (0..hd).step_by(8) {
                    let kv0 = _mm256_loadu_ps(k0.add(d));
                    let kv1 = _mm256_loadu_ps(k1.add(d));
                    for (a, q) in a.iter_mut().zip(&q) {
                        let qv = _mm256_loadu_ps(q.add(d));
                        a[0] = _mm256_fmadd_ps(qv, kv0, a[0]);
                        a[1] = _mm256_fmadd_ps(qv, kv1, a[1]);
                    }
                }
                for (s, a) in s.iter_mut().zip(&a) {
                    s[jj] = job.finish_score(hsum(a[0]));
                    if jj + 1 < nk {
                        s[jj + 1] = job.finish_score(hsum(a[1]));
                    }
                }
                jj += 2;
            }
            // Online softmax: new maxima rescale the running sums, then weights = exp(s - max).
            for h in 0..H {
                let row = &mut s[h];
                row[nk..].fill(f32::NEG_INFINITY);
                let tile_max = row[..nk].iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
                if tile_max > max[h] {
                    let r = (max[h] - tile_max).exp();
                    sum[h] *= r;
                    let rv = _mm256_set1_ps(r);
                    for a in acc[h][..hd].chunks_exact_mut(8) {
                        _mm256_storeu_ps(
                            a.as_mut_ptr(),
                            _mm256_mul_ps(rv, _mm256_loadu_ps(a.as_ptr())),
                        );
                    }
                    max[h] = tile_max;
                }
                let m = _mm256_set1_ps(max[h]);
                let mut tot = _mm256_setzero_ps();
                for c in row[..nk.div_ceil(8) * 8].chunks_exact_mut(8) {
                    let x = _mm256_loadu_ps(c.as_ptr());
                    // exp clamps its input, so the padding lanes (-inf) are zeroed explicitly.
                    let valid = _mm256_cmp_ps(x, _mm256_set1_ps(f32::NEG_INFINITY), _CMP_NEQ_OQ);
                    let e = _mm256_and_ps(exp(_mm256_sub_ps(x, m)), valid);
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                    tot = _mm256_add_ps(tot, e);
                }
                sum[h] += hsum(tot);
            }
            // acc[h] += Σ_j w[h][j] · V[j], 16 dimensions at a time.
            for d in (0..hd).step_by(16) {
                let mut a: [[__m256; 2]; H] = std::array::from_fn(|h| {
                    let p = acc[h][d..].as_ptr();
                    [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
                });
                for jj in 0..nk {
                    let v = job.value(j0 + jj).as_ptr().add(d);
                    let (v0, v1) = (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)));
                    for (a, s) in a.iter_mut().zip(&s) {
                        let w = _mm256_set1_ps(s[jj]);
                        a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                        a[1] = _mm256_fmadd_ps(w, v1, a[1]);
                    }
                }
                for (h, a) in a.iter().enumerate() {
                    let p = acc[h][d..].as_mut_ptr();
                    _mm256_storeu_ps(p, a[0]);
                    _mm256_storeu_ps(p.add(8), a[1]);
                }
            }
        }
        for h in 0..H {
            let inv = _mm256_set1_ps(1.0 / sum[h]);
            let o = out[h * hd..].as_mut_ptr();
            for d in (0..hd).step_by(8) {
                _mm256_storeu_ps(
                    o.add(d),
                    _mm256_mul_ps(inv, _mm256_loadu_ps(acc[h][d..].as_ptr())),
                );
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
    /// groups of 1–6 heads per KV head, long windows that span several key tiles, every thread
    /// split.
    #[test]
    fn both_paths_match_reference() {
        let seed: u64 = rand::rng().random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..12 {
            let hd = [16, 32, 48, 256][case % 4];
            let kv = rng.random_range(1..3);
            let heads = kv * rng.random_range(1..7);
            let ring = 300;
            let n = rng.random_range(1..6);
            let p0 = rng.random_range(0..(ring - n) as u32);
            let spec = AttnSpec {
                n_heads: heads,
                n_kv_heads: kv,
                head_dim: hd,
                scale: 0.1,
                window: [None, Some(1), Some(70)][case % 3],
                softcap: if case % 5 == 0 { Some(10.0) } else { None },
                ring,
            };
            let rand = |rng: &mut rand::rngs::StdRng, len| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect()
            };
            let q = rand(&mut rng, n * heads * hd);
            let kc = rand(&mut rng, ring * kv * hd);
            let vc = rand(&mut rng, ring * kv * hd);
            let positions: Vec<u32> = (p0..p0 + n as u32).collect();
            let want = reference::attention(&q, &kc, &vc, &spec, &positions);
            for isa in [Isa::Portable, Isa::Avx2] {
                for threads in [1, 2] {
                    let pool = Pool::new(threads).unwrap();
                    let mut out = vec![f32::NAN; want.len()];
                    attention_with(isa, &pool, &q, &kc, &vc, &spec, &positions, &mut out);
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5,
                            "{isa:?} {spec:?} n={n} [{i}]: {a} vs {b}; seed {seed}"
                        );
                    }
                }
            }
        }
    }
}
