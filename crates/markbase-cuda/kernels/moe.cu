// Mixture-of-experts: routing (softmax → top-k → renormalise → per-expert scale) and the routed
// expert MLPs as grouped matrix-vector products over (token, chosen expert) pairs. Expert ids
// travel as f32 (the Backend contract); a bad id raises MB_ERR_EXPERT_ID in `err` and its
// pair contributes nothing. Needs common.cuh and quant.cuh.

#define MOE_MAX_PER_LANE 8  // up to 256 experts

// One warp per token row of n_experts router logits.
extern "C" __global__ void moe_route(const float* logits, int n, int n_experts, int top_k,
                                     const float* expert_scale, float* weights, float* ids) {
    wait_prior_grid();
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (t >= n) return;
    const float* row = logits + (u64)t * n_experts;
    float p[MOE_MAX_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; i++) {
        int e = lane + WARP * i;
        p[i] = e < n_experts ? row[e] : NEG_INF;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; i++) {
        int e = lane + WARP * i;
        p[i] = e < n_experts ? expf(p[i] - mx) : 0.f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; i++) p[i] = p[i] / sum;
    u32 taken = 0;  // bit i: expert lane + 32 i already chosen
    float kept = 0.f;
    for (int j = 0; j < top_k; j++) {
        float best = -1.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_MAX_PER_LANE; i++) {
            int e = lane + WARP * i;
            if (e < n_experts && !(taken & (1u << i)) && p[i] > best) {
                best = p[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
        kept += best;
        if (lane == 0) {
            weights[(u64)t * top_k + j] = best;  // probability for now, scaled below
            ids[(u64)t * top_k + j] = (float)best_e;
        }
    }
    __syncwarp();
    if (lane == 0) {
        for (int j = 0; j < top_k; j++) {
            u64 o = (u64)t * top_k + j;
            int e = (int)ids[o];
            weights[o] = weights[o] / kept * expert_scale[e];
        }
    }
}

// The expert id of pair `pair`, or −1 (and the error raised) when it is not a valid id.
__device__ __forceinline__ int expert_of(const float* ids, u64 pair, int n_experts, u32* err) {
    float f = ids[pair];
    int e = (int)f;
    if (!(f >= 0.f) || f != (float)e || e >= n_experts) {
        atomicOr(err, (u32)MB_ERR_EXPERT_ID);
        return -1;
    }
    return e;
}

// gu[pair, r] = gate_up[e·2F + r, :] · x[pair / top_k, :] for r < 2F: one warp per output.
// Grid: (ceil(2F / warps per block), pairs).
template <int FMT>
__device__ void moe_gate_up_impl(const u8* w, u64 row_bytes, int d, int f2, const float* x,
                                 int top_k, int n_experts, const float* ids, float* gu, u32* err) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u64 pair = blockIdx.y;
    bool active = r < f2;
    int e = expert_of(ids, pair, n_experts, err);  // the same for the whole block
    float acc[1] = {0.f};
    if (e >= 0)
        warp_row_dot<FMT, 1>(active, w + ((u64)e * f2 + (active ? r : 0)) * row_bytes,
                             x + (pair / top_k) * d, d, 1, acc);
    if (active && (threadIdx.x & 31) == 0) gu[pair * f2 + r] = acc[0];
}

// out[t, r] = Σ_j weights[t, j] · down[e_j·D + r, :] · h[t·top_k + j, :]: one warp per output.
// Grid: (ceil(D / warps per block), tokens).
template <int FMT>
__device__ void moe_down_impl(const u8* w, u64 row_bytes, int d, int f, const float* h,
                              int top_k, int n_experts, const float* weights, const float* ids,
                              float* out, u32* err) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u64 t = blockIdx.y;
    bool active = r < d;
    float total = 0.f;
    for (int j = 0; j < top_k; j++) {
        u64 pair = t * top_k + j;
        int e = expert_of(ids, pair, n_experts, err);  // the same for the whole block
        if (e < 0) continue;
        float acc[1];
        warp_row_dot<FMT, 1>(active, w + ((u64)e * d + (active ? r : 0)) * row_bytes,
                             h + pair * f, f, 1, acc);
        total += weights[pair] * acc[0];
    }
    if (active && (threadIdx.x & 31) == 0) out[t * d + r] = total;
}

#define MOE_KERNELS(S, F)                                                                       \
    extern "C" __global__ void moe_gate_up_##S(const u8* w, u64 row_bytes, int d, int f2,       \
                                               const float* x, int top_k, int n_experts,        \
                                               const float* ids, float* gu, u32* err) {         \
        wait_prior_grid();                                                                      \
        moe_gate_up_impl<F>(w, row_bytes, d, f2, x, top_k, n_experts, ids, gu, err);            \
    }                                                                                           \
    extern "C" __global__ void moe_down_##S(const u8* w, u64 row_bytes, int d, int f,           \
                                            const float* h, int top_k, int n_experts,           \
                                            const float* weights, const float* ids, float* out, \
                                            u32* err) {                                         \
        wait_prior_grid();                                                                      \
        moe_down_impl<F>(w, row_bytes, d, f, h, top_k, n_experts, weights, ids, out, err);      \
    }
FOR_EACH_FORMAT(MOE_KERNELS)

// h[pair, i] = gelu_tanh(gu[pair, i]) · gu[pair, F + i] for i < F. Grid: (ceil(F / block), pairs).
extern "C" __global__ void moe_act(const float* gu, int f, float* h) {
    wait_prior_grid();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    u64 pair = blockIdx.y;
    if (i >= f) return;
    const float* g = gu + pair * 2 * f;
    h[pair * f + i] = gelu_tanh(g[i]) * g[f + i];
}
