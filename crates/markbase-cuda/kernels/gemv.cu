// Decode matmul: out[t, r] = Σ_k x[t, k] · w[r, k] for up to 8 token rows per launch, any
// stored format; with `mul` (not null) out[t, r] = gelu_tanh(that) · mul[t · mul_stride + r]
// (Gemma 4's per-layer-input gate). Blocks of 256 threads (8 warps); the weights are read once for all of the
// launch's tokens (weights dominate the bytes). Larger decode batches take several launches.
//
// Quantized rows: one warp per row (8 rows per block), the activations staged per block;
// Q4_K rows and Q8_0 rows of a multiple of 256 values may be shared by `split` warps (1, 2 or
// 4) like plain rows below, and take 16-bit activations (i16_rows). `gemv` and `gemv_many`
// take `xt`: for one token row of such weights, the activations as their producer's Q4_K tiles
// (rounded.rs), read in place of staging; else null. The gated kernel for one token row of
// Q4_K weights (and of Q8_0 weights of whole 256-value groups) is gemv_walk.cu's.
// Plain-float rows (f32 / f16 / bf16, k a multiple of 8): `split` warps (1, 2, 4 or 8) share a
// row, each taking every split-th 16-byte group of it with four loads in flight per lane, and
// add their sums through shared memory: short matrices (a few hundred rows) then still fill
// the GPU, and long rows keep enough bytes in flight to run at the memory's rate.
// Needs common.cuh and quant.cuh.

// Weight bytes a warp asks L2 for before it waits for the kernel ahead (see wait_prior_grid):
// the kernel's blocks start while the previous kernel runs, so the first loads of each row
// hit L2 when the activations are ready. Lanes take one 128-byte line each.
#ifndef GEMV_PREFETCH_LINES
#define GEMV_PREFETCH_LINES 16
#endif

// Blocks of 256 threads per multiprocessor the one-token plain-float `gemv` and `gemv_many`
// kernels are compiled to fit (`__launch_bounds__`, a register cap): 3 lets them keep more
// loads in flight than the compiler's own choice (64 registers), which made E4B's q/k/v, o
// and down products 8–20 % faster on the H200 (docs/perf.md, session 16). The gated pair
// kernel, more token rows and other formats are left to the compiler (GEMV_BOUNDS_ below).
#ifndef GEMV_PLAIN_MIN_BLOCKS
#define GEMV_PLAIN_MIN_BLOCKS 3
#endif

