//! The chain of one-token bf16 and Q4_K products in one persistent launch (chain.cu) on the CPU
//! emulator, its blocks all resident and waiting for each other through global memory, against
//! the f64 products (tests/common/chain.rs) on fresh random inputs (seed printed,
//! `MARKBASE_TEST_SEED` replays it): the whole chain in one launch, again in a second pass
//! (the launch left its counts and tickets at 0), a link a launch, in descending order, and
//! with the first or the last blocks running ahead of the others (a count raised before its
//! outputs were written shows as poisoned inputs) give the same bits; with 3 and 5 blocks and
//! rings of their default and of 3 stages, and (bf16) 5 warps a block of 2 048-value items,
//! and items copied by each lane's cp.async instead of bulk copies, and with the boundaries
//! pipelined (`CHAIN_PIPE=1`: outputs counted a chunk at a time, a stager and a finalizer warp);
//! with the phases' stamps (bf16), every block's wait ends after the blocks it waits for
//! counted their outputs.
//!
//! Without a C++ compiler every test prints why and passes.

#[path = "common/chain.rs"]
mod chain;
#[path = "common/matrices.rs"]
mod matrices;

use chain::*;
use markbase_core::quant::GgmlType;
use markbase_cuda::sources::{define_lines, Module, Unit};
use markbase_cuda::{chain_format, device_bytes, ChainFormat, ChainOp, CHAIN_PHASES, CHAIN_ROWS};
use markbase_kernel_emu::{compiler_available, EmuModule, Order};
use markbase_test_support::rng;

/// `chain_bf16` and `chain_q4_k` (chain.cu).
type ChainKernel = unsafe extern "C" fn(
    ops: *const u32,
    first: i32,
    count: i32,
    done: *mut u32,
    exits: *mut u32,
    x_floats: i32,
);

/// Blocks a test launch runs at most (the stamps' room).
const MAX_BLOCKS: usize = 8;

/// A chain laid out in host memory as the kernel reads it (the emulator runs in-process).
struct HostChain {
    format: ChainFormat,
    _weights: Vec<Vec<u8>>,
    table: Vec<u32>,
    outputs: Vec<Vec<f32>>,
    scratch: Vec<(Vec<f32>, Vec<u32>)>,
    /// With `CHAIN_STAMPS=1`: each link's stamps for up to `MAX_BLOCKS` blocks.
    stamps: Vec<Vec<u64>>,
    done: Vec<u32>,
    exits: Vec<u32>,
    max_k: usize,
    products: Vec<(usize, usize, bool)>,
}

impl HostChain {
    fn new(spec: &[LinkSpec], inputs: &ChainInputs, defines: &str) -> HostChain {
        let ty = inputs.weights[0].ty;
        let lines = define_lines(defines).unwrap();
        let format = chain_format(ty).unwrap().with_defines(&lines).unwrap();
        let weights: Vec<Vec<u8>> = inputs
            .weights
            .iter()
            .map(|m| device_bytes(ty, m.bytes.as_slice(), m.rows).into_owned())
            .collect();
        let mut outputs: Vec<Vec<f32>> = spec.iter().map(|l| vec![f32::NAN; l.outputs()]).collect();
        let mut scratch = Vec::new();
        let mut stamps = Vec::new();
        let mut table = Vec::new();
        for (j, l) in spec.iter().enumerate() {
            let (input, dep) = match l.source {
                Source::Outside => (inputs.outside.as_ptr() as u64, None),
                Source::Link { link, offset } => {
                    (outputs[link][offset..].as_ptr() as u64, Some(link))
                }
            };
            let mut op = ChainOp {
                format,
                weights: weights[j].as_ptr() as u64,
                input,
                norm: if l.norm {
                    inputs.norms[j].as_ptr() as u64
                } else {
                    0
                },
                out: outputs[j].as_mut_ptr() as u64,
                rows: l.rows,
                k: l.k,
                pair: l.pair,
                dep,
                eps: EPS,
                parts: 0,
                tickets: 0,
                stamps: 0,
                gated: l.gated,
            };
            // Q4_K's run sums and tickets (bf16 keeps its sums in shared memory).
            let (mut parts, mut tickets) = (Vec::new(), Vec::new());
            if !format.item_sums {
                parts = vec![f32::NAN; op.tiles() * op.chunks() * CHAIN_ROWS];
                tickets = vec![0u32; op.tiles()];
                op.parts = parts.as_mut_ptr() as u64;
                op.tickets = tickets.as_mut_ptr() as u64;
            }
            let mut link_stamps = Vec::new();
            if format.stamps {
                link_stamps = vec![0u64; MAX_BLOCKS * CHAIN_PHASES];
                op.stamps = link_stamps.as_mut_ptr() as u64;
            }
            table.extend(op.words().unwrap());
            scratch.push((parts, tickets));
            stamps.push(link_stamps);
        }
        HostChain {
            format,
            _weights: weights,
            table,
            outputs,
            scratch,
            stamps,
            done: vec![0; spec.len() * format.counts_per_link()],
            exits: vec![0],
            max_k: spec.iter().map(|l| l.k).max().unwrap(),
            products: spec.iter().map(|l| (l.rows, l.k, l.gated)).collect(),
        }
    }

