//! Programmatic edges into cuBLASLt's kernels in a captured step.
//!
//! Every kernel of ours is launched with programmatic stream serialization: it may start
//! while the kernel ahead of it runs, and waits for that kernel's writes at its
//! `griddepcontrol.wait` (common.cuh). cuBLASLt's products are captured as plain launches,
//! so the kernel of a product starts only once the kernel ahead of it has ended, and its
//! launch is not hidden behind that kernel. Hopper's half-precision cuBLASLt kernels
//! (`sm90_xmma_gemm_…` on 16-bit inputs) wait for the grid ahead themselves (their SASS
//! holds `ACQBULK`, the instruction `griddepcontrol.wait` becomes), so under capture the
//! edge from our kernel to such a product's first kernel may be programmatic. Each edge made
//! so is checked after the product is captured: a kernel whose name is not of that family, or
//! a capture that fails with the edges, makes the recorder capture the step again without
//! them and never add them again.
//!
//! Off unless `MARKBASE_CUBLASLT_PDL=1`; when on, each capture says on stderr how many edges
//! it made, or why they were dropped.

use std::ffi::CStr;

use cudarc::driver::sys;
use markbase_core::Result;

use crate::device::driver_err;

/// The environment variable that turns the edges on (`1`).
const CUBLASLT_PDL_VAR: &str = "MARKBASE_CUBLASLT_PDL";

/// Whether captured products get programmatic edges.
pub(crate) fn enabled() -> bool {
    std::env::var(CUBLASLT_PDL_VAR).is_ok_and(|v| v == "1")
}

/// Whether a kernel of this name waits for the grid ahead of it before it reads anything:
/// cuBLASLt's Hopper kernels on 16-bit inputs (checked on libcublasLt 13.0.2's SASS: every
/// `sm90_xmma_gemm_` kernel on f16 or bf16 inputs holds `ACQBULK`; those on f64 do not).
fn waits_for_grid_ahead(name: &str) -> bool {
    name.strip_prefix("sm90_xmma_gemm_")
        .is_some_and(|rest| rest.starts_with("bf16") || rest.starts_with("f16"))
}

/// Makes the capture's next edge programmatic if the capture's one dependency is a kernel
/// node; returns that node (to [`refusal`] after the product is captured).
///
/// # Safety
/// `stream` is capturing.
pub(crate) unsafe fn open(stream: sys::CUstream) -> Result<Option<sys::CUgraphNode>> {
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
        return Ok(None);
    }
    let mut node = *deps;
    let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut ty)
        .result()
        .map_err(|e| driver_err("graph node type", e))?;
    if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
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
    Ok(Some(node))
}

/// The name of a kernel a programmatic edge from `node` leads to that does not wait for the
/// grid ahead ([`waits_for_grid_ahead`]); `None` if every such kernel waits.
///
/// # Safety
/// `node` is a node of a graph being captured.
pub(crate) unsafe fn refusal(node: sys::CUgraphNode) -> Result<Option<String>> {
    let mut n = 0usize;
    sys::cuGraphNodeGetDependentNodes_v2(node, std::ptr::null_mut(), std::ptr::null_mut(), &mut n)
        .result()
        .map_err(|e| driver_err("dependent nodes", e))?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    let mut data = vec![
        sys::CUgraphEdgeData {
            from_port: 0,
            to_port: 0,
            type_: 0,
            reserved: [0; 5],
        };
        n
    ];
    sys::cuGraphNodeGetDependentNodes_v2(node, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n)
        .result()
        .map_err(|e| driver_err("dependent nodes", e))?;
    let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    for (&next, edge) in nodes.iter().zip(&data).take(n) {
        if edge.type_ != programmatic {
            continue;
        }
        let name = kernel_name(next)?;
        if !waits_for_grid_ahead(&name) {
            return Ok(Some(if name.is_empty() {
                "(not a kernel)".into()
            } else {
                name
            }));
        }
    }
    Ok(None)
}

/// Says on stderr how many edges a step's capture made (the switch is a measurement aid).
pub(crate) fn report_made(edges: usize) {
    eprintln!(
        "markbase-cuda: {CUBLASLT_PDL_VAR}: {edges} programmatic edges into cuBLASLt products"
    );
}

/// Says on stderr why the edges are off from now on.
pub(crate) fn report_dropped(why: &str) {
    eprintln!(
        "markbase-cuda: {CUBLASLT_PDL_VAR}: edges dropped, steps captured without them: {why}"
    );
}

/// The function name of a graph node (empty for a node that is not a kernel).
///
/// # Safety
/// `node` is a node of a live graph.
unsafe fn kernel_name(node: sys::CUgraphNode) -> Result<String> {
    let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut ty)
        .result()
        .map_err(|e| driver_err("graph node type", e))?;
    if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(String::new());
    }
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
    sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
        .result()
        .map_err(|e| driver_err("kernel node", e))?;
    // A node made from a library kernel may carry it in `kern` with no function.
    let mut name: *const std::ffi::c_char = std::ptr::null();
    if params.func.is_null() {
        sys::cuKernelGetName(&mut name, params.kern)
    } else {
        sys::cuFuncGetName(&mut name, params.func)
    }
    .result()
    .map_err(|e| driver_err("kernel name", e))?;
    Ok(if name.is_null() {
        String::new()
    } else {
        CStr::from_ptr(name).to_string_lossy().into_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_half_precision_hopper_kernels_count_as_waiting() {
        assert!(waits_for_grid_ahead(
            "sm90_xmma_gemm_bf16f32_bf16f32_f32_nt_n_tilesize64x256x64_cgasize1x1x1_\
             warpgroupsize1x1x1_aligna2_alignc4_execute_segment_k_off_kernel__5x_cublas"
        ));
        assert!(waits_for_grid_ahead(
            "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_x"
        ));
        assert!(!waits_for_grid_ahead(
            "sm90_xmma_gemm_f64f64_f64f64_f64_nt_n_x"
        ));
        assert!(!waits_for_grid_ahead("nvjet_sm90_tss_320x128"));
        assert!(!waits_for_grid_ahead(""));
    }
}
