// Products of 2–32 token rows with Q4_K weights on the tensor cores (mma.sync m16n8k16: f16
// weights and activations, f32 sums): out[t, r] = Σ_k x[t, k] · w[r, k]. The weights stream
// from memory once for all the tokens, as 4-bit values, and are dequantized to f16 in
// registers; the GEMVs they replace read each weight once a token row (their dot products
// grow with the tokens), and cuBLAS needs them dequantized into memory first. Appended to
// gemv.cu's module (its Q4_K unit).
//
// The work is items — a row tile of 16 rows of one of the launch's matrices (up to 4 of one
// width: q, k, v or gate, up) over one split of the rows' super-blocks (blockIdx.y of the
// launch's `splits`) — and an item's units, one super-block each. A block's 8 warps walk
// the tiles grid-stride over the split's blocks, one item at a time, each warp a stream of
// units with MMQ_UNITS_AHEAD of them loaded into registers ahead of the one it multiplies
// (the first before waiting for the kernel ahead). The block first stages its split's
// activations for all the tokens in shared memory (f16, as a product's rounded copy,
// rounded.rs; by cp.async). With one split a warp stores its item's sums; with several it
// stores them as the split's part, and the item's last warp (a ticket a tile, reset by that
// warp) adds the parts in split order. Every run gives the same bits.
//
// Fragments: a lane (g = lane / 4, c = lane % 4) holds for rows g and g + 8 of its warp's
// tile the quant bytes 32c .. 32c + 31 of each super-block: chunk 2c's 32 weights (low
// nibbles) and chunk 2c + 1's (high nibbles), so each lane needs one chunk pair's scales.
// Word i of those bytes gives one k16 slab per chunk: its weights 4i, 4i + 1 in the A
// fragment's first k pair and 4i + 2, 4i + 3 in its second; the B fragment takes the same
// four activations of token g, contiguous in shared memory. The k order within a slab is a
// permutation shared by A and B, so the sums are the product's.
//
// Dequantization: a nibble n becomes the f16 1024 + n (or 1024 + 16n from the high nibble)
// by one lop3 with 0x6400, then the exact n by a subtraction (or 1/16 · v − 64), then
// w = fma(n, S, −M) rounded once to f16, with S = f16(d · scale) and M = f16(dmin · min) (each
// rounded once, saturating at ±65 504). Tests model exactly this rounding.

#if FORMAT_q4_k && __CUDA_ARCH__ >= 800  // mma.sync m16n8k16 and cp.async

// Bytes one token's 256 activations of a super-block take in shared memory: the 4 lanes'
// groups of 64 (128 bytes each) padded to 144, so a quarter warp's 16-byte loads (2 tokens,
// 4 groups) hit 32 different banks.
#define MMQ_GROUP_BYTES 144
#define MMQ_TOKEN_BYTES (4 * MMQ_GROUP_BYTES)
// Units (16 rows × one super-block) a warp has loaded ahead of the one it multiplies.
#ifndef MMQ_UNITS_AHEAD
#define MMQ_UNITS_AHEAD 2
#endif
// Accumulator sets of a warp for up to 16 tokens (one for more): a unit's products of chunk
// 2c and of chunk 2c + 1 go to two chains of dependent mma instructions, not one.
#ifndef MMQ_CHAINS
#define MMQ_CHAINS 2
#endif

// The f16 pair (lo, hi) of two floats, saturating at ±65 504 (f16_range).
__device__ __forceinline__ u32 mmq_f16x2(float lo, float hi) {
    u32 r;
#if __CUDA_ARCH__ >= 900
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f16_range(hi)), "f"(f16_range(lo)));
#endif
    return r;
}

__device__ __forceinline__ u32 mmq_hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 mmq_hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (a & b) | c.
__device__ __forceinline__ u32 mmq_and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// c += a · b on the tensor cores (16 × 16 f16 A, 16 × 8 f16 B, f32 C).
__device__ __forceinline__ void mmq_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mmq_cp16(u32 smem, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(g) : "memory");
}

