//! Portable integer dot products of a stored weight row with a [`QuantAct`] row: plain loops
//! that unpack each weight to a small integer, multiply it with the 16-bit activation in 32-bit
//! integers (exact), and apply the float scales once per block. The twin of `qdot_avx2`.
//!
//! [`QuantAct`]: super::act::QuantAct

use markbase_core::quant::{k_scale_min, q3_k_scales, GgmlType};

use super::act::ActRow;

/// The IEEE half at `b[i..i + 2]`, as f32.
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// `out[i] = x · row i` for the `out.len()` rows of `rb` bytes at the start of `rows`, for a
/// quantized `ty` (not F32/F16/BF16); sizes were checked by the caller.
pub(super) fn qdot_rows(ty: GgmlType, rows: &[u8], rb: usize, x: ActRow, out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(rb)) {
        *o = qdot(ty, row, x);
    }
}

/// `out[j] = x · row index[j]` for the rows of `rb` bytes in `rows`, for a quantized `ty`;
/// the caller checked that every index is a row of `rows`.
pub(super) fn qdot_gather(
    ty: GgmlType,
    rows: &[u8],
    rb: usize,
    index: &[u32],
    x: ActRow,
    out: &mut [f32],
) {
    for (o, &r) in out.iter_mut().zip(index) {
        let r = r as usize;
        *o = qdot(ty, &rows[r * rb..(r + 1) * rb], x);
    }
}

/// x · row for a quantized `ty`.
fn qdot(ty: GgmlType, row: &[u8], x: ActRow) -> f32 {
    match ty {
        GgmlType::Q8_0 => blocks32(row, 34, x, |b, x, j| {
            let p = dot_i32(b[2..34].iter().map(|&v| i32::from(v as i8)), x, j);
            (f16_at(b, 0), p, 0.0)
        }),
        GgmlType::Q4_0 => blocks32(row, 18, x, |b, x, j| {
            let p = dot_i32(nibbles(&b[2..18]).map(|u| u - 8), x, j);
            (f16_at(b, 0), p, 0.0)
        }),
        GgmlType::Q4_1 => blocks32(row, 20, x, |b, x, j| {
            let p = dot_i32(nibbles(&b[4..20]), x, j);
            (f16_at(b, 0), p, f16_at(b, 2))
        }),
        GgmlType::Q5_0 => blocks32(row, 22, x, |b, x, j| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let p = dot_i32(five_bits(&b[6..22], qh).map(|u| u - 16), x, j);
            (f16_at(b, 0), p, 0.0)
        }),
        GgmlType::Q5_1 => blocks32(row, 24, x, |b, x, j| {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let p = dot_i32(five_bits(&b[8..24], qh), x, j);
            (f16_at(b, 0), p, f16_at(b, 2))
        }),
        GgmlType::Q2_K => blocks256(row, 84, x, q2_k),
        GgmlType::Q3_K => blocks256(row, 110, x, q3_k),
        GgmlType::Q4_K => blocks256(row, 144, x, |b, x| q45_k(b, x, false)),
        GgmlType::Q5_K => blocks256(row, 176, x, |b, x| q45_k(b, x, true)),
        GgmlType::Q6_K => blocks256(row, 210, x, q6_k),
        GgmlType::Q8_K => blocks256(row, 292, x, q8_k),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            unreachable!("float formats take the f32 path")
        }
    }
}

/// Σ a_l · (activation `32 j + l`) over the 32 values of `a`, in 32-bit integers.
fn dot_i32(a: impl Iterator<Item = i32>, x: ActRow, j: usize) -> i32 {
    a.enumerate()
        .map(|(l, a)| a * i32::from(x.at(32 * j + l)))
        .sum()
}

/// The 32 4-bit values of a legacy block's 16 bytes (low nibbles first).
fn nibbles(qs: &[u8]) -> impl Iterator<Item = i32> + '_ {
    let lo = qs.iter().map(|&v| i32::from(v & 0x0F));
    lo.chain(qs.iter().map(|&v| i32::from(v >> 4)))
}

/// The 32 5-bit values of a legacy block: nibbles plus bit `i` of `qh` as bit 4.
fn five_bits(qs: &[u8], qh: u32) -> impl Iterator<Item = i32> + '_ {
    nibbles(qs)
        .enumerate()
        .map(move |(i, u)| u | (((qh >> i) & 1) << 4) as i32)
}

/// Sums over 32-weight blocks of `ts` bytes: `block(b, x, j)` gives `(d, p, m)` for block `j`
/// whose weights are `d · u + m` and `p = Σ u·q`; the block adds `d · d_x · p + m · s_x`.
fn blocks32(
    row: &[u8],
    ts: usize,
    x: ActRow,
    block: impl Fn(&[u8], ActRow, usize) -> (f32, i32, f32),
) -> f32 {
    let mut sum = 0f32;
    for (j, b) in row.chunks_exact(ts).enumerate() {
        let (d, p, m) = block(b, x, j);
        sum += d * x.d[j] * p as f32 + m * x.s32[j];
    }
    sum
}

