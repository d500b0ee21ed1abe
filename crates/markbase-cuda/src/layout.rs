//! How weight rows lie in device memory where it differs from the file. Q8_0 blocks are 34
//! bytes (an f16 scale, 32 quants), so as stored no block past the first of a row starts on a
//! 4-byte boundary and kernels can only read them two bytes at a time. On the device each
//! full group of 8 blocks (256 values) of a row lies as its 8 scales (16 bytes) followed by its
//! 256 quants: the same 272 bytes, now 16-byte aligned where the row is, so a lane loads a
//! block's quants as two `uint4`s. The blocks after a row's last full group stay as stored.
//! `q8_0_block` in quant.cuh reads this layout.
//!
//! Q6_K super-blocks are 210 bytes, so as stored they lie only 2-byte aligned. On the device
//! each takes 224 bytes (6.7 % more), laid out for the lanes that read it: a lane `s` of its 8
//! (`s = 2n + h`) takes values `16h .. 16h + 16` of chunks `2n` and `2n + 1` (32 values each),
//! as a one-token Q4_K lane does (quant.cuh, `i16_rows`). Bytes `16s .. 16s + 16` hold their
//! 6-bit values' low 4 bits (chunk `2n` in the low nibbles, `2n + 1` in the high ones, like
//! Q4_K's quants); the words at `128 + 8s` (chunk `2n`) and `132 + 8s` (chunk `2n + 1`) their
//! high 2 bits, value `4i + j`'s at bits `8j + 2i` of its word (so `(w >> 2i) & 0x03030303`
//! gives word `i` of the low bits their high bits); and the word at `192 + 4s` the two
//! chunks' 16-value scales as bytes and the super-block's f16 `d` above them. The 6-bit values
//! stay unsigned (`w = d · scale · (q − 32)`). quant.cuh's Q6_K readers take this layout.
//!
//! Q4_0 and Q5_0 rows of a multiple of 256 values (18- and 22-byte blocks, 2-byte aligned as
//! stored) lie on the device in units of 8 blocks, the same bytes, 16-byte aligned: the 8 f16
//! scales (16 bytes), then for each lane slot `s = 2n + h` 16 bytes holding values
//! `16h .. 16h + 16` of blocks `2n` (low nibbles) and `2n + 1` (high nibbles) as a Q4_K lane
//! reads them, then (Q5_0) for each slot a word of their fifth bits: block `2n`'s value
//! `16h + m` at bit `8(m % 4) + m / 4`, block `2n + 1`'s 4 bits above it (so `(w >> i) &
//! 0x01010101` gives word `i` of the low bits their fifth bits). Rows of other widths, and
//! every other format, lie as stored.
//!
//! Q5_K super-blocks (176 bytes, 16-byte aligned as stored) keep their bytes but not their
//! order: the 16-byte header, then the 128 quant bytes (as Q4_K's, at the same offset), then
//! for each lane slot `s = 2n + h` the word of its values' fifth bits, chunk `2n`'s value
//! `16h + m` at bit `8(m % 4) + m / 4` and chunk `2n + 1`'s 4 bits above it (as Q5_0's). As
//! stored, all 32 bytes of fifth bits hold bits of every chunk, so each lane read 16 bytes
//! to use 4.

use std::borrow::Cow;

use markbase_core::quant::GgmlType;

/// Bytes of a Q8_0 block: its f16 scale and 32 quants.
const Q8_0_BLOCK: usize = 34;
/// Blocks of a regrouped Q8_0 group.
const GROUP_BLOCKS: usize = 8;

/// Bytes of a Q6_K super-block as stored.
const Q6_K_BLOCK: usize = 210;
/// Bytes of a Q6_K super-block on the device.
const Q6_K_DEVICE_BLOCK: usize = 224;

/// Bytes of a Q5_K super-block (as stored and on the device).
const Q5_K_BLOCK: usize = 176;

