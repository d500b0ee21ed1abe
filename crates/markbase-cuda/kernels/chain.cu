// A chain of one-token products in one persistent launch, of bf16 (`chain_bf16`) or Q4_K
// (`chain_q4_k`) weights: an experiment towards a decode step in one kernel (docs/perf.md,
// sessions 44 and 58). Product j of the chain computes
// out_j[r] = Σ_i W_j[r, i] · x_j[i], where x_j is an input vector — in the chain, an earlier
// product's outputs — taken as it is, or as gelu_tanh(a) · b of its two halves (`pair`), and
// RMS-normed with weights (`norm`) where the product asks.
//
// Why: a decode step of one token is ≈ 500 dependent kernels whose boundaries leave the memory
// idle (each kernel's tail, the next one's ramp; docs/perf.md sessions 17–30). Here every block
// of the launch (one a multiprocessor, all resident) takes an equal contiguous share of every
// product and streams its weights into shared memory by cp.async ahead of their use, across
// the products' boundaries: while a block waits for the product its next product reads, the
// weights of its next units are already on their way. A block waits on a count in global
// memory (`done`; the waiting thread spins with acquire loads) that each block raises once at
// the end of its share of a product (one fence and atomic a product).
//
// Q4_K (`chain_q4_k`, session 44; measured on the H100 at 15 % of the copy rate, bound by its
// per-unit loop): a block's share is a run of units — 8 weight rows × 2 048 values, 9 KB — that
// its 8 warps take together through one ring of CHAIN_Q4K_STAGES stages, a block barrier a
// unit, a warp a row. The count is of tiles (8 rows) stored. A tile whose units fall to more
// than one block leaves each block's sum of its run as a part, which the block that ends the
// tile's last run (a ticket a tile, reset by that block) adds in unit order.
//
// bf16 (`chain_bf16`, session 58: 69–70 % of the H100's copy rate, against 36 % for session
// 44's version of the Q4_K shape and 83 % for the backend's own operations; session 59's
// stamps put its items at the copy rate and the loss in staging x at the boundaries, and its
// staging without a block reduction, gated links and fields in shared memory: 75–76 %; session
// 60: items by bulk copies and L2 asked for the next weights while a block waits, 75 → 78 %,
// and a boundary's time is not covered by the copies in flight at any ring depth, so only
// shorter boundaries will raise it much): a
// block's share is whole rows (a gated product's whole pairs of rows), cut into items of a row's
// CHAIN_K values (1 024, 2 KB). Its CHAIN_WARPS warps take every CHAIN_WARPS-th item, each
// streaming its items through its own ring of CHAIN_STAGES stages — lane 0 requests an item
// by one bulk copy counted on the stage's mbarrier (CHAIN_BULK), or each lane copies its own
// 16-byte pieces — and each lane multiplies its own pieces: no block barrier an item, no
// address arithmetic but a row's. x is staged as x · γ and the norm's
// RMS scale multiplies the row sums (chain_stage_scaled_x). A warp's item sums go to shared
// memory; after the block's last item of a product its threads add each row's items in order
// and store the row. The count is of blocks done. The product in use and the next one sit in
// shared memory, the next copied from the table during the current one's items.
//
// Either way every run of a launch of the same grid gives the same bits. A launch may cover
// any range of the chain's products (`first`, `count`); a product whose input comes from
// outside the range reads it without waiting (the stream ordered its producer first). The
// block that exits last (a count in `exits`) sets the range's counts and `exits` back to 0, so
// the arguments of every pass are the same and a captured graph replays them. Dynamic shared
// memory holds the ring(s), (bf16) two products' ChainOp, x (x_floats floats), 32 floats of
// reductions and (Q4_K) x's 16-bit tiles, (bf16) the item sums (chain.rs
// `ChainFormat::shared_bytes`); the grid's blocks are all resident at once.

// bf16: warps a block, the stages of each warp's ring (an item each) and an item's values (a
// multiple of 256); chain.rs `ChainFormat::with_defines` reads the same defines.
#ifndef CHAIN_WARPS
#define CHAIN_WARPS 16
#endif
// 1: (bf16) a product's outputs counted a chunk at a time, its consumers starting on the chunks
// already stored, a warp a block staging x and one storing rows (chain_bf16_piped, session 61);
// 0: a count a product, every block waiting for the whole input (chain_bf16_counted).
#ifndef CHAIN_PIPE
#define CHAIN_PIPE 0
#endif
#ifndef CHAIN_STAGES
#if CHAIN_PIPE
#define CHAIN_STAGES 3
#else
#define CHAIN_STAGES 5
#endif
#endif
#ifndef CHAIN_K
#define CHAIN_K 1024
#endif
// KB of a block's next weights (after its rings' copies) L2 is asked for by one bulk prefetch
// when the block has to wait for a product's input, so the memory streams on through the wait
// (session 60: 64 KB, −1.2 % a pass on the H100); 0: none.
#ifndef CHAIN_WAIT_L2
#define CHAIN_WAIT_L2 64
#endif
// 1: lane 0 of each warp requests the warp's items by bulk copies (TMA), one mbarrier a stage
// (session 60: +2 % on E4B's products, H100); 0: every lane copies its own 16-byte pieces by
// cp.async (faster where the boundaries cost little: docs/perf.md, session 60).
#ifndef CHAIN_BULK
#define CHAIN_BULK 1
#endif
// 1: thread 0 of each block stamps the SM's clock at the phases of its share of every bf16
// product (chain_stamp), for `cuda_bench --chain bf16` to add up; 0: no stamps.
#ifndef CHAIN_STAMPS
#define CHAIN_STAMPS 0
#endif
// Q4_K: the ring's stages (units of 9 KB) and a unit's rows.
#ifndef CHAIN_Q4K_STAGES
#define CHAIN_Q4K_STAGES 16
#endif
#define CHAIN_ROWS 8

// One product of the chain, as the host lays it out (chain.rs `ChainOp`, 88 bytes).
struct ChainOp {
    u64 w;        // weights [rows, k] (bf16, or Q4_K super-blocks as stored)
    u64 in;       // f32 input: k values, or (pair) 2k with x[i] = gelu_tanh(in[i]) · in[k + i]
    u64 norm;     // f32 RMSNorm weights of x (0: x as it is)
    u64 out;      // f32 outputs [rows]
    u64 parts;    // Q4_K: f32 [tiles · chunks][8], run sums of tiles cut between blocks
    u64 tickets;  // Q4_K: u32 [tiles], units of the tile done so far (0 between launches)
    u64 stamps;   // bf16 with CHAIN_STAMPS: u64 [blocks][CHAIN_PHASES] clock stamps (else 0)
    int rows, k, pair, dep;  // dep: the product whose outputs `in` holds (-1: none)
    int tiles, chunks;       // ⌈rows / 8⌉, ⌈k / values of a unit (item)⌉
    float eps;
    int gated;  // bf16: rows are (gate, up) pairs, out[i] = gelu_tanh(gate_i · x) · (up_i · x)
};

// A block's place in the chain: unit u of product op, its share ending before unit end.
struct ChainCursor {
    int op, u, end;
};

// The first unit of this block's share of product `u` — ⌊units · b / blocks⌋ for block b.
__device__ __forceinline__ int chain_share(int units, int b) {
    return (int)((u64)units * b / gridDim.x);
}

