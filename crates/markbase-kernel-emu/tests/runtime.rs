//! The emulator's own pieces on small kernels written here: block barriers and shared memory,
//! shuffles, `mma.sync`'s and `wgmma`'s operand layouts against plain matrix products, the
//! errors of a barrier that never fills and of a collective a lane has left, and resident
//! launches, whose blocks wait for each other through global memory.

use markbase_kernel_emu::{compiler_available, EmuError, EmuModule, Order};
use rand::{Rng, SeedableRng};

const SOURCE: &str = r#"
typedef unsigned int u32;

// out[b] = the sum of in over block b's threads (blockDim.x of them), by shared memory.
extern "C" __global__ void block_sums(const float* in, float* out) {
    __shared__ float part[32];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += part[w];
        out[blockIdx.x] = s;
    }
}

// One warp: d = a (16 x 16, f16, row-major) times b (16 x 8, f16, k-major) as mma.sync m16n8k16
// fragments, built here from the matrices by the PTX layout.
extern "C" __global__ void mma_tile(const unsigned short* a, const unsigned short* b, float* d) {
    int lane = threadIdx.x, g = lane >> 2, c = lane & 3;
    auto pair = [](unsigned short lo, unsigned short hi) { return (u32)lo | (u32)hi << 16; };
    u32 fa[4] = {pair(a[g * 16 + 2 * c], a[g * 16 + 2 * c + 1]),
                 pair(a[(g + 8) * 16 + 2 * c], a[(g + 8) * 16 + 2 * c + 1]),
                 pair(a[g * 16 + 2 * c + 8], a[g * 16 + 2 * c + 9]),
                 pair(a[(g + 8) * 16 + 2 * c + 8], a[(g + 8) * 16 + 2 * c + 9])};
    u32 b0 = pair(b[(2 * c) * 8 + g], b[(2 * c + 1) * 8 + g]);
    u32 b1 = pair(b[(2 * c + 8) * 8 + g], b[(2 * c + 9) * 8 + g]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    mb_emu::mma(acc, fa, b0, b1, false);
    d[g * 8 + 2 * c] = acc[0];
    d[g * 8 + 2 * c + 1] = acc[1];
    d[(g + 8) * 8 + 2 * c] = acc[2];
    d[(g + 8) * 8 + 2 * c + 1] = acc[3];
}

// Each warpgroup w of the block: d_w = a_w (64 x 16, f16, row-major) times b (16 x 32, f16,
// k-major) as wgmma m64n32k16 operands built here by the PTX layouts: A fragments as mma.sync's
// of the warp's 16 rows, B as core matrices of 8 columns x 8 k values (16 bytes a column) at
// 512 bytes apart along K and 128 along N in dynamic shared memory, d as mma.sync's C, n-tile
// after n-tile. Accumulates onto d's values.
extern "C" __global__ void wgmma_tile(const unsigned short* a, const unsigned short* b, float* d) {
    extern __shared__ unsigned char wg_smem[];
    const int t = threadIdx.x & 127, wg = threadIdx.x >> 7;
    const int row = 16 * (t >> 5) + ((t & 31) >> 2), c = t & 3;
    for (int i = threadIdx.x; i < 16 * 32; i += blockDim.x) {
        const int k = i / 32, col = i % 32;
        unsigned short* at = (unsigned short*)(wg_smem + (k >> 3) * 512 + (col >> 3) * 128 +
                                               (col & 7) * 16 + (k & 7) * 2);
        *at = b[k * 32 + col];
    }
    __syncthreads();
    const unsigned short* aw = a + wg * 64 * 16;
    auto pair = [](unsigned short lo, unsigned short hi) { return (u32)lo | (u32)hi << 16; };
    u32 fa[4] = {pair(aw[row * 16 + 2 * c], aw[row * 16 + 2 * c + 1]),
                 pair(aw[(row + 8) * 16 + 2 * c], aw[(row + 8) * 16 + 2 * c + 1]),
                 pair(aw[row * 16 + 2 * c + 8], aw[row * 16 + 2 * c + 9]),
                 pair(aw[(row + 8) * 16 + 2 * c + 8], aw[(row + 8) * 16 + 2 * c + 9])};
    float* dw = d + wg * 64 * 32;
    float acc[16];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[4 * j + i] = dw[(row + 8 * (i >> 1)) * 32 + 8 * j + 2 * c + (i & 1)];
    mb_emu::wgmma_f16(acc, fa, wg_smem, 512, 128, 32);
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) dw[(row + 8 * (i >> 1)) * 32 + 8 * j + 2 * c + (i & 1)] = acc[4 * j + i];
}

