//! The LM head's screening copy ([`ScreenCopy`]): every weight in 4 bits, one integer scale
//! per 64 weights, the columns first centred and divided by their mean magnitude.
//!
//! Weight `w[r][i]` in chunk `c` (weights `64c..64c + 64`) is `μ[i] + β[i] · d[r] · s[r][c] · q`
//! with the signed code `q ∈ −8..=7`: `μ[i]` is column `i`'s mean over all rows (a token's
//! `x · μ` is one number added to all its logits, so the codes rank only what tells rows
//! apart), `β[i]` the column's mean `|w − μ|` (the screening activations are multiplied by it,
//! so the kernel never sees it), `s ∈ 0..=63` the chunk's integer scale and `d` the row's. The
//! chunk step `d · s` is its largest `|w − μ| / β` over 7.5, rounded up to a 63rd of the
//! row's largest step. Integer chunk scales let the kernel sum a whole row in integers
//! (`kernels::screen`).
//!
//! Measured on the default Gemma 3 270M (Q8_0 head) with transformers' hidden states
//! (docs/perf.md): over 4 094 positions of the Vim manual and the 270M reference prompts,
//! transformers' top 8 are always within the copy's top 87; perplexity of 2 048 positions
//! +0.035 % with the top 4 096 recomputed exactly. A row-scaled copy without chunk scales put
//! a top-8 logit at rank 13 756. The copy is 48 % of the Q8_0 head's bytes.
//!
//! Layout: each row is `cols / 2` bytes of codes, 64 weights per 32-byte chunk; byte `j` of
//! chunk `c` holds `q + 8` of weight `64c + j` in its low nibble and of `64c + 32 + j` in its
//! high nibble.

use std::num::NonZeroUsize;

use markbase_core::backend::HostMatrix;
use markbase_core::quant::dequantize_row;
use markbase_core::{Error, Result};

use super::act::ROUND;

/// Weights per 32-byte chunk of a row.
pub const CHUNK: usize = 64;
/// Largest integer chunk scale.
const MAX_SCALE: f32 = 63.0;

/// A 4-bit copy of a matrix with integer chunk scales, for ranking its rows.
pub struct ScreenCopy {
    /// Name of the copied matrix, for errors.
    pub name: String,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns (a multiple of [`CHUNK`]).
    pub cols: usize,
    /// `rows × cols / 2` bytes of codes.
    pub codes: Vec<u8>,
    /// `rows × cols / 64` integer chunk scales `s`.
    pub scales: Vec<u8>,
    /// Per row: the scale `d`.
    pub steps: Vec<f32>,
    /// Per row: `128 · Σ_c s[c] · Σq`, the integer offset of unsigned activations
    /// (`kernels::screen`).
    pub offsets: Vec<i32>,
    /// Per column: the mean `μ` over all rows, taken out before quantizing.
    pub mean: Vec<f32>,
    /// Per column: the mean magnitude `β` of `w − μ`.
    pub beta: Vec<f32>,
}

impl ScreenCopy {
    /// Builds the copy of `m` (any stored format), rows split over the available cores.
    ///
    /// # Errors
    /// If `cols` is not a multiple of [`CHUNK`] or a row cannot be dequantized.
    pub fn build(m: &HostMatrix) -> Result<Self> {
        if m.cols == 0 || !m.cols.is_multiple_of(CHUNK) {
            return Err(Error::Invalid(format!(
                "screening copy of '{}': {} columns, needs a multiple of {CHUNK}",
                m.name, m.cols
            )));
        }
        let (rows, cols) = (m.rows, m.cols);
        let mean = column_means(m, |v, _| v)?;
        let beta: Vec<f32> = column_means(m, |v, i| (v - mean[i]).abs())?
            .into_iter()
            // A column equal to its mean everywhere gets β = 1 (its codes stay at zero).
            .map(|b| if b > 0.0 && b.is_finite() { b } else { 1.0 })
            .collect();
        let parts = for_row_chunks(m, |rows_f32, part: &mut Encoded| {
            for row in rows_f32.chunks_exact(cols) {
                part.push(row, &mean, &beta);
            }
        })?;
        let mut out = ScreenCopy {
            name: m.name.clone(),
            rows,
            cols,
            codes: Vec::with_capacity(rows * cols / 2),
            scales: Vec::with_capacity(rows * cols / CHUNK),
            steps: Vec::with_capacity(rows),
            offsets: Vec::with_capacity(rows),
            mean,
            beta,
        };
        for p in parts {
            out.codes.extend_from_slice(&p.codes);
            out.scales.extend_from_slice(&p.scales);
            out.steps.extend_from_slice(&p.steps);
            out.offsets.extend_from_slice(&p.offsets);
        }
        Ok(out)
    }