// Moves c to this block's first unit at or after product c.op (c.op == last: none left).
__device__ __forceinline__ void chain_seek(const ChainOp* ops, int last, ChainCursor& c) {
    for (; c.op < last; c.op++) {
        const int units = ops[c.op].tiles * ops[c.op].chunks;
        c.u = chain_share(units, blockIdx.x);
        c.end = chain_share(units, blockIdx.x + 1);
        if (c.u < c.end) return;
    }
}

__device__ __forceinline__ void chain_next(const ChainOp* ops, int last, ChainCursor& c) {
    if (++c.u == c.end) {
        c.op++;
        chain_seek(ops, last, c);
    }
}

// *p, ordered before every later load of the thread (acquire, GPU scope).
__device__ __forceinline__ u32 chain_acquire(const u32* p) {
#ifdef MB_EMU
    return *(const volatile u32*)p;
#else
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#endif
}

// A turn of a spin-wait loop.
__device__ __forceinline__ void chain_spin() {
#ifdef MB_EMU
    mb_emu::spin();
#else
    asm volatile("nanosleep.u32 64;");
#endif
}

// Waits (thread 0, then the block) until *count reaches `ready`; count null: no wait. Where
// the block has to wait, thread 0 first asks L2 for the `ahead_bytes` at `ahead` (if any).
__device__ __forceinline__ void chain_wait(const u32* count, u32 ready, const u8* ahead = nullptr,
                                           u32 ahead_bytes = 0) {
    if (!count) return;
    if (threadIdx.x == 0) {
        bool asked = false;
        while (chain_acquire(count) < ready) {
            // The block has to wait, and its memory would idle: L2 is asked for the weights
            // after the rings' copies (CHAIN_WAIT_L2).
            if (!asked && ahead_bytes) {
#ifndef MB_EMU
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ahead),
                             "r"(ahead_bytes)
                             : "memory");
#endif
                asked = true;
            }
            chain_spin();
        }
    }
    __syncthreads();
}

// The phases a block's share of a bf16 product is stamped at (CHAIN_STAMPS): its start, its
// input ready, x staged, its items multiplied (every warp), its rows stored and counted.
#define CHAIN_PHASES 5

// Thread 0 stamps phase `phase` of this block's share of product o with the SM's cycle count
// (the emulator: a count of stamps), where CHAIN_STAMPS asks and o has stamps (bf16).
__device__ __forceinline__ void chain_stamp(const ChainOp& o, int phase) {
#if CHAIN_STAMPS
    if (threadIdx.x != 0 || !o.stamps) return;
#ifdef MB_EMU
    static u64 ticks = 0;
    const u64 t = ++ticks;
#else
    u64 t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
#endif
    ((u64*)o.stamps)[CHAIN_PHASES * blockIdx.x + phase] = t;
#endif
}

// Queues unit u of product o (its tile's 8 rows, the row bytes of chunk `chunk` ..) into the
// stage at s: row r's at U::CHUNK_BYTES · r, zeros past the rows and past the row's bytes.
template <class U>
__device__ __forceinline__ void chain_issue(const ChainOp& o, int u, u32 s) {
    const int tile = u / o.chunks, chunk = u - tile * o.chunks;
    constexpr int PIECES = U::CHUNK_BYTES / 16;  // 16-byte pieces of a row's chunk
    const u64 row_bytes = U::row_bytes(o.k);
    for (int p = threadIdx.x; p < CHAIN_ROWS * PIECES; p += blockDim.x) {
        const int row = tile * CHAIN_ROWS + p / PIECES;
        const u64 at = (u64)chunk * U::CHUNK_BYTES + 16 * (p % PIECES);
        const bool in = row < o.rows && at < row_bytes;
        const u8* g = (const u8*)o.w + (in ? (u64)row * row_bytes + at : 0);
        cp_async16_fill(s + 16 * p, g, in ? 16 : 0);
    }
}

// gelu_tanh(a) · b, value by value: x of a pair input from its two halves.
__device__ __forceinline__ float4 chain_pair4(float4 a, float4 b) {
    return make_float4(gelu_tanh(a.x) * b.x, gelu_tanh(a.y) * b.y, gelu_tanh(a.z) * b.z,
                       gelu_tanh(a.w) * b.w);
}

// Adds x's squares to ss and returns x · γ (x as it is where γ is null), value by value.
__device__ __forceinline__ float4 chain_scaled4(float4 x, const float4* g, float& ss) {
    ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
    if (g) {
        x.x *= g->x;
        x.y *= g->y;
        x.z *= g->z;
        x.w *= g->w;
    }
    return x;
}

// Value i of product o's x · γ (γ the norm's weights nw, or none), read from L2 one at a time
// (an input not 16-byte aligned), its square added to ss.
__device__ __forceinline__ float chain_scaled_value(const ChainOp& o, const float* nw, int i,
                                                    float& ss) {
    const float* in = (const float*)o.in;
    float v = __ldcg(in + i);
    if (o.pair) v = gelu_tanh(v) * __ldcg(in + o.k + i);
    ss += v * v;
    if (nw) v *= __ldg(nw + i);
    return v;
}

