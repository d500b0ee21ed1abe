//! Programmatic edges into cuBLASLt's products in a captured step, where a probe showed the
//! product waits for the kernel ahead.
//!
//! Every kernel of ours is launched with programmatic stream serialization: it may start
//! while the kernel ahead of it runs, and waits for that kernel's writes at its
//! `griddepcontrol.wait` (common.cuh). cuBLASLt's products are captured as plain launches, so
//! a product's first kernel starts only once the kernel ahead has ended, and its launch is not
//! hidden behind that kernel. Under capture the edge from our kernel into the product may be
//! made programmatic ([`open`]) — safe only if the product's kernel waits for the grid ahead
//! before it reads what that grid writes. cuBLASLt does not say which of its kernels do, and
//! the kernels it picks for decode-sized products on the device (`nvjet_*`) cannot be read
//! from the library, so each planned product is tried first ([`product_waits`]): behind an
//! edge from a kernel that lets it launch at once and writes the product's activations only
//! after a long hold, it must give what it gives with the activations written before it.
//!
//! Off unless `MARKBASE_CUBLASLT_PDL=1`: the probe has not yet run on a GPU (docs/perf.md,
//! session 64, has the ceiling measured with unchecked edges and the commands to time it).

use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use markbase_core::Result;

use crate::device::driver_err;
use crate::device_wide::capturing;
use crate::kernels::{Arg, Grid, Launch};

/// How long the probe's writer holds before it writes the activations: long against any
/// product's launch (a few µs), short against a plan's timing.
const PROBE_HOLD_NS: u64 = 200_000;

/// Whether planned products are probed and captured behind programmatic edges.
pub(crate) fn enabled() -> bool {
    std::env::var("MARKBASE_CUBLASLT_PDL").is_ok_and(|v| v == "1")
}

/// Makes the capture's next edge programmatic if the capture's one dependency is a kernel
/// node; whether it did.
///
/// # Safety
/// `stream` is capturing.
pub(crate) unsafe fn open(stream: sys::CUstream) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut data: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    sys::cuStreamGetCaptureInfo_v3(
        stream,
        &mut status,
        &mut id,
        &mut graph,
        &mut deps,
        &mut data,
        &mut n,
    )
    .result()
    .map_err(|e| driver_err("capture info", e))?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n != 1 {
        return Ok(false);
    }
    let mut node = *deps;
    let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut ty)
        .result()
        .map_err(|e| driver_err("graph node type", e))?;
    if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(false);
    }
    let edge = sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    sys::cuStreamUpdateCaptureDependencies_v2(
        stream,
        &mut node,
        &edge,
        1,
        sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32,
    )
    .result()
    .map_err(|e| driver_err("capture dependencies", e))?;
    Ok(true)
}

/// The activations and output of a probed product.
pub(crate) struct ProbeShape {
    /// 16-bit activation values the product reads (from element 0).
    pub(crate) inputs: usize,
    /// The pattern's first value (`pdl_probe_fill` in ops.cu): 1.0 in the inputs' format.
    pub(crate) one: u32,
    /// Bytes of output the product writes (from byte 0).
    pub(crate) out_bytes: usize,
    /// Whether the output is f32 (else bf16).
    pub(crate) f32_out: bool,
}

