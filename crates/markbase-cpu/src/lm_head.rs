//! The screened LM head ([`Backend::matmul_screened`]): logits for the whole vocabulary from a
//! 4-bit copy of the head ([`ScreenCopy`]), then the leaders recomputed from the exact rows.
//!
//! A 262k-token head in Q8_0 is most of a small model's bytes, and decoding one token on a CPU
//! is bound by the bytes it reads. The coarse pass reads the copy (about half the bytes, summed
//! in integers: `kernels::screen`); the exact pass reads `top_k` rows. Greedy choices, the
//! likely tokens a sampler draws from and their probabilities are exact; only the logits of
//! unlikely tokens keep the copy's error.
//!
//! [`Backend::matmul_screened`]: markbase_core::backend::Backend::matmul_screened

use markbase_core::backend::HostMatrix;

use crate::kernels::act::QuantAct;
use crate::kernels::dot::dot_row;
use crate::kernels::qdot::{qdot_gather, supports};
use crate::kernels::screen::{screen_tokens, ScreenAct, ScreenRow};
use crate::kernels::screen_copy::ScreenCopy;
use crate::matmul;
use crate::pool::{Pool, SendPtr};

/// Every `STRIDE`-th coarse logit is sampled to place the selection threshold.
const STRIDE: usize = 16;
/// Exact rows recomputed per parallel task.
const REFINE_GRAIN: usize = 128;
/// Tokens whose activations one screening call takes at once.
const SCREEN_TOKENS: usize = 16;
/// How many coarse leaders [`greedy_pick`] has recomputed after each of its stages (the best
/// exact logit usually stands out after the first).
const GREEDY_STAGES: [usize; 3] = [64, 256, 1024];
/// How many times the largest coarse error seen among the recomputed leaders the best exact
/// logit must clear the next leader's coarse logit by, for a greedy pick to stand early. On
/// the default model those errors reach about 4 root-mean-squares among 4 096 leaders and
/// 3 among 64 (measured, docs/perf.md).
const GREEDY_MARGIN: f32 = 1.5;

/// Reused buffers of one token's leader selection.
#[derive(Default)]
pub struct Selection {
    sample: Vec<f32>,
    leaders: Vec<u32>,
}

/// Reused buffers of [`screened`] (kept between calls: no allocation per token).
#[derive(Default)]
pub struct Scratch {
    /// One leader selection per token of the largest call so far.
    selections: Vec<Selection>,
    /// The activations of the screening pass, in bytes.
    bytes: ScreenAct,
    /// The activations of the exact rows, in 16-bit blocks.
    act: QuantAct,
}

/// `out[n, exact.rows]`: coarse logits for every row of `x` from `coarse`, then each row's
/// `top_k` leaders (by coarse logit) recomputed from `exact`. Sizes are checked by the caller;
/// `coarse` and `exact` have the same shape.
#[allow(clippy::too_many_arguments)]
pub fn screened(
    pool: &Pool,
    x: &[f32],
    n: usize,
    coarse: &ScreenCopy,
    exact: &HostMatrix,
    top_k: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let rows = exact.rows;
    screen(pool, &mut scratch.bytes, x, n, coarse, out);
    if scratch.selections.len() < n {
        scratch.selections.resize_with(n, Selection::default);
    }
    let (logits, selections) = (
        SendPtr(out.as_mut_ptr()),
        SendPtr(scratch.selections.as_mut_ptr()),
    );
    pool.run(n, &|t| {
        // SAFETY: task t alone touches token t's logits and selection; the caller checked
        // `out.len() >= n * rows`.
        let (row, selection) = unsafe {
            (
                std::slice::from_raw_parts(logits.get().add(t * rows), rows),
                &mut *selections.get().add(t),
            )
        };
        select_leaders(row, top_k, selection);
    });
    refine(pool, scratch, x, n, exact, out);
}

