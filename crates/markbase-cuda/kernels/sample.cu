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

// A row's draw: temperature t (0: greedy), top-k (0: off), top-p (1: off), min-p (0: off) and
// the uniform number u in [0, 1), as 5 words (the floats' bits).
#define SAMPLE_DRAW_WORDS 5
// A pick the kernel leaves to the host (a nucleus without top-k, or top-k over 256).
#define SAMPLE_ON_HOST 0xffffffffu

// The token each row of n logits picks under its draw (markbase_core::sampling::pick): one
// block of 1 024 threads a row, s = logit / t, NaN never kept.
// - t = 0: the argmax (ties: the lowest index).
// - No top-k (or k ≥ n) and no top-p: every token in index order, e = exp(s − max), those
//   under min-p (e < min_p) dropped; the token where u · Σe falls in the running sum. Each
//   thread sums a contiguous slice; the slice that holds u · Σe walks its values.
// - Top-k ≤ 256 (k < n): the k best (value desc, index asc), one block-argmax pass each, then
//   as the host: probabilities over them, the shortest prefix reaching top-p, those under
//   min-p × the first dropped, the token where u · their sum falls, in rank order.
// - Anything else: SAMPLE_ON_HOST.
extern "C" __global__ void sample_rows(const float* x, int n, const u32* draws, u32* out) {
    wait_prior_grid();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float cand_v[SAMPLE_MAX_K];
    __shared__ int cand_i[SAMPLE_MAX_K];
    __shared__ int tail;
    const float* r = x + (u64)blockIdx.x * n;
    const u32* d = draws + SAMPLE_DRAW_WORDS * blockIdx.x;
    const float t = __uint_as_float(d[0]), top_p = __uint_as_float(d[2]);
    const float min_p = __uint_as_float(d[3]), u = __uint_as_float(d[4]);
    const int top_k = (int)d[1];
    if (t == 0.f) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = clean(r[j]);
            if (better(v, j, bv, bi)) { bv = v; bi = j; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) out[blockIdx.x] = bi < n ? (u32)bi : 0u;
        return;
    }
    const float inv_t = 1.f / t;
    const bool whole = top_k == 0 || top_k >= n;
    if (whole && top_p >= 1.f) {
        const int per = (n + blockDim.x - 1) / blockDim.x;
        const int lo = min(n, (int)threadIdx.x * per), hi = min(n, lo + per);
        float mx = NEG_INF;
        int mi = 0x7fffffff;
        for (int j = lo; j < hi; j++) {
            float s = clean(r[j]) * inv_t;
            if (better(s, j, mx, mi)) { mx = s; mi = j; }
        }
        block_best(mx, mi, sv, si);
        float mine = 0.f;
        for (int j = lo; j < hi; j++) {
            float e = expf(clean(r[j]) * inv_t - mx);
            if (e >= min_p) mine += e;
        }
        float total;
        const float before = block_exclusive_scan(mine, sv, &total);
        const float target = u * total;
        // The slice holding the target walks its values to it. Rounding may put the target
        // at a slice's edge: every slice starting at or below it walks, the lowest pick wins,
        // and where none reached it the last slice starting at or below it gives its last
        // kept token.
        const bool walks = mine > 0.f && before <= target;
        float fv = NEG_INF;
        int fi = 0x7fffffff, last = -1;
        if (walks) {
            float run = 0.f, want = target - before;
            for (int j = lo; j < hi; j++) {
                float e = expf(clean(r[j]) * inv_t - mx);
                if (e < min_p || e == 0.f) continue;
                run += e;
                last = j;
                if (want < run) { fv = 1.f; fi = j; break; }
            }
        }
        block_best(fv, fi, sv, si);
        if (fv > 0.f) {
            if (threadIdx.x == 0) out[blockIdx.x] = (u32)fi;
            return;
        }
        float tv = walks ? 1.f : NEG_INF;
        int ti = blockDim.x - 1 - threadIdx.x;
        block_best(tv, ti, sv, si);
        if (tv > 0.f && threadIdx.x == blockDim.x - 1 - ti) tail = last;
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = tv > 0.f ? (u32)tail : (u32)mi;
        return;
    }
    if (whole || top_k > SAMPLE_MAX_K) {
        if (threadIdx.x == 0) out[blockIdx.x] = SAMPLE_ON_HOST;
        return;
    }
    // Candidates come out in order: each pass takes the best entry below the previous one.
    float pv = __int_as_float(0x7f800000);
    int pi = -1;
    for (int c = 0; c < top_k; c++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float v = clean(r[j]);
            bool below = v < pv || (v == pv && j > pi);
            if (below && better(v, j, bv, bi)) { bv = v; bi = j; }
        }
        block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) { cand_v[c] = bv * inv_t; cand_i[c] = bi; }
        pv = bv;
        pi = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // As markbase_core::sampling::distribution, one thread, in rank order: each
        // candidate's value becomes its probability once.
        const float mx = cand_v[0];
        float total = 0.f;
        for (int c = 0; c < top_k; c++) {
            cand_v[c] = expf(cand_v[c] - mx);
            total += cand_v[c];
        }
        for (int c = 0; c < top_k; c++) cand_v[c] /= total;
        int keep = top_k;
        if (top_p < 1.f) {
            float mass = 0.f;
            for (int c = 0; c < top_k; c++) {
                mass += cand_v[c];
                if (mass >= top_p) { keep = c + 1; break; }
            }
        }
        if (min_p > 0.f) {
            const float floor = min_p * cand_v[0];
            int c = 1;
            while (c < keep && cand_v[c] >= floor) c++;
            keep = c;
        }
        float kept = 0.f;
        for (int c = 0; c < keep; c++) kept += cand_v[c];
        const float target = u * kept;
        float run = 0.f;
        int pick = cand_i[keep - 1];
        for (int c = 0; c < keep; c++) {
            run += cand_v[c];
            if (target < run) { pick = cand_i[c]; break; }
        }
        out[blockIdx.x] = pick < n ? (u32)pick : 0u;
    }
}