// Half the warp waits at a shuffle of the whole warp, the other half at a block barrier.
extern "C" __global__ void half_barrier(float* out) {
    if (threadIdx.x < 16)
        out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.f, 0);
    else
        __syncthreads();
}

// A cp.async's bytes: out[0] read before the wait of its group, out[1] after a wait that
// leaves the newest group pending, out[2] after the wait for all.
extern "C" __global__ void async_copy(const unsigned* src, unsigned* out) {
    __shared__ __attribute__((aligned(16))) unsigned s[8];
    s[0] = 7u;
    s[4] = 7u;
    unsigned a = mb_emu::shared_handle(s);
    mb_emu::cp_async16(a, src, 16);
    mb_emu::cp_async_commit();
    out[0] = s[0];
    mb_emu::cp_async16(a + 16, src + 4, 16);
    mb_emu::cp_async_commit();
    mb_emu::cp_async_wait(1);
    out[1] = s[0];
    out[2] = s[4];
    mb_emu::cp_async_wait(0);
    out[3] = s[4];
}

// Warp 1 reads what warp 0 wrote to shared memory, with no barrier between: right only when
// warp 0 runs first.
extern "C" __global__ void missing_barrier(float* out) {
    __shared__ float s[32];
    if (threadIdx.x < 32) s[threadIdx.x] = 1.f;
    __syncwarp();
    if (threadIdx.x >= 32) out[threadIdx.x - 32] = s[threadIdx.x - 32];
}

// Lane 5 leaves before the shuffle its warp needs it for.
extern "C" __global__ void early_exit(float* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.f, 0);
}
"#;

/// Kernels for resident launches: blocks that wait for each other, with no static shared
/// arrays (one copy for all blocks).
const RESIDENT_SOURCE: &str = r#"
#define SPIN() mb_emu::spin()

// The last block writes data[t] = 1000 + t, then sets the flag; block 0 waits for the flag
// and copies data to out.
extern "C" __global__ void wait_for_last(volatile unsigned* flag, volatile unsigned* data,
                                         unsigned* out) {
    if (blockIdx.x == gridDim.x - 1) {
        data[threadIdx.x] = 1000u + threadIdx.x;
        __syncthreads();
        if (threadIdx.x == 0) *flag = 1u;
    } else if (blockIdx.x == 0) {
        while (*flag == 0u) SPIN();
        out[threadIdx.x] = data[threadIdx.x];
    }
}

// Every thread logs its block in two phases a block barrier apart.
extern "C" __global__ void phases(unsigned* log, unsigned* n) {
    for (unsigned phase = 0; phase < 2; phase++) {
        log[atomicAdd(n, 1u)] = blockIdx.x;
        __syncthreads();
    }
}

// Every thread waits for a flag no thread sets.
extern "C" __global__ void wait_forever(volatile unsigned* flag) {
    while (*flag == 0u) SPIN();
}