/// Bytes of a Q4_0 block: its f16 scale and 16 bytes of nibbles.
const Q4_0_BLOCK: usize = 18;
/// Bytes of a Q5_0 block: its f16 scale, a word of fifth bits and 16 bytes of nibbles.
const Q5_0_BLOCK: usize = 22;

/// Lays one row out as on the device (the row as stored, its place).
type LayRow = fn(&[u8], &mut [u8]);

/// `bytes` (`rows` rows of `ty`, as stored in the file) as they lie on the device.
pub fn device_bytes(ty: GgmlType, bytes: &[u8], rows: usize) -> Cow<'_, [u8]> {
    let (out_row, lay): (usize, LayRow) = match ty {
        _ if rows == 0 => return Cow::Borrowed(bytes),
        GgmlType::Q8_0 => (bytes.len() / rows, regroup_q8_0_row),
        GgmlType::Q6_K => (
            bytes.len() / rows / Q6_K_BLOCK * Q6_K_DEVICE_BLOCK,
            lay_q6_k_row,
        ),
        GgmlType::Q5_K => (bytes.len() / rows, lay_q5_k_row),
        GgmlType::Q4_0 if (bytes.len() / rows / Q4_0_BLOCK).is_multiple_of(GROUP_BLOCKS) => {
            (bytes.len() / rows, |r, o| lay_legacy_row(r, o, false))
        }
        GgmlType::Q5_0 if (bytes.len() / rows / Q5_0_BLOCK).is_multiple_of(GROUP_BLOCKS) => {
            (bytes.len() / rows, |r, o| lay_legacy_row(r, o, true))
        }
        _ => return Cow::Borrowed(bytes),
    };
    let row_bytes = bytes.len() / rows;
    let mut out = vec![0u8; out_row * rows];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Whole rows a thread, at least 4 MB of them.
    let per_thread = rows
        .div_ceil(threads)
        .max((4 << 20) / row_bytes.max(1))
        .max(1);
    std::thread::scope(|s| {
        for (src, dst) in bytes
            .chunks(per_thread * row_bytes)
            .zip(out.chunks_mut(per_thread * out_row))
        {
            s.spawn(move || {
                for (r, o) in src.chunks(row_bytes).zip(dst.chunks_mut(out_row)) {
                    lay(r, o);
                }
            });
        }
    });
    Cow::Owned(out)
}

/// One Q8_0 row (as stored) into `out` (as on the device).
fn regroup_q8_0_row(row: &[u8], out: &mut [u8]) {
    let group = GROUP_BLOCKS * Q8_0_BLOCK;
    let full = row.len() / group;
    for (src, dst) in row.chunks(group).zip(out.chunks_mut(group)).take(full) {
        for (b, block) in src.chunks_exact(Q8_0_BLOCK).enumerate() {
            dst[2 * b..2 * b + 2].copy_from_slice(&block[..2]);
            let q = 2 * GROUP_BLOCKS + 32 * b;
            dst[q..q + 32].copy_from_slice(&block[2..]);
        }
    }
    out[full * group..].copy_from_slice(&row[full * group..]);
}