    /// With stamps, after a whole-chain pass of `spec` in `blocks` blocks: each block's phases
    /// of each link in order, and each block's input ready (phase 1) after every block counted
    /// the link it reads (phase 4) — the emulator's stamps count in one order over all blocks.
    fn check_stamps(&self, spec: &[LinkSpec], what: &str, blocks: usize) {
        if !self.format.stamps {
            return;
        }
        let at = |j: usize, b: usize, p: usize| self.stamps[j][CHAIN_PHASES * b + p];
        for (j, l) in spec.iter().enumerate() {
            for b in 0..blocks {
                let ordered = (1..CHAIN_PHASES).all(|p| at(j, b, p - 1) < at(j, b, p));
                assert!(ordered, "{what}: link {j}, block {b}: phases out of order");
                if let Source::Link { link: d, .. } = l.source {
                    let counted = (0..blocks).map(|c| at(d, c, 4)).max().unwrap();
                    assert!(
                        at(j, b, 1) > counted,
                        "{what}: link {j}, block {b} went on before link {d} was counted"
                    );
                }
            }
        }
    }

    /// One pass: the whole chain in one launch, or a link a launch; the outputs poisoned first.
    fn pass(&mut self, unit: &EmuModule, order: Order, blocks: u32, whole: bool) {
        assert!(blocks as usize <= MAX_BLOCKS);
        for o in &mut self.outputs {
            o.fill(f32::NAN);
        }
        let links = self.outputs.len();
        let launches: Vec<(usize, usize)> = match whole {
            true => vec![(0, links)],
            false => (0..links).map(|j| (j, 1)).collect(),
        };
        let sums = self
            .format
            .sum_floats(self.products.iter().copied(), blocks as usize);
        let shared = self.format.shared_bytes(self.max_k, sums);
        let x_floats = self.format.x_floats(self.max_k);
        // SAFETY: the chain kernels' signature in chain.cu.
        let kernel: ChainKernel = unsafe { unit.kernel(self.format.kernel) }.unwrap();
        let (table, done, exits) = (
            self.table.as_ptr(),
            self.done.as_mut_ptr(),
            self.exits.as_mut_ptr(),
        );
        for (first, count) in launches {
            let body = || unsafe {
                kernel(
                    table,
                    first as i32,
                    count as i32,
                    done,
                    exits,
                    x_floats as i32,
                )
            };
            unit.launch_resident_in(
                order,
                [blocks, 1, 1],
                [self.format.threads, 1, 1],
                shared,
                &body,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
        for (_, tickets) in &self.scratch {
            assert!(
                tickets.iter().all(|&t| t == 0),
                "a launch leaves its tickets at 0"
            );
        }
    }
}

/// The chain unit compiled with `defines` (e.g. "" or `CHAIN_STAGES=N`), or None where no C++
/// compiler runs.
fn chain_unit(defines: &str) -> Option<EmuModule> {
    if let Err(e) = compiler_available() {
        eprintln!("skipped: {e}");
        return None;
    }
    let unit = Unit::holding(Module::Chain, None);
    let lines = define_lines(defines).unwrap();
    let name = format!("{}{}", unit.name(), defines.replace('=', "_"));
    Some(EmuModule::compile(&name, &unit.source(&lines)).unwrap_or_else(|e| panic!("{e}")))
}

/// Runs `spec` of `ty` weights on the chain unit compiled with `defines` (the host's layout read
/// from the same defines) with 3 and 5 blocks, every pass in every order bit-equal to the first.
fn check(ty: GgmlType, spec: &[LinkSpec], defines: &str) {
    let Some(unit) = chain_unit(defines) else {
        return;
    };
    let mut r = rng(&format!("chain {ty} {defines}"));
    let inputs = chain_inputs(&mut r, spec, ty);
    for blocks in [3, 5] {
        let mut chain = HostChain::new(spec, &inputs, defines);
        chain.pass(&unit, Order::Ascending, blocks, true);
        let what = format!("chain {ty} {defines}, {blocks} blocks");
        check_chain(&what, spec, &inputs, &chain.outputs);
        chain.check_stamps(spec, &what, blocks as usize);
        let first = chain.outputs.clone();
        for (order, whole) in [
            (Order::Ascending, true),
            (Order::Ascending, false),
            (Order::Descending, true),
            (Order::Descending, false),
            (Order::FirstAhead, true),
            (Order::LastAhead, true),
        ] {
            chain.pass(&unit, order, blocks, whole);
            if whole {
                chain.check_stamps(spec, &format!("{what} ({order:?})"), blocks as usize);
            }
            for (j, (a, b)) in first.iter().zip(&chain.outputs).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{what}: link {j} differs in a later pass ({order:?}, whole {whole})"
                );
            }
        }
    }
}