// x[i] for values i0 + 4j (j < 4, i0 a multiple of 4) of product o's input, read from L2
// (other blocks wrote it in this launch): all loads first, so they are in flight together.
__device__ __forceinline__ void chain_x4(const ChainOp& o, int i0, float4* x) {
    const float* in = (const float*)o.in;
    float4 a[4], b[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = i0 + 4 * j;
        a[j] = i < o.k ? __ldcg((const float4*)(in + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (o.pair) b[j] = i < o.k ? __ldcg((const float4*)(in + o.k + i)) : a[j];
    }
#pragma unroll
    for (int j = 0; j < 4; j++) x[j] = o.pair ? chain_pair4(a[j], b[j]) : a[j];
}

// Product o's γ (RMSNorm weights, nw) for x's values i0 + 4j (j < 4; zeros past k).
__device__ __forceinline__ void chain_gamma4(const float* nw, int k, int i0, float4* g) {
#pragma unroll
    for (int j = 0; j < 4; j++)
        g[j] = i0 + 4 * j < k ? __ldg((const float4*)(nw + i0 + 4 * j))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
}

// Waits until *count reaches `ready` (count null: no wait; chain_wait, which asks L2 for
// `ahead_bytes` at `ahead` if the block has to wait), then stages x · γ for product
// o (kx floats, zeros past k; γ its norm's weights, or 1) and, where o normalizes, leaves each
// warp's share of Σ x² in red[warp] for chain_rms_scale: the RMS scale multiplies the row
// sums, so staging needs no block reduction. A thread's γ for its first 16-value span is
// loaded before the wait. Ends with a block barrier.
__device__ void chain_stage_scaled_x(const ChainOp& o, const u32* count, u32 ready, int kx,
                                     float* xs, float* red, const u8* ahead = nullptr,
                                     u32 ahead_bytes = 0) {
    const float* nw = (const float*)o.norm;
    const bool spans = (o.in & 15) == 0 && (o.k & 3) == 0 && (o.norm & 15) == 0;
    const int first = 16 * threadIdx.x;
    float4 g[4];
    if (spans && nw && first < kx) chain_gamma4(nw, o.k, first, g);
    chain_wait(count, ready, ahead, ahead_bytes);
    chain_stamp(o, 1);
    float ss = 0.f;
    if (spans) {
        for (int i0 = first; i0 < kx; i0 += 16 * blockDim.x) {
            float4 x[4];
            chain_x4(o, i0, x);
            if (nw && i0 != first) chain_gamma4(nw, o.k, i0, g);
#pragma unroll
            for (int j = 0; j < 4; j++)
                *(float4*)(xs + i0 + 4 * j) = chain_scaled4(x[j], nw ? &g[j] : nullptr, ss);
        }
    } else {
        for (int i = threadIdx.x; i < kx; i += blockDim.x)
            xs[i] = i < o.k ? chain_scaled_value(o, nw, i, ss) : 0.f;
    }
    if (nw) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
}

// The RMS scale of product o's x (1 where o has no norm) from the warps' sums that
// chain_stage_scaled_x left in red, added in warp order (every thread the same bits).
__device__ __forceinline__ float chain_rms_scale(const ChainOp& o, const float* red) {
    if (!o.norm) return 1.f;
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
    return rsqrtf(s / (float)o.k + o.eps);
}

// Q4_K: chain_stage_scaled_x, then x times its RMS scale where o normalizes (the 16-bit tiles
// take x as the one-token GEMVs do). Ends with a block barrier.
__device__ void chain_stage_normed_x(const ChainOp& o, const u32* count, u32 ready, int kx,
                                     float* xs, float* red) {
    chain_stage_scaled_x(o, count, ready, kx, xs, red);
    if (!o.norm) return;
    const float scale = chain_rms_scale(o, red);
    for (int i = threadIdx.x; i < o.k; i += blockDim.x) xs[i] *= scale;
    __syncthreads();
}

// How a format's units are laid out, staged and multiplied: K values a row (CHUNK_BYTES of
// it), STAGES stages in the ring; row_bytes(k), a row's bytes; prepare(xs, kx, tiles), what
// its dot reads besides x, after x is staged; dot(row, xs, tiles, kx, chunk, lane), a row's dot
// over a unit (the row's CHUNK_BYTES in the stage) with x (kx values staged), complete in every
// lane of the warp.
template <int FMT>
struct ChainUnit;

// Q4_K rows (super-blocks of 256 values, 144 bytes, as stored): x as the one-token GEMVs take
// it, 16-bit integers a 32-value chunk in Q4_K tiles (store_q4k_tiles), and a lane's 16-byte
// slice of a super-block times them by dp2a (i16_block), 8 lanes a super-block, two passes of
// 4 over the unit's 8.
template <>
struct ChainUnit<F_Q4_K> {
    static constexpr int K = 2048, CHUNK_BYTES = 8 * 144, STAGES = CHAIN_Q4K_STAGES;

    static __device__ __forceinline__ u64 row_bytes(int k) { return 144 * (u64)(k >> 8); }

    static __device__ __forceinline__ void prepare(const float* xs, int kx, u8* tiles) {
        store_q4k_tiles(xs, kx, tiles);
        __syncthreads();
    }

    static __device__ __forceinline__ float dot(const u8* row, const float*, const u8* tiles,
                                                int kx, int chunk, int lane) {
        // x's tiles: 16-bit values (2 bytes a value) for the kx values of the staged x, then
        // their (d, d·Σq) pairs; this unit's super-blocks from 8 · chunk on.
        const uint4* xq = (const uint4*)tiles;
        const float2* xm = (const float2*)(tiles + 2 * (u64)kx);
        const int sub = lane & 7;
        float acc[1][1] = {{0.f}};
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            const int b = (lane >> 3) + 4 * pass;
            I16Slice<F_Q4_K> s;
            s.h = *(const uint4*)(row + 144 * b);
            s.q = *(const uint4*)(row + 144 * b + 16 + 16 * sub);
            i16_block<F_Q4_K, 1, 1>(&s, xq, xm, 8 * chunk + b, sub, 1, acc);
        }
        float v = acc[0][0];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
};

// Whether unit v of a product of `units` starts a block's share.
__device__ __forceinline__ bool chain_starts_share(int v, int units) {
    const int b = (int)(((u64)v * gridDim.x + units - 1) / units);
    return b < (int)gridDim.x && chain_share(units, b) == v;
}

// Ends this block's run of tile `tile` of product o (units `first_chunk` .. `chunk`, their
// sum `run` in lane 0 of warp w, for row w): stores it as the tile's outputs when the run is
// the whole tile, else as its part, the block ending the tile's last run adding the parts.
// Returns whether this block stored the tile's outputs. Writers' stores reach thread 0 through
// the block barrier, and thread 0's fence orders them before its ticket (and, after it, the
// other runs' parts before the reads). flag: an int of shared memory.
__device__ bool chain_end_run(const ChainOp& o, int tile, int first_chunk, int chunk, float run,
                              int w, int lane, int* flag) {
    const int row = tile * CHAIN_ROWS + w;
    if (first_chunk == 0 && chunk == o.chunks - 1) {
        if (lane == 0 && row < o.rows) ((float*)o.out)[row] = run;
        return true;
    }
    const float* parts = (const float*)o.parts + (u64)tile * o.chunks * CHAIN_ROWS;
    if (lane == 0) ((float*)parts)[first_chunk * CHAIN_ROWS + w] = run;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const int n = chunk - first_chunk + 1;
        const u32 before = atomicAdd((u32*)o.tickets + tile, (u32)n);
        const bool last = before + n == (u32)o.chunks;
        if (last) ((u32*)o.tickets)[tile] = 0;
        __threadfence();
        *flag = last;
    }
    __syncthreads();
    if (!*flag) return false;
    if (lane == 0 && row < o.rows) {
        // The runs in unit order: each starts at chunk 0 or at a block's share.
        const int units = o.tiles * o.chunks;
        float s = 0.f;
        for (int c = 0; c < o.chunks; c++)
            if (c == 0 || chain_starts_share(tile * o.chunks + c, units))
                s += __ldcg(parts + c * CHAIN_ROWS + w);
        ((float*)o.out)[row] = s;
    }
    return true;
}

// Ends this block's share of product `op`: counts the `stored` tiles whose outputs it stored
// as done, once their stores are ordered before the count (thread 0's fence after the barrier).
__device__ __forceinline__ void chain_end_share(u32* done, int op, int stored) {
    __syncthreads();
    if (threadIdx.x == 0 && stored > 0) {
        __threadfence();
        atomicAdd(done + op, (u32)stored);
    }
}

// The launch's end: the last block out sets the counts of products first .. last − 1 (`per`
// a product) and `exits` back to 0 (every block is past its waits by then).
__device__ __forceinline__ void chain_exit(int first, int last, u32* done, u32* exits,
                                           int per = 1) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(exits, 1u) == gridDim.x - 1) {
            for (int j = per * first; j < per * last; j++) done[j] = 0;
            *exits = 0;
            __threadfence();
        }
    }
}

