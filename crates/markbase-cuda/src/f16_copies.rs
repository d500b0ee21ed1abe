//! f16 copies of quantized weight matrices for products of many token rows.
//!
//! Past 64 token rows the tensor-core kernels of quantized weights (mmq.rs) read each matrix
//! once a run of 64 rows and spend most of their time in their per-unit loop, while cuBLAS on
//! 16-bit weights streams a matrix once for the whole step. On an H100 (docs/perf.md, session
//! 53) E4B ran 128 sequences at 12 084 t/s in Q4_K_M but 20 096 in bf16, and 65 sequences at
//! 8 109 against 11 189. So a quantized matrix that meets a product of more than
//! [`F16_COPY_ABOVE_ROWS`] rows is dequantized once into an f16 copy kept beside it, and such
//! products multiply the copy with cuBLAS (the same f16 values the products past 128 rows
//! dequantized a tile at a time for every call before). Fewer rows keep the stored weights:
//! the copy's bytes would cost a one-token step 3–4× its reads. Measured on an H100 (session
//! 54, `bench --synthetic e4b:… -p 512 -n 16`, without copies → with): Q4_K_M at 65 / 128 /
//! 256 sequences 8 131 / 12 094 / 16 326 → 10 711 / 18 215 / 25 553 t/s, pp512 27 504 →
//! 38 931; Q8_0 7 688 / 11 816 / 16 839 → 10 592 / 18 529 / 19 760, pp512 28 412 → 39 946;
//! 64 sequences unchanged (11 246 / 11 116); the copies of E4B take 8.65 GiB.
//!
//! A copy is made only while the device keeps [`reserve`] bytes free after it (for scratch
//! growth and the rest of the process); a matrix refused once keeps its stored weights for
//! good. [`CudaBackend::set_f16_copies`] turns copies off (`markbase --no-f16-copies`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use markbase_core::quant::GgmlType;
use markbase_core::Result;

use crate::backend::CudaBackend;
use crate::buffer::{addr, CudaMatrix, DeviceMem};
use crate::device::driver_err;

/// Token rows above which a product of quantized weights reads the matrix's f16 copy.
pub(crate) const F16_COPY_ABOVE_ROWS: usize = 64;

/// Rows dequantized a launch while a copy is made (the launch grid's height is at most 65 535).
const COPY_LAUNCH_ROWS: usize = 32_768;

/// Device memory left free after a copy: 2 GiB, or a sixteenth of the device if more.
pub(crate) fn reserve(total: usize) -> usize {
    (2usize << 30).max(total / 16)
}

/// Whether a copy of `bytes` fits while `free` of the device's `total` bytes are free.
pub(crate) fn copy_fits(bytes: usize, free: usize, total: usize) -> bool {
    free.checked_sub(bytes)
        .is_some_and(|left| left >= reserve(total))
}

/// Whether a product of `n` token rows with weights stored as `ty` reads an f16 copy when
/// copies are on.
pub(crate) fn copy_suits(ty: GgmlType, n: usize) -> bool {
    n > F16_COPY_ABOVE_ROWS && ty.block_size() > 1
}

/// The backend's copy policy and the bytes its copies hold.
pub(crate) struct F16Copies {
    on: AtomicBool,
    bytes: AtomicUsize,
}

impl F16Copies {
    /// Copies on, none made.
    pub(crate) fn new() -> F16Copies {
        F16Copies {
            on: AtomicBool::new(true),
            bytes: AtomicUsize::new(0),
        }
    }
}

/// A matrix's f16 copy, rows × cols values in the stored row order.
pub(crate) struct F16Copy {
    _mem: DeviceMem<u16>,
    pub(crate) ptr: u64,
}

impl CudaBackend {
    /// Turns the f16 copies of quantized matrices on or off for products not yet queued
    /// (copies already made stay and are used).
    pub fn set_f16_copies(&self, on: bool) {
        self.f16_copies.on.store(on, Ordering::Relaxed);
    }

