//! AVX2 integer dot products of stored weight rows with 16-bit [`QuantAct`] rows, for one or
//! several tokens at a time.
//!
//! For every format, the 32 weights of one activation block are unpacked to bytes in weight
//! order (nibble masks and shifts, extra high bits merged in, format offsets such as Q4_0's 8
//! subtracted so the bytes hold the signed integer weight, or kept unsigned where the format
//! has a separate minimum) and widened to two vectors of 16-bit lanes by byte unpacking (the
//! activations are stored in the matching order). That unpacking is done **once per weight
//! block** and shared by a group of tokens: for each token the widened weights are
//! multiplied with its activations by `vpmaddwd` into eight 32-bit sums — exact integers;
//! lanes 0..4 hold the block's first 16 weights, lanes 4..8 the last 16 — converted to f32
//! once and accumulated with their float scale (weight scale × the token's activation scale;
//! per 16-weight half for formats with 16-weight sub-blocks) by one FMA. Legacy formats keep
//! one accumulator per token, so that a group of [`LEGACY_GROUP`] tokens fits the sixteen
//! vector registers; K formats, whose per-token scale vectors take registers too, keep two
//! and share each unpacking among [`K_GROUP`] tokens. Minimums (`_1` and K
//! formats) are applied through the activation block sums. Legacy block scales are converted
//! from f16 by table lookup (a plain load), which keeps the shuffle and convert units free for
//! the weights.
//!
//! Rows are walked one after the other. Every (row, token) result is accumulated by the same
//! sequence of operations whatever the group, so a token's result does not depend on how many
//! tokens were computed with it.
//!
//! Safety contract of every `unsafe fn` here: the CPU has AVX2, FMA and F16C, and the rows
//! and activations hold the sizes the public entry point checked.
//!
//! [`QuantAct`]: super::act::QuantAct

use std::arch::x86_64::*;

use markbase_core::quant::{q3_k_scales, GgmlType};

use super::act::ActRow;
use super::avx2::{bits_to_bytes, f16_at, u8x8_to_f32};
use super::f16_table;
use super::vmath::avx2::hsum;

/// Tokens that share one unpacking of each 32-weight legacy block (one accumulator each, in
/// registers); larger token counts are cut into groups of this size.
const LEGACY_GROUP: usize = 8;

/// Tokens that share one unpacking of each K super-block (two accumulators and a scale vector
/// each).
const K_GROUP: usize = 4;

/// Rows ahead of the current one whose bytes are prefetched: the hardware prefetcher alone
/// leaves bandwidth unused on one stream per core, and cannot guess gathered rows.
const PREFETCH_ROWS: usize = 4;

/// Raw pointers into an activation row (advanced block by block).
#[derive(Clone, Copy)]
struct X {
    q: *const i16,
    d: *const f32,
    s32: *const f32,
    s16: *const f32,
}

impl X {
    fn of(x: ActRow) -> X {
        X {
            q: x.q.as_ptr(),
            d: x.d.as_ptr(),
            s32: x.s32.as_ptr(),
            s16: x.s16.as_ptr(),
        }
    }

    /// The rows of a group of `N` tokens.
    fn group<const N: usize>(xs: &[ActRow]) -> [X; N] {
        std::array::from_fn(|t| X::of(xs[t]))
    }

    /// The same row, `blocks` 32-activation blocks further on.
    unsafe fn skip(self, blocks: usize) -> X {
        X {
            q: self.q.add(32 * blocks),
            d: self.d.add(blocks),
            s32: self.s32.add(blocks),
            s16: self.s16.add(2 * blocks),
        }
    }
}

/// `outs[t][i] = xs[t] · row i` for the `outs[t].len()` rows of `rb` bytes at the start of
/// `rows` (the same count for every token), for a quantized `ty` (not F32/F16/BF16). The
/// format is matched once per group of tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn qdot_rows(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    xs: &[ActRow],
    outs: &mut [&mut [f32]],
) {
    let w = Rows {
        at: rows.as_ptr(),
        rb,
        index: std::ptr::null(),
    };
    qdot_tokens(ty, w, xs, outs)
}