/// Whether the product `product(x, c)` queues (activations at `x`, output at `c`) waits for
/// the kernel ahead of it: run behind `fill` (ops.cu's `pdl_probe_fill`) with a programmatic
/// edge, holding its writes [`PROBE_HOLD_NS`], it gives what it gives with the activations
/// written first. `false` also where the capture with the edge fails or gives no output to
/// tell by. Queues on `stream` and waits for it.
pub(crate) fn product_waits(
    stream: &Arc<CudaStream>,
    fill: &CudaFunction,
    shape: &ProbeShape,
    mut product: impl FnMut(u64, u64) -> Result<()>,
) -> Result<bool> {
    let alloc = |bytes: usize| -> Result<CudaSlice<u8>> {
        stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| driver_err("probe scratch", e))
    };
    let mut x = alloc(2 * shape.inputs)?;
    let want = alloc(shape.out_bytes)?;
    let got = alloc(shape.out_bytes)?;
    let (x_at, want_at, got_at) = (
        x.device_ptr(stream).0,
        want.device_ptr(stream).0,
        got.device_ptr(stream).0,
    );
    let writer = |hold: u64| {
        let blocks = shape.inputs.div_ceil(256).clamp(1, 64) as u32;
        Launch::new(
            fill,
            Grid::new((blocks, 1), 256),
            &[
                Arg::U64(x_at),
                Arg::U64(shape.inputs as u64),
                Arg::I32(shape.one as i32),
                Arg::U64(hold),
            ],
            true,
        )
    };
    writer(0).issue(stream)?;
    product(x_at, want_at)?;
    stream
        .memset_zeros(&mut x)
        .map_err(|e| driver_err("probe scratch", e))?;
    let graph = {
        let _capturing = capturing();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        stream
            .begin_capture(mode)
            .map_err(|e| driver_err("probe capture", e))?;
        // SAFETY: the stream is capturing.
        let queued = writer(PROBE_HOLD_NS)
            .issue(stream)
            .and_then(|()| unsafe { open(stream.cu_stream()) })
            .and_then(|edge| product(x_at, got_at).map(|()| edge));
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (queued, graph) {
            (Ok(true), Ok(Some(graph))) => graph,
            _ => return Ok(false),
        }
    };
    graph
        .launch()
        .map_err(|e| driver_err("probe graph launch", e))?;
    let read = |c: &CudaSlice<u8>| {
        stream
            .clone_dtoh(c)
            .map_err(|e| driver_err("probe output", e))
    };
    let (want, got) = (read(&want)?, read(&got)?);
    stream
        .synchronize()
        .map_err(|e| driver_err("probe output", e))?;
    Ok(outputs_agree(&want, &got, shape.f32_out))
}

/// Whether two outputs of one product on the same inputs agree: `want` holds a value that
/// is not zero (else it tells nothing) and every value of `got` is within 1e-3 of its
/// magnitude (the same algorithm sums in the same order; a split-K product may add its parts
/// in another).
fn outputs_agree(want: &[u8], got: &[u8], f32_out: bool) -> bool {
    let values = |b: &[u8]| -> Vec<f32> {
        if f32_out {
            b.chunks_exact(4)
                .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect()
        } else {
            b.chunks_exact(2)
                .map(|w| f32::from_bits((u16::from_le_bytes([w[0], w[1]]) as u32) << 16))
                .collect()
        }
    };
    let (want, got) = (values(want), values(got));
    want.iter().any(|&w| w != 0.0 && w.is_finite())
        && want
            .iter()
            .zip(&got)
            .all(|(&w, &g)| (w - g).abs() <= 1e-3 * w.abs().max(g.abs()) + 1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn outputs_agree_only_on_nonzero_equal_sums() {
        let want = f32_bytes(&[1.5, -2.0, 0.0, 300.0]);
        assert!(outputs_agree(&want, &want, true));
        // Within the tolerance (a split-K product's other order of parts).
        let near = f32_bytes(&[1.5, -2.0, 0.0, 300.0001]);
        assert!(outputs_agree(&want, &near, true));
        // A product that read the zeros before the writer's values.
        let zeros = f32_bytes(&[0.0; 4]);
        assert!(!outputs_agree(&want, &zeros, true));
        // One value off.
        let off = f32_bytes(&[1.5, -2.0, 0.5, 300.0]);
        assert!(!outputs_agree(&want, &off, true));
        // An output of zeros tells nothing.
        assert!(!outputs_agree(&zeros, &zeros, true));
        // Values exact in bf16: their top 16 bits.
        let bf16 = |v: &[f32]| -> Vec<u8> {
            v.iter()
                .flat_map(|&x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect()
        };
        assert!(outputs_agree(&bf16(&[1.0, 2.0]), &bf16(&[1.0, 2.0]), false));
        assert!(!outputs_agree(
            &bf16(&[1.0, 2.0]),
            &bf16(&[1.0, 0.0]),
            false
        ));
    }
}