/// Sums `block(b, x)` over the 256-weight super-blocks of `row` (`ts` bytes each), `x` being
/// the matching part of the activation row.
fn blocks256(row: &[u8], ts: usize, x: ActRow, block: impl Fn(&[u8], ActRow) -> f32) -> f32 {
    let mut sum = 0f32;
    for (s, b) in row.chunks_exact(ts).enumerate() {
        let part = ActRow {
            q: &x.q[256 * s..256 * (s + 1)],
            d: &x.d[8 * s..8 * (s + 1)],
            s32: &x.s32[8 * s..8 * (s + 1)],
            s16: &x.s16[16 * s..16 * (s + 1)],
        };
        sum += block(b, part);
    }
    sum
}

/// Q2_K super-block; weight `i = 128 n + 32 k + l` is bits `2k..2k+2` of `qs[32 n + l]`,
/// sub-block `s = i / 16` has `w = d·(sc & 15)·u − dmin·(sc >> 4)`.
fn q2_k(b: &[u8], x: ActRow) -> f32 {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut sum = 0f32;
    let mut mins = 0f32;
    for j in 0..8 {
        let (n, k) = (j / 4, j % 4);
        let mut p = 0i32;
        for l in 0..32 {
            let u = i32::from((qs[32 * n + l] >> (2 * k)) & 3);
            let sc = i32::from(scales[2 * j + l / 16] & 0x0F);
            p += sc * u * i32::from(x.at(32 * j + l));
        }
        sum += d * x.d[j] * p as f32;
        for h in 0..2 {
            mins += dmin * f32::from(scales[2 * j + h] >> 4) * x.s16[2 * j + h];
        }
    }
    sum - mins
}

/// Q3_K super-block; weight `i = 128 n + 32 k + l` has bits `2k..2k+2` of `qs[32 n + l]`,
/// minus 4 unless bit `i / 32` of `hmask[l]` is set; sub-block `s = i / 16` is scaled by
/// `d · scales[s]`.
fn q3_k(b: &[u8], x: ActRow) -> f32 {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    let mut sum = 0f32;
    for j in 0..8 {
        let (n, k) = (j / 4, j % 4);
        let mut p = 0i32;
        for l in 0..32 {
            let low = i32::from((qs[32 * n + l] >> (2 * k)) & 3);
            let high = (hmask[l] >> j) & 1 != 0;
            let w = if high { low } else { low - 4 };
            p += i32::from(scales[2 * j + l / 16]) * w * i32::from(x.at(32 * j + l));
        }
        sum += d * x.d[j] * p as f32;
    }
    sum
}

/// Q4_K / Q5_K super-block; weight `i = 64 n + 32 h + l` is nibble `h` of `qs[32 n + l]`
/// (plus, for Q5_K, bit `i / 32` of `qh[l]` as bit 4); sub-block `j = i / 32` has
/// `w = d·sc·u − dmin·m` with `(sc, m)` from [`k_scale_min`].
fn q45_k(b: &[u8], x: ActRow, five: bool) -> f32 {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if five {
        (&b[16..48], &b[48..176])
    } else {
        (&b[0..0], &b[16..144])
    };
    let mut sum = 0f32;
    let mut mins = 0f32;
    for j in 0..8 {
        let (sc, m) = k_scale_min(scales, j);
        let mut p = 0i32;
        for l in 0..32 {
            let mut u = i32::from((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F);
            if five {
                u |= i32::from((qh[l] >> j) & 1) << 4;
            }
            p += u * i32::from(x.at(32 * j + l));
        }
        sum += d * f32::from(sc) * x.d[j] * p as f32;
        mins += dmin * f32::from(m) * x.s32[j];
    }
    sum - mins
}

/// Q6_K super-block; weight `i = 128 n + 32 k + l` has low nibble `k / 2` of
/// `ql[64 n + 32 (k % 2) + l]` and bits `2k..2k+2` of `qh[32 n + l]` as bits 4–5, minus 32;
/// sub-block `s = i / 16` is scaled by `d · scales[s]`.
fn q6_k(b: &[u8], x: ActRow) -> f32 {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    let mut sum = 0f32;
    for j in 0..8 {
        let (n, k) = (j / 4, j % 4);
        // 32 terms of up to 128 · 32 · 32767 can pass 2^31: sum in 64 bits.
        let mut p = 0i64;
        for l in 0..32 {
            let lo = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            let hi = (qh[32 * n + l] >> (2 * k)) & 3;
            let w = i32::from(lo | (hi << 4)) - 32;
            let sc = i32::from(scales[2 * j + l / 16] as i8);
            p += i64::from(sc * w * i32::from(x.at(32 * j + l)));
        }
        sum += d * x.d[j] * p as f32;
    }
    sum
}

/// Q8_K super-block: `d: f32`, 256 signed bytes (the block sums are not needed here).
fn q8_k(b: &[u8], x: ActRow) -> f32 {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut sum = 0f32;
    for j in 0..8 {
        let w = b[4 + 32 * j..4 + 32 * (j + 1)].iter();
        let p = dot_i32(w.map(|&v| i32::from(v as i8)), x, j);
        sum += d * x.d[j] * p as f32;
    }
    sum
}
