// Mixture-of-experts: routing (softmax → top-k → renormalise → per-expert scale) and the routed
// expert MLPs, two ways: for a few tokens, products per (token, chosen expert) pair (the down
// products on the tensor cores where moe_mma.cu takes the format, a tile a pair); for many,
// the pairs grouped by expert on the device so that a block reads an expert's rows once for
// up to MOE_TILE of its pairs (moe_group and the kernels after it; the products on the tensor
// cores where moe_mma.cu, appended to this module, takes the format). Expert ids
// travel as f32 (the Backend contract); a bad id raises MB_ERR_EXPERT_ID in `err` and its
// pair contributes nothing. Needs common.cuh and quant.cuh.

#define MOE_MAX_PER_LANE 8  // up to 256 experts

#if SHARED_KERNELS  // format-independent (quant.cuh)
// One warp per token row of n_experts router logits (top_k ≤ 32): choice j is found by the
// j-th butterfly over the lanes' remaining probabilities and kept by lane j, which then writes
// its weight and id — every choice's scale read at once, no result read back.
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
    float kept = 0.f, mine = 0.f;
    int mine_e = 0;
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
        if (lane == j) {
            mine = best;
            mine_e = best_e;
        }
    }
    if (lane < top_k) {
        u64 o = (u64)t * top_k + lane;
        weights[o] = mine / kept * expert_scale[mine_e];
        ids[o] = (float)mine_e;
    }
}
#endif  // SHARED_KERNELS

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

// The per-pair path (a few tokens): each (token, expert) pair reads its expert's rows, and
// every kernel spreads its work over the pairs, so no warp walks its token's experts one after
// another.
//
// h[pair, i] = gelu_tanh(gate_e[i] · x[pair / top_k, :]) · (up_e[i] · x[pair / top_k, :]) for
// i < F, gate_e[i] = gate_up[e·2F + i, :] and up_e[i] its row F + i (e the pair's expert; 0
// for a bad id), as floats (h_kind 0) or rounded_bits(h_kind, ·) for a down product on the
// tensor cores: one warp per row pair. Grid: (ceil(F / warps per block), pairs).
template <int FMT>
__device__ void moe_gate_up_impl(const u8* w, u64 row_bytes, int d, int f, const float* x,
                                 int top_k, int n_experts, const float* ids, int h_kind, void* h,
                                 u32* err) {
    int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u64 pair = blockIdx.y;
    bool active = i < f;
    int e = expert_of(ids, pair, n_experts, err);  // the same for the whole block
    float g[1] = {0.f}, u[1] = {0.f};
    if (e >= 0) {
        const u8* gate = w + ((u64)e * 2 * f + (active ? i : 0)) * row_bytes;
        warp_row_pair_dot<FMT, 1>(active, gate, gate + (u64)f * row_bytes,
                                  x + (pair / top_k) * d, d, 1, g, u);
    }
    if (active && (threadIdx.x & 31) == 0) {
        const float v = gelu_tanh(g[0]) * u[0];
        if (h_kind)
            ((u16*)h)[pair * f + i] = rounded_bits(h_kind, v);
        else
            ((float*)h)[pair * f + i] = v;
    }
}

// y[pair, r] = down[e·D + r, :] · h[pair, :] for r < D (0 for a bad expert id): one warp per
// output; moe_combine then adds each token's pairs. Grid: (ceil(D / warps per block), pairs).
template <int FMT>
__device__ void moe_down_impl(const u8* w, u64 row_bytes, int d, int f, const float* h,
                              int n_experts, const float* ids, float* y, u32* err) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u64 pair = blockIdx.y;
    bool active = r < d;
    int e = expert_of(ids, pair, n_experts, err);  // the same for the whole block
    float acc[1] = {0.f};
    if (e >= 0)
        warp_row_dot<FMT, 1>(active, w + ((u64)e * d + (active ? r : 0)) * row_bytes,
                             h + pair * f, f, 1, acc);
    if (active && (threadIdx.x & 31) == 0) y[pair * d + r] = acc[0];
}

#define MOE_KERNELS(S, F)                                                                      \
    extern "C" __global__ void moe_gate_up_##S(const u8* w, u64 row_bytes, int d, int f,       \
                                               const float* x, int top_k, int n_experts,       \
                                               const float* ids, int h_kind, void* h,          \
                                               u32* err, int beside) {                         \
        start_step(beside);                                                                    \
        moe_gate_up_impl<F>(w, row_bytes, d, f, x, top_k, n_experts, ids, h_kind, h, err);     \
        end_step(beside);                                                                      \
    }                                                                                          \
    extern "C" __global__ void moe_down_##S(const u8* w, u64 row_bytes, int d, int f,          \
                                            const float* h, int n_experts, const float* ids,   \
                                            float* y, u32* err) {                              \
        wait_prior_grid();                                                                     \
        moe_down_impl<F>(w, row_bytes, d, f, h, n_experts, ids, y, err);                       \
    }
FOR_EACH_FORMAT(MOE_KERNELS)