__device__ __forceinline__ void mmq_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void mmq_wait_all() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// A float another warp wrote (read from L2, not a stale L1 line).
__device__ __forceinline__ float mmq_load_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// A lane's share of one unit (16 rows × one super-block): its two rows' 16-byte headers and
// quant bytes 32c .. 32c + 31.
struct MmqUnit {
    uint4 h[2];
    uint4 q[2][2];
};

// Word i (0..7) of a lane's 32 quant bytes of one row.
__device__ __forceinline__ u32 mmq_word(const uint4* q, int i) {
    const uint4 v = q[i >> 2];
    const int j = i & 3;
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// acc[h % CH][j] (n-tile j) += the unit `a`'s chunk 2c + h times the staged activations of
// its super-block `xs` (lane (g, c) reads token 8j + g's group c).
template <int NT, int CH>
__device__ __forceinline__ void mmq_unit(const MmqUnit& a, const u8* xs, int g, int c,
                                         float (*acc)[NT][4]) {
    // The lane's chunk pair's scales as broadcast f16 pairs: S[row][hi], −M[row][hi].
    u32 S[2][2], M[2][2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float d = f16_to_f32((u16)(a.h[e].x & 0xffff)), dm = f16_to_f32((u16)(a.h[e].x >> 16));
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            float s, m;
            q4k_scale_min(a.h[e], 2 * c + hi, &s, &m);
            S[e][hi] = mmq_f16x2(d * s, d * s);
            M[e][hi] = mmq_f16x2(-(dm * m), -(dm * m));
        }
    }
    const u8* xl = xs + g * MMQ_TOKEN_BYTES + c * MMQ_GROUP_BYTES;
#pragma unroll
    for (int ip = 0; ip < 4; ip++) {
        // A fragments of words 2ip and 2ip + 1: [word][hi] = {row g first pair, row g + 8 first
        // pair, row g second pair, row g + 8 second pair}.
        u32 A[2][2][4];
#pragma unroll
        for (int wi = 0; wi < 2; wi++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                // Bytes 0, 2, 1, 3: each 16-bit half then holds two consecutive weights.
                u32 w = __byte_perm(mmq_word(a.q[e], 2 * ip + wi), 0, 0x3120), w8 = w >> 8;
                u32 l0 = mmq_hsub2(mmq_and_or(w, 0x000F000Fu, 0x64006400u), 0x64006400u);
                u32 l1 = mmq_hsub2(mmq_and_or(w8, 0x000F000Fu, 0x64006400u), 0x64006400u);
                u32 h0 = mmq_hfma2(mmq_and_or(w, 0x00F000F0u, 0x64006400u), 0x2C002C00u,
                                   0xD400D400u);
                u32 h1 = mmq_hfma2(mmq_and_or(w8, 0x00F000F0u, 0x64006400u), 0x2C002C00u,
                                   0xD400D400u);
                A[wi][0][e] = mmq_hfma2(l0, S[e][0], M[e][0]);
                A[wi][0][2 + e] = mmq_hfma2(l1, S[e][0], M[e][0]);
                A[wi][1][e] = mmq_hfma2(h0, S[e][1], M[e][1]);
                A[wi][1][2 + e] = mmq_hfma2(h1, S[e][1], M[e][1]);
            }
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const u8* xt = xl + 8 * j * MMQ_TOKEN_BYTES + 16 * ip;
            uint4 lo = *(const uint4*)xt, hi = *(const uint4*)(xt + 64);
            mmq_mma(acc[0][j], A[0][0], lo.x, lo.y);
            mmq_mma(acc[0][j], A[1][0], lo.z, lo.w);
            mmq_mma(acc[1 % CH][j], A[0][1], hi.x, hi.y);
            mmq_mma(acc[1 % CH][j], A[1][1], hi.z, hi.w);
        }
    }
}

// A warp's place in its stream of units: its item (a row tile of one matrix, over the
// block's split) — the tile's first row in the matrix, the matrix (its weights, output and
// rows), the tile's first row among all the matrices' rows — and the unit's super-block of
// the split.
struct MmqCursor {
    int tile, i;
    int r0, rows, g0;
    u64 w, out;
};