#[test]
fn bf16_chain_matches_reference_and_repeats_bit_for_bit() {
    check(GgmlType::BF16, &test_chain(), "");
}

#[test]
fn bf16_chain_with_a_short_ring_matches_reference() {
    check(GgmlType::BF16, &test_chain(), "CHAIN_STAGES=3");
}

#[test]
fn bf16_chain_of_other_warps_and_items_matches_reference() {
    check(
        GgmlType::BF16,
        &test_chain(),
        "CHAIN_WARPS=5 CHAIN_K=2048 CHAIN_STAGES=2",
    );
}

#[test]
fn bf16_chain_of_lanes_own_copies_matches_reference() {
    check(GgmlType::BF16, &test_chain(), "CHAIN_BULK=0");
    check(GgmlType::BF16, &test_chain(), "CHAIN_BULK=0 CHAIN_STAGES=2");
}

#[test]
fn bf16_chain_with_stamps_matches_reference_and_waits_for_its_inputs() {
    check(GgmlType::BF16, &test_chain(), "CHAIN_STAMPS=1");
}

#[test]
fn bf16_chain_pipelined_matches_reference_and_repeats_bit_for_bit() {
    check(GgmlType::BF16, &test_chain(), "CHAIN_PIPE=1");
    check(
        GgmlType::BF16,
        &test_chain(),
        "CHAIN_PIPE=1 CHAIN_WARPS=5 CHAIN_K=2048 CHAIN_STAGES=2",
    );
    check(GgmlType::BF16, &test_chain(), "CHAIN_PIPE=1 CHAIN_BULK=0");
}

#[test]
fn q4_k_chain_matches_reference_and_repeats_bit_for_bit() {
    check(GgmlType::Q4_K, &test_chain_q4k(), "");
}

#[test]
fn q4_k_chain_with_a_short_ring_matches_reference() {
    check(GgmlType::Q4_K, &test_chain_q4k(), "CHAIN_Q4K_STAGES=3");
}