/// `out[j] = x · row index[j]` for the rows of `rb` bytes at `rows`; the caller checked that
/// every index is a row of `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn qdot_gather(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    index: &[u32],
    x: ActRow,
    out: &mut [f32],
) {
    let w = Rows {
        at: rows.as_ptr(),
        rb,
        index: index.as_ptr(),
    };
    qdot_tokens(ty, w, &[x], &mut [out])
}

/// [`qdot_rows`] over the rows `w` addresses, in groups of tokens.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qdot_tokens(ty: GgmlType, w: Rows, xs: &[ActRow], outs: &mut [&mut [f32]]) {
    let nb = xs[0].d.len();
    let legacy = ty.block_size() == 32;
    let most = if legacy { LEGACY_GROUP } else { K_GROUP };
    let mut t0 = 0;
    while t0 < xs.len() {
        let g = (xs.len() - t0).min(most);
        let (x, o) = (&xs[t0..t0 + g], &mut outs[t0..t0 + g]);
        if legacy {
            for_group_size!(g; 1, 2, 3, 4, 5, 6, 7, 8; N => {
                legacy_group::<N>(ty, w, &X::group(x), nb, o)
            })
        } else {
            for_group_size!(g; 1, 2, 3, 4; N => k_group::<N>(ty, w, &X::group(x), nb, o))
        }
        t0 += g;
    }
}

/// [`qdot_rows`] for a group of `N` tokens (at most [`K_GROUP`]) of a K format; `nb` blocks of
/// 32 per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_group<const N: usize>(
    ty: GgmlType,
    w: Rows,
    x: &[X; N],
    nb: usize,
    outs: &mut [&mut [f32]],
) {
    match ty {
        GgmlType::Q2_K => kquant::<84, N>(w, x, nb / 8, q2_k::<N>, outs),
        GgmlType::Q3_K => kquant::<110, N>(w, x, nb / 8, q3_k::<N>, outs),
        GgmlType::Q4_K => kquant::<144, N>(w, x, nb / 8, q45_k::<false, N>, outs),
        GgmlType::Q5_K => kquant::<176, N>(w, x, nb / 8, q45_k::<true, N>, outs),
        GgmlType::Q6_K => kquant::<210, N>(w, x, nb / 8, q6_k::<N>, outs),
        GgmlType::Q8_K => kquant::<292, N>(w, x, nb / 8, q8_k::<N>, outs),
        _ => unreachable!("{ty} is not a K format"),
    }
}

/// [`qdot_rows`] for a group of `N` tokens (at most [`LEGACY_GROUP`]) of a 32-weight legacy
/// format.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_group<const N: usize>(
    ty: GgmlType,
    w: Rows,
    x: &[X; N],
    nb: usize,
    outs: &mut [&mut [f32]],
) {
    match ty {
        GgmlType::Q8_0 => legacy::<34, false, N>(w, x, nb, q8_0, outs),
        GgmlType::Q4_0 => legacy::<18, false, N>(w, x, nb, q4_0, outs),
        GgmlType::Q4_1 => legacy::<20, true, N>(w, x, nb, q4_1, outs),
        GgmlType::Q5_0 => legacy::<22, false, N>(w, x, nb, q5_0, outs),
        GgmlType::Q5_1 => legacy::<24, true, N>(w, x, nb, q5_1, outs),
        _ => {
            unreachable!("{ty} is not a 32-weight legacy format (float formats take the f32 path)")
        }
    }
}

/// Weight rows: the first row's address, the bytes per row, and the rows to walk: all in
/// order where `index` is null, else `index[0]`, `index[1]`, ….
#[derive(Clone, Copy)]
struct Rows {
    at: *const u8,
    rb: usize,
    index: *const u32,
}

impl Rows {
    /// The `i`-th row walked.
    #[inline]
    unsafe fn row(self, i: usize) -> *const u8 {
        let r = if self.index.is_null() {
            i
        } else {
            *self.index.add(i) as usize
        };
        self.at.add(r * self.rb)
    }