// Points cursor u at tile `tile` (of all matrices' tiles of 16 rows, in order), unit 0;
// constant indices into `p` (a runtime index copies it to the stack).
__device__ __forceinline__ void mmq_seek(const Products& p, int tile, MmqCursor& u) {
    u.tile = tile;
    u.i = 0;
    u.g0 = 0;
    u.w = p.w[0];
    u.out = p.out[0];
    u.rows = p.rows[0];
    int t = tile;
#pragma unroll
    for (int i = 1; i < 4; i++) {
        int tiles = (u.rows + 15) >> 4;
        if (i < p.count && t >= tiles) {
            t -= tiles;
            u.g0 += u.rows;
            u.w = p.w[i];
            u.out = p.out[i];
            u.rows = p.rows[i];
        }
    }
    u.r0 = 16 * t;
}

// The unit under cursor u: rows r0 + g and r0 + g + 8 (the last row past the end) of its
// matrix, super-block sb0 + u.i.
__device__ __forceinline__ void mmq_load(u64 row_bytes, const MmqCursor& u, int sb0, int g,
                                         int c, MmqUnit& a) {
    const u8* base = (const u8*)u.w + (u64)(sb0 + u.i) * 144;
    const u8* b0 = base + (u64)min(u.r0 + g, u.rows - 1) * row_bytes;
    const u8* b1 = base + (u64)min(u.r0 + g + 8, u.rows - 1) * row_bytes;
    a.h[0] = __ldg((const uint4*)b0);
    a.h[1] = __ldg((const uint4*)b1);
    a.q[0][0] = __ldg((const uint4*)(b0 + 16 + 32 * c));
    a.q[0][1] = __ldg((const uint4*)(b0 + 32 + 32 * c));
    a.q[1][0] = __ldg((const uint4*)(b1 + 16 + 32 * c));
    a.q[1][1] = __ldg((const uint4*)(b1 + 32 + 32 * c));
}

// Moves cursor u to the next unit: the next super-block of the split, or unit 0 of the
// warp's next tile (`stride` tiles on).
__device__ __forceinline__ void mmq_next(const Products& p, int count, int stride,
                                         MmqCursor& u) {
    if (++u.i == count) mmq_seek(p, u.tile + stride, u);
}

// Stores the warp's sums of item u (lane (g, c): rows g, g + 8 — v 0, 1 and 2, 3 — tokens
// 8j + 2c + (v & 1)): to its matrix's output, or with several splits as this split's part,
// the item's last warp adding the parts in split order.
template <int NT>
__device__ __forceinline__ void mmq_store(const MmqCursor& u, float (*acc)[4], int n,
                                          int total_rows, float* parts, u32* tickets,
                                          int splits, int g, int c) {
    const int rows = u.rows;
    float* out = (float*)u.out;
    // The sums' place: the output (rows a token), or this split's part (total_rows a token).
    float* dst = splits == 1 ? out : parts + (u64)blockIdx.y * n * total_rows + u.g0;
    const int ld = splits == 1 ? rows : total_rows;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) {
            int r = u.r0 + g + 8 * (v >> 1), t = 8 * j + 2 * c + (v & 1);
            if (r < rows && t < n) dst[(u64)t * ld + r] = acc[j][v];
        }
    if (splits == 1) return;
    __threadfence();
    __syncwarp();
    u32 ticket = 0;
    if ((threadIdx.x & 31) == 0) ticket = atomicAdd(&tickets[u.tile], 1u);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != (u32)splits - 1) return;
    if ((threadIdx.x & 31) == 0) tickets[u.tile] = 0;
    __threadfence();
    for (int i = threadIdx.x & 31; i < 16 * n; i += 32) {
        int r = u.r0 + (i & 15), t = i >> 4;
        if (r >= rows) continue;
        float s = 0.f;
        for (int q = 0; q < splits; q++)
            s += mmq_load_l2(parts + ((u64)q * n + t) * total_rows + u.g0 + r);
        out[(u64)t * rows + r] = s;
    }
}

