// Products of 3–32 token rows with Q4_K weights on the tensor cores (mma.sync m16n8k16: f16
// weights and activations, f32 sums): out[t, r] = Σ_k x[t, k] · w[r, k]. The weights stream
// from memory once for all the tokens, as 4-bit values, and are dequantized to f16 in
// registers; the GEMVs they replace read each weight once a token row (their dot products
// grow with the tokens), and cuBLAS needs them dequantized into memory first. Appended to
// gemv.cu's module (its Q4_K unit).
//
// A block of 8 warps takes 16·WM rows (WM warps of 16 rows each) and a share of the rows'
// super-blocks (blockIdx.y of the launch's `splits`), walked in stages of WK super-blocks,
// one a warp: WM·WK = 8 and the launch's NT n-tiles of 8 tokens make WK = 8 / NT, so every
// stage stages WK · 8·NT = 64 token slices of 256 activations. The stages' activations (f16,
// as a product's rounded copy, rounded.rs) go to shared memory by cp.async, two stages in a
// ring; each warp loads its next super-block's weights into registers while it multiplies the
// current one (the first before waiting for the kernel ahead). Warps of one row tile add their
// sums through shared memory in order; with several splits each block stores its sums as a
// part, and the tile's last block (a ticket a tile, reset by that block) adds the parts in
// split order. Every run gives the same bits.
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
// Token slices a stage holds (WK super-blocks × 8·NT tokens) and its bytes.
#define MMQ_STAGE_SLICES 64
#define MMQ_STAGE_BYTES (MMQ_STAGE_SLICES * MMQ_TOKEN_BYTES)

// d = the f16 pair (lo, hi) of two floats clamped to f16's finite range.
__device__ __forceinline__ u32 mmq_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f16_range(hi)), "f"(f16_range(lo)));
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

__device__ __forceinline__ void mmq_wait_one() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// A float another block wrote (read from L2, not a stale L1 line).
__device__ __forceinline__ float mmq_load_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// A lane's share of one super-block of its two rows: the 16-byte headers and quant bytes
// 32c .. 32c + 31.
struct MmqRows {
    uint4 h[2];
    uint4 q[2][2];
};

__device__ __forceinline__ void mmq_load(const u8* row0, const u8* row1, int sb, int c,
                                         MmqRows& a) {
    const u8* b0 = row0 + (u64)sb * 144;
    const u8* b1 = row1 + (u64)sb * 144;
    a.h[0] = __ldg((const uint4*)b0);
    a.h[1] = __ldg((const uint4*)b1);
    a.q[0][0] = __ldg((const uint4*)(b0 + 16 + 32 * c));
    a.q[0][1] = __ldg((const uint4*)(b0 + 32 + 32 * c));
    a.q[1][0] = __ldg((const uint4*)(b1 + 16 + 32 * c));
    a.q[1][1] = __ldg((const uint4*)(b1 + 32 + 32 * c));
}

// Word i (0..7) of a lane's 32 quant bytes of one row.
__device__ __forceinline__ u32 mmq_word(const uint4* q, int i) {
    const uint4 v = q[i >> 2];
    const int j = i & 3;
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// acc[j] (n-tile j) += the lane's rows' super-block in `a` times the staged activations `xs`
// (this warp's slot of the stage; lane (g, c) reads token 8j + g's group c).
template <int NT>
__device__ __forceinline__ void mmq_super_block(const MmqRows& a, const u8* xs, int g, int c,
                                                float (*acc)[4]) {
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
            mmq_mma(acc[j], A[0][0], lo.x, lo.y);
            mmq_mma(acc[j], A[1][0], lo.z, lo.w);
            mmq_mma(acc[j], A[0][1], hi.x, hi.y);
            mmq_mma(acc[j], A[1][1], hi.z, hi.w);
        }
    }
}

// Copies stage `st`'s activations (super-blocks sb0 + st·WK .. of the split, below sb_end)
// into shared memory `buf`: slot s, token t at (s · 8NT + t) · MMQ_TOKEN_BYTES.
template <int NT>
__device__ __forceinline__ void mmq_stage(const u16* xh, int k, int n, int sb0, int sb_end,
                                          int st, u32 buf) {
    const int WK = 8 / NT, per = WK * 8 * NT * 32;  // 16-byte pieces a stage
    for (int p = threadIdx.x; p < per; p += blockDim.x) {
        int piece = p & 31, slice = p >> 5, t = slice % (8 * NT), s = slice / (8 * NT);
        int sb = sb0 + st * WK + s;
        if (t < n && sb < sb_end) {
            const u16* src = xh + (u64)t * k + sb * 256 + 8 * piece;
            u32 dst = buf + slice * MMQ_TOKEN_BYTES + (piece >> 3) * MMQ_GROUP_BYTES +
                      16 * (piece & 7);
            mmq_cp16(dst, src);
        }
    }
}

