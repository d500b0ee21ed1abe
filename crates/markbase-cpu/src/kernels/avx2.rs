//! AVX2 + FMA + F16C kernels for x86-64.
//!
//! Q8_0, Q4_0, Q5_0, Q4_K and Q6_K (the formats of the default model) have block kernels:
//! the integer values of a block are unpacked with byte shuffles, converted to f32 eight at a
//! time and multiplied into f32 sums with FMA; a block's (sub-)scale multiplies its partial sum
//! once, or, for Q4_K's offsets, each weight is formed as `scale * q - min` with one FMA, which
//! is exactly the reference weight because `scale * q` is exact in f32. The float formats are
//! converted in registers. Other formats dequantize a chunk with the reference code and take an
//! f32 dot product. Dequantizing for [`dot_rows`] gives weights bit-identical to the reference.
//!
//! Safety contract of every `unsafe fn` here: the CPU has AVX2, FMA and F16C, and the slices
//! passed hold the sizes their docs state (the public entry points check them).

use std::arch::x86_64::*;
use std::ptr;

use markbase_core::quant::GgmlType;

use super::vmath::avx2::hsum;
use super::{chunks, dequantize_chunk, CHUNK};

/// Sums `kernel(block, x, acc)` over the 32-weight blocks of `row` (`$ts` bytes each), with
/// two independent accumulators, and returns the total.
macro_rules! blocks32 {
    ($kernel:ident, $ts:expr, $row:expr, $x:expr) => {{
        let (row, x): (&[u8], &[f32]) = ($row, $x);
        let mut acc = [_mm256_setzero_ps(); 2];
        let pairs = row.chunks_exact(2 * $ts);
        let last = pairs.remainder();
        for (b, xb) in pairs.zip(x.chunks_exact(64)) {
            acc[0] = $kernel(b.as_ptr(), xb.as_ptr(), acc[0]);
            acc[1] = $kernel(b[$ts..].as_ptr(), xb[32..].as_ptr(), acc[1]);
        }
        if !last.is_empty() {
            acc[0] = $kernel(last.as_ptr(), x[x.len() - 32..].as_ptr(), acc[0]);
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }};
}

/// x · row; `row` holds exactly `x.len()` weights of `ty`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => dot_f32(row.as_ptr().cast(), x.as_ptr(), x.len()),
        GgmlType::F16 => dot_f16(row, x),
        GgmlType::BF16 => dot_bf16(row, x),
        GgmlType::Q8_0 => blocks32!(q8_0_block, 34, row, x),
        GgmlType::Q4_0 => blocks32!(q4_0_block, 18, row, x),
        GgmlType::Q5_0 => blocks32!(q5_0_block, 22, row, x),
        GgmlType::Q4_K => blocks256(q4_k_block, 144, row, x),
        GgmlType::Q6_K => blocks256(q6_k_block, 210, row, x),
        _ => {
            let mut buf = [0f32; CHUNK];
            let mut sum = 0f32;
            for (start, m, bytes) in chunks(ty, x.len()) {
                dequantize_chunk(ty, &row[bytes], &mut buf[..m]);
                sum += dot_f32(buf.as_ptr(), x[start..].as_ptr(), m);
            }
            sum
        }
    }
}

/// `out[i] = xs[i*k..(i+1)*k] · row`; `row` holds `k` weights of `ty`, `xs` holds
/// `out.len() * k` values. Each chunk of the row is dequantized once into a stack buffer.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_rows(ty: GgmlType, row: &[u8], xs: &[f32], k: usize, out: &mut [f32]) {
    let mut buf = [0f32; CHUNK];
    out.fill(0.0);
    for (start, m, bytes) in chunks(ty, k) {
        dequantize(ty, &row[bytes], &mut buf[..m]);
        for (o, x) in out.iter_mut().zip(xs.chunks_exact(k)) {
            *o += dot_f32(buf.as_ptr(), x[start..].as_ptr(), m);
        }
    }
}