    /// Bytes of device memory the f16 copies hold.
    pub fn f16_copy_bytes(&self) -> usize {
        self.f16_copies.bytes.load(Ordering::Relaxed)
    }

    /// Whether a product of `n` token rows with weights stored as `ty` takes the matrices'
    /// f16 copies (where the device has room for them: `f16_copy`).
    pub(crate) fn f16_copy_applies(&self, ty: GgmlType, n: usize) -> bool {
        self.f16_copies.on.load(Ordering::Relaxed) && copy_suits(ty, n)
    }

    /// The address of `w`'s f16 copy for a product of `n` token rows, made now if it is the
    /// first such product and the device has room (`copy_fits`); `None` where the product
    /// reads the stored weights.
    pub(crate) fn f16_copy(&self, w: &CudaMatrix, n: usize) -> Result<Option<u64>> {
        if !self.f16_copy_applies(w.ty, n) {
            return Ok(None);
        }
        if let Some(made) = w.f16.get() {
            return Ok(made.as_ref().map(|c| c.ptr));
        }
        let made = self.make_f16_copy(w)?;
        let bytes = made.as_ref().map_or(0, |_| 2 * w.rows * w.cols);
        // Another thread may have set the copy first (the same values); then ours is freed.
        if w.f16.set(made).is_ok() {
            self.f16_copies.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(w.f16.get().and_then(|m| m.as_ref().map(|c| c.ptr)))
    }

    /// Allocates `w`'s copy and queues its dequantization, or `None` where the device would
    /// keep less than `reserve` free after it.
    fn make_f16_copy(&self, w: &CudaMatrix) -> Result<Option<F16Copy>> {
        let values = w.rows * w.cols;
        let (free, total) = self.dev.memory()?;
        if !copy_fits(2 * values, free, total) {
            return Ok(None);
        }
        let mem = {
            // Operations held back for a graph go first (as for `Growable::get`).
            let mut steps = self.steps.lock()?;
            steps.release()?;
            // SAFETY: every value is written by the dequantization below before any product
            // reads it (both in stream order).
            unsafe { self.dev.stream.alloc::<u16>(values) }
                .map_err(|e| driver_err(&format!("allocating the f16 copy of '{}'", w.name), e))?
        };
        self.queue.bump();
        let ptr = addr(&mem, &self.dev.stream);
        let copy = F16Copy {
            _mem: DeviceMem::new(mem, &self.steps),
            ptr,
        };
        let mut r0 = 0;
        while r0 < w.rows {
            let rows = COPY_LAUNCH_ROWS.min(w.rows - r0);
            self.queue_dequant("dequant_f16", w, r0, rows, ptr + 2 * (r0 * w.cols) as u64)?;
            r0 += rows;
        }
        Ok(Some(copy))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_keep_the_reserve_free() {
        const GIB: usize = 1 << 30;
        // An 80 GiB device keeps 5 GiB free, an 8 GiB one 2 GiB.
        assert_eq!(reserve(80 * GIB), 5 * GIB);
        assert_eq!(reserve(8 * GIB), 2 * GIB);
        assert!(copy_fits(GIB, 6 * GIB, 80 * GIB));
        assert!(!copy_fits(GIB + 1, 6 * GIB, 80 * GIB));
        assert!(!copy_fits(7 * GIB, 6 * GIB, 80 * GIB));
        assert!(copy_fits(GIB, 3 * GIB, 8 * GIB));
        assert!(!copy_fits(GIB, 3 * GIB - 1, 8 * GIB));
    }

    #[test]
    fn only_quantized_products_past_64_rows_take_copies() {
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q8_0,
            GgmlType::Q6_K,
            GgmlType::Q4_0,
        ] {
            assert!(!copy_suits(ty, 1));
            assert!(!copy_suits(ty, 64));
            assert!(copy_suits(ty, 65));
            assert!(copy_suits(ty, 1024));
        }
        for ty in [GgmlType::BF16, GgmlType::F16, GgmlType::F32] {
            assert!(!copy_suits(ty, 128));
        }
    }
}
