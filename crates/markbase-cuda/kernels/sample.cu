// Token choice on the device: greedy argmax, and top-k / top-p sampling with a given uniform
// draw. One block (1024 threads) per row of n logits. NaN counts as −inf. Needs common.cuh.

#define SAMPLE_THREADS 1024
#define SAMPLE_MAX_K 256

// The better of two (value, index) candidates: larger value, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index); every thread gets it. `sv`, `si` hold 32 entries each.
__device__ void block_best(float& v, int& i, float* sv, int* si) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[w] = v; si[w] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

__device__ __forceinline__ float clean(float x) { return x == x ? x : NEG_INF; }

// Greedy argmax in two passes, so one long row (262 144 logits) spreads over many blocks:
// block (row, p) of `argmax_part` writes the best (value, index) of slice p of the row to
// part[2·(row·parts + p)] (the index as float bits); one warp per row of `argmax_join` picks
// the best of the row's slices into out[row] (ties: lowest index).
extern "C" __global__ void argmax_part(const float* x, int n, int parts, float* part) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    int row = blockIdx.x, p = blockIdx.y;
    const float* r = x + (u64)row * n;
    int span = (n + parts - 1) / parts;
    int lo = p * span, hi = min(n, lo + span);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        float v = clean(r[j]);
        if (better(v, j, bv, bi)) { bv = v; bi = j; }
    }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        u64 o = 2 * ((u64)row * parts + p);
        part[o] = bv;
        part[o + 1] = __int_as_float(bi);
    }
}

extern "C" __global__ void argmax_join(const float* part, int parts, int n, u32* out) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = part + 2 * (u64)blockIdx.x * parts;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        float v = r[2 * p];
        int i = __float_as_int(r[2 * p + 1]);
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = bi < n ? (u32)bi : 0u;
}

// Top-k (k ≤ 256) then top-p (nucleus) sampling at `temperature` with the uniform draw u[row]
// in [0, 1): the k best logits (value desc, index asc) are taken one block-argmax pass at a
// time, softmax(logit / temperature) over them, the shortest prefix whose mass reaches top_p
// is kept, and the token where u · mass falls in that prefix's cumulative sum is chosen.
extern "C" __global__ void sample_top_k_p(const float* x, int n, int top_k, float top_p,
                                          float temperature, const float* u, u32* out) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float cand_v[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    const float* r = x + (u64)blockIdx.x * n;
    int k = min(min(top_k, SAMPLE_MAX_K), n);
    // Candidates come out in order: each pass takes the best entry below the previous one.
    float pv = __int_as_float(0x7f800000);
    int pi = -1;
    for (int c = 0; c < k; c++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = clean(r[j]);
            bool below = v < pv || (v == pv && j > pi);
            if (below && better(v, j, bv, bi)) { bv = v; bi = j; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) { cand_v[c] = bv; cand_i[c] = bi; }
        pv = bv;
        pi = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = cand_v[0];
        float total = 0.f;
        for (int c = 0; c < k; c++) total += expf((cand_v[c] - mx) / temperature);
        float mass = 0.f;
        int keep = k;
        for (int c = 0; c < k; c++) {
            mass += expf((cand_v[c] - mx) / temperature) / total;
            if (mass >= top_p) { keep = c + 1; break; }
        }
        float kept = 0.f;
        for (int c = 0; c < keep; c++) kept += expf((cand_v[c] - mx) / temperature);
        float target = u[blockIdx.x] * kept, run = 0.f;
        int pick = cand_i[keep - 1];
        for (int c = 0; c < keep; c++) {
            run += expf((cand_v[c] - mx) / temperature);
            if (target < run) { pick = cand_i[c]; break; }
        }
        out[blockIdx.x] = pick < n ? (u32)pick : 0u;
    }
}