/// One Q6_K row (as stored) into `out` (as on the device: the module's layout).
fn lay_q6_k_row(row: &[u8], out: &mut [u8]) {
    for (b, o) in row
        .chunks_exact(Q6_K_BLOCK)
        .zip(out.chunks_exact_mut(Q6_K_DEVICE_BLOCK))
    {
        let (ql, qh, scales, d) = (&b[..128], &b[128..192], &b[192..208], &b[208..210]);
        // The 6-bit value of weight i = 128 n + 32 k + l (markbase-core's kquants::q6_k).
        let q = |i: usize| {
            let (n, k, l) = (i / 128, (i % 128) / 32, i % 32);
            let lo = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
            let hi = (qh[32 * n + l] >> (2 * k)) & 3;
            lo | (hi << 4)
        };
        for s in 0..8 {
            let (n, h) = (s / 2, s % 2);
            let mut high = [0u32; 2];
            for m in 0..16 {
                let (a, c) = (q(64 * n + 16 * h + m), q(64 * n + 32 + 16 * h + m));
                o[16 * s + m] = (a & 0x0F) | ((c & 0x0F) << 4);
                let bit = 8 * (m % 4) + 2 * (m / 4);
                high[0] |= u32::from(a >> 4) << bit;
                high[1] |= u32::from(c >> 4) << bit;
            }
            o[128 + 8 * s..132 + 8 * s].copy_from_slice(&high[0].to_le_bytes());
            o[132 + 8 * s..136 + 8 * s].copy_from_slice(&high[1].to_le_bytes());
            let hdr = 192 + 4 * s;
            o[hdr] = scales[4 * n + h];
            o[hdr + 1] = scales[4 * n + 2 + h];
            o[hdr + 2..hdr + 4].copy_from_slice(d);
        }
    }
}

/// One Q5_K row (as stored) into `out` (as on the device: the module's layout).
fn lay_q5_k_row(row: &[u8], out: &mut [u8]) {
    for (b, o) in row
        .chunks_exact(Q5_K_BLOCK)
        .zip(out.chunks_exact_mut(Q5_K_BLOCK))
    {
        let qh = &b[16..48];
        o[..16].copy_from_slice(&b[..16]);
        o[16..144].copy_from_slice(&b[48..]);
        for s in 0..8 {
            let (n, h) = (s / 2, s % 2);
            let mut fifth = 0u32;
            for m in 0..16 {
                let bits = qh[16 * h + m] >> (2 * n);
                let at = 8 * (m % 4) + m / 4;
                fifth |= u32::from(bits & 1) << at | u32::from((bits >> 1) & 1) << (at + 4);
            }
            o[144 + 4 * s..148 + 4 * s].copy_from_slice(&fifth.to_le_bytes());
        }
    }
}

/// The 5-bit (Q5_0) or 4-bit (Q4_0, no fifth-bit word) value `v` of a legacy block `b`
/// (markbase-core's legacy.rs).
fn legacy_q(b: &[u8], five: bool, v: usize) -> u8 {
    let qs = &b[if five { 6 } else { 2 }..];
    let low = (qs[v % 16] >> (4 * (v / 16))) & 0x0F;
    if !five {
        return low;
    }
    let qh = u32::from_le_bytes(b[2..6].try_into().unwrap());
    low | (((qh >> v) & 1) as u8) << 4
}