// ---- Grouped path. The pairs (pair p = t·top_k + j: token t's j-th expert) are sorted by
// expert into "slots" — expert 0's pairs first, each expert's in pair order, so every result
// is the same run to run — and an expert's slots cut into tiles of up to `tile` pairs
// (MOE_TILE for the kernels below; 8 or 16 for moe_mma.cu's). A
// block of the product kernels takes one tile: grids are (row blocks, most tiles), fixed by
// (pairs, experts); blocks past the last tile exit. Index arrays (ints) written by moe_group:
//   order[pairs]      the pair in each slot (−1 past the valid pairs),
//   slot_of[pairs]    each pair's slot (−1 for a bad expert id),
//   tiles[3 · most]   (expert, first slot, pairs) of each tile (0 pairs past the last).

#define MOE_TILE 8  // pairs a block reads an expert's rows for: the largest GEMV variant
#define MOE_MAX_EXPERTS (WARP * MOE_MAX_PER_LANE)
#define MOE_GROUP_WARPS (MOE_MAX_EXPERTS / WARP)  // moe_group's block: a thread per expert

#if SHARED_KERNELS  // format-independent (quant.cuh)
// Groups the pairs by expert (the index arrays above). One block of MOE_MAX_EXPERTS threads:
// warp w takes the pairs of a contiguous range (ranges in warp order), and counts each
// expert's pairs in its range (lanes with the same expert found with __match_any_sync); a
// thread per expert turns the counts into each warp's first slot for that expert and writes
// the expert's tiles; the warps then walk their ranges again and place each pair at its
// warp's next slot for its expert, in pair order.
extern "C" __global__ void moe_group(const float* ids, int pairs, int n_experts, int tile,
                                     int most_tiles, int* order, int* slot_of, int* tiles,
                                     u32* err) {
    __shared__ int next[MOE_GROUP_WARPS][MOE_MAX_EXPERTS];  // per warp: count, then next slot
    __shared__ int red[32];
    wait_prior_grid();
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int span = (pairs + MOE_GROUP_WARPS * WARP - 1) / (MOE_GROUP_WARPS * WARP) * WARP;
    int lo = min(pairs, w * span), hi = min(pairs, lo + span);
    for (int v = 0; v < MOE_GROUP_WARPS; v++) next[v][threadIdx.x] = 0;
    __syncthreads();
    for (int c = lo; c < hi; c += WARP) {
        int p = c + lane;
        int e = p < hi ? expert_of(ids, p, n_experts, err) : -1;
        u32 same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(same) - 1) next[w][e] += __popc(same);
        __syncwarp();
    }
    __syncthreads();
    int ex = threadIdx.x, count = 0;  // this thread's expert and its pairs
    if (ex < n_experts) {
        for (int v = 0; v < MOE_GROUP_WARPS; v++) {
            int c = next[v][ex];
            next[v][ex] = count;
            count += c;
        }
    }
    int used_tiles, valid;
    int ntiles = (count + tile - 1) / tile;
    int first_tile = block_exclusive_scan(ntiles, red, &used_tiles);
    int first_slot = block_exclusive_scan(count, red, &valid);
    if (ex < n_experts) {
        for (int v = 0; v < MOE_GROUP_WARPS; v++) next[v][ex] += first_slot;
        for (int i = 0; i < ntiles; i++) {
            int* t = tiles + 3 * (first_tile + i);
            t[0] = ex;
            t[1] = first_slot + tile * i;
            t[2] = min(tile, count - tile * i);
        }
    }
    for (int i = used_tiles + threadIdx.x; i < most_tiles; i += blockDim.x) tiles[3 * i + 2] = 0;
    for (int s = valid + threadIdx.x; s < pairs; s += blockDim.x) order[s] = -1;
    __syncthreads();
    for (int c = lo; c < hi; c += WARP) {
        int p = c + lane;
        int e = p < hi ? expert_of(ids, p, n_experts, err) : -1;
        u32 same = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
            int slot = next[w][e] + __popc(same & ((1u << lane) - 1));
            order[slot] = p;
            slot_of[p] = slot;
        } else if (p < hi) {
            slot_of[p] = -1;
        }
        __syncwarp();
        if (e >= 0 && lane == __ffs(same) - 1) next[w][e] += __popc(same);
        __syncwarp();
    }
}
#endif  // SHARED_KERNELS

#if SHARED_KERNELS  // format-independent (quant.cuh)
// xg[s, :] = x[order[s] / top_k, :]: each slot's token row, so that a tile's activation rows
// are contiguous for the row-dot helpers. One block per slot.
extern "C" __global__ void moe_gather(const float* x, int d, int top_k, const int* order,
                                      float* xg) {
    wait_prior_grid();
    u64 s = blockIdx.x;
    int p = order[s];
    if (p < 0) return;
    const float* src = x + (u64)(p / top_k) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) xg[s * d + i] = src[i];
}
#endif  // SHARED_KERNELS

