// Decode matmul: out[t, r] = Σ_k x[t, k] · w[r, k] for up to 8 token rows per launch, any
// stored format. One warp per weight row; the row is read once for all of the launch's tokens
// (weights dominate the bytes). Larger decode batches take several launches.
// Needs common.cuh and quant.cuh.

// Q4_K rows, specialised: eight lanes share a 144-byte super-block, each loading one 16-byte
// slice of its quants (the warp reads 4 consecutive super-blocks, coalesced) and the header
// words; with w = d·sc·q − dmin·m per 32-weight sub-block, a lane needs only Σ q·x and Σ x.
template <int NT>
__device__ __forceinline__ void q4k_row_dot(const u8* row, const float* x, int k, int nt,
                                            float* acc) {
    int lane = threadIdx.x & 31, sub = lane & 7;
    int n = sub >> 1, l0 = 16 * (sub & 1);
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    int nb = k >> 8;
    for (int b = lane >> 3; b < nb; b += 4) {
        const u8* blk = row + (u64)b * 144;
        uint4 q = __ldg((const uint4*)(blk + 16) + sub);
        u32 h = __ldg((const u32*)blk);
        u32 w0 = __ldg((const u32*)(blk + 4)), w1 = __ldg((const u32*)(blk + 8)),
            w2 = __ldg((const u32*)(blk + 12));
        u8 sc[12];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sc[i] = (u8)(w0 >> (8 * i));
            sc[4 + i] = (u8)(w1 >> (8 * i));
            sc[8 + i] = (u8)(w2 >> (8 * i));
        }
        float d = f16_to_f32((u16)(h & 0xffff)), dmin = f16_to_f32((u16)(h >> 16));
        int s0, m0, s1, m1;
        k_scale_min(sc, 2 * n, &s0, &m0);
        k_scale_min(sc, 2 * n + 1, &s1, &m1);
        float d0 = d * (float)s0, c0 = dmin * (float)m0;
        float d1 = d * (float)s1, c1 = dmin * (float)m1;
        u32 qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* xb = x + (u64)t * k + 256 * b + 64 * n + l0;
                float sq0 = 0.f, sx0 = 0.f, sq1 = 0.f, sx1 = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 xa = __ldg((const float4*)xb + i);
                    float4 xh = __ldg((const float4*)(xb + 32) + i);
                    u32 v = qw[i];
                    sq0 = fmaf((float)(v & 15), xa.x, sq0);
                    sq0 = fmaf((float)((v >> 8) & 15), xa.y, sq0);
                    sq0 = fmaf((float)((v >> 16) & 15), xa.z, sq0);
                    sq0 = fmaf((float)((v >> 24) & 15), xa.w, sq0);
                    sq1 = fmaf((float)((v >> 4) & 15), xh.x, sq1);
                    sq1 = fmaf((float)((v >> 12) & 15), xh.y, sq1);
                    sq1 = fmaf((float)((v >> 20) & 15), xh.z, sq1);
                    sq1 = fmaf((float)((v >> 28) & 15), xh.w, sq1);
                    sx0 += (xa.x + xa.y) + (xa.z + xa.w);
                    sx1 += (xh.x + xh.y) + (xh.z + xh.w);
                }
                acc[t] += (d0 * sq0 - c0 * sx0) + (d1 * sq1 - c1 * sx1);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

template <int FMT, int NT>
__device__ void gemv_impl(const u8* w, u64 row_bytes, int rows, int k, const float* x, int nt,
                          float* out) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= rows) return;
    float acc[NT];
    if (FMT == F_Q4_K)
        q4k_row_dot<NT>(w + (u64)r * row_bytes, x, k, nt, acc);
    else
        warp_row_dot<FMT, NT>(w + (u64)r * row_bytes, x, k, nt, acc);
    if ((threadIdx.x & 31) == 0) {
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