/// Dequantizes whole blocks of `ty` from `src` into `dst` (matching sizes), bit-identical to
/// the reference.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => {
            for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
                store_scaled(q8_0_values(b.as_ptr()), y);
            }
        }
        GgmlType::Q4_0 => {
            for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
                store_scaled(q4_0_values(b.as_ptr()), y);
            }
        }
        GgmlType::Q5_0 => {
            for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(32)) {
                store_scaled(q5_0_values(b.as_ptr()), y);
            }
        }
        GgmlType::Q4_K => {
            for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(256)) {
                q4_k_each(b, |i, w| _mm256_storeu_ps(y[i..].as_mut_ptr(), w));
            }
        }
        GgmlType::Q6_K => {
            for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(256)) {
                q6_k_each(b, |i, scale, [q0, q1]| {
                    let scale = _mm256_set1_ps(scale);
                    _mm256_storeu_ps(y[i..].as_mut_ptr(), _mm256_mul_ps(scale, q0));
                    _mm256_storeu_ps(y[i + 8..].as_mut_ptr(), _mm256_mul_ps(scale, q1));
                });
            }
        }
        _ => dequantize_chunk(ty, src, dst),
    }
}

// ---------------------------------------------------------------------------------------------
// Shared pieces

/// The IEEE half stored little-endian at `p`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Eight f32 from `p` (any alignment).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const f32) -> __m256 {
    _mm256_loadu_ps(p)
}

/// The eight signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x8_at(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The 16 signed bytes of `v` as two vectors of f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x16_to_f32(v: __m128i) -> [__m256; 2] {
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))),
    ]
}

/// The 32 signed bytes of `v` as four vectors of f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x32_to_f32(v: __m256i) -> [__m256; 4] {
    let [a, b] = i8x16_to_f32(_mm256_castsi256_si128(v));
    let [c, d] = i8x16_to_f32(_mm256_extracti128_si256(v, 1));
    [a, b, c, d]
}

/// a · b over `n` values from `a` and `b` (any alignment).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, s) in acc.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(load(a.add(i + 8 * j)), load(b.add(i + 8 * j)), *s);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(load(a.add(i)), load(b.add(i)), acc[0]);
        i += 8;
    }
    let mut sum = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        sum += ptr::read_unaligned(a.add(i)) * *b.add(i);
        i += 1;
    }
    sum
}

/// x · row for little-endian IEEE halves.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let (p, n) = (row.as_ptr(), x.len());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 8 <= n {
        let w = _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i).cast()));
        acc[(i / 8) % 2] = _mm256_fmadd_ps(w, load(x.as_ptr().add(i)), acc[(i / 8) % 2]);
        i += 8;
    }
    let mut sum = hsum(_mm256_add_ps(acc[0], acc[1]));
    for (j, xj) in x.iter().enumerate().skip(i) {
        sum += f16_at(p.add(2 * j)) * xj;
    }
    sum
}

/// x · row for little-endian bfloat16.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let (p, n) = (row.as_ptr(), x.len());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 8 <= n {
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i).cast()));
        let w = _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
        acc[(i / 8) % 2] = _mm256_fmadd_ps(w, load(x.as_ptr().add(i)), acc[(i / 8) % 2]);
        i += 8;
    }
    let mut sum = hsum(_mm256_add_ps(acc[0], acc[1]));
    for (w, xj) in row.chunks_exact(2).zip(x).skip(i) {
        sum += f32::from_bits(u32::from(u16::from_le_bytes([w[0], w[1]])) << 16) * xj;
    }
    sum
}

// ---------------------------------------------------------------------------------------------
// 32-weight formats: a block is one f16 scale `d` and 32 small integers `q`, `w = q * d`.

/// A 32-weight block as its scale and its integer values in four f32 vectors.
type Scaled32 = (f32, [__m256; 4]);

/// `acc + d * (q · x)` for one 32-weight block and the 32 activations at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_dot32((d, q): Scaled32, x: *const f32, acc: __m256) -> __m256 {
    let s0 = _mm256_mul_ps(q[0], load(x));
    let s1 = _mm256_mul_ps(q[1], load(x.add(8)));
    let s0 = _mm256_fmadd_ps(q[2], load(x.add(16)), s0);
    let s1 = _mm256_fmadd_ps(q[3], load(x.add(24)), s1);
    _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(s0, s1), acc)
}

