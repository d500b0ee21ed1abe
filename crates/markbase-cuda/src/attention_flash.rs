//! Prefill attention, flash style (flash_attention.cu). The split-K kernel gives each query
//! row its own warp walking the keys, which suits decode (one row per sequence) but reads every
//! key and value once per query row. Here, per sequence of the step: the keys and values its
//! rows see are gathered once into contiguous f16 rows, then one launch gives each block 64
//! query rows of a KV head's group and streams their keys through shared memory, the scores and
//! the weighted values on the f16 tensor cores (f32 sums) with an online softmax between: no
//! score matrix is written. The output also goes out rounded for the o product, when that
//! product would round it (rounded.rs).

use markbase_core::backend::{first_visible_key, AttnSpec, KvLayout};
use markbase_core::Result;

use crate::backend::{int, CudaBackend};
use crate::buffer::CudaBuffer;
use crate::kernels::{Arg, Grid};
use crate::sources::Module;

/// Fewest query rows every sequence of a step needs for `CudaBackend::attention_flash`
/// (fewer, e.g. decode rows, take the split-K kernel).
pub const ATTN_FLASH_MIN_ROWS: usize = 32;
/// Query rows ((token, head) pairs) of a block (`FA_ROWS` in flash_attention.cu).
const FLASH_ROWS: usize = 64;
/// Keys of a shared-memory tile (`FA_KEYS`).
const FLASH_KEYS: usize = 32;

/// Whether `layout` suits the flash kernel: at least one row, and every sequence with rows
/// has [`ATTN_FLASH_MIN_ROWS`] or more.
pub(crate) fn attention_flash_suits(layout: &KvLayout<'_>) -> bool {
    let rows = layout.seq_start.windows(2).map(|w| (w[1] - w[0]) as usize);
    let mut any = false;
    for r in rows.filter(|&r| r > 0) {
        if r < ATTN_FLASH_MIN_ROWS {
            return false;
        }
        any = true;
    }
    any
}

/// The kernel for head dim `hd` and its launch (threads a block, shared bytes a block), where
/// a block's tiles fit in `max_shared` bytes (the device's per-block limit).
pub(crate) fn flash_kernel(hd: usize, max_shared: u32) -> Option<(&'static str, u32, u32)> {
    let name = match hd {
        32 => "attn_flash_32",
        64 => "attn_flash_64",
        128 => "attn_flash_128",
        256 => "attn_flash_256",
        512 => "attn_flash_512",
        _ => return None,
    };
    // Head dim 512: a row group's pair of warps splits the head dims (`FLASH_HALVES`),
    // swapping partial scores through 2 KiB a warp; smaller heads: the pair splits the keys of
    // each stage, which then holds twice as many.
    let (stage_keys, swap) = if hd == 512 {
        (FLASH_KEYS, 8 * 2048)
    } else {
        (2 * FLASH_KEYS, 0)
    };
    let shared = ((FLASH_ROWS + 4 * stage_keys) * (hd + 8) * 2 + swap) as u32;
    (shared <= max_shared).then_some((name, 256, shared))
}

/// Rounds a count of 16-bit values up to 128 (256-byte boundaries).
fn padded(n: usize) -> usize {
    n.div_ceil(128) * 128
}