/// Coarse logits `out[n, rows]` from the copy: row chunks on the pool, each against every
/// token ([`screen_tokens`] unpacks a chunk of codes once for a group of tokens).
fn screen(
    pool: &Pool,
    bytes: &mut ScreenAct,
    x: &[f32],
    n: usize,
    coarse: &ScreenCopy,
    out: &mut [f32],
) {
    let rows = coarse.rows;
    bytes.quantize(x, n, coarse);
    let bytes = &*bytes;
    let chunk = matmul::rows_per_task(rows, coarse.row_bytes(), pool.threads());
    let ptr = SendPtr(out.as_mut_ptr());
    pool.run(rows.div_ceil(chunk), &|c| {
        let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(rows));
        for t0 in (0..n).step_by(SCREEN_TOKENS) {
            let g = SCREEN_TOKENS.min(n - t0);
            let xs: [ScreenRow; SCREEN_TOKENS] =
                std::array::from_fn(|t| bytes.row(t0 + t.min(g - 1)));
            let mut outs: [&mut [f32]; SCREEN_TOKENS] = Default::default();
            for (t, o) in outs[..g].iter_mut().enumerate() {
                // SAFETY: (t0 + t, r0..r1) is inside `out` (checked by the caller) and belongs
                // to this task only.
                *o = unsafe {
                    std::slice::from_raw_parts_mut(ptr.get().add((t0 + t) * rows + r0), r1 - r0)
                };
            }
            screen_tokens(coarse, r0, &xs[..g], &mut outs[..g]);
        }
    });
}

/// Recomputes every token's leaders (`scratch.selections`) from the exact rows, one task per
/// [`REFINE_GRAIN`] leaders of a token.
fn refine(
    pool: &Pool,
    scratch: &mut Scratch,
    x: &[f32],
    n: usize,
    exact: &HostMatrix,
    out: &mut [f32],
) {
    let rows = exact.rows;
    let rows_of = ExactRows::new(&mut scratch.act, x, n, exact);
    let selections = &scratch.selections[..n];
    let per_token = selections
        .iter()
        .map(|s| s.leaders.len().div_ceil(REFINE_GRAIN))
        .max()
        .unwrap_or(0);
    let logits = SendPtr(out.as_mut_ptr());
    pool.run(n * per_token, &|c| {
        let (t, part) = (c / per_token, c % per_token);
        let leaders = &selections[t].leaders;
        let index = &leaders[(part * REFINE_GRAIN).min(leaders.len())
            ..((part + 1) * REFINE_GRAIN).min(leaders.len())];
        let mut values = [0f32; REFINE_GRAIN];
        let values = &mut values[..index.len()];
        rows_of.logits(t, index, values);
        for (&i, &v) in index.iter().zip(values.iter()) {
            // SAFETY: i < rows and a token's leaders are distinct, so tasks write disjoint
            // logits of token t's row, inside `out` (checked by the caller).
            unsafe { *logits.get().add(t * rows + i as usize) = v };
        }
    });
}

/// Exact logits of chosen rows of the stored head: integer dot products of gathered rows for
/// block-quantized heads (the activations quantized once per call), f32 ones for float heads.
struct ExactRows<'a> {
    exact: &'a HostMatrix,
    x: &'a [f32],
    act: Option<&'a QuantAct>,
}

impl<'a> ExactRows<'a> {
    /// Prepares the `n` activation rows `x` for `exact`, quantizing them into `act` if the
    /// integer path takes them.
    fn new(act: &'a mut QuantAct, x: &'a [f32], n: usize, exact: &'a HostMatrix) -> Self {
        let act = supports(exact.ty).then(|| {
            act.quantize(x, n, exact.cols);
            &*act
        });
        ExactRows { exact, x, act }
    }

    /// `values[j] = x[t] · row index[j]`.
    fn logits(&self, t: usize, index: &[u32], values: &mut [f32]) {
        let (k, rb) = (self.exact.cols, self.exact.row_bytes());
        let bytes = self.exact.bytes.as_slice();
        match self.act {
            Some(act) => qdot_gather(self.exact.ty, bytes, index, act.row(t), values),
            None => {
                for (v, &i) in values.iter_mut().zip(index) {
                    let i = i as usize;
                    *v = dot_row(
                        self.exact.ty,
                        &bytes[i * rb..(i + 1) * rb],
                        &self.x[t * k..(t + 1) * k],
                    );
                }
            }
        }
    }
}

