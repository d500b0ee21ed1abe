// Decode matmul: out[t, r] = Σ_k x[t, k] · w[r, k] for up to 8 token rows per launch, any
// stored format. One warp per weight row (blocks of 256 threads, 8 rows); the row is read once
// for all of the launch's tokens (weights dominate the bytes). Larger decode batches take
// several launches.
// Needs common.cuh and quant.cuh.

template <int FMT, int NT>
__device__ void gemv_impl(const u8* w, u64 row_bytes, int rows, int k, const float* x, int nt,
                          float* out) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    bool active = r < rows;
    float acc[NT];
    warp_row_dot<FMT, NT>(active, w + (u64)(active ? r : 0) * row_bytes, x, k, nt, acc);
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < nt) out[(u64)t * rows + r] = acc[t];
    }
}

#define GEMV_KERNEL(S, F, NT)                                                                 \
    extern "C" __global__ void gemv_##S##_##NT(const u8* w, u64 row_bytes, int rows, int k,   \
                                               const float* x, int nt, float* out) {          \
        gemv_impl<F, NT>(w, row_bytes, rows, k, x, nt, out);                                  \
    }
#define GEMV_KERNELS(S, F) \
    GEMV_KERNEL(S, F, 1)   \
    GEMV_KERNEL(S, F, 2)   \
    GEMV_KERNEL(S, F, 4)   \
    GEMV_KERNEL(S, F, 8)
FOR_EACH_FORMAT(GEMV_KERNELS)