impl CudaBackend {
    /// [`markbase_core::backend::Backend::attention`] through the flash kernel `kernel` (what
    /// [`flash_kernel`] chose for the head dim on this device; checked by the caller: spec,
    /// layout, buffer sizes, a device of compute capability 8.0 or newer).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_flash(
        &self,
        (name, threads, shared): (&'static str, u32, u32),
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        spec: &AttnSpec,
        layout: &KvLayout<'_>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (hd, nh, kvh) = (spec.head_dim, spec.n_heads, spec.n_kv_heads);
        let func = self
            .kernels
            .func_with_shared(Module::FlashAttention, name, shared)?;
        let row = kvh * hd;
        let window = spec.window.unwrap_or(0);
        let mut s = self.scratch()?;
        let len = layout.positions.len() * nh * hd;
        let round = self.round_target(&mut s, (layout.positions.len(), nh * hd), false)?;
        let held = self.uploads()?;
        let positions = self.upload_idx(&held, layout.positions)?;
        let tables = self.upload_idx(&held, layout.block_tables)?;
        for seq in 0..layout.n_seqs() {
            let (r0, r1) = (
                layout.seq_start[seq] as usize,
                layout.seq_start[seq + 1] as usize,
            );
            let pos = &layout.positions[r0..r1];
            let (Some(&hi), Some(&lo)) = (pos.iter().max(), pos.iter().min()) else {
                continue;
            };
            let k_lo = first_visible_key(lo as usize, spec.window);
            let n_keys = hi as usize + 1 - k_lo;
            // Keys then values, f16, in float-sized scratch.
            let halves = padded(n_keys * row);
            let kg = s.floats.get(&self.dev.stream, halves)?;
            let vg = kg + 2 * halves as u64;
            self.run(
                Module::FlashAttention,
                "kv_gather_f16",
                Grid::new((int("keys", n_keys)? as u32, 1), 128),
                &[
                    Arg::U64(k_cache.ptr),
                    Arg::U64(v_cache.ptr),
                    Arg::U64(tables + 4 * (seq * layout.table_width) as u64),
                    Arg::I32(int("block size", layout.block_size)?),
                    Arg::I32(int("row", row)?),
                    Arg::I32(int("first key", k_lo)?),
                    Arg::U64(kg),
                    Arg::U64(vg),
                ],
            )?;
            let first = 4 * (r0 * nh * hd) as u64;
            let tiles = ((r1 - r0) * (nh / kvh)).div_ceil(FLASH_ROWS);
            let grid = Grid {
                blocks: (int("row tiles", tiles)? as u32, kvh as u32, 1),
                threads,
                shared,
            };
            self.launch_fn(
                &func,
                grid,
                &[
                    Arg::U64(q.ptr + first),
                    Arg::U64(kg),
                    Arg::U64(vg),
                    Arg::U64(out.ptr + first),
                    Arg::U64(round.at + first / 2),
                    Arg::U64(positions + 4 * r0 as u64),
                    Arg::I32(int("rows", r1 - r0)?),
                    Arg::I32(nh as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(int("first key", k_lo)?),
                    Arg::I32(int("keys", n_keys)?),
                    Arg::I32(int("window", window)?),
                    Arg::I32(round.kind),
                    Arg::F32(spec.scale),
                    Arg::F32(spec.softcap.unwrap_or(0.0)),
                ],
            )?;
        }
        s.rounded.hold(round, out.ptr, len, &self.queue);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout<'a>(seq_start: &'a [u32]) -> KvLayout<'a> {
        KvLayout {
            block_size: 16,
            positions: &[],
            seq_start,
            block_tables: &[],
            table_width: 0,
        }
    }

    #[test]
    fn flash_takes_steps_whose_sequences_all_have_many_rows() {
        let m = ATTN_FLASH_MIN_ROWS as u32;
        assert!(attention_flash_suits(&layout(&[0, m])));
        assert!(attention_flash_suits(&layout(&[0, m, m, 3 * m])));
        assert!(!attention_flash_suits(&layout(&[0, m, m + 1])));
        assert!(!attention_flash_suits(&layout(&[0, 0])));
        assert!(!attention_flash_suits(&layout(&[0])));
    }

    #[test]
    fn flash_tiles_fit_in_shared_memory() {
        // 227 KiB a block on Hopper.
        let hopper = 227 * 1024;
        for hd in [32, 64, 128, 256, 512] {
            let (_, threads, shared) = flash_kernel(hd, hopper).unwrap();
            assert!(shared <= hopper, "head dim {hd}: {shared} bytes");
            assert_eq!(threads, 256);
        }
        assert!(flash_kernel(96, hopper).is_none());
        // 99 KiB (most sm_8x GPUs): the large heads' tiles do not fit, and those layers take
        // the split-K kernel.
        let small = 99 * 1024;
        assert!(flash_kernel(128, small).is_some());
        assert!(flash_kernel(256, small).is_none());
        assert!(flash_kernel(512, small).is_none());
    }
}