    /// Asks the cache for the `i`-th row walked, if there is one among the `n`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prefetch(self, i: usize, n: usize) {
        if i < n {
            let row = self.row(i);
            for line in (0..self.rb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(row.add(line).cast());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared pieces

/// The half at `p` through the conversion table `t` (a load, no conversion instruction).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_via(t: *const f32, p: *const u8) -> f32 {
    *t.add(usize::from(u16::from_le_bytes([*p, *p.add(1)])))
}

/// The 32 signed weight bytes of `v` (weight order) widened to 16 bits: weights `0..8,
/// 16..24` in the first vector, `8..16, 24..32` in the second — the activation order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_i8(v: __m256i) -> (__m256i, __m256i) {
    let sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
    (_mm256_unpacklo_epi8(v, sign), _mm256_unpackhi_epi8(v, sign))
}

/// [`widen_i8`] for unsigned weight bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_u8(v: __m256i) -> (__m256i, __m256i) {
    let zero = _mm256_setzero_si256();
    (_mm256_unpacklo_epi8(v, zero), _mm256_unpackhi_epi8(v, zero))
}

/// `lo · q[0..16] + hi · q[16..32]` as eight 32-bit pair sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn madd_pair(lo: __m256i, hi: __m256i, q: *const i16) -> __m256i {
    let a = _mm256_madd_epi16(lo, _mm256_loadu_si256(q.cast()));
    let b = _mm256_madd_epi16(hi, _mm256_loadu_si256(q.add(16).cast()));
    _mm256_add_epi32(a, b)
}

/// Lane `j` of `v` in all eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane(v: __m256, j: usize) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j as i32))
}

/// Lane `2i` of `v` in lanes 0..4 and lane `2i + 1` in lanes 4..8 (the two 16-weight halves
/// of activation block `i` of a 4-block group).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(v: __m256, i: usize) -> __m256 {
    let (a, b) = (2 * i as i32, 2 * i as i32 + 1);
    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(a, a, a, a, b, b, b, b))
}

// ---------------------------------------------------------------------------------------------
// 32-weight legacy formats: one activation block per weight block.

/// A block unpacker: the block's weight integers at `b`, widened to 16 bits in the activation
/// order (see [`widen_i8`]).
type Unpack32 = unsafe fn(*const u8) -> (__m256i, __m256i);

/// Every row of `w` (as many as `outs[0]` holds) against `N` tokens: Σ over the `nb` blocks
/// of `TS` bytes of `d · d_x · p` (plus `m · s_x` for formats with a minimum, `MIN`; `d` and
/// `m` are the block's first two halves, else `d` alone). Rows are walked one after the other
/// (one stream of addresses for the hardware prefetcher), with one accumulator per token: a
/// block's unpacking and products take longer than the FMA latency that chains them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const TS: usize, const MIN: bool, const N: usize>(
    w: Rows,
    x: &[X; N],
    nb: usize,
    unpack: Unpack32,
    outs: &mut [&mut [f32]],
) {
    let t = f16_table().as_ptr();
    for i in 0..outs[0].len() {
        let row = w.row(i);
        w.prefetch(i + PREFETCH_ROWS, outs[0].len());
        let mut acc = [_mm256_setzero_ps(); N];
        let mut mins = [0f32; N];
        for j in 0..nb {
            let b = row.add(j * TS);
            let (lo, hi) = unpack(b);
            let d = _mm256_set1_ps(f16_via(t, b));
            for n in 0..N {
                let p = madd_pair(lo, hi, x[n].q.add(32 * j));
                let s = _mm256_mul_ps(d, _mm256_broadcast_ss(&*x[n].d.add(j)));
                acc[n] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), acc[n]);
                if MIN {
                    mins[n] += f16_via(t, b.add(2)) * *x[n].s32.add(j);
                }
            }
        }
        for n in 0..N {
            outs[n][i] = hsum(acc[n]) + mins[n];
        }
    }
}

/// Q8_0 (34 bytes): `d: f16, qs: [i8; 32]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(b: *const u8) -> (__m256i, __m256i) {
    widen_i8(_mm256_loadu_si256(b.add(2).cast()))
}

/// The 32 nibbles of 16 bytes at `p` (low nibbles = weights 0..16) as unsigned bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let qs = _mm_loadu_si128(p.cast());
    let both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// 0xFF in byte `j` where bit `j` of the little-endian u32 at `qh` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits(qh: *const u8) -> __m256i {
    bits_to_bytes(u32::from_le(std::ptr::read_unaligned(qh.cast::<u32>())))
}