/// The greedy pick of each of the `n` rows of `x · exactᵀ` (ties: the lowest index): coarse
/// logits for every row into `out` (scratch), then per token ([`greedy_pick`]) the
/// coarse leaders recomputed exactly, a few first and `top_k` of them when the few
/// leave doubt. Sizes are checked by the caller.
#[allow(clippy::too_many_arguments)]
pub fn greedy(
    pool: &Pool,
    x: &[f32],
    n: usize,
    coarse: &ScreenCopy,
    exact: &HostMatrix,
    top_k: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) -> Vec<u32> {
    let rows = exact.rows;
    screen(pool, &mut scratch.bytes, x, n, coarse, out);
    if scratch.selections.len() < n {
        scratch.selections.resize_with(n, Selection::default);
    }
    let rows_of = ExactRows::new(&mut scratch.act, x, n, exact);
    let selections = SendPtr(scratch.selections.as_mut_ptr());
    let mut picks = vec![0u32; n];
    let picked = SendPtr(picks.as_mut_ptr());
    let out = &*out;
    pool.run(n, &|t| {
        // SAFETY: task t alone touches token t's selection and pick.
        let (selection, pick) =
            unsafe { (&mut *selections.get().add(t), &mut *picked.get().add(t)) };
        let row = &out[t * rows..(t + 1) * rows];
        *pick = greedy_pick(row, top_k, selection, &|index, values| {
            rows_of.logits(t, index, values)
        });
    });
    picks
}

/// The index of the largest exact logit of a row whose coarse logits are `coarse`; `exact`
/// computes the exact logits of a list of rows.
///
/// The coarse leaders are recomputed in stages of [`GREEDY_STAGES`] rows, in coarse order.
/// After a stage, a row not yet recomputed has a coarse logit at most the stage's last one,
/// `floor`, and its exact logit differs from that by the copy's error, which the recomputed
/// rows sample: with `err` the largest |exact − coarse| among them, the best exact logit so
/// far is the pick once it exceeds `floor + GREEDY_MARGIN · err`. Rows that still leave doubt
/// after the last stage take the `top_k` coarse leaders, as the full screened head ranks them.
fn greedy_pick(
    coarse: &[f32],
    top_k: usize,
    selection: &mut Selection,
    exact: &dyn Fn(&[u32], &mut [f32]),
) -> u32 {
    const WIDEST: usize = GREEDY_STAGES[GREEDY_STAGES.len() - 1];
    select_leaders(coarse, WIDEST.min(top_k), selection);
    let leaders = &mut selection.leaders;
    leaders.sort_unstable_by(|&a, &b| coarse[b as usize].total_cmp(&coarse[a as usize]));
    let (mut best, mut err, mut done) = (Pick::NONE, 0f32, 0);
    let mut values = [0f32; WIDEST];
    for stage in GREEDY_STAGES {
        let end = stage.min(leaders.len());
        exact(&leaders[done..end], &mut values[done..end]);
        for (&i, &v) in leaders[done..end].iter().zip(&values[done..end]) {
            best.offer(v, i);
            err = err.max((v - coarse[i as usize]).abs());
        }
        done = end;
        let floor = coarse[leaders[end - 1] as usize];
        if end == coarse.len() || best.value > floor + GREEDY_MARGIN * err {
            return best.index;
        }
        if end == leaders.len() {
            break;
        }
    }
    select_leaders(coarse, top_k, selection);
    let mut best = Pick::NONE;
    let mut values = [0f32; REFINE_GRAIN];
    for part in selection.leaders.chunks(REFINE_GRAIN) {
        let values = &mut values[..part.len()];
        exact(part, values);
        for (&i, &v) in part.iter().zip(values.iter()) {
            best.offer(v, i);
        }
    }
    best.index
}

/// The largest value offered so far and its index (ties: the lowest index; NaN never wins).
#[derive(Clone, Copy)]
struct Pick {
    value: f32,
    index: u32,
}

impl Pick {
    /// Nothing offered yet.
    const NONE: Pick = Pick {
        value: f32::NEG_INFINITY,
        index: 0,
    };

    /// Keeps `(value, index)` if it beats the pick so far.
    fn offer(&mut self, value: f32, index: u32) {
        if value > self.value || (value == self.value && index < self.index) {
            *self = Pick { value, index };
        }
    }
}