/// Writes the 32 weights `q * d` of a block to `y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_scaled((d, q): Scaled32, y: &mut [f32]) {
    let d = _mm256_set1_ps(d);
    for (i, v) in q.iter().enumerate() {
        _mm256_storeu_ps(y[8 * i..].as_mut_ptr(), _mm256_mul_ps(*v, d));
    }
}

/// Q8_0 block (34 bytes at `b`): `d: f16, qs: [i8; 32]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_values(b: *const u8) -> Scaled32 {
    let q = b.add(2);
    let v = [
        i8x8_at(q),
        i8x8_at(q.add(8)),
        i8x8_at(q.add(16)),
        i8x8_at(q.add(24)),
    ];
    (f16_at(b), v)
}

/// Q4_0 block (18 bytes at `b`): `d: f16, qs: [u8; 16]`, nibbles offset by 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_values(b: *const u8) -> Scaled32 {
    let qs = _mm_loadu_si128(b.add(2).cast());
    let (m4, eight) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(8));
    let lo = _mm_sub_epi8(_mm_and_si128(qs, m4), eight);
    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), eight);
    let [a, c] = i8x16_to_f32(lo);
    let [e, g] = i8x16_to_f32(hi);
    (f16_at(b), [a, c, e, g])
}

/// Q5_0 block (22 bytes at `b`): `d: f16, qh: u32, qs: [u8; 16]`, 5-bit values offset by 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_values(b: *const u8) -> Scaled32 {
    let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
    let qs = _mm_loadu_si128(b.add(6).cast());
    let m4 = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(qs, m4);
    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
    let nibbles = _mm256_set_m128i(hi, lo);
    let fifth = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
    let q = _mm256_sub_epi8(_mm256_or_si256(nibbles, fifth), _mm256_set1_epi8(16));
    (f16_at(b), i8x32_to_f32(q))
}

/// Byte `j` of the result is 0xFF where bit `j` of `bits` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    // byte j <- byte j / 8 of `bits`
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    // set every bit but bit j % 8: all ones exactly when that bit was set
    let probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(probe, _mm256_set1_epi8(-1))
}

/// Q8_0 block kernel for [`blocks32`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_block(b: *const u8, x: *const f32, acc: __m256) -> __m256 {
    scaled_dot32(q8_0_values(b), x, acc)
}

/// Q4_0 block kernel for [`blocks32`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_block(b: *const u8, x: *const f32, acc: __m256) -> __m256 {
    scaled_dot32(q4_0_values(b), x, acc)
}

/// Q5_0 block kernel for [`blocks32`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_block(b: *const u8, x: *const f32, acc: __m256) -> __m256 {
    scaled_dot32(q5_0_values(b), x, acc)
}

// ---------------------------------------------------------------------------------------------
// 256-weight K-quant super-blocks.

/// Sums `kernel(block, x)` (a vector of partial sums) over the super-blocks of `row`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks256(
    kernel: unsafe fn(&[u8], &[f32]) -> __m256,
    ts: usize,
    row: &[u8],
    x: &[f32],
) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (b, xb) in row.chunks_exact(ts).zip(x.chunks_exact(256)) {
        acc = _mm256_add_ps(acc, kernel(b, xb));
    }
    hsum(acc)
}

/// The eight 6-bit scales and the eight 6-bit mins of a Q4_K/Q5_K super-block, one per byte
/// (sub-block `j` in byte `j`), from its 12 packed scale bytes — the word-wide form of
/// `markbase_core::quant::k_scale_min`.
#[inline]
fn k_scales_mins(s: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let low6 = 0x3f3f_3f3f;
    let (nibbles, top2) = (0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & nibbles) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & nibbles) | (((b >> 6) & top2) << 4);
    let sc = u64::from(a & low6) | (u64::from(sc_hi) << 32);
    let m = u64::from(b & low6) | (u64::from(m_hi) << 32);
    (sc, m)
}