    /// Bytes of one row's codes.
    pub fn row_bytes(&self) -> usize {
        self.cols / 2
    }

    /// Row `r` as the copy represents it, less the column means: `β[i] · d · s[c] · q`.
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let (rb, chunks) = (self.row_bytes(), self.cols / CHUNK);
        let codes = &self.codes[r * rb..(r + 1) * rb];
        (0..self.cols)
            .map(|i| {
                let s = f32::from(self.scales[r * chunks + i / CHUNK]);
                self.beta[i] * self.steps[r] * s * f32::from(code(codes, i))
            })
            .collect()
    }
}

/// The signed code `q` of weight `i` in a row's bytes (see the module's layout).
pub fn code(row: &[u8], i: usize) -> i8 {
    let (c, j) = (i / CHUNK, i % CHUNK);
    let b = row[c * CHUNK / 2 + j % 32];
    let u = if j < 32 { b & 15 } else { b >> 4 };
    u as i8 - 8
}

/// Codes, scales and offsets of a run of rows.
#[derive(Default)]
struct Encoded {
    /// One row less the means, over β (reused).
    z: Vec<f32>,
    codes: Vec<u8>,
    scales: Vec<u8>,
    steps: Vec<f32>,
    offsets: Vec<i32>,
}

impl Encoded {
    /// Appends the encoding of one row `w` (columns less `mean`, divided by `beta`).
    fn push(&mut self, w: &[f32], mean: &[f32], beta: &[f32]) {
        self.z.clear();
        self.z.extend(
            w.iter()
                .zip(mean.iter().zip(beta))
                .map(|(v, (m, b))| (v - m) / b),
        );
        let amax = |z: &[f32]| z.iter().fold(0f32, |m, v| m.max(v.abs()));
        let top = amax(&self.z);
        let d = if top > 0.0 && top.is_finite() {
            top / 7.5 / MAX_SCALE
        } else {
            0.0
        };
        let mut offset = 0i32;
        for zc in self.z.chunks_exact(CHUNK) {
            let s = if d > 0.0 {
                (amax(zc) / 7.5 / d).ceil().clamp(0.0, MAX_SCALE)
            } else {
                0.0
            };
            let step = d * s;
            let q = |i: usize| -> i8 {
                if step > 0.0 {
                    (((zc[i] / step) + ROUND) - ROUND).clamp(-8.0, 7.0) as i8
                } else {
                    0
                }
            };
            let mut sum = 0i32;
            for j in 0..32 {
                let (lo, hi) = (q(j), q(32 + j));
                sum += i32::from(lo) + i32::from(hi);
                self.codes.push((lo + 8) as u8 | (((hi + 8) as u8) << 4));
            }
            self.scales.push(s as u8);
            offset += 128 * s as i32 * sum;
        }
        self.steps.push(d);
        self.offsets.push(offset);
    }
}

/// Per column of `m`: the mean over all rows of `f(w, column)`.
fn column_means(m: &HostMatrix, f: impl Fn(f32, usize) -> f32 + Sync) -> Result<Vec<f32>> {
    let cols = m.cols;
    let parts = for_row_chunks(m, |rows_f32, acc: &mut Vec<f64>| {
        acc.resize(cols, 0.0);
        for row in rows_f32.chunks_exact(cols) {
            for (i, (a, v)) in acc.iter_mut().zip(row).enumerate() {
                *a += f64::from(f(*v, i));
            }
        }
    })?;
    let mut sum = vec![0f64; cols];
    for p in &parts {
        for (s, v) in sum.iter_mut().zip(p) {
            *s += v;
        }
    }
    Ok(sum
        .iter()
        .map(|s| (s / m.rows.max(1) as f64) as f32)
        .collect())
}