// Each block writes its index into its dynamic shared memory, counts itself in, waits until
// every block has, and writes what a neighbour thread of its block wrote (read through the
// 32-bit shared address) to out.
extern "C" __global__ void own_shared(volatile unsigned* arrived, unsigned* out) {
    extern __shared__ unsigned mine[];
    mine[threadIdx.x] = blockIdx.x * 1000u + threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) *arrived = *arrived + 1u;
    while (*arrived < gridDim.x) SPIN();
    unsigned next = mb_emu::shared_handle(mine + (threadIdx.x + 1) % blockDim.x);
    out[blockIdx.x * blockDim.x + threadIdx.x] = *(unsigned*)mb_emu::shared_pointer(next);
}
"#;

fn module() -> Option<EmuModule> {
    if let Err(e) = compiler_available() {
        eprintln!("skipped: {e}");
        return None;
    }
    Some(EmuModule::compile("emu-runtime-test", SOURCE).expect("the test unit compiles"))
}

fn resident_module() -> Option<EmuModule> {
    if let Err(e) = compiler_available() {
        eprintln!("skipped: {e}");
        return None;
    }
    Some(
        EmuModule::compile("emu-resident-test", RESIDENT_SOURCE)
            .expect("the resident test unit compiles"),
    )
}

/// `wait_for_last`'s signature.
type WaitForLast = unsafe extern "C" fn(*mut u32, *mut u32, *mut u32);

#[test]
fn block_sums_see_every_thread_through_shuffles_and_a_barrier() {
    let Some(m) = module() else { return };
    type Kernel = unsafe extern "C" fn(*const f32, *mut f32);
    // SAFETY: the signature of block_sums.
    let k: Kernel = unsafe { m.kernel("block_sums") }.unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (blocks, threads) = (3usize, 96usize);
    let input: Vec<f32> = (0..blocks * threads)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut out = vec![0f32; blocks];
    let (ip, op) = (input.as_ptr() as usize, out.as_mut_ptr() as usize);
    // SAFETY: the buffers outlive the launch and hold what the kernel reads and writes.
    m.launch(
        [blocks as u32, 1, 1],
        [threads as u32, 1, 1],
        0,
        &|| unsafe { k(ip as *const f32, op as *mut f32) },
    )
    .unwrap();
    for b in 0..blocks {
        let want: f32 = input[b * threads..(b + 1) * threads].iter().sum();
        assert!(
            (out[b] - want).abs() < 1e-4,
            "block {b}: {} vs {want}",
            out[b]
        );
    }
}

/// `n` f16 values uniform in [-2, 2) from seed `seed`.
fn random_f16(seed: u64, n: usize) -> Vec<half::f16> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| half::f16::from_f32(rng.random_range(-2.0..2.0)))
        .collect()
}

/// Runs the tile product kernel `name` (mma_tile, wgmma_tile: A and B in, the product into d)
/// on one block of `threads` threads with `shared` bytes of dynamic shared memory.
fn run_tile(
    m: &EmuModule,
    name: &str,
    threads: u32,
    shared: usize,
    a: &[half::f16],
    b: &[half::f16],
    d: &mut [f32],
) {
    type Kernel = unsafe extern "C" fn(*const u16, *const u16, *mut f32);
    // SAFETY: the signature of the tile kernels (mma_tile, wgmma_tile).
    let k: Kernel = unsafe { m.kernel(name) }.unwrap();
    let (ap, bp, dp) = (
        a.as_ptr() as usize,
        b.as_ptr() as usize,
        d.as_mut_ptr() as usize,
    );
    // SAFETY: the buffers outlive the launch.
    m.launch([1, 1, 1], [threads, 1, 1], shared, &|| unsafe {
        k(ap as *const u16, bp as *const u16, dp as *mut f32)
    })
    .unwrap();
}

#[test]
fn mma_fragments_multiply_as_the_ptx_layout_says() {
    let Some(m) = module() else { return };
    let a = random_f16(2, 256);
    let b = random_f16(3, 128);
    let mut d = vec![0f32; 128];
    run_tile(&m, "mma_tile", 32, 0, &a, &b, &mut d);
    for i in 0..16 {
        for j in 0..8 {
            let want: f64 = (0..16)
                .map(|k| a[i * 16 + k].to_f64() * b[k * 8 + j].to_f64())
                .sum();
            assert!((d[i * 8 + j] as f64 - want).abs() < 1e-5, "d[{i}][{j}]");
        }
    }
}