// The chain's launch over products first .. first + count − 1 (chain.cu's header); U: the
// units' format.
template <class U>
__device__ void chain_impl(const ChainOp* ops, int first, int count, u32* done, u32* exits,
                           int x_floats) {
    constexpr int STAGE_BYTES = CHAIN_ROWS * U::CHUNK_BYTES;
    extern __shared__ __align__(16) u8 chain_smem[];
    const int last = first + count, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 ring = shared_address(chain_smem);
    float* xs = (float*)(chain_smem + U::STAGES * STAGE_BYTES);
    float* red = xs + x_floats;
    int* flag = (int*)(red + 8);
    u8* tiles = (u8*)(red + 32);

    ChainCursor load{first, 0, 0};
    chain_seek(ops, last, load);
    ChainCursor use = load;
    // The first stages before the wait for the kernel ahead: weights only.
#pragma unroll 1
    for (int s = 0; s < U::STAGES - 1; s++) {
        if (load.op < last) {
            chain_issue<U>(ops[load.op], load.u, ring + s * STAGE_BYTES);
            chain_next(ops, last, load);
        }
        cp_async_commit();
    }
    wait_prior_grid();

    int staged = -1, first_chunk = 0, stored = 0;
    float run = 0.f;
    for (int i = 0; use.op < last; i++) {
        cp_async_wait<U::STAGES - 2>();
        __syncthreads();  // unit i landed for every thread; stage (i - 1) % STAGES is free
        if (load.op < last) {
            chain_issue<U>(ops[load.op], load.u,
                           ring + (i + U::STAGES - 1) % U::STAGES * STAGE_BYTES);
            chain_next(ops, last, load);
        }
        cp_async_commit();
        const ChainOp& o = ops[use.op];
        if (use.op != staged) {
            staged = use.op;
            const bool wait = o.dep >= first;
            chain_stage_normed_x(o, wait ? done + o.dep : nullptr,
                                 wait ? (u32)ops[o.dep].tiles : 0, o.chunks * U::K, xs, red);
            U::prepare(xs, o.chunks * U::K, tiles);
        }
        const int tile = use.u / o.chunks, chunk = use.u - tile * o.chunks;
        if (chunk == 0 || use.u == chain_share(o.tiles * o.chunks, blockIdx.x)) {
            first_chunk = chunk;
            run = 0.f;
        }
        const u8* row = chain_smem + i % U::STAGES * STAGE_BYTES + w * U::CHUNK_BYTES;
        run += U::dot(row, xs, tiles, o.chunks * U::K, chunk, lane);
        if (chunk == o.chunks - 1 || use.u + 1 == use.end)
            stored += chain_end_run(o, tile, first_chunk, chunk, run, w, lane, flag);
        if (use.u + 1 == use.end) {
            chain_end_share(done, use.op, stored);
            stored = 0;
        }
        chain_next(ops, last, use);
    }
    cp_async_wait<0>();
    chain_exit(first, last, done, exits);
}

// chain_q4_k: the chain of Q4_K products in units of 8 rows.
extern "C" __global__ void __launch_bounds__(256, 1)
    chain_q4_k(const ChainOp* ops, int first, int count, u32* done, u32* exits, int x_floats) {
    chain_impl<ChainUnit<F_Q4_K>>(ops, first, count, done, exits, x_floats);
}

// chain_bf16: the chain of bf16 products, in items of a row's chunk of CHAIN_K values,
// each warp streaming its own items through its own ring (chain.cu's header).

// A warp's place in the chain: item u of product op (the block's items of it end before
// `end`), which is chunk `chunk` of row `row`; the product's fields the copies need, and how far
// the warp's next item of it lies (step_rows rows and step_chunks chunks on), kept in registers.
struct ChainItems {
    int op, u, end, row, chunk, chunks, k, step_rows, step_chunks;
    const u8* w;
};

// The first weight row of block b's share of bf16 product o: whole outputs (a gated product's
// row pairs).
__device__ __forceinline__ int chain_row_share(const ChainOp& o, int b) {
    return chain_share(o.rows >> o.gated, b) << o.gated;
}

// Moves c to warp w's first item at or after item c.u of product c.op (c.op == last: none
// left); a product it moves past starts the warp at its item w.
__device__ __forceinline__ void chain_items_seek(const ChainOp* ops, int last, int w,
                                                 ChainItems& c) {
    for (; c.op < last; c.op++, c.u = w) {
        const ChainOp& o = ops[c.op];
        const int r0 = chain_row_share(o, blockIdx.x);
        c.end = (chain_row_share(o, blockIdx.x + 1) - r0) * o.chunks;
        if (c.u < c.end) {
            c.chunks = o.chunks;
            c.k = o.k;
            c.w = (const u8*)o.w;
            c.row = r0 + c.u / o.chunks;
            c.chunk = c.u % o.chunks;
            c.step_rows = CHAIN_WARPS / o.chunks;
            c.step_chunks = CHAIN_WARPS % o.chunks;
            return;
        }
    }
}

// Moves (row, chunk) on by step_rows rows and step_chunks chunks of a row of `chunks`.
__device__ __forceinline__ void chain_item_step(int& row, int& chunk, int chunks, int step_rows,
                                                int step_chunks) {
    row += step_rows;
    chunk += step_chunks;
    if (chunk >= chunks) {
        chunk -= chunks;
        row++;
    }
}

__device__ __forceinline__ void chain_items_next(const ChainOp* ops, int last, int w,
                                                 ChainItems& c) {
    c.u += CHAIN_WARPS;
    if (c.u < c.end)
        chain_item_step(c.row, c.chunk, c.chunks, c.step_rows, c.step_chunks);
    else
        chain_items_seek(ops, last, w, c);
}

// Queues this lane's 16-byte pieces of the item of chunk `chunk` of row `row` of weights w (k
// values a row; 8 values a piece: pieces lane + 32 m, those inside the row) into the warp's
// stage at s, each at its place in the item.
__device__ __forceinline__ void chain_row_issue(const u8* w, int row, int k, int chunk, u32 s,
                                                int lane) {
    const int v0 = chunk * CHAIN_K;
    const u8* g = w + 2 * ((u64)row * k + v0);
    const bool whole = v0 + CHAIN_K <= k;
#pragma unroll
    for (int m = 0; m < CHAIN_K / 256; m++) {
        const int v = 8 * (lane + 32 * m);
        if (whole || v0 + v < k) cp_async16(s + 2 * v, g + 2 * v);
    }
}

// Queues the item of chunk `chunk` of row `row` of weights w (k values a row) into the warp's
// stage at s: this lane's pieces by cp.async (the caller commits the group), or (CHAIN_BULK)
// the whole item by one bulk copy from lane 0, on the stage's mbarrier `bar` (the warp read the
// stage's last item before: the fence orders those reads before the copy's writes).
__device__ __forceinline__ void chain_item_issue(const u8* w, int row, int k, int chunk, u32 s,
                                                 u32 bar, int lane) {
#if CHAIN_BULK
    if (lane == 0) {
        const int v0 = chunk * CHAIN_K;
        const u32 bytes = 2 * min(CHAIN_K, k - v0);
        bulk_fence();
        mbar_arrive_expect_tx(bar, bytes);
        bulk_copy(s, w + 2 * ((u64)row * k + v0), bytes, bar);
    }
#else
    (void)bar;
    chain_row_issue(w, row, k, chunk, s, lane);
#endif
}