/// Runs `f` over the dequantized rows of `m` in one contiguous run of rows per core, each run
/// into its own accumulator; the accumulators come back in row order.
fn for_row_chunks<A: Default + Send>(
    m: &HostMatrix,
    f: impl Fn(&[f32], &mut A) + Sync,
) -> Result<Vec<A>> {
    /// Rows dequantized at once.
    const BATCH: usize = 64;
    let threads = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    let per = m.rows.div_ceil(threads).max(1);
    let (src, rb, cols) = (m.bytes.as_slice(), m.row_bytes(), m.cols);
    std::thread::scope(|s| {
        let tasks: Vec<_> = (0..m.rows.div_ceil(per))
            .map(|c| {
                let f = &f;
                s.spawn(move || -> Result<A> {
                    let (r0, r1) = (c * per, ((c + 1) * per).min(m.rows));
                    let mut acc = A::default();
                    let mut buf = vec![0f32; BATCH * cols];
                    for b0 in (r0..r1).step_by(BATCH) {
                        let b1 = (b0 + BATCH).min(r1);
                        let n = (b1 - b0) * cols;
                        dequantize_row(m.ty, &src[b0 * rb..b1 * rb], &mut buf[..n])?;
                        f(&buf[..n], &mut acc);
                    }
                    Ok(acc)
                })
            })
            .collect();
        tasks
            .into_iter()
            .map(|t| t.join().expect("screening copy thread panicked"))
            .collect()
    })
}

/// A plain f32 matrix of `rows × cols` values `w`, for tests.
#[cfg(test)]
pub(crate) fn f32_matrix(name: &str, rows: usize, cols: usize, w: &[f32]) -> HostMatrix {
    use markbase_core::backend::HostBytes;
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    HostMatrix {
        name: name.into(),
        ty: markbase_core::quant::GgmlType::F32,
        rows,
        cols,
        bytes: HostBytes::Owned(bytes.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Every weight comes back within half its chunk's step (times its column's β) around
    /// the column mean; means and β are the columns' own; offsets are `128 · Σ s · Σq`.
    #[test]
    fn rows_round_trip_within_half_a_step() {
        let mut rng = rand::rng();
        let (rows, cols) = (37, 192);
        let col_scale: Vec<f32> = (0..cols).map(|_| rng.random_range(0.1..3.0)).collect();
        let col_shift: Vec<f32> = (0..cols).map(|_| rng.random_range(-0.5..0.5)).collect();
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| rng.random_range(-1.0..1.0) * col_scale[i % cols] + col_shift[i % cols])
            .collect();
        let copy = ScreenCopy::build(&f32_matrix("w", rows, cols, &w)).unwrap();
        let w = &w;
        let column = |i: usize| (0..rows).map(move |r| w[r * cols + i]);
        for i in 0..cols {
            let mean = column(i).sum::<f32>() / rows as f32;
            let beta = column(i).map(|v| (v - mean).abs()).sum::<f32>() / rows as f32;
            assert!((copy.mean[i] - mean).abs() <= 1e-5, "μ[{i}]");
            assert!((copy.beta[i] - beta).abs() <= 1e-5 * beta, "β[{i}]");
        }
        let chunks = cols / CHUNK;
        for r in 0..rows {
            let got = copy.dequantize_row(r);
            let codes = &copy.codes[r * cols / 2..(r + 1) * cols / 2];
            let mut offset = 0;
            for c in 0..chunks {
                let s = copy.scales[r * chunks + c];
                let step = copy.steps[r] * f32::from(s);
                let mut sum = 0;
                for i in c * CHUNK..(c + 1) * CHUNK {
                    sum += i32::from(code(codes, i));
                    let (b, v) = (copy.beta[i], w[r * cols + i] - copy.mean[i]);
                    assert!(
                        (got[i] - v).abs() <= 0.5001 * step * b + 1e-6,
                        "row {r} col {i}: {} vs {v}",
                        got[i]
                    );
                }
                offset += 128 * i32::from(s) * sum;
            }
            assert_eq!(copy.offsets[r], offset, "row {r}");
        }
    }

    /// Columns that are not a whole number of chunks are refused with the matrix's name.
    #[test]
    fn refuses_ragged_columns() {
        let m = f32_matrix("head", 2, 96, &[0.0; 2 * 96]);
        let err = ScreenCopy::build(&m).err().unwrap().to_string();
        assert!(err.contains("'head'") && err.contains("96"), "{err}");
    }
}