#[test]
fn wgmma_operands_multiply_as_the_ptx_layouts_say() {
    let Some(m) = module() else { return };
    // Two warpgroups, each its own 64 rows of A and of d; one B.
    let a = random_f16(4, 2 * 64 * 16);
    let b = random_f16(5, 16 * 32);
    let d0: Vec<f32> = (0..2 * 64 * 32).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut d = d0.clone();
    run_tile(&m, "wgmma_tile", 256, 1024, &a, &b, &mut d);
    for w in 0..2 {
        for i in 0..64 {
            for j in 0..32 {
                let at = (w * 64 + i) * 32 + j;
                let want: f64 = d0[at] as f64
                    + (0..16)
                        .map(|k| a[(w * 64 + i) * 16 + k].to_f64() * b[k * 32 + j].to_f64())
                        .sum::<f64>();
                assert!((d[at] as f64 - want).abs() < 1e-4, "group {w} d[{i}][{j}]");
            }
        }
    }
}

#[test]
fn a_barrier_that_never_fills_and_a_lane_that_left_are_errors() {
    let Some(m) = module() else { return };
    let mut out = vec![0f32; 32];
    let op = out.as_mut_ptr() as usize;
    type Kernel = unsafe extern "C" fn(*mut f32);
    // SAFETY: the signature of half_barrier.
    let k: Kernel = unsafe { m.kernel("half_barrier") }.unwrap();
    // SAFETY: `out` outlives the launch.
    let e = m.launch([1, 1, 1], [32, 1, 1], 0, &|| unsafe { k(op as *mut f32) });
    let Err(EmuError::Launch { message, .. }) = e else {
        panic!("expected a hang reported, got {e:?}")
    };
    assert!(message.contains("never fill"), "{message}");

    // SAFETY: the signature of early_exit.
    let k: Kernel = unsafe { m.kernel("early_exit") }.unwrap();
    // SAFETY: `out` outlives the launch.
    let e = m.launch([1, 1, 1], [32, 1, 1], 0, &|| unsafe { k(op as *mut f32) });
    let Err(EmuError::Launch { message, .. }) = e else {
        panic!("expected a broken collective reported, got {e:?}")
    };
    assert!(message.contains("left"), "{message}");
}

#[test]
fn async_copies_land_at_the_wait_for_their_group() {
    let Some(m) = module() else { return };
    type Kernel = unsafe extern "C" fn(*const u32, *mut u32);
    // SAFETY: the signature of async_copy.
    let k: Kernel = unsafe { m.kernel("async_copy") }.unwrap();
    let src: Vec<u32> = (100..108).collect();
    let mut out = vec![0u32; 4];
    let (sp, op) = (src.as_ptr() as usize, out.as_mut_ptr() as usize);
    // SAFETY: the buffers outlive the launch.
    m.launch([1, 1, 1], [1, 1, 1], 0, &|| unsafe {
        k(sp as *const u32, op as *mut u32)
    })
    .unwrap();
    assert_eq!(out, [7, 100, 7, 104]);
}

#[test]
fn the_descending_order_exposes_a_missing_barrier() {
    let Some(m) = module() else { return };
    type Kernel = unsafe extern "C" fn(*mut f32);
    // SAFETY: the signature of missing_barrier.
    let k: Kernel = unsafe { m.kernel("missing_barrier") }.unwrap();
    let mut got = Vec::new();
    for order in [Order::Ascending, Order::Descending] {
        let mut out = vec![0f32; 32];
        let op = out.as_mut_ptr() as usize;
        // SAFETY: `out` outlives the launch.
        m.launch_in(order, [1, 1, 1], [64, 1, 1], 0, &|| unsafe {
            k(op as *mut f32)
        })
        .unwrap();
        got.push(out[0]);
    }
    // Ascending, warp 0 wrote first; descending, warp 1 read the launch's stale bytes.
    assert_eq!(got[0], 1.0);
    assert_ne!(got[1], 1.0);
}