/// Q4_0 (18 bytes): `d: f16, qs: [u8; 16]`, weights `q − 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0(b: *const u8) -> (__m256i, __m256i) {
    widen_i8(_mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)))
}

/// Q4_1 (20 bytes): `d: f16, m: f16, qs: [u8; 16]`, weights `d · q + m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1(b: *const u8) -> (__m256i, __m256i) {
    widen_u8(nibbles32(b.add(4)))
}

/// Q5_0 (22 bytes): `d: f16, qh: u32, qs: [u8; 16]`, weights `q − 16`: the nibble minus 16
/// where the fifth bit is clear.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0(b: *const u8) -> (__m256i, __m256i) {
    let off = _mm256_andnot_si256(high_bits(b.add(2)), _mm256_set1_epi8(16));
    widen_i8(_mm256_sub_epi8(nibbles32(b.add(6)), off))
}

/// Q5_1 (24 bytes): `d: f16, m: f16, qh: u32, qs: [u8; 16]`, weights `d · q + m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1(b: *const u8) -> (__m256i, __m256i) {
    let fifth = _mm256_and_si256(high_bits(b.add(4)), _mm256_set1_epi8(16));
    widen_u8(_mm256_or_si256(nibbles32(b.add(8)), fifth))
}

// ---------------------------------------------------------------------------------------------
// 256-weight K super-blocks: eight activation blocks each.

/// A super-block kernel for `N` tokens: adds its scaled sums, minus its minimum terms, to
/// each token's two accumulators; `x` is every token's activations at this super-block.
type Block256<const N: usize> = unsafe fn(*const u8, &[X; N], &mut [[__m256; 2]; N]);

/// Every row of `w` (as many as `outs[0]` holds) against `N` tokens: Σ over `ns`
/// super-blocks of `TS` bytes, two accumulators per token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kquant<const TS: usize, const N: usize>(
    w: Rows,
    x: &[X; N],
    ns: usize,
    block: Block256<N>,
    outs: &mut [&mut [f32]],
) {
    for i in 0..outs[0].len() {
        let row = w.row(i);
        w.prefetch(i + PREFETCH_ROWS, outs[0].len());
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for s in 0..ns {
            let xs: [X; N] = std::array::from_fn(|n| x[n].skip(8 * s));
            block(row.add(s * TS), &xs, &mut acc);
        }
        for (o, a) in outs.iter_mut().zip(&acc) {
            o[i] = hsum(_mm256_add_ps(a[0], a[1]));
        }
    }
}

/// Adds activation block `j` of every token, times the weights widened in `lo` / `hi` and
/// the token's scales `s[n]` (weight scale × activation scale, per 16-weight half), to the
/// token's accumulator `j % 2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_block<const N: usize>(
    acc: &mut [[__m256; 2]; N],
    x: &[X; N],
    j: usize,
    s: [__m256; N],
    (lo, hi): (__m256i, __m256i),
) {
    for n in 0..N {
        let p = madd_pair(lo, hi, x[n].q.add(32 * j));
        acc[n][j % 2] = _mm256_fmadd_ps(s[n], _mm256_cvtepi32_ps(p), acc[n][j % 2]);
    }
}

/// Per-half scales of a super-block with sixteen 16-weight sub-blocks, for each token: `sub`
/// holds the 16 sub-block scales (times the super-block scale) as two vectors of eight; the
/// result is the same times each half's activation block scale (`[group of four blocks]
/// [token]`), for [`halves`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_scales<const N: usize>(sub: [__m256; 2], x: &[X; N]) -> [[__m256; N]; 2] {
    let lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    [
        x.map(|x| _mm256_mul_ps(sub[0], _mm256_permutevar8x32_ps(_mm256_loadu_ps(x.d), lo))),
        x.map(|x| _mm256_mul_ps(sub[1], _mm256_permutevar8x32_ps(_mm256_loadu_ps(x.d), hi))),
    ]
}

/// Per-block scales of a super-block with eight 32-weight sub-blocks, for each token: the
/// weight scales `sw` times the token's activation block scales, for [`lane`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_scales<const N: usize>(sw: __m256, x: &[X; N]) -> [__m256; N] {
    std::array::from_fn(|n| _mm256_mul_ps(sw, _mm256_loadu_ps(x[n].d)))
}