// Waits until the warp's item t (in stage t % CHAIN_STAGES) has landed, the items after it
// may still be on their way.
__device__ __forceinline__ void chain_item_wait(u32 bars, int t) {
#if CHAIN_BULK
    mbar_wait(bars + 8 * (t % CHAIN_STAGES), (t / CHAIN_STAGES) & 1);
#else
    (void)bars;
    (void)t;
    cp_async_wait<CHAIN_STAGES - 2>();
#endif
}

// One piece of a row, 8 bf16 values (16 bytes), times x's 8 values at xv.
__device__ __forceinline__ float chain_piece_dot(uint4 q, const float* xv) {
    const float4 a = *(const float4*)xv, b = *(const float4*)(xv + 4);
    float s = __uint_as_float(q.x << 16) * a.x;
    s += __uint_as_float(q.x & 0xffff0000u) * a.y;
    s += __uint_as_float(q.y << 16) * a.z + __uint_as_float(q.y & 0xffff0000u) * a.w;
    s += __uint_as_float(q.z << 16) * b.x + __uint_as_float(q.z & 0xffff0000u) * b.y;
    s += __uint_as_float(q.w << 16) * b.z + __uint_as_float(q.w & 0xffff0000u) * b.w;
    return s;
}

// The item of chunk `chunk` of a row of k values (its pieces in `stage`, this lane's own) times
// x: the sum over the item's values, in every lane. A whole item loads its pieces together.
__device__ __forceinline__ float chain_row_dot(int k, int chunk, const u8* stage, const float* xs,
                                               int lane) {
    constexpr int PIECES = CHAIN_K / 256;
    const int v0 = chunk * CHAIN_K;
    float acc = 0.f;
    if (v0 + CHAIN_K <= k) {
        uint4 q[PIECES];
#pragma unroll
        for (int m = 0; m < PIECES; m++) q[m] = *(const uint4*)(stage + 16 * (lane + 32 * m));
#pragma unroll
        for (int m = 0; m < PIECES; m++)
            acc += chain_piece_dot(q[m], xs + v0 + 8 * (lane + 32 * m));
    } else {
#pragma unroll
        for (int m = 0; m < PIECES; m++) {
            const int v = 8 * (lane + 32 * m);
            if (v0 + v < k) acc += chain_piece_dot(*(const uint4*)(stage + 2 * v), xs + v0 + v);
        }
    }
    return warp_sum(acc);
}

// chain_bf16 with a count a product (CHAIN_PIPE=0): every block waits for the whole input of a
// product, then stages it.
__device__ void chain_bf16_counted(const ChainOp* ops, int first, int count, u32* done,
                                   u32* exits, int x_floats) {
    constexpr int STAGE_BYTES = 2 * CHAIN_K;
    extern __shared__ __align__(16) u8 chain_smem[];
    const int last = first + count, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u8* ring = chain_smem + w * CHAIN_STAGES * STAGE_BYTES;
    const u32 ring_at = shared_address(ring);
    // The stages' mbarriers (CHAIN_BULK), the warp's CHAIN_STAGES of them.
    u64* bars = (u64*)(chain_smem + CHAIN_WARPS * CHAIN_STAGES * STAGE_BYTES);
    const u32 bars_at = shared_address(bars + w * CHAIN_STAGES);
    // The product in use and the next one, copied from `ops` a product ahead (warp 0).
    ChainOp* slots = (ChainOp*)(bars + CHAIN_WARPS * CHAIN_STAGES);
    float* xs = (float*)(slots + 2);
    float* red = xs + x_floats;
    float* partial = red + 32;
    constexpr int OP_WORDS = sizeof(ChainOp) / 4;
    if (threadIdx.x < OP_WORDS)
        ((u32*)slots)[threadIdx.x] = ((const u32*)(ops + first))[threadIdx.x];

#if CHAIN_BULK
    if (lane == 0)
        for (int s = 0; s < CHAIN_STAGES; s++) mbar_init(bars_at + 8 * s, 1);
    mbar_init_fence();
    __syncwarp();
#endif
    ChainItems load{};
    load.op = first;
    load.u = w;
    chain_items_seek(ops, last, w, load);
    // The first stages before the wait for the kernel ahead: weights only. (Without bulk
    // copies each stage is a cp.async group, committed even when empty.)
#pragma unroll 1
    for (int s = 0; s < CHAIN_STAGES - 1; s++) {
        if (load.op < last) {
            chain_item_issue(load.w, load.row, load.k, load.chunk, ring_at + s * STAGE_BYTES,
                             bars_at + 8 * s, lane);
            chain_items_next(ops, last, w, load);
        }
        if (!CHAIN_BULK) cp_async_commit();
    }
    wait_prior_grid();
    __syncthreads();

    int t = 0;  // the warp's items used so far: item t sits in stage t % CHAIN_STAGES
    for (int op = first; op < last; op++) {
        const ChainOp& o = slots[(op - first) & 1];
        // The next product's words, on their way through this one's items.
        const bool copies = threadIdx.x < OP_WORDS && op + 1 < last;
        const u32 next_word = copies ? ((const u32*)(ops + op + 1))[threadIdx.x] : 0;
        chain_stamp(o, 0);
        const int r0 = chain_row_share(o, blockIdx.x);
        const int rows = chain_row_share(o, blockIdx.x + 1) - r0;
        // The fields in registers: the copies' asm (a memory clobber) would reload them.
        const int k = o.k, chunks = o.chunks, items = rows * chunks;
        const int step_chunks = CHAIN_WARPS % chunks;
        float* out = (float*)o.out;
        const bool wait = o.dep >= first;
        // What L2 is asked for if the block has to wait: from warp 0's next item to the end of
        // the block's share of that item's product, up to CHAIN_WAIT_L2 KB.
        const u8* ahead = nullptr;
        u32 ahead_bytes = 0;
        if (CHAIN_WAIT_L2 && threadIdx.x == 0 && load.op < last) {
            const u64 from = (u64)load.row * load.k + load.chunk * CHAIN_K;
            const int row_end = load.row + (load.end - load.u + load.chunk) / load.chunks;
            ahead = load.w + 2 * from;
            ahead_bytes = (u32)min(2 * ((u64)row_end * load.k - from),
                                   (u64)CHAIN_WAIT_L2 * 1024) & ~15u;
        }
        chain_stage_scaled_x(o, wait ? done + o.dep : nullptr, gridDim.x, chunks * CHAIN_K, xs,
                             red, ahead, ahead_bytes);
        chain_stamp(o, 2);
        int chunk = w % chunks;
        for (int u = w; u < items; u += CHAIN_WARPS, t++) {
            // Item t landed; the stage of item t − 1 (read by every lane before the warp's
            // last sum) is free for the item CHAIN_STAGES − 1 ahead.
            chain_item_wait(bars_at, t);
            if (load.op < last) {
                const int s = (t + CHAIN_STAGES - 1) % CHAIN_STAGES;
                chain_item_issue(load.w, load.row, load.k, load.chunk, ring_at + s * STAGE_BYTES,
                             bars_at + 8 * s, lane);
                chain_items_next(ops, last, w, load);
            }
            if (!CHAIN_BULK) cp_async_commit();
            const float v =
                chain_row_dot(k, chunk, ring + t % CHAIN_STAGES * STAGE_BYTES, xs, lane);
            if (lane == 0) partial[u] = v;
            chunk += step_chunks;
            if (chunk >= chunks) chunk -= chunks;
        }
        if (copies) ((u32*)&slots[(op + 1 - first) & 1])[threadIdx.x] = next_word;
        __syncthreads();
        chain_stamp(o, 3);
        // A row's chunks added in order, times x's RMS scale: the same bits every run; a gated
        // product's pairs of rows give one output each.
        const float scale = chain_rms_scale(o, red);
        const int gated = o.gated;
        for (int i = threadIdx.x; i < rows >> gated; i += blockDim.x) {
            const float* p = partial + (i << gated) * chunks;
            float sum = 0.f;
            for (int c = 0; c < chunks; c++) sum += p[c];
            sum *= scale;
            if (gated) {
                float up = 0.f;
                for (int c = 0; c < chunks; c++) up += p[chunks + c];
                sum = gelu_tanh(sum) * (up * scale);
            }
            out[(r0 >> gated) + i] = sum;
        }
        // Every block counts each product once, after its rows' stores (thread 0's fence
        // after the barrier orders them before the count).
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(done + op, 1u);
        }
        chain_stamp(o, 4);
    }
    cp_async_wait<0>();
    chain_exit(first, last, done, exits);
}