/// The eight bytes of `v` (least significant first) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn u8x8_to_f32(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// Calls `f(i, w)` for the eight weights `w` at `i, i+1, .., i+7` of a Q4_K super-block
/// (144 bytes: `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`), 32 calls in all.
/// `w = (d * sc) * q - dmin * m` with a single rounding, which equals the reference's
/// two-rounding result because `(d * sc) * q` is exact (11 + 6 + 4 significant bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_each(b: &[u8], mut f: impl FnMut(usize, __m256)) {
    let (d, dmin) = (f16_at(b.as_ptr()), f16_at(b.as_ptr().add(2)));
    let (sc, m) = k_scales_mins(&b[4..16]);
    let scales = _mm256_mul_ps(_mm256_set1_ps(d), u8x8_to_f32(sc));
    let mins = _mm256_mul_ps(_mm256_set1_ps(dmin), u8x8_to_f32(m));
    let lane = |j: i32| _mm256_set1_epi32(j);
    let qs = b[16..144].as_ptr();
    let m4 = _mm256_set1_epi32(0x0F);
    for n in 0..4 {
        let j = 2 * n as i32;
        let d0 = _mm256_permutevar8x32_ps(scales, lane(j));
        let min0 = _mm256_permutevar8x32_ps(mins, lane(j));
        let d1 = _mm256_permutevar8x32_ps(scales, lane(j + 1));
        let min1 = _mm256_permutevar8x32_ps(mins, lane(j + 1));
        for g in 0..4 {
            let raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(32 * n + 8 * g).cast()));
            let lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, m4));
            let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
            f(64 * n + 8 * g, _mm256_fmsub_ps(d0, lo, min0));
            f(64 * n + 32 + 8 * g, _mm256_fmsub_ps(d1, hi, min1));
        }
    }
}

/// Q4_K super-block kernel: partial sums of (weights · x).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_block(b: &[u8], x: &[f32]) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let xp = x.as_ptr();
    q4_k_each(b, |i, w| {
        let s = &mut acc[(i / 8) % 8];
        *s = _mm256_fmadd_ps(w, load(xp.add(i)), *s);
    });
    let [a, b, c, d, e, f, g, h] = acc;
    let sum4 = |a, b, c, d| _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
    _mm256_add_ps(sum4(a, b, c, d), sum4(e, f, g, h))
}

/// Calls `f(i, scale, [q0, q1])` for each 16-weight sub-block of a Q6_K super-block (210 bytes:
/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`): `q0`, `q1` are the signed 6-bit
/// values at `i..i+8` and `i+8..i+16`, `scale = d * scales[i / 16]`, the weights `scale * q`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_each(b: &[u8], mut f: impl FnMut(usize, f32, [__m256; 2])) {
    let d = f16_at(b[208..].as_ptr());
    let scales = &b[192..208];
    let (m4, m3, off) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
    for n in 0..2 {
        let qa = _mm256_loadu_si256(b[64 * n..].as_ptr().cast());
        let qb = _mm256_loadu_si256(b[64 * n + 32..].as_ptr().cast());
        let h = _mm256_loadu_si256(b[128 + 32 * n..].as_ptr().cast());
        let high = |shift: i32| {
            let bits = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(shift)), m3);
            _mm256_slli_epi16(bits, 4)
        };
        let q = [
            _mm256_or_si256(_mm256_and_si256(qa, m4), high(0)),
            _mm256_or_si256(_mm256_and_si256(qb, m4), high(2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), high(4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4), high(6)),
        ];
        for (k, v) in q.into_iter().enumerate() {
            let i = 128 * n + 32 * k;
            let [v0, v1, v2, v3] = i8x32_to_f32(_mm256_sub_epi8(v, off));
            f(i, d * f32::from(scales[i / 16] as i8), [v0, v1]);
            f(i + 16, d * f32::from(scales[i / 16 + 1] as i8), [v2, v3]);
        }
    }
}

/// Q6_K super-block kernel: partial sums of (weights · x), each 16-weight sub-block's scale
/// applied once to its sum.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_block(b: &[u8], x: &[f32]) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let xp = x.as_ptr();
    q6_k_each(b, |i, scale, [q0, q1]| {
        let sum = _mm256_fmadd_ps(q1, load(xp.add(i + 8)), _mm256_mul_ps(q0, load(xp.add(i))));
        let s = &mut acc[(i / 16) % 4];
        *s = _mm256_fmadd_ps(_mm256_set1_ps(scale), sum, *s);
    });
    _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))
}