// Prefetches up to GEMV_PREFETCH_LINES lines of `row` into L2: the `span`-byte spans at
// offsets (first + stride · i) · span, the lanes of a span its consecutive lines (not in the
// CPU emulator).
__device__ __forceinline__ void prefetch_row(const u8* row, u64 row_bytes, int first, int stride,
                                             int span) {
#if __CUDA_ARCH__ >= 900 && !MB_EMU
    int lane = threadIdx.x & 31, per_span = span >> 7;
    if (lane < GEMV_PREFETCH_LINES) {
        u64 off = (u64)(first + stride * (lane / per_span)) * span + 128 * (lane % per_span);
        if (off < row_bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
    }
#endif
}

// The value stored for token t, row r of a product whose dot is `acc`.
__device__ __forceinline__ float gemv_result(float acc, const float* mul, u64 mul_stride, int t,
                                             int r) {
    return mul ? gelu_tanh(acc) * mul[(u64)t * mul_stride + r] : acc;
}

template <int FMT, int NT>
__device__ void gemv_impl(const u8* w, u64 row_bytes, int rows, int k, const float* x, int nt,
                          float* out, int split, const float* mul, u64 mul_stride,
                          const uint4* xt) {
    const bool i16 = i16_takes(FMT, k);
    if (((FMT == F_F32 || FMT == F_F16 || FMT == F_BF16) && (k & 7) == 0) || i16) {
        __shared__ float part_sums[8][NT];
        int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        int r = (blockIdx.x * (blockDim.x >> 5) + warp) / split, part = warp % split;
        if (r < rows) prefetch_row(w + (u64)r * row_bytes, row_bytes, part, split, 512);
        if (!i16) wait_prior_grid();  // i16_rows wait after their first loads
        float acc[NT];
        if constexpr (fmt_i16(FMT)) {
            const u8* row = w + (u64)(r < rows ? r : 0) * row_bytes;
            float a[1][NT];
            i16_rows<FMT, NT, 1, true>(r < rows, &row, x, k, nt, part, split, a, xt);
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = a[0][t];
        } else if (r < rows && split == 1) {
            float_row_part<FMT, NT, true>(w + (u64)r * row_bytes, x, k, nt, 0, 1, acc);
        } else if (r < rows) {
            float_row_part<FMT, NT, false>(w + (u64)r * row_bytes, x, k, nt, part, split, acc);
        } else {
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = 0.f;
        }
        if (split == 1) {
            if (r < rows && lane == 0) {
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < nt) out[(u64)t * rows + r] = gemv_result(acc[t], mul, mul_stride, t, r);
            }
            return;
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++) part_sums[warp][t] = acc[t];
        }
        __syncthreads();
        if (part == 0 && r < rows && lane < nt && lane < NT) {
            float s = 0.f;
            for (int p = 0; p < split; p++) s += part_sums[warp + p][lane];
            out[(u64)lane * rows + r] = gemv_result(s, mul, mul_stride, lane, r);
        }
        return;
    }
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    bool active = r < rows;
    if (active) prefetch_row(w + (u64)r * row_bytes, row_bytes, 0, 1, 2048);
    wait_prior_grid();
    float acc[NT];
    warp_row_dot<FMT, NT>(active, w + (u64)(active ? r : 0) * row_bytes, x, k, nt, acc);
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) out[(u64)t * rows + r] = gemv_result(acc[t], mul, mul_stride, t, r);
    }
}

// The gated feed-forward's first half for up to 8 token rows: out[t, r] =
// gelu_tanh(x_t · gate_r) · (x_t · up_r), one warp per row pair (gate and up share the
// stored format and row length), so one launch replaces two GEMVs and the elementwise pass.
// One token row of Q4_K weights (Q8_0 of whole groups) takes gemv_walk.cu's walk instead.
template <int FMT, int NT>
__device__ void gemv_gelu_impl(const u8* wg, const u8* wu, u64 row_bytes, int rows, int k,
                               const float* x, int nt, float* out) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    bool active = r < rows;
    u64 off = (u64)(active ? r : 0) * row_bytes;
    if (active) {
        prefetch_row(wg + off, row_bytes, 0, 1, 2048);
        prefetch_row(wu + off, row_bytes, 0, 1, 2048);
    }
    float g[NT], u[NT];
    warp_row_pair_dot<FMT, NT, true>(active, wg + off, wu + off, x, k, nt, g, u);
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) out[(u64)t * rows + r] = gelu_tanh(g[t]) * u[t];
    }
}

// Up to 4 products of the same activations in one launch (a layer's q, k and v): the
// matrices' rows are numbered one after another, one warp per row; every matrix has the same
// stored format and row length. `MAX_PRODUCTS` in kernels.rs.
struct Products {
    u64 w[4];
    u64 out[4];
    int rows[4];
    int count;
};

template <int FMT, int NT>
__device__ void gemv_many_impl(const Products& p, u64 row_bytes, int k, const float* x,
                               int nt, const uint4* xt) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    // The warp's matrix, its fields picked by constant indices: indexing the parameter `p`
    // at run time copied it to an 88-byte stack frame in every thread.
    u64 w_m = p.w[0], out_m = p.out[0];
    int rows_m = p.rows[0];
#pragma unroll
    for (int i = 1; i < 4; i++) {
        if (i < p.count && r >= rows_m) {
            r -= rows_m;
            w_m = p.w[i];
            out_m = p.out[i];
            rows_m = p.rows[i];
        }
    }
    bool active = r < rows_m;
    const u8* w = (const u8*)w_m;
    if (active) prefetch_row(w + (u64)r * row_bytes, row_bytes, 0, 1, 2048);
    float acc[NT];
    warp_row_dot<FMT, NT, true>(active, w + (u64)(active ? r : 0) * row_bytes, x, k, nt, acc,
                                xt);
    if (active && (threadIdx.x & 31) == 0) {
        float* out = (float*)out_m;
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) out[(u64)t * rows_m + r] = acc[t];
    }
}

