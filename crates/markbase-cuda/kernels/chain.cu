// A chain of one-token bf16 products in one persistent launch: an experiment towards a decode
// step in one kernel (docs/perf.md, session 44). Product j of the chain computes
// out_j[r] = Σ_i W_j[r, i] · x_j[i], where x_j is an input vector — in the chain, an earlier
// product's outputs — taken as it is, or as gelu_tanh(a) · b of its two halves (`pair`), and
// RMS-normed with weights (`norm`) where the product asks.
//
// Why: a decode step of one token is ≈ 500 dependent kernels whose boundaries leave the memory
// idle (each kernel's tail, the next one's ramp; docs/perf.md sessions 17–30). Here every block
// of the launch (one a multiprocessor, all resident) takes an equal contiguous share of every
// product's units — 8 weight rows × 1 024 values, 16 KB — and streams its units' weights
// through a ring of CHAIN_STAGES shared-memory stages by cp.async, across the products'
// boundaries: while a block waits for the product its next product reads, the weights of its
// next units are already on their way. A block waits on a count of the tiles (8 rows) that
// product has finished (`done`, in global memory; the waiting thread spins with acquire loads),
// which each block raises once at the end of its share by the tiles whose outputs it stored
// (one fence and atomic a product, not one a tile). A tile whose units fall to more than one block
// leaves each block's sum of its run as a part, which the block that ends the tile's last run
// (a ticket a tile, reset by that block) adds in unit order: every run of a launch of the same
// grid gives the same bits.
//
// A launch may cover any range of the chain's products (`first`, `count`); a product whose input
// comes from outside the range reads it without waiting (the stream ordered its producer
// first). The block that exits last (a count in `exits`) sets the range's counts and `exits`
// back to 0, so the arguments of every pass are the same and a captured graph replays them.
// Blocks of 256 threads (a warp a row of the unit), CHAIN_STAGES · 16 KB + (x_floats + 32) · 4
// bytes of dynamic shared memory, and a grid whose blocks are all resident at once.

#ifndef CHAIN_STAGES
#define CHAIN_STAGES 11
#endif
#define CHAIN_ROWS 8
#define CHAIN_K 1024
#define CHAIN_STAGE_BYTES (CHAIN_ROWS * CHAIN_K * 2)