/// Subtracts the minimum terms `m · s` (eight lanes) of every token from its accumulator 0,
/// `s` being the token's activation sums at `at(x)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sub_mins<const N: usize>(
    acc: &mut [[__m256; 2]; N],
    x: &[X; N],
    m: __m256,
    at: impl Fn(X) -> *const f32,
) {
    for n in 0..N {
        acc[n][0] = _mm256_fnmadd_ps(m, _mm256_loadu_ps(at(x[n])), acc[n][0]);
    }
}

/// The 16 signed bytes of `v` as two vectors of eight f32, times `d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x16_scaled(v: __m128i, d: f32) -> [__m256; 2] {
    let d = _mm256_set1_ps(d);
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    [_mm256_mul_ps(d, lo), _mm256_mul_ps(d, hi)]
}

/// The eight 6-bit scales and the eight 6-bit mins of a Q4_K/Q5_K super-block, one per byte
/// (sub-block `j` in byte `j`), from its 12 packed scale bytes — the word-wide form of
/// `markbase_core::quant::k_scale_min`.
#[inline]
unsafe fn k_scales_mins(s: *const u8) -> (u64, u64) {
    let word = |i: usize| u32::from_le(std::ptr::read_unaligned(s.add(i).cast::<u32>()));
    let (a, b, c) = (word(0), word(4), word(8));
    let low6 = 0x3f3f_3f3f;
    let (nibbles, top2) = (0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & nibbles) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & nibbles) | (((b >> 6) & top2) << 4);
    let sc = u64::from(a & low6) | (u64::from(sc_hi) << 32);
    let m = u64::from(b & low6) | (u64::from(m_hi) << 32);
    (sc, m)
}

/// Q2_K (84 bytes): `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`; weight
/// `128 n + 32 k + l` is bits `2k..2k+2` of `qs[32 n + l]`; sub-block `s` of 16:
/// `w = d · (scales[s] & 15) · u − dmin · (scales[s] >> 4)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k<const N: usize>(b: *const u8, x: &[X; N], acc: &mut [[__m256; 2]; N]) {
    let (d, dmin) = (f16_at(b.add(80)), f16_at(b.add(82)));
    let sc = _mm_loadu_si128(b.cast());
    let m4 = _mm_set1_epi8(0x0F);
    // Both nibbles are below 16, so reading them as signed bytes is exact.
    let m = i8x16_scaled(_mm_and_si128(_mm_srli_epi16(sc, 4), m4), dmin);
    sub_mins(acc, x, m[0], |x| x.s16);
    sub_mins(acc, x, m[1], |x| x.s16.add(8));
    let tok = half_scales(i8x16_scaled(_mm_and_si128(sc, m4), d), x);
    let three = _mm256_set1_epi8(3);
    for (n, tok) in tok.into_iter().enumerate() {
        let qs = _mm256_loadu_si256(b.add(16 + 32 * n).cast());
        for k in 0..4 {
            let u = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * k as i32)), three);
            let s = tok.map(|v| halves(v, k));
            add_block(acc, x, 4 * n + k, s, widen_u8(u));
        }
    }
}

/// Q3_K (110 bytes): `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`; weight
/// `i = 128 n + 32 k + l` has bits `2k..2k+2` of `qs[32 n + l]`, minus 4 unless bit `i / 32`
/// of `hmask[l]` is set; sub-block `s` of 16 is scaled by `d · scale[s]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k<const N: usize>(b: *const u8, x: &[X; N], acc: &mut [[__m256; 2]; N]) {
    let sc = q3_k_scales(std::slice::from_raw_parts(b.add(96), 12));
    let sc = _mm_loadu_si128(sc.as_ptr().cast());
    let tok = half_scales(i8x16_scaled(sc, f16_at(b.add(108))), x);
    let hm = _mm256_loadu_si256(b.cast());
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    for (n, tok) in tok.into_iter().enumerate() {
        let qs = _mm256_loadu_si256(b.add(32 + 32 * n).cast());
        for k in 0..4 {
            let j = 4 * n + k;
            let shift = _mm_cvtsi32_si128(2 * k as i32);
            let low = _mm256_and_si256(_mm256_srl_epi16(qs, shift), three);
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            let v = _mm256_sub_epi8(low, _mm256_andnot_si256(set, four));
            let s = tok.map(|v| halves(v, k));
            add_block(acc, x, j, s, widen_i8(v));
        }
    }
}