// The warps of the launch walk the tiles of 16 rows of `p`'s matrices grid-stride over the
// blocks of their split (blockIdx.y: super-blocks blockIdx.y · per_split ..), each through
// its units with MMQ_UNITS_AHEAD of them loaded ahead. The block stages its split's
// activations once: token t's super-block i at (i · 8NT + t) · MMQ_TOKEN_BYTES.
template <int NT>
__device__ void mmq_q4k_impl(const Products& p, u64 row_bytes, int k, const u16* xh, int n,
                             int total_rows, float* parts, u32* tickets, int splits,
                             int per_split) {
    constexpr int D = MMQ_UNITS_AHEAD;
    extern __shared__ uint4 mmq_smem[];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int sb0 = blockIdx.y * per_split, count = min(k >> 8, sb0 + per_split) - sb0;
    const int stride = gridDim.x * (blockDim.x >> 5);
    const int first = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int tiles = 0;
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (i < p.count) tiles += (p.rows[i] + 15) >> 4;
    const int mine = first < tiles ? (tiles - first + stride - 1) / stride * count : 0;

    MmqCursor load, use;
    mmq_seek(p, first, load);
    use = load;
    MmqUnit a[D];
#pragma unroll
    for (int j = 0; j < D; j++)
        if (j < mine) {
            mmq_load(row_bytes, load, sb0, g, c, a[j]);
            mmq_next(p, count, stride, load);
        }
    wait_prior_grid();
    const u32 smem = shared_address(mmq_smem);
    for (int q = threadIdx.x; q < count * 8 * NT * 32; q += blockDim.x) {
        int piece = q & 31, slice = q >> 5, t = slice % (8 * NT), i = slice / (8 * NT);
        if (t < n)
            mmq_cp16(smem + slice * MMQ_TOKEN_BYTES + (piece >> 3) * MMQ_GROUP_BYTES +
                         16 * (piece & 7),
                     xh + (u64)t * k + (sb0 + i) * 256 + 8 * piece);
    }
    mmq_commit();
    mmq_wait_all();
    __syncthreads();

    constexpr int CH = NT <= 2 ? MMQ_CHAINS : 1;
    float acc[CH][NT][4];
#pragma unroll
    for (int h = 0; h < CH; h++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[h][j][0] = acc[h][j][1] = acc[h][j][2] = acc[h][j][3] = 0.f;
    for (int q = 0; q < mine; q += D) {
#pragma unroll
        for (int j = 0; j < D; j++) {
            if (q + j < mine) {
                mmq_unit<NT, CH>(a[j], (const u8*)mmq_smem + use.i * 8 * NT * MMQ_TOKEN_BYTES, g,
                                 c, acc);
                if (use.i == count - 1) {
#pragma unroll
                    for (int h = 1; h < CH; h++)
#pragma unroll
                        for (int t = 0; t < NT; t++)
#pragma unroll
                            for (int v = 0; v < 4; v++) acc[0][t][v] += acc[h][t][v];
                    mmq_store<NT>(use, acc[0], n, total_rows, parts, tickets, splits, g, c);
#pragma unroll
                    for (int h = 0; h < CH; h++)
#pragma unroll
                        for (int t = 0; t < NT; t++)
                            acc[h][t][0] = acc[h][t][1] = acc[h][t][2] = acc[h][t][3] = 0.f;
                }
                mmq_next(p, count, stride, use);
                if (q + j + D < mine) {
                    mmq_load(row_bytes, load, sb0, g, c, a[j]);
                    mmq_next(p, count, stride, load);
                }
            }
        }
    }
}

// The kernels for NT = 1, 2, 4 n-tiles (up to 8, 16, 32 token rows); blocks of 256 threads
// with 8·NT · per_split · MMQ_TOKEN_BYTES of dynamic shared memory.
#define MMQ_KERNEL(NT)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                      \
        mmq_q4_k_##NT(Products p, u64 row_bytes, int k, const u16* xh, int n, int total_rows, \
                      float* parts, u32* tickets, int splits, int per_split) {                \
        mmq_q4k_impl<NT>(p, row_bytes, k, xh, n, total_rows, parts, tickets, splits,          \
                         per_split);                                                          \
    }
MMQ_KERNEL(1)
MMQ_KERNEL(2)
MMQ_KERNEL(4)

#endif