// One product of the chain, as the host lays it out (chain.rs `ChainOp`, 80 bytes).
struct ChainOp {
    u64 w;        // bf16 weights [rows, k]
    u64 in;       // f32 input: k values, or (pair) 2k with x[i] = gelu_tanh(in[i]) · in[k + i]
    u64 norm;     // f32 RMSNorm weights of x (0: x as it is)
    u64 out;      // f32 outputs [rows]
    u64 parts;    // f32 [tiles · chunks][8]: run sums of tiles cut between blocks
    u64 tickets;  // u32 [tiles]: units of the tile done so far (0 between launches)
    int rows, k, pair, dep;  // dep: the product whose outputs `in` holds (-1: none)
    int tiles, chunks;       // ⌈rows / 8⌉, ⌈k / 1 024⌉
    float eps;
    int pad;
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

// 16 bytes from g to shared address s, or `bytes` 0: zeros.
__device__ __forceinline__ void chain_cp16(u32 s, const void* g, int bytes) {
#ifdef MB_EMU
    mb_emu::cp_async16(s, g, bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void chain_commit() {
#ifdef MB_EMU
    mb_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Every committed group of this thread's copies but the newest N has landed.
template <int N>
__device__ __forceinline__ void chain_wait() {
#ifdef MB_EMU
    mb_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
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

// Queues unit u of product o (its tile's 8 rows, values 1 024 · chunk ..) into the stage at s:
// row r's values at 2 048 · r, zeros past the rows and past k.
__device__ __forceinline__ void chain_issue(const ChainOp& o, int u, u32 s) {
    const int tile = u / o.chunks, chunk = u - tile * o.chunks;
    constexpr int PIECES = CHAIN_K / 8;  // 16-byte pieces a row
    for (int p = threadIdx.x; p < CHAIN_ROWS * PIECES; p += blockDim.x) {
        const int row = tile * CHAIN_ROWS + p / PIECES, col = chunk * CHAIN_K + 8 * (p % PIECES);
        const bool in = row < o.rows && col < o.k;
        const u16* g = (const u16*)o.w + (in ? (u64)row * o.k + col : 0);
        chain_cp16(s + 16 * p, g, in ? 16 : 0);
    }
}

// The sum of v over the block (every thread gets it); red: 8 floats of shared memory.
__device__ __forceinline__ float chain_block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
    __syncthreads();
    return s;
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
    for (int j = 0; j < 4; j++) {
        if (o.pair) {
            a[j].x = gelu_tanh(a[j].x) * b[j].x;
            a[j].y = gelu_tanh(a[j].y) * b[j].y;
            a[j].z = gelu_tanh(a[j].z) * b[j].z;
            a[j].w = gelu_tanh(a[j].w) * b[j].w;
        }
        x[j] = a[j];
    }
}

// Waits until product o's input is done (a product of the launch's range, from `first`), then
// stages x (chunks · 1 024 floats, zeros past k).
// A thread takes 16-value spans of x (4 float4s, their loads in flight together) where the
// input lies on 16 bytes and k is a multiple of 4, else single values.
__device__ void chain_stage_x(const ChainOp* ops, const ChainOp& o, const u32* done, int first,
                              float* xs, float* red) {
    if (o.dep >= first) {
        if (threadIdx.x == 0) {
            const u32 tiles = (u32)ops[o.dep].tiles;
            while (chain_acquire(done + o.dep) < tiles) chain_spin();
        }
        __syncthreads();
    }
    const int kx = o.chunks * CHAIN_K;
    float ss = 0.f;
    if ((o.in & 15) == 0 && (o.k & 3) == 0) {
        for (int i0 = 16 * threadIdx.x; i0 < kx; i0 += 16 * blockDim.x) {
            float4 x[4];
            chain_x4(o, i0, x);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                *(float4*)(xs + i0 + 4 * j) = x[j];
                ss += x[j].x * x[j].x + x[j].y * x[j].y + x[j].z * x[j].z + x[j].w * x[j].w;
            }
        }
    } else {
        const float* in = (const float*)o.in;
        for (int i = threadIdx.x; i < kx; i += blockDim.x) {
            float v = 0.f;
            if (i < o.k) {
                v = __ldcg(in + i);
                if (o.pair) v = gelu_tanh(v) * __ldcg(in + o.k + i);
            }
            xs[i] = v;
            ss += v * v;
        }
    }
    if (o.norm) {
        const float scale = rsqrtf(chain_block_sum(ss, red) / (float)o.k + o.eps);
        const float* nw = (const float*)o.norm;
        for (int i = threadIdx.x; i < o.k; i += blockDim.x) xs[i] *= scale * __ldg(nw + i);
    }
    __syncthreads();
}

// Row w's dot over the unit in the stage at `stage` (its 1 024 values) with x's values at xc,
// complete in every lane.
__device__ __forceinline__ float chain_dot(const u8* stage, const float* xc, int w, int lane) {
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < CHAIN_K / 256; m++) {
        const int v0 = 256 * m + 8 * lane;
        const uint4 q = *(const uint4*)(stage + 2 * (CHAIN_K * w + v0));
        const float4 a = *(const float4*)(xc + v0), b = *(const float4*)(xc + v0 + 4);
        acc += bf16_to_f32((u16)(q.x & 0xffff)) * a.x + bf16_to_f32((u16)(q.x >> 16)) * a.y;
        acc += bf16_to_f32((u16)(q.y & 0xffff)) * a.z + bf16_to_f32((u16)(q.y >> 16)) * a.w;
        acc += bf16_to_f32((u16)(q.z & 0xffff)) * b.x + bf16_to_f32((u16)(q.z >> 16)) * b.y;
        acc += bf16_to_f32((u16)(q.w & 0xffff)) * b.z + bf16_to_f32((u16)(q.w >> 16)) * b.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

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

extern "C" __global__ void __launch_bounds__(256, 1)
    chain_bf16(const ChainOp* ops, int first, int count, u32* done, u32* exits, int x_floats) {
    extern __shared__ __align__(16) u8 chain_smem[];
    const int last = first + count, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 ring = shared_address(chain_smem);
    float* xs = (float*)(chain_smem + CHAIN_STAGES * CHAIN_STAGE_BYTES);
    float* red = xs + x_floats;
    int* flag = (int*)(red + 8);

    ChainCursor load{first, 0, 0};
    chain_seek(ops, last, load);
    ChainCursor use = load;
    // The first stages before the wait for the kernel ahead: weights only.
#pragma unroll 1
    for (int s = 0; s < CHAIN_STAGES - 1; s++) {
        if (load.op < last) {
            chain_issue(ops[load.op], load.u, ring + s * CHAIN_STAGE_BYTES);
            chain_next(ops, last, load);
        }
        chain_commit();
    }
    wait_prior_grid();

    int staged = -1, first_chunk = 0, stored = 0;
    float run = 0.f;
    for (int i = 0; use.op < last; i++) {
        chain_wait<CHAIN_STAGES - 2>();
        __syncthreads();  // unit i landed for every thread; stage (i - 1) % CHAIN_STAGES is free
        if (load.op < last) {
            chain_issue(ops[load.op], load.u,
                        ring + (i + CHAIN_STAGES - 1) % CHAIN_STAGES * CHAIN_STAGE_BYTES);
            chain_next(ops, last, load);
        }
        chain_commit();
        const ChainOp& o = ops[use.op];
        if (use.op != staged) {
            staged = use.op;
            chain_stage_x(ops, o, done, first, xs, red);
        }
        const int tile = use.u / o.chunks, chunk = use.u - tile * o.chunks;
        if (chunk == 0 || use.u == chain_share(o.tiles * o.chunks, blockIdx.x)) {
            first_chunk = chunk;
            run = 0.f;
        }
        run += chain_dot(chain_smem + i % CHAIN_STAGES * CHAIN_STAGE_BYTES, xs + chunk * CHAIN_K,
                         w, lane);
        if (chunk == o.chunks - 1 || use.u + 1 == use.end)
            stored += chain_end_run(o, tile, first_chunk, chunk, run, w, lane, flag);
        if (use.u + 1 == use.end) {
            chain_end_share(done, use.op, stored);
            stored = 0;
        }
        chain_next(ops, last, use);
    }
    chain_wait<0>();
    // The last block out resets the counts: every block is past its waits by then.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(exits, 1u) == gridDim.x - 1) {
            for (int j = first; j < last; j++) done[j] = 0;
            *exits = 0;
            __threadfence();
        }
    }
}