/// Blocks and threads of the resident tests' launches.
const BLOCKS: u32 = 4;
const THREADS: u32 = 64;

/// The error message of a launch expected to fail.
fn launch_error(result: Result<(), EmuError>) -> String {
    match result {
        Err(EmuError::Launch { message, .. }) => message,
        other => panic!("expected a launch error, got {other:?}"),
    }
}

#[test]
fn resident_blocks_wait_for_each_other_through_global_memory() {
    let Some(m) = resident_module() else { return };
    // SAFETY: the signature of wait_for_last.
    let k: WaitForLast = unsafe { m.kernel("wait_for_last") }.unwrap();
    for order in [Order::Ascending, Order::Descending] {
        let (mut flag, mut data, mut out) = (vec![0u32], vec![0u32; 64], vec![0u32; 64]);
        let (fp, dp, op) = (
            flag.as_mut_ptr() as usize,
            data.as_mut_ptr() as usize,
            out.as_mut_ptr() as usize,
        );
        // SAFETY: the buffers outlive the launch.
        m.launch_resident_in(order, [BLOCKS, 1, 1], [THREADS, 1, 1], 0, &|| unsafe {
            k(fp as *mut u32, dp as *mut u32, op as *mut u32)
        })
        .unwrap_or_else(|e| panic!("{order:?}: {e}"));
        let want: Vec<u32> = (1000..1064).collect();
        assert_eq!(out, want, "{order:?}");
    }
}

#[test]
fn ahead_orders_run_the_first_or_the_last_blocks_ahead_of_the_others() {
    let Some(m) = resident_module() else { return };
    type Phases = unsafe extern "C" fn(*mut u32, *mut u32);
    // SAFETY: the signature of phases.
    let k: Phases = unsafe { m.kernel("phases") }.unwrap();
    let log_of = |order| {
        let (mut log, mut n) = (vec![u32::MAX; (2 * BLOCKS * THREADS) as usize], vec![0u32]);
        let (lp, np) = (log.as_mut_ptr() as usize, n.as_mut_ptr() as usize);
        // SAFETY: the buffers outlive the launch.
        m.launch_resident_in(order, [BLOCKS, 1, 1], [THREADS, 1, 1], 0, &|| unsafe {
            k(lp as *mut u32, np as *mut u32)
        })
        .unwrap_or_else(|e| panic!("{order:?}: {e}"));
        assert_eq!(n[0], 2 * BLOCKS * THREADS);
        log
    };
    // Ahead, a block runs to its end before the next one in the order starts; in turn, the
    // blocks' phases interleave.
    let first = log_of(Order::FirstAhead);
    assert!(first.windows(2).all(|w| w[0] <= w[1]), "{first:?}");
    let last = log_of(Order::LastAhead);
    assert!(last.windows(2).all(|w| w[0] >= w[1]), "{last:?}");
    let turns = log_of(Order::Ascending);
    assert!(!turns.windows(2).all(|w| w[0] <= w[1]), "{turns:?}");
}

