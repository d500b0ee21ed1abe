//! Choosing among cuBLASLt's candidate algorithms for a decode-sized product by timing them.
//!
//! cuBLASLt's heuristic ranks algorithms by a model of the product; for the skinny products
//! of a batched decode step (8–64 token rows against a weight matrix of tens of MB, bound by
//! the weights' stream) its first choice is often not the fastest. Each candidate runs on
//! the product's own weights and activations into scratch output, with the L2 cache
//! overwritten before every timed run (a decode step reads each matrix once, from memory).

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use markbase_core::{Error, Result};

use crate::device::driver_err;

/// Timed runs of each candidate (after one untimed run).
const RUNS: usize = 5;
/// Bytes written before each timed run so the run finds none of its weights in L2 (twice
/// the H200's 50 MB).
const FLUSH_BYTES: usize = 100 << 20;

/// The mean time of each candidate's runs in µs (`None` where a run failed), and the index
/// of the fastest; `run(i, out)` queues candidate `i` writing its output at device address
/// `out` (scratch of `out_bytes`).
///
/// Waits for the stream (before timing and for each candidate's events): a planning cost,
/// paid once per product shape.
pub(crate) fn fastest(
    stream: &Arc<CudaStream>,
    candidates: usize,
    out_bytes: usize,
    mut run: impl FnMut(usize, u64) -> Result<()>,
) -> Result<(usize, Vec<Option<f32>>)> {
    let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
        stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| driver_err("tuning scratch", e))
    };
    let out = alloc(out_bytes)?;
    let mut flush = alloc(FLUSH_BYTES)?;
    let out_ptr = out.device_ptr(stream).0;
    let ctx = stream.context();
    let event = || {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_err("timing event", e))
    };
    let mut times = Vec::with_capacity(candidates);
    for i in 0..candidates {
        if run(i, out_ptr).is_err() {
            times.push(None);
            continue;
        }
        let mut total = 0.0;
        for _ in 0..RUNS {
            stream
                .memset_zeros(&mut flush)
                .map_err(|e| driver_err("L2 flush", e))?;
            let (start, end) = (event()?, event()?);
            start
                .record(stream)
                .map_err(|e| driver_err("timing event", e))?;
            run(i, out_ptr)?;
            end.record(stream)
                .map_err(|e| driver_err("timing event", e))?;
            total += start
                .elapsed_ms(&end)
                .map_err(|e| driver_err("timing event", e))?;
        }
        times.push(Some(total * 1000.0 / RUNS as f32));
    }
    let best = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
        .ok_or_else(|| Error::Invalid("cuBLASLt: no candidate algorithm ran".into()))?;
    Ok((best, times))
}