#define GEMV_KERNEL(S, F, NT, BOUNDS)                                                         \
    extern "C" __global__ void BOUNDS gemv_##S##_##NT(const u8* w, u64 row_bytes, int rows,      \
                                                      int k, const float* x, int nt, float* out, \
                                                      int split, const float* mul,               \
                                                      u64 mul_stride, const uint4* xt) {         \
        gemv_impl<F, NT>(w, row_bytes, rows, k, x, nt, out, split, mul, mul_stride, xt);         \
    }
#define GEMV_GELU_KERNEL(S, F, NT)                                                            \
    extern "C" __global__ void gemv_gelu_##S##_##NT(const u8* wg, const u8* wu, u64 row_bytes, \
                                                    int rows, int k, const float* x, int nt,   \
                                                    float* out) {                              \
        gemv_gelu_impl<F, NT>(wg, wu, row_bytes, rows, k, x, nt, out);                         \
    }
#define GEMV_MANY_KERNEL(S, F, NT, BOUNDS)                                                    \
    extern "C" __global__ void BOUNDS gemv_many_##S##_##NT(Products p, u64 row_bytes, int k,   \
                                                           const float* x, int nt,             \
                                                           const uint4* xt) {                  \
        gemv_many_impl<F, NT>(p, row_bytes, k, x, nt, xt);                                     \
    }
// The one-token kernels' launch bounds by format suffix (GEMV_PLAIN_MIN_BLOCKS).
#define GEMV_BOUNDS_f32 __launch_bounds__(256, GEMV_PLAIN_MIN_BLOCKS)
#define GEMV_BOUNDS_f16 GEMV_BOUNDS_f32
#define GEMV_BOUNDS_bf16 GEMV_BOUNDS_f32
#define GEMV_BOUNDS_q4_0
#define GEMV_BOUNDS_q4_1
#define GEMV_BOUNDS_q5_0
#define GEMV_BOUNDS_q5_1
#define GEMV_BOUNDS_q8_0
#define GEMV_BOUNDS_q2_k
#define GEMV_BOUNDS_q3_k
#define GEMV_BOUNDS_q4_k
#define GEMV_BOUNDS_q5_k
#define GEMV_BOUNDS_q6_k
// The one-token gated kernel by format suffix: Q4_K's is gemv_walk.cu's walk (Q8_0's too
// for rows of whole groups; others keep gemv_gelu_q8_0_1).
#define GEMV_GELU_ONE_f32(S, F) GEMV_GELU_KERNEL(S, F, 1)
#define GEMV_GELU_ONE_f16 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_bf16 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q4_0 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q4_1 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q5_0 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q5_1 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q8_0 GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q2_k GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q3_k GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q4_k(S, F)
#define GEMV_GELU_ONE_q5_k GEMV_GELU_ONE_f32
#define GEMV_GELU_ONE_q6_k GEMV_GELU_ONE_f32
#define GEMV_KERNELS(S, F)                       \
    GEMV_MANY_KERNEL(S, F, 1, GEMV_BOUNDS_##S)   \
    GEMV_MANY_KERNEL(S, F, 2, )                  \
    GEMV_MANY_KERNEL(S, F, 4, )                  \
    GEMV_MANY_KERNEL(S, F, 8, )                  \
    GEMV_KERNEL(S, F, 1, GEMV_BOUNDS_##S)        \
    GEMV_KERNEL(S, F, 2, )                       \
    GEMV_KERNEL(S, F, 4, )                       \
    GEMV_KERNEL(S, F, 8, )                       \
    GEMV_GELU_ONE_##S(S, F)                      \
    GEMV_GELU_KERNEL(S, F, 2)                    \
    GEMV_GELU_KERNEL(S, F, 4)                    \
    GEMV_GELU_KERNEL(S, F, 8)
FOR_EACH_FORMAT(GEMV_KERNELS)