// warp_row_dot of one row with a tile's MOE_TILE activation rows, less the fallback for
// plain-float rows of a width that is not a multiple of 8: that fallback alone took the bf16
// down kernel from 76 registers to 144 (one block a multiprocessor). The backend keeps such
// rows on the per-pair path.
template <int FMT>
__device__ __forceinline__ void moe_row_dot(bool active, const u8* row, const float* x, int k,
                                            int nt, float* acc) {
    if constexpr (FMT == F_F32 || FMT == F_F16 || FMT == F_BF16) {
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) acc[t] = 0.f;
        if (active) float_row_dot<FMT, MOE_TILE>(row, x, k, nt, acc);
    } else {
        warp_row_dot<FMT, MOE_TILE>(active, row, x, k, nt, acc);
    }
}

// h[s, i] = gelu_tanh(gate_e[i] · xg[s]) · (up_e[i] · xg[s]) for the slots s of one tile
// (expert e) and i < F, gate_e[i] = gate_up[e·2F + i, :] and up_e[i] its row F + i: one warp
// per row pair, reading both rows once for the tile's pairs. Grid: (ceil(F / warps per
// block), most tiles).
template <int FMT>
__device__ void moe_gate_up_grouped_impl(const u8* w, u64 row_bytes, int d, int f,
                                         const float* xg, const int* tiles, float* h) {
    const int* tile = tiles + 3 * blockIdx.y;
    int e = tile[0], s0 = tile[1], nt = tile[2];
    if (nt == 0) return;  // the whole block: past the last tile
    int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool active = i < f;
    const u8* gate = w + ((u64)e * 2 * f + (active ? i : 0)) * row_bytes;
    const u8* up = gate + (u64)f * row_bytes;
    const float* x = xg + (u64)s0 * d;
    float g[MOE_TILE], u[MOE_TILE];
    if constexpr (FMT == F_Q4_K) {
        warp_row_pair_dot<FMT, MOE_TILE>(active, gate, up, x, d, nt, g, u);  // shared x reads
    } else {
        moe_row_dot<FMT>(active, gate, x, d, nt, g);
        moe_row_dot<FMT>(active, up, x, d, nt, u);
    }
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++)
            if (t < nt) h[(u64)(s0 + t) * f + i] = gelu_tanh(g[t]) * u[t];
    }
}

// y[s, r] = down[e·D + r, :] · h[s, :] for the slots s of one tile (expert e) and r < D: one
// warp per row, read once for the tile's pairs. Grid: (ceil(D / warps per block), most tiles).
template <int FMT>
__device__ void moe_down_grouped_impl(const u8* w, u64 row_bytes, int d, int f, const float* h,
                                      const int* tiles, float* y) {
    const int* tile = tiles + 3 * blockIdx.y;
    int e = tile[0], s0 = tile[1], nt = tile[2];
    if (nt == 0) return;  // the whole block: past the last tile
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool active = r < d;
    float acc[MOE_TILE];
    moe_row_dot<FMT>(active, w + ((u64)e * d + (active ? r : 0)) * row_bytes, h + (u64)s0 * f,
                     f, nt, acc);
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++)
            if (t < nt) y[(u64)(s0 + t) * d + r] = acc[t];
    }
}

#define MOE_GROUPED_KERNELS(S, F)                                                              \
    extern "C" __global__ void moe_gate_up_grouped_##S(const u8* w, u64 row_bytes, int d,      \
                                                       int f, const float* xg,                 \
                                                       const int* tiles, float* h) {           \
        wait_prior_grid();                                                                     \
        moe_gate_up_grouped_impl<F>(w, row_bytes, d, f, xg, tiles, h);                         \
    }                                                                                          \
    extern "C" __global__ void moe_down_grouped_##S(const u8* w, u64 row_bytes, int d, int f,  \
                                                    const float* h, const int* tiles,          \
                                                    float* y) {                                \
        wait_prior_grid();                                                                     \
        moe_down_grouped_impl<F>(w, row_bytes, d, f, h, tiles, y);                             \
    }
FOR_EACH_FORMAT(MOE_GROUPED_KERNELS)

#if SHARED_KERNELS  // format-independent (quant.cuh)
// out[t, r] = Σ_j weights[t·top_k + j] · y[slot_of[t·top_k + j], r], j in order (a pair with
// a bad expert id adds nothing); without slot_of (the per-pair path) pair p's row is y's row p.
// A thread per output, its token's pairs read at once. Grid: (ceil(D / block), tokens).
extern "C" __global__ void moe_combine(const float* y, int d, int top_k, const float* weights,
                                       const int* slot_of, float* out) {
    wait_prior_grid();
    u64 t = blockIdx.y;
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= d) return;
    float total = 0.f;
    for (int j = 0; j < top_k; j++) {
        u64 pair = t * top_k + j;
        int s = slot_of ? slot_of[pair] : (int)pair;
        if (s >= 0) total += weights[pair] * y[(u64)s * d + r];
    }
    out[t * d + r] = total;
}
#endif  // SHARED_KERNELS