// chain_bf16 pipelined (CHAIN_PIPE=1): a product's outputs are counted a chunk of CHAIN_K
// values at a time, so a block starts on the chunks of its input already stored while the
// rest are still being made. Block b of G takes the outputs b, b + G, b + 2G, … of every
// product (each pair of a gated product's rows one output), so that every block stores some of
// every output chunk, in chunk order. Its CHAIN_WARPS warps take the items of its rows chunk by
// chunk — every row's chunk 0 first, then chunk 1, … — so a product needs its input's chunks
// in order, and its rows end one after another in its last chunk's pass, the first output
// chunk early in that pass. Two more warps do the rest. The stager waits for the input chunks
// of the block's next products on their counts in `done` (CHAIN_OUT_CHUNKS a product) and
// stages each as x · γ (γ the norm's weights) into one of two x buffers (a product and the
// next). The finalizer, as the warps report a chunk's rows done (arrivals in shared memory),
// adds their item sums, scales, stores and counts them. The warps wait only for the chunk of x
// an item needs; the weights' rings run on across the products as before.

// Output chunks of CHAIN_K values a product at most (its counts in `done`).
#define CHAIN_OUT_CHUNKS 32
// Slots of the warps' arrivals in shared memory: a sequence of output chunks over the launch,
// each slot counting CHAIN_WARPS arrivals a use (the warps run at most two products, 64 output
// chunks, ahead of the finalizer).
#define CHAIN_FIN_SLOTS 128
// Chunks of CHAIN_K floats of the staging's scratch (a batch's pair halves and γ).
#define CHAIN_TMP_CHUNKS 4

// How many of a product's `outs` outputs this block takes (b, b + G, …).
__device__ __forceinline__ int pipe_outputs(int outs) {
    const int b = blockIdx.x, g = gridDim.x;
    return b < outs ? (outs - b + g - 1) / g : 0;
}

// The index among this block's outputs of its first output at or past output i.
__device__ __forceinline__ int pipe_output_at(int i) {
    const int b = blockIdx.x, g = gridDim.x;
    return i <= b ? 0 : (i - b + g - 1) / g;
}

// The weight row of this block's item row jr: its output jr >> gated (a gated output's gate
// and up rows).
__device__ __forceinline__ int pipe_weight_row(int jr, int gated) {
    return ((blockIdx.x + gridDim.x * (jr >> gated)) << gated) | (jr & gated);
}

// The end (exclusive) of this block's item rows of output chunk oc of a product of `outs`
// outputs.
__device__ __forceinline__ int pipe_chunk_rows_end(int oc, int outs, int gated) {
    return pipe_output_at(min((oc + 1) * CHAIN_K, outs)) << gated;
}

// A warp's place in the pipelined chain: item u of product op (the block's items of it end
// before `end`), which is chunk `chunk` of item row jr of the block's `rows`; the product's
// fields the copies need.
struct PipeItems {
    int op, u, end, jr, chunk, rows, chunks, k, gated;
    const u8* w;
};

// Moves c to warp w's first item at or after item c.u of product c.op (c.op == last: none
// left); a product it moves past starts the warp at its item w.
__device__ __forceinline__ void pipe_items_seek(const ChainOp* ops, int last, int w,
                                                PipeItems& c) {
    for (; c.op < last; c.op++, c.u = w) {
        const ChainOp& o = ops[c.op];
        c.rows = pipe_outputs(o.rows >> o.gated) << o.gated;
        c.end = c.rows * o.chunks;
        if (c.u < c.end) {
            c.chunks = o.chunks;
            c.k = o.k;
            c.gated = o.gated;
            c.w = (const u8*)o.w;
            c.chunk = c.u / c.rows;
            c.jr = c.u - c.chunk * c.rows;
            return;
        }
    }
}

// Moves item row jr on by CHAIN_WARPS, into the next chunks past the block's `rows`.
__device__ __forceinline__ void pipe_step(int& jr, int& chunk, int rows) {
    jr += CHAIN_WARPS;
    while (jr >= rows) {
        jr -= rows;
        chunk++;
    }
}

__device__ __forceinline__ void pipe_items_next(const ChainOp* ops, int last, int w,
                                                PipeItems& c) {
    c.u += CHAIN_WARPS;
    if (c.u < c.end)
        pipe_step(c.jr, c.chunk, c.rows);
    else
        pipe_items_seek(ops, last, w, c);
}

// Waits until x buffer `flag`'s product is op with at least `need` chunks staged (need 0: its
// staging begun, the buffer op's); returns the chunks staged (lane 0 polls, the warp waits).
__device__ __forceinline__ int pipe_wait_staged(const u32* flag, int op, int need, int lane) {
    const u32 want = ((u32)op << 8) | (u32)need;
    u32 v = 0;
    if (lane == 0)
        while ((v = *(const volatile u32*)flag) < want) chain_spin();
    v = __shfl_sync(0xffffffffu, v, 0);
    __threadfence_block();
    return v >> 8 == (u32)op ? (int)(v & 255) : need;
}

// Lane 0 reports the warp done with output chunks from .. to − 1 of the product whose first
// output chunk is number `seq` of the launch (after its item sums' stores).
__device__ __forceinline__ void pipe_arrive(u32* fin, int seq, int from, int to, int lane) {
    if (lane != 0 || from >= to) return;
    __threadfence_block();
    for (int oc = from; oc < to; oc++) atomicAdd(fin + (seq + oc) % CHAIN_FIN_SLOTS, 1u);
}

// A relaxed load of *p (GPU scope): a poll, ordered by a fence after it.
__device__ __forceinline__ u32 chain_poll(const u32* p) {
#ifdef MB_EMU
    return *(const volatile u32*)p;
#else
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#endif
}