#[test]
fn a_block_spinning_for_a_later_block_fails_when_blocks_run_one_at_a_time() {
    let Some(m) = resident_module() else { return };
    // SAFETY: the signature of wait_for_last.
    let k: WaitForLast = unsafe { m.kernel("wait_for_last") }.unwrap();
    let (mut flag, mut data, mut out) = (vec![0u32], vec![0u32; 64], vec![0u32; 64]);
    let (fp, dp, op) = (
        flag.as_mut_ptr() as usize,
        data.as_mut_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    // SAFETY: the buffers outlive the launch.
    let message = launch_error(m.launch_in(
        Order::Ascending,
        [BLOCKS, 1, 1],
        [THREADS, 1, 1],
        0,
        &|| unsafe { k(fp as *mut u32, dp as *mut u32, op as *mut u32) },
    ));
    assert!(
        message.starts_with("block (0, 0, 0), thread ")
            && message.ends_with(
                ": every live thread spins, waiting for memory no thread will change \
                 (blocks that wait for each other need a resident launch)"
            ),
        "{message}"
    );
}

#[test]
fn a_resident_launch_where_every_thread_spins_fails() {
    let Some(m) = resident_module() else { return };
    type Kernel = unsafe extern "C" fn(*mut u32);
    // SAFETY: the signature of wait_forever.
    let k: Kernel = unsafe { m.kernel("wait_forever") }.unwrap();
    for order in [Order::Ascending, Order::Descending] {
        let mut flag = vec![0u32];
        let fp = flag.as_mut_ptr() as usize;
        // SAFETY: `flag` outlives the launch.
        let message = launch_error(m.launch_resident_in(
            order,
            [BLOCKS, 1, 1],
            [THREADS, 1, 1],
            0,
            &|| unsafe { k(fp as *mut u32) },
        ));
        assert!(
            message.starts_with("block (")
                && message.ends_with(
                    ": every live thread spins, waiting for memory no thread will change"
                ),
            "{order:?}: {message}"
        );
    }
}

#[test]
fn each_resident_block_has_its_own_shared_memory_and_index() {
    let Some(m) = resident_module() else { return };
    type Kernel = unsafe extern "C" fn(*mut u32, *mut u32);
    // SAFETY: the signature of own_shared.
    let k: Kernel = unsafe { m.kernel("own_shared") }.unwrap();
    for order in [Order::Ascending, Order::Descending] {
        let mut arrived = vec![0u32];
        let mut out = vec![0u32; (BLOCKS * THREADS) as usize];
        let (ap, op) = (arrived.as_mut_ptr() as usize, out.as_mut_ptr() as usize);
        // SAFETY: the buffers outlive the launch.
        m.launch_resident_in(
            order,
            [BLOCKS, 1, 1],
            [THREADS, 1, 1],
            THREADS as usize * 4,
            &|| unsafe { k(ap as *mut u32, op as *mut u32) },
        )
        .unwrap_or_else(|e| panic!("{order:?}: {e}"));
        let want: Vec<u32> = (0..BLOCKS)
            .flat_map(|b| (0..THREADS).map(move |t| b * 1000 + (t + 1) % THREADS))
            .collect();
        assert_eq!(out, want, "{order:?}");
    }
}

#[test]
fn a_resident_launch_refuses_static_shared_arrays_and_too_many_threads() {
    let Some(m) = module() else { return };
    type Kernel = unsafe extern "C" fn(*const f32, *mut f32);
    // SAFETY: the signature of block_sums.
    let k: Kernel = unsafe { m.kernel("block_sums") }.unwrap();
    let input = vec![1f32; 2 * 64];
    let mut out = vec![0f32; 2];
    let (ip, op) = (input.as_ptr() as usize, out.as_mut_ptr() as usize);
    // SAFETY: the buffers outlive the launch.
    let body = || unsafe { k(ip as *const f32, op as *mut f32) };
    // One block may use the unit's one copy of its static arrays.
    m.launch_resident([1, 1, 1], [64, 1, 1], 0, &body).unwrap();
    assert_eq!(out[0], 64.0);
    let message = launch_error(m.launch_resident([2, 1, 1], [64, 1, 1], 0, &body));
    assert!(
        message.starts_with("a resident launch of 2 blocks: the unit has static __shared__ arrays"),
        "{message}"
    );
    let message = launch_error(m.launch_resident([65, 1, 1], [1024, 1, 1], 0, &body));
    assert!(message.contains("more than 65536 threads"), "{message}");
}