/// Q4_K (144 bytes) and Q5_K (176 bytes) share this: `d: f16, dmin: f16, scales: [u8; 12]`,
/// for Q5_K `qh: [u8; 32]`, then `qs: [u8; 128]`; weight `i = 64 n + 32 h + l` is nibble `h`
/// of `qs[32 n + l]` (plus bit `i / 32` of `qh[l]` as bit 4); sub-block `j = i / 32` has
/// `w = d · sc[j] · u − dmin · m[j]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k<const FIVE: bool, const N: usize>(
    b: *const u8,
    x: &[X; N],
    acc: &mut [[__m256; 2]; N],
) {
    let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
    let (sc, m) = k_scales_mins(b.add(4));
    let tok = block_scales(_mm256_mul_ps(_mm256_set1_ps(d), u8x8_to_f32(sc)), x);
    let mv = _mm256_mul_ps(_mm256_set1_ps(dmin), u8x8_to_f32(m));
    sub_mins(acc, x, mv, |x| x.s32);
    let qs = b.add(if FIVE { 48 } else { 16 });
    let (m4, bit4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    // Bit j of each qh byte, walked down to bit 0 one sub-block at a time.
    let mut hb = if FIVE {
        _mm256_loadu_si256(b.add(16).cast())
    } else {
        _mm256_setzero_si256()
    };
    for n in 0..4 {
        let raw = _mm256_loadu_si256(qs.add(32 * n).cast());
        let mut lo = _mm256_and_si256(raw, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if FIVE {
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
            hb = _mm256_srli_epi16(hb, 1);
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
            hb = _mm256_srli_epi16(hb, 1);
        }
        let (j0, j1) = (2 * n, 2 * n + 1);
        add_block(acc, x, j0, tok.map(|v| lane(v, j0)), widen_u8(lo));
        add_block(acc, x, j1, tok.map(|v| lane(v, j1)), widen_u8(hi));
    }
}

/// Q6_K (210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`; weight
/// `i = 128 n + 32 k + l` has low nibble `k / 2` of `ql[64 n + 32 (k % 2) + l]` and bits
/// `2k..2k+2` of `qh[32 n + l]` as bits 4–5, minus 32; sub-block `s` of 16 is scaled by
/// `d · scales[s]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const N: usize>(b: *const u8, x: &[X; N], acc: &mut [[__m256; 2]; N]) {
    let sc = _mm_loadu_si128(b.add(192).cast());
    let tok = half_scales(i8x16_scaled(sc, f16_at(b.add(208))), x);
    let (m4, m3, off) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
    for (n, tok) in tok.into_iter().enumerate() {
        let qa = _mm256_loadu_si256(b.add(64 * n).cast());
        let qb = _mm256_loadu_si256(b.add(64 * n + 32).cast());
        let h = _mm256_loadu_si256(b.add(128 + 32 * n).cast());
        let high = |shift: i32| {
            let bits = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)), m3);
            _mm256_slli_epi16(bits, 4)
        };
        let v = [
            _mm256_or_si256(_mm256_and_si256(qa, m4), high(0)),
            _mm256_or_si256(_mm256_and_si256(qb, m4), high(2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), high(4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4), high(6)),
        ];
        for (k, v) in v.into_iter().enumerate() {
            let w = widen_i8(_mm256_sub_epi8(v, off));
            let s = tok.map(|v| halves(v, k));
            add_block(acc, x, 4 * n + k, s, w);
        }
    }
}

/// Q8_K (292 bytes): `d: f32, qs: [i8; 256], bsums: [i16; 16]` (sums unused here).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_k<const N: usize>(b: *const u8, x: &[X; N], acc: &mut [[__m256; 2]; N]) {
    let d = f32::from_le_bytes(std::ptr::read_unaligned(b.cast::<[u8; 4]>()));
    let tok = block_scales(_mm256_set1_ps(d), x);
    for j in 0..8 {
        let v = _mm256_loadu_si256(b.add(4 + 32 * j).cast());
        add_block(acc, x, j, tok.map(|v| lane(v, j)), widen_i8(v));
    }
}