/// One Q4_0 / Q5_0 row of whole 8-block units (as stored) into `out` (as on the device).
fn lay_legacy_row(row: &[u8], out: &mut [u8], five: bool) {
    let block = if five { Q5_0_BLOCK } else { Q4_0_BLOCK };
    for (src, o) in row
        .chunks_exact(GROUP_BLOCKS * block)
        .zip(out.chunks_exact_mut(GROUP_BLOCKS * block))
    {
        let b = |i: usize| &src[i * block..(i + 1) * block];
        for i in 0..GROUP_BLOCKS {
            o[2 * i..2 * i + 2].copy_from_slice(&b(i)[..2]);
        }
        for s in 0..8 {
            let (n, h) = (s / 2, s % 2);
            let mut fifth = 0u32;
            for m in 0..16 {
                let (a, c) = (
                    legacy_q(b(2 * n), five, 16 * h + m),
                    legacy_q(b(2 * n + 1), five, 16 * h + m),
                );
                o[16 + 16 * s + m] = (a & 0x0F) | ((c & 0x0F) << 4);
                let bit = 8 * (m % 4) + m / 4;
                fifth |= u32::from(a >> 4) << bit | u32::from(c >> 4) << (bit + 4);
            }
            if five {
                o[144 + 4 * s..148 + 4 * s].copy_from_slice(&fifth.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_rows_regroup_full_groups_and_keep_their_tail() {
        // Two rows of 25 blocks (three full groups and one block): block b's scale bytes are
        // (b, 200 + b), its quants 32 times the byte b + 1 + row · 100.
        let (rows, blocks) = (2, 25);
        let mut bytes = Vec::new();
        for r in 0..rows {
            for b in 0..blocks {
                bytes.extend([b as u8, 200 + b as u8]);
                bytes.extend([(b + 1 + 100 * r) as u8; 32]);
            }
        }
        let out = device_bytes(GgmlType::Q8_0, &bytes, rows);
        assert_eq!(out.len(), bytes.len());
        for r in 0..rows {
            let row = &out[r * blocks * 34..(r + 1) * blocks * 34];
            for b in 0..24 {
                let g = &row[272 * (b / 8)..];
                assert_eq!(&g[2 * (b % 8)..2 * (b % 8) + 2], &[b as u8, 200 + b as u8]);
                let q = &g[16 + 32 * (b % 8)..16 + 32 * (b % 8) + 32];
                assert!(
                    q.iter().all(|&v| v == (b + 1 + 100 * r) as u8),
                    "row {r} block {b}"
                );
            }
            assert_eq!(&row[816..], &bytes[r * 850 + 816..(r + 1) * 850]);
        }
        let other = device_bytes(GgmlType::Q4_0, &bytes, rows);
        assert!(matches!(other, Cow::Borrowed(_)));
    }

    /// The device's Q6_K super-blocks, read as the layout above says (the twin of quant.cuh's
    /// readers), give the weights markbase-core's dequantization gives the stored ones.
    #[test]
    fn q6_k_super_blocks_lay_out_for_their_readers() {
        use markbase_core::quant::dequantize_row;
        let (rows, blocks) = (3, 5);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes: Vec<u8> = (0..rows * blocks * Q6_K_BLOCK)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 56) as u8
            })
            .collect();
        for b in bytes.chunks_exact_mut(Q6_K_BLOCK) {
            b[208..].copy_from_slice(&0x2c00u16.to_le_bytes()); // d = 1/16
        }
        let dev = device_bytes(GgmlType::Q6_K, &bytes, rows);
        assert_eq!(dev.len(), rows * blocks * Q6_K_DEVICE_BLOCK);
        let f16 = |lo: u8, hi: u8| half::f16::from_le_bytes([lo, hi]).to_f32();
        for (r, row) in bytes.chunks_exact(blocks * Q6_K_BLOCK).enumerate() {
            let mut want = vec![0f32; 256 * blocks];
            dequantize_row(GgmlType::Q6_K, row, &mut want).unwrap();
            let drow = &dev[r * blocks * Q6_K_DEVICE_BLOCK..][..blocks * Q6_K_DEVICE_BLOCK];
            for (i, &w) in want.iter().enumerate() {
                let u = &drow[(i / 256) * Q6_K_DEVICE_BLOCK..][..Q6_K_DEVICE_BLOCK];
                let (c, v) = ((i % 256) / 32, i % 32);
                let (n, odd, h, m) = (c / 2, c % 2, v / 16, v % 16);
                let s = 2 * n + h;
                let lo = (u[16 * s + m] >> (4 * odd)) & 0x0F;
                let word = 128 + 8 * s + 4 * odd;
                let hw = u32::from_le_bytes(u[word..word + 4].try_into().unwrap());
                let hi = (hw >> (8 * (m % 4) + 2 * (m / 4))) & 3;
                let hdr = &u[192 + 4 * s..][..4];
                let got = f16(hdr[2], hdr[3])
                    * f32::from(hdr[odd] as i8)
                    * (f32::from(lo | (hi as u8) << 4) - 32.0);
                assert_eq!(got, w, "row {r} weight {i}");
            }
        }
    }

    /// The device's Q5_K super-blocks, read as the layout above says (the twin of quant.cuh's
    /// readers: each value's nibble and fifth bit), give back the stored bytes.
    #[test]
    fn q5_k_super_blocks_lay_out_for_their_readers() {
        let (rows, blocks) = (3, 4);
        let mut seed = 0x1234_5678_9abc_def1u64;
        let bytes: Vec<u8> = (0..rows * blocks * Q5_K_BLOCK)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(7);
                (seed >> 56) as u8
            })
            .collect();
        let dev = device_bytes(GgmlType::Q5_K, &bytes, rows);
        assert_eq!(dev.len(), bytes.len());
        for (b, u) in bytes
            .chunks_exact(Q5_K_BLOCK)
            .zip(dev.chunks_exact(Q5_K_BLOCK))
        {
            assert_eq!(&u[..16], &b[..16]);
            let mut stored = b[..16].to_vec();
            stored.resize(Q5_K_BLOCK, 0);
            for c in 0..8 {
                for v in 0..32 {
                    let (n, odd, h, m) = (c / 2, c % 2, v / 16, v % 16);
                    let s = 2 * n + h;
                    let q = (u[16 + 16 * s + m] >> (4 * odd)) & 0x0F;
                    let fw = u32::from_le_bytes(u[144 + 4 * s..148 + 4 * s].try_into().unwrap());
                    let fifth = (fw >> (8 * (m % 4) + 4 * odd + m / 4)) & 1;
                    stored[48 + 32 * n + v] |= q << (4 * odd);
                    stored[16 + v] |= (fifth as u8) << c;
                }
            }
            assert_eq!(stored, b);
        }
    }

    /// Q4_0 / Q5_0 rows of whole 8-block units, read as the layout above says (the twin of
    /// quant.cuh's readers), give markbase-core's weights; other rows stay as stored.
    #[test]
    fn q4_0_and_q5_0_rows_of_whole_units_lay_out_for_their_readers() {
        use markbase_core::quant::dequantize_row;
        let f16 = |lo: u8, hi: u8| half::f16::from_le_bytes([lo, hi]).to_f32();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for (ty, block, five) in [
            (GgmlType::Q4_0, Q4_0_BLOCK, false),
            (GgmlType::Q5_0, Q5_0_BLOCK, true),
        ] {
            let (rows, blocks) = (3, 16);
            let mut bytes: Vec<u8> = (0..rows * blocks * block)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 56) as u8
                })
                .collect();
            for b in bytes.chunks_exact_mut(block) {
                b[..2].copy_from_slice(&0x2c00u16.to_le_bytes()); // d = 1/16
            }
            let dev = device_bytes(ty, &bytes, rows);
            let row_bytes = blocks * block;
            for r in 0..rows {
                let mut want = vec![0f32; 32 * blocks];
                dequantize_row(ty, &bytes[r * row_bytes..][..row_bytes], &mut want).unwrap();
                for (i, &w) in want.iter().enumerate() {
                    let u = &dev[r * row_bytes + (i / 256) * 8 * block..][..8 * block];
                    let (c, v) = ((i % 256) / 32, i % 32);
                    let (n, odd, h, m) = (c / 2, c % 2, v / 16, v % 16);
                    let s = 2 * n + h;
                    let mut q = (u[16 + 16 * s + m] >> (4 * odd)) & 0x0F;
                    let offset = if five {
                        let fw =
                            u32::from_le_bytes(u[144 + 4 * s..148 + 4 * s].try_into().unwrap());
                        q |= (((fw >> (8 * (m % 4) + 4 * odd + m / 4)) & 1) as u8) << 4;
                        16.0
                    } else {
                        8.0
                    };
                    let got = f16(u[2 * c], u[2 * c + 1]) * (f32::from(q) - offset);
                    assert_eq!(got, w, "{ty} row {r} weight {i}");
                }
            }
            // 20 blocks a row (640 values): as stored.
            let short = &bytes[..2 * 20 * block];
            assert!(matches!(device_bytes(ty, short, 2), Cow::Borrowed(_)));
        }
    }
}