/// Puts into `scratch.leaders` the indices of the `top_k` largest `logits` (all of them if
/// there are fewer), in no particular order.
///
/// A strided sample sets a threshold that about `2 · top_k` values pass; the passing indices
/// are then cut to the exact `top_k`. If too few pass (an unlucky sample), every index is a
/// candidate, so the result is always the true top `top_k`.
pub fn select_leaders(logits: &[f32], top_k: usize, scratch: &mut Selection) {
    let k = top_k.min(logits.len());
    let cands = &mut scratch.leaders;
    cands.clear();
    if k == 0 {
        return;
    }
    let sample = &mut scratch.sample;
    sample.clear();
    sample.extend(logits.iter().step_by(STRIDE));
    let rank = ((2 * k).div_ceil(STRIDE)).min(sample.len()) - 1;
    let (_, &mut tau, _) = sample.select_nth_unstable_by(rank, |a, b| b.total_cmp(a));
    // Runs of 16 values are tested with a branch-free (vectorised) comparison first: about
    // one value in 16 / 2k passes, so most runs are skipped whole.
    for (c, run) in logits.chunks(16).enumerate() {
        // (NaN passes the test too, so the exact comparison still ranks it as total_cmp does.)
        if run
            .iter()
            .fold(false, |hit, &v| hit | (v >= tau) | v.is_nan())
        {
            cands.extend(
                (0..run.len())
                    .filter(|&j| run[j].total_cmp(&tau).is_ge())
                    .map(|j| (16 * c + j) as u32),
            );
        }
    }
    if cands.len() < k {
        cands.clear();
        cands.extend(0..logits.len() as u32);
    }
    if cands.len() > k {
        cands.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        cands.truncate(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::screen_copy::ScreenCopy;
    use markbase_core::backend::HostBytes;
    use markbase_core::quant::{quantize_row, GgmlType};
    use rand::Rng;

    fn matrix(ty: GgmlType, rows: usize, cols: usize, w: &[f32]) -> HostMatrix {
        let mut bytes = vec![0u8; rows * ty.bytes_for(cols).unwrap()];
        quantize_row(ty, w, &mut bytes).unwrap();
        HostMatrix {
            name: format!("{ty} head"),
            ty,
            rows,
            cols,
            bytes: HostBytes::Owned(bytes.into()),
        }
    }

    /// Leaders carry the exact logits (the reference: dequantized exact rows times the
    /// activations as the exact pass quantizes them), every other logit the coarse one (the
    /// screening copy times the screening pass's byte activations), and the leaders are the
    /// coarse top k.
    #[test]
    fn leaders_are_exact_and_the_rest_coarse() {
        let mut rng = rand::rng();
        let (rows, cols, n, top_k) = (3000, 128, 3, 200);
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let exact = matrix(GgmlType::Q8_0, rows, cols, &w);
        let coarse = ScreenCopy::build(&exact).unwrap();
        let f64s = |v: Vec<f32>| -> Vec<f64> { v.into_iter().map(f64::from).collect() };
        let want_exact = f64s(crate::reference::matmul_quantized(&x, n, &exact).unwrap());
        let want_coarse = f64s(crate::reference::matmul_screen_copy(&x, n, &coarse));
        let mut out = vec![0f32; n * rows];
        let pool = Pool::new(2).unwrap();
        let mut scratch = Scratch::default();
        screened(&pool, &x, n, &coarse, &exact, top_k, &mut scratch, &mut out);
        for t in 0..n {
            let row = |v: &[f64]| v[t * rows..(t + 1) * rows].to_vec();
            let (e, c) = (row(&want_exact), row(&want_coarse));
            let mut order: Vec<usize> = (0..rows).collect();
            order.sort_by(|&a, &b| c[b].total_cmp(&c[a]));
            let mut is_leader = vec![false; rows];
            // ranks near the cut may swap on f32 rounding of the coarse sums: skip them
            for &i in &order[..top_k - 2] {
                is_leader[i] = true;
            }
            for i in 0..rows {
                let got = out[t * rows + i] as f64;
                if is_leader[i] {
                    assert!(
                        (got - e[i]).abs() < 1e-4,
                        "row {t} leader {i}: {got} vs exact {}",
                        e[i]
                    );
                } else if !order[top_k - 2..top_k + 2].contains(&i) {
                    assert!(
                        (got - c[i]).abs() < 1e-4,
                        "row {t} tail {i}: {got} vs coarse {}",
                        c[i]
                    );
                }
            }
        }
    }

    /// Greedy picks with exact logits `coarse ± a` (every error exactly `a`, so the margin
    /// test is sound): always the best exact logit among the `top_k` coarse leaders, from the
    /// first stage when `a` is small and after all of them when it is large.
    #[test]
    fn greedy_pick_is_the_best_exact_leader() {
        use std::cell::Cell;
        let mut rng = rand::rng();
        let mut selection = Selection::default();
        let (rows, top_k) = (20_000, 4096);
        for &(a, most_rows) in &[(0.05f32, 64usize), (0.5, 1024), (3.0, 1024 + 4096)] {
            for _ in 0..20 {
                // distinct coarse logits in a random order of rows
                let mut coarse: Vec<f32> = (0..rows).map(|i| i as f32 * 1e-3).collect();
                for i in (1..rows).rev() {
                    coarse.swap(i, rng.random_range(0..=i));
                }
                let sign: Vec<f32> = (0..rows)
                    .map(|_| if rng.random_bool(0.5) { a } else { -a })
                    .collect();
                let exact_of = |i: usize| coarse[i] + sign[i];
                let computed = Cell::new(0);
                let exact = |index: &[u32], values: &mut [f32]| {
                    computed.set(computed.get() + index.len());
                    for (v, &i) in values.iter_mut().zip(index) {
                        *v = exact_of(i as usize);
                    }
                };
                let pick = greedy_pick(&coarse, top_k, &mut selection, &exact);
                let mut order: Vec<usize> = (0..rows).collect();
                order.sort_by(|&x, &y| coarse[y].total_cmp(&coarse[x]));
                let want = order[..top_k]
                    .iter()
                    .copied()
                    .max_by(|&x, &y| exact_of(x).total_cmp(&exact_of(y)).then(y.cmp(&x)))
                    .unwrap();
                assert_eq!(pick as usize, want, "a = {a}");
                assert!(
                    computed.get() <= most_rows,
                    "a = {a}: {} rows recomputed",
                    computed.get()
                );
            }
        }
    }

    /// The screened head's greedy picks are the argmax of the exact logits when one row per
    /// token stands out (random matrices, the row made to align with the token).
    #[test]
    fn greedy_picks_the_standout_row() {
        let mut rng = rand::rng();
        let (rows, cols, n) = (5000, 128, 5);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let want: Vec<u32> = (0..n).map(|_| rng.random_range(0..rows as u32)).collect();
        for (t, &r) in want.iter().enumerate() {
            let r = r as usize;
            for c in 0..cols {
                w[r * cols + c] = x[t * cols + c].signum() * 0.9;
            }
        }
        let exact = matrix(GgmlType::Q8_0, rows, cols, &w);
        let coarse = ScreenCopy::build(&exact).unwrap();
        let pool = Pool::new(2).unwrap();
        let mut out = vec![0f32; n * rows];
        let got = greedy(
            &pool,
            &x,
            n,
            &coarse,
            &exact,
            200,
            &mut Scratch::default(),
            &mut out,
        );
        assert_eq!(got, want);
    }

    /// The selection equals a full sort's top k on random rows with ties and odd sizes.
    #[test]
    fn leaders_are_the_true_top_k() {
        let mut rng = rand::rng();
        let mut scratch = Selection::default();
        for &(len, k) in &[
            (1usize, 1usize),
            (7, 3),
            (1000, 1),
            (5000, 64),
            (70000, 4096),
            (300, 500),
        ] {
            // coarse values on a grid, so ties are common
            let v: Vec<f32> = (0..len)
                .map(|_| (rng.random_range(-400..400) as f32) * 0.25)
                .collect();
            select_leaders(&v, k, &mut scratch);
            let mut got: Vec<f32> = scratch.leaders.iter().map(|&i| v[i as usize]).collect();
            let mut all = v.clone();
            all.sort_by(|a, b| b.total_cmp(a));
            got.sort_by(|a, b| b.total_cmp(a));
            assert_eq!(got.len(), k.min(len), "len {len} k {k}");
            assert_eq!(got, all[..k.min(len)], "len {len} k {k}");
            let mut ids = scratch.leaders.clone();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), k.min(len), "indices must be distinct");
        }
    }
}