// Whether the producer's output chunks that chunk c of product sp's x reads (its values
// c · CHAIN_K … and, for a pair, k on) are stored by every block (one thread, its four polls in
// flight together; a fence after them orders the staging's loads).
__device__ bool pipe_input_ready(const ChainOp* ops, int first, int sp, int c, const u32* done) {
    const ChainOp& o = ops[sp];
    if (o.dep < first) return true;
    const int k = o.k, v0 = c * CHAIN_K, n = min(CHAIN_K, k - v0);
    const int at = (int)((o.in - ops[o.dep].out) / 4) + v0;
    const u32* counts = done + CHAIN_OUT_CHUNKS * o.dep;
    u32 least = min(chain_poll(counts + at / CHAIN_K), chain_poll(counts + (at + n - 1) / CHAIN_K));
    if (o.pair)
        least = min(least, min(chain_poll(counts + (at + k) / CHAIN_K),
                               chain_poll(counts + (at + k + n - 1) / CHAIN_K)));
    return least >= gridDim.x;
}

// Stages chunks c .. c + chunks − 1 of product sp's x (buffer sp & 1; their input ready):
// values c · CHAIN_K … of the input (and, for a pair, k on) as x · γ, adding their squares to
// this lane's `ss` (after the product's last chunk, their sum to sums[sp & 1]); then publishes
// them in flags[sp & 1] (the stager warp; its scratch `tmp` holds the pair halves and γ).
__device__ void pipe_stage(const ChainOp* ops, int sp, int c, int chunks, bool last_chunk,
                           float* xs, int x_floats, float* tmp, u32* flags, float* sums,
                           float& ss, int lane) {
    const ChainOp& o = ops[sp];
    const int k = o.k, v0 = c * CHAIN_K, n = min(chunks * CHAIN_K, k - v0), pair = o.pair;
    const int gamma_at = pair ? n : 0;
    const int buf = sp & 1;
    float* x = xs + buf * x_floats + v0;
    const float* in = (const float*)o.in + v0;
    const float* nw = o.norm ? (const float*)o.norm + v0 : nullptr;
    if ((o.in & 15) == 0 && (o.norm & 15) == 0) {
        // Every 16-byte piece of the chunk (and of its pair half and γ) on its way at once.
        const u32 xa = shared_address(x), ta = shared_address(tmp);
        for (int i = 4 * lane; i < n; i += 128) {
            cp_async16(xa + 4 * i, in + i);
            if (pair) cp_async16(ta + 4 * i, in + k + i);
            if (nw) cp_async16(ta + 4 * (gamma_at + i), nw + i);
        }
        cp_async_commit();
        cp_async_wait<0>();
        for (int i = 4 * lane; i < n; i += 128) {
            float4 a = *(float4*)(x + i);
            if (pair) a = chain_pair4(a, *(const float4*)(tmp + i));
            *(float4*)(x + i) =
                chain_scaled4(a, nw ? (const float4*)(tmp + gamma_at + i) : nullptr, ss);
        }
    } else {
        const float* gamma = (const float*)o.norm;
        for (int i = lane; i < n; i += 32) x[i] = chain_scaled_value(o, gamma, v0 + i, ss);
    }
    if (last_chunk) {
        // x's Σ x² for the product's RMS scale, before its last chunk shows as staged.
        const float total = warp_sum(ss);
        if (lane == 0) sums[buf] = total;
    }
    __syncwarp();
    if (lane == 0) {
        __threadfence_block();
        *(volatile u32*)(flags + buf) = ((u32)sp << 8) | (u32)(c + chunks);
    }
}

// Adds, scales and stores this block's outputs of output chunk oc of product op (its item sums
// in `partial`, x's Σ x² in sums[op & 1]; the finalizer warp).
__device__ void pipe_finalize(const ChainOp& o, int op, int oc, const float* partial,
                              const float* sums, int lane) {
    const int gated = o.gated, outs = o.rows >> gated, chunks = o.chunks, buf = op & 1;
    float scale = 1.f;
    if (o.norm) scale = rsqrtf(sums[buf] / (float)o.k + o.eps);
    float* out = (float*)o.out;
    const int end = pipe_output_at(min((oc + 1) * CHAIN_K, outs));
    for (int j = pipe_output_at(oc * CHAIN_K) + lane; j < end; j += 32) {
        // A row's chunks added in order, times x's RMS scale: the same bits every run.
        const float* p = partial + 2 * (j << gated) * chunks + buf;
        float sum = 0.f;
        for (int c = 0; c < chunks; c++) sum += p[2 * c];
        sum *= scale;
        if (gated) {
            float up = 0.f;
            for (int c = 0; c < chunks; c++) up += p[2 * (chunks + c)];
            sum = gelu_tanh(sum) * (up * scale);
        }
        out[blockIdx.x + gridDim.x * j] = sum;
    }
}

// How many of the next `room` (at most 32) things are ready, in a row from the first, which
// lane 0 found ready; `ready` is lane l's finding for the l-th (the warp, every lane the same).
__device__ __forceinline__ int pipe_ready_run(bool ready, int room, int lane) {
    const u32 mask = __ballot_sync(0xffffffffu, lane == 0 || (lane < room && ready));
    return min(room, ~mask ? __ffs(~mask) - 1 : 32);
}

// The stager warp of a pipelined chain (see above): stages the input chunks of product sp, at
// most one product past the one the finalizer warp is on (flags[2]; the next but one product
// reuses its x buffer), in order, as their counts allow. Lane 0 alone polls until it can act
// (the others wait for its choice), then the warp acts.
__device__ void pipe_stager(const ChainOp* ops, int first, int last, const u32* done, float* xs,
                            int x_floats, float* tmp, u32* flags, float* sums, int lane) {
    for (int sp = first; sp < last; sp++) {
        // sp's buffer is free once the finalizer is past the product two before it (the warps
        // are done with that product's x).
        if (lane == 0) {
            while ((int)*(const volatile u32*)(flags + 2) + 1 < sp) chain_spin();
            *(volatile u32*)(flags + (sp & 1)) = (u32)sp << 8;
        }
        float ss = 0.f;
        const ChainOp& o = ops[sp];
        const int chunks = o.chunks, scratch = o.pair + (o.norm != 0);
        const int batch = scratch ? CHAIN_TMP_CHUNKS / scratch : 32;
        for (int c = 0; c < chunks;) {
            // Lane 0 waits for chunk c; the chunks after it ready by then go with it.
            if (lane == 0)
                while (!pipe_input_ready(ops, first, sp, c, done)) chain_spin();
            __syncwarp();
            const int room = min(chunks - c, batch);
            const bool ready =
                lane > 0 && lane < room && pipe_input_ready(ops, first, sp, c + lane, done);
            const int n = pipe_ready_run(ready, room, lane);
            __threadfence();
            pipe_stage(ops, sp, c, n, c + n == chunks, xs, x_floats, tmp, flags, sums, ss, lane);
            c += n;
        }
    }
}

// Whether every warp reported output chunk `seq` of the launch done.
__device__ __forceinline__ bool pipe_arrived(const u32* fin, int seq) {
    const u32 want = (u32)CHAIN_WARPS * (seq / CHAIN_FIN_SLOTS + 1);
    return *(const volatile u32*)(fin + seq % CHAIN_FIN_SLOTS) >= want;
}