template <int NT>
__device__ void mmq_q4k_impl(const u8* w, u64 row_bytes, int rows, int k, const u16* xh, int n,
                             float* out, float* parts, u32* tickets, int splits, int per_split) {
    constexpr int WK = 8 / NT, WM = NT;
    extern __shared__ uint4 mmq_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int wm = warp / WK, wk = warp % WK;
    const int nb = k >> 8, sb0 = blockIdx.y * per_split, sb_end = min(nb, sb0 + per_split);
    const int stages = (sb_end - sb0 + WK - 1) / WK;
    const int r0 = blockIdx.x * 16 * WM + 16 * wm;
    const u8* row0 = w + (u64)min(r0 + g, rows - 1) * row_bytes;
    const u8* row1 = w + (u64)min(r0 + g + 8, rows - 1) * row_bytes;
    const u32 smem = shared_address(mmq_smem);

    MmqRows a, next;
    if (sb0 + wk < sb_end) mmq_load(row0, row1, sb0 + wk, c, a);
    wait_prior_grid();
    mmq_stage<NT>(xh, k, n, sb0, sb_end, 0, smem);
    mmq_commit();

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int st = 0; st < stages; st++) {
        const int sb = sb0 + st * WK + wk, sb_next = sb + WK;
        if (st + 1 < stages)
            mmq_stage<NT>(xh, k, n, sb0, sb_end, st + 1, smem + ((st + 1) & 1) * MMQ_STAGE_BYTES);
        mmq_commit();
        if (sb_next < sb_end) mmq_load(row0, row1, sb_next, c, next);
        mmq_wait_one();
        __syncthreads();
        if (sb < sb_end) {
            const u8* xs = (const u8*)mmq_smem + (st & 1) * MMQ_STAGE_BYTES +
                           wk * 8 * NT * MMQ_TOKEN_BYTES;
            mmq_super_block<NT>(a, xs, g, c, acc);
        }
        __syncthreads();
        a = next;
    }

    // The tile's warps add their sums in order: warp (wm, 0) holds the total.
    float* red = (float*)mmq_smem;
    if (WK > 1) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) red[((warp * NT + j) * 4 + v) * 32 + lane] = acc[j][v];
        __syncthreads();
        if (wk == 0) {
            for (int o = 1; o < WK; o++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int v = 0; v < 4; v++)
                        acc[j][v] += red[(((warp + o) * NT + j) * 4 + v) * 32 + lane];
        }
    }
    // Lane (g, c) holds rows g (v 0, 1) and g + 8 (v 2, 3), tokens 8j + 2c + (v & 1).
    float* dst = splits > 1 ? parts + (u64)blockIdx.y * n * rows : out;
    if (wk == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                int r = r0 + g + 8 * (v >> 1), t = 8 * j + 2 * c + (v & 1);
                if (r < rows && t < n) dst[(u64)t * rows + r] = acc[j][v];
            }
    }
    if (splits == 1) return;

    // The tile's last block adds the parts in split order.
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 ticket = atomicAdd(&tickets[blockIdx.x], 1u);
        last = ticket == (u32)splits - 1;
        if (last) tickets[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int tile0 = blockIdx.x * 16 * WM, tile_rows = min(16 * WM, rows - tile0);
    for (int i = threadIdx.x; i < tile_rows * n; i += blockDim.x) {
        int t = i / tile_rows, r = tile0 + i % tile_rows;
        float s = 0.f;
        for (int p = 0; p < splits; p++) s += mmq_load_l2(parts + ((u64)p * n + t) * rows + r);
        out[(u64)t * rows + r] = s;
    }
}

// The kernels for NT = 1, 2, 4 n-tiles (up to 8, 16, 32 token rows); blocks of 256
// threads with 2 · MMQ_STAGE_BYTES of dynamic shared memory.
#define MMQ_KERNEL(NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2)                                       \
        mmq_q4_k_##NT(const u8* w, u64 row_bytes, int rows, int k, const u16* xh, int n,       \
                      float* out, float* parts, u32* tickets, int splits, int per_split) {     \
        mmq_q4k_impl<NT>(w, row_bytes, rows, k, xh, n, out, parts, tickets, splits, per_split); \
    }
MMQ_KERNEL(1)
MMQ_KERNEL(2)
MMQ_KERNEL(4)

#endif
