//! How weight rows lie in device memory where it differs from the file. Q8_0 blocks are 34
//! bytes (an f16 scale, 32 quants), so as stored no block past the first of a row starts on a
//! 4-byte boundary and kernels can only read them two bytes at a time. On the device each
//! full group of 8 blocks (256 values) of a row lies as its 8 scales (16 bytes) followed by its
//! 256 quants: the same 272 bytes, now 16-byte aligned where the row is, so a lane loads a
//! block's quants as two `uint4`s. The blocks after a row's last full group stay as stored.
//! `q8_0_block` in quant.cuh reads this layout; every other format lies as stored.

use std::borrow::Cow;

use markbase_core::quant::GgmlType;

/// Bytes of a Q8_0 block: its f16 scale and 32 quants.
const Q8_0_BLOCK: usize = 34;
/// Blocks of a regrouped Q8_0 group.
const GROUP_BLOCKS: usize = 8;

/// `bytes` (`rows` rows of `ty`) as they lie on the device.
pub(crate) fn device_bytes(ty: GgmlType, bytes: &[u8], rows: usize) -> Cow<'_, [u8]> {
    if ty != GgmlType::Q8_0 || rows == 0 {
        return Cow::Borrowed(bytes);
    }
    let row_bytes = bytes.len() / rows;
    let mut out = vec![0u8; bytes.len()];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Whole rows a thread, at least 4 MB of them.
    let per_thread = rows
        .div_ceil(threads)
        .max((4 << 20) / row_bytes.max(1))
        .max(1);
    std::thread::scope(|s| {
        for (src, dst) in bytes
            .chunks(per_thread * row_bytes)
            .zip(out.chunks_mut(per_thread * row_bytes))
        {
            s.spawn(move || {
                for (r, o) in src.chunks(row_bytes).zip(dst.chunks_mut(row_bytes)) {
                    regroup_q8_0_row(r, o);
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
}