// The finalizer warp of a pipelined chain (see above): finalizes the output chunks of every
// product in order as the warps report them done (lane 0 polls), and shows the product it is
// on in flags[2].
__device__ void pipe_finalizer(const ChainOp* ops, int first, int last, u32* done,
                               const float* partial, const u32* fin, u32* flags,
                               const float* sums, int lane) {
    int seq = 0;
    for (int fp = first; fp < last; fp++) {
        const ChainOp& f = ops[fp];
        const int ocs = ((f.rows >> f.gated) + CHAIN_K - 1) / CHAIN_K;
        for (int oc = 0; oc < ocs;) {
            // Lane 0 waits for output chunk oc; the chunks after it done by then go with it,
            // counted after one fence.
            if (lane == 0)
                while (!pipe_arrived(fin, seq)) chain_spin();
            __syncwarp();
            const int room = min(ocs - oc, 32);
            const int n = pipe_ready_run(lane < room && pipe_arrived(fin, seq + lane), room, lane);
            __threadfence_block();
            for (int i = 0; i < n; i++) pipe_finalize(f, fp, oc + i, partial, sums, lane);
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                for (int i = 0; i < n; i++) atomicAdd(done + CHAIN_OUT_CHUNKS * fp + oc + i, 1u);
            }
            oc += n;
            seq += n;
        }
        if (lane == 0) *(volatile u32*)(flags + 2) = (u32)(fp + 1);
    }
}

__device__ void chain_bf16_piped(const ChainOp* ops, int first, int count, u32* done,
                                 u32* exits, int x_floats) {
    constexpr int STAGE_BYTES = 2 * CHAIN_K;
    extern __shared__ __align__(16) u8 chain_smem[];
    const int last = first + count, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool service = w >= CHAIN_WARPS;
    u8* ring = chain_smem + w * CHAIN_STAGES * STAGE_BYTES;
    const u32 ring_at = shared_address(ring);
    // The stages' mbarriers (CHAIN_BULK), the warp's CHAIN_STAGES of them.
    u64* bars = (u64*)(chain_smem + CHAIN_WARPS * CHAIN_STAGES * STAGE_BYTES);
    const u32 bars_at = shared_address(bars + w * CHAIN_STAGES);
    // The arrivals' slots (16-byte aligned after the mbarriers); the x buffers' flags and the
    // finalizer's product; their Σ x²; the staging's pair halves and γ; the two x buffers; the
    // item sums of two products, interleaved.
    constexpr int RINGS = CHAIN_WARPS * CHAIN_STAGES * (STAGE_BYTES + 8);
    u32* fin = (u32*)(chain_smem + (RINGS + 15) / 16 * 16);
    u32* flags = fin + CHAIN_FIN_SLOTS;
    float* sums = (float*)(flags + 4);
    float* tmp = sums + 4;
    float* xs = tmp + CHAIN_TMP_CHUNKS * CHAIN_K;
    float* partial = xs + 2 * x_floats;
    if (threadIdx.x < CHAIN_FIN_SLOTS) fin[threadIdx.x] = 0;
    if (threadIdx.x < 3) flags[threadIdx.x] = threadIdx.x == 2 ? first : 0;

#if CHAIN_BULK
    if (lane == 0 && !service)
        for (int s = 0; s < CHAIN_STAGES; s++) mbar_init(bars_at + 8 * s, 1);
    mbar_init_fence();
    __syncwarp();
#endif
    PipeItems load{};
    load.op = service ? last : first;
    load.u = w;
    pipe_items_seek(ops, last, w, load);
    // The first stages before the wait for the kernel ahead: weights only. (Without bulk
    // copies each stage is a cp.async group, committed even when empty.)
#pragma unroll 1
    for (int s = 0; s < CHAIN_STAGES - 1 && !service; s++) {
        if (load.op < last) {
            chain_item_issue(load.w, pipe_weight_row(load.jr, load.gated), load.k, load.chunk,
                             ring_at + s * STAGE_BYTES, bars_at + 8 * s, lane);
            pipe_items_next(ops, last, w, load);
        }
        if (!CHAIN_BULK) cp_async_commit();
    }
    wait_prior_grid();
    __syncthreads();

    if (w == CHAIN_WARPS) {
        pipe_stager(ops, first, last, done, xs, x_floats, tmp, flags, sums, lane);
    } else if (service) {
        pipe_finalizer(ops, first, last, done, partial, fin, flags, sums, lane);
    } else {
        int t = 0, seq = 0;  // item t sits in stage t % CHAIN_STAGES; seq: output chunks so far
        for (int op = first; op < last; op++) {
            const ChainOp& o = ops[op];
            // The fields in registers: the copies' asm (a memory clobber) would reload them.
            const int gated = o.gated, outs = o.rows >> gated, chunks = o.chunks, k = o.k;
            const int rows = pipe_outputs(outs) << gated, items = rows * chunks;
            const int ocs = (outs + CHAIN_K - 1) / CHAIN_K, buf = op & 1;
            const float* x = xs + buf * x_floats;
            int ready = pipe_wait_staged(flags + buf, op, 0, lane), arrived = 0, jr = 0, chunk = 0;
            if (w < items) {
                chunk = w / rows;
                jr = w - chunk * rows;
            }
            for (int u = w; u < items; u += CHAIN_WARPS, t++) {
                if (chunk >= ready) ready = pipe_wait_staged(flags + buf, op, chunk + 1, lane);
                if (chunk == chunks - 1) {
                    // The warp is past its rows of the output chunks that end by row jr.
                    int to = arrived;
                    while (to < ocs && pipe_chunk_rows_end(to, outs, gated) <= jr) to++;
                    pipe_arrive(fin, seq, arrived, to, lane);
                    arrived = to;
                }
                // Item t landed; the stage of item t − 1 (read by every lane before the warp's
                // last sum) is free for the item CHAIN_STAGES − 1 ahead.
                chain_item_wait(bars_at, t);
                if (load.op < last) {
                    const int s = (t + CHAIN_STAGES - 1) % CHAIN_STAGES;
                    chain_item_issue(load.w, pipe_weight_row(load.jr, load.gated), load.k,
                                     load.chunk, ring_at + s * STAGE_BYTES, bars_at + 8 * s,
                                     lane);
                    pipe_items_next(ops, last, w, load);
                }
                if (!CHAIN_BULK) cp_async_commit();
                const float v =
                    chain_row_dot(k, chunk, ring + t % CHAIN_STAGES * STAGE_BYTES, x, lane);
                if (lane == 0) partial[2 * (jr * chunks + chunk) + buf] = v;
                pipe_step(jr, chunk, rows);
            }
            pipe_arrive(fin, seq, arrived, ocs, lane);
            seq += ocs;
        }
        cp_async_wait<0>();
    }
    chain_exit(first, last, done, exits, CHAIN_OUT_CHUNKS);
}

extern "C" __global__ void __launch_bounds__(32 * (CHAIN_WARPS + 2 * CHAIN_PIPE), 1)
    chain_bf16(const ChainOp* ops, int first, int count, u32* done, u32* exits, int x_floats) {
#if CHAIN_PIPE
    chain_bf16_piped(ops, first, count, done, exits, x_floats);
#else
    chain_bf16_counted(ops, first, count, done, exits, x_floats);
#endif
}
