// Row-wise and element-wise operations: embedding gather, RMSNorm (+ fused residual add),
// per-head norm + RoPE, KV write, activations, weight dequantization for prefill GEMMs and the
// bf16 rounding of a tensor-core GEMM's activations.
// Needs common.cuh and quant.cuh.

// Threads per block of the embed and dequant kernels (the launches use this block size).
#define DEQUANT_THREADS 128

// Output element types of the dequant kernels.
#define OUT_F32 0
#define OUT_F16 1

template <int OUT>
__device__ __forceinline__ void store(void* base, u64 i, float v) {
    if (OUT == OUT_F32) ((float*)base)[i] = v;
    else ((u16*)base)[i] = to_f16(v);
}

// dst[o + e] = dequant(row)[e] · scale over span `span` of a stored row of k weights (its
// DEQUANT_THREADS chunks of 32 weights from chunk span · DEQUANT_THREADS); block:
// DEQUANT_THREADS. Each thread decodes one chunk into shared memory (rows of 33 floats: no bank
// conflicts), then the block writes the span with consecutive threads on consecutive
// addresses — direct stores of 32 values per thread would scatter every warp store over 32
// separate segments.
// Span `span` (DEQUANT_THREADS · 32 values) of a Q8_0 row of whole groups (layout.rs) to f16 at
// dst: thread t takes the 8 values 8·(t + DEQUANT_THREADS·i) of the span for i < 4, one 8-byte
// load of quants and one 16-byte store each, so a warp's loads and stores are contiguous. Each
// value is d · q (exact in f32) rounded as to_f16 rounds it. `row` and `dst` 16-byte aligned.
__device__ __forceinline__ void dequant_q8_0_f16(const u8* row, int k, int span, u16* dst) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int v = 32 * DEQUANT_THREADS * span + 8 * (threadIdx.x + DEQUANT_THREADS * i);
        if (v >= k) return;
        const u8* grp = row + 272 * (u64)(v >> 8);
        const float d = f16_to_f32(__ldg((const u16*)grp + ((v & 255) >> 5)));
        const uint2 q = __ldg((const uint2*)(grp + 16 + (v & 255)));
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 w = j < 2 ? q.x : q.y, sh = 16 * (j & 1);
            h[j] = (u32)to_f16(d * (float)(signed char)(w >> sh)) |
                   ((u32)to_f16(d * (float)(signed char)(w >> (sh + 8))) << 16);
        }
        *(uint4*)(dst + v) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

template <int FMT, int OUT>
__device__ void dequant_span(const u8* row, int k, float scale, int span, void* dst, u64 o) {
    if constexpr (FMT == F_Q8_0 && OUT == OUT_F16) {
        // Rows of whole groups, aligned rows and output: the tensor cores' f16 tiles.
        if ((k & 255) == 0 && scale == 1.f && (((u64)row | (u64)((u16*)dst + o)) & 15) == 0) {
            dequant_q8_0_f16(row, k, span, (u16*)dst + o);
            return;
        }
    }
    __shared__ float stage[DEQUANT_THREADS * 33];
    int c0 = span * DEQUANT_THREADS;
    int c = c0 + threadIdx.x;
    int chunks = (k + 31) >> 5;
    if (c < chunks) {
        float v[32];
        int kv = min(32, k - 32 * c);
        deq32<FMT>(row, c, kv, k, v);
#pragma unroll
        for (int i = 0; i < 32; i++) stage[threadIdx.x * 33 + i] = v[i] * scale;
    }
    __syncthreads();
    int begin = 32 * c0, end = min(k, 32 * (c0 + DEQUANT_THREADS));
    for (int e = begin + threadIdx.x; e < end; e += DEQUANT_THREADS) {
        int rel = e - begin;
        store<OUT>(dst, o + e, stage[(rel >> 5) * 33 + (rel & 31)]);
    }
}

// out[t, :] = dequant(table[tokens[t], :]) · scale. Grid: (tokens, spans of the row).
template <int FMT>
__device__ void embed_impl(const u8* table, u64 row_bytes, const u32* tokens, int k, float scale,
                           float* out) {
    int t = blockIdx.x;
    dequant_span<FMT, OUT_F32>(table + (u64)tokens[t] * row_bytes, k, scale, blockIdx.y, out,
                               (u64)t * k);
}

// dst[r - r0, :] = dequant(w[r, :]) for rows r0 .. r0 + n_rows. Grid: (spans of a row, rows).
template <int FMT, int OUT>
__device__ void dequant_impl(const u8* w, u64 row_bytes, int r0, int k, void* dst) {
    int r = blockIdx.y;
    dequant_span<FMT, OUT>(w + (u64)(r0 + r) * row_bytes, k, 1.f, blockIdx.x, dst, (u64)r * k);
}

#define OPS_FORMAT_KERNELS(S, F)                                                              \
    extern "C" __global__ void embed_##S(const u8* table, u64 row_bytes, const u32* tokens,   \
                                         int k, float scale, float* out) {                    \
        wait_prior_grid();                                                                    \
        embed_impl<F>(table, row_bytes, tokens, k, scale, out);                               \
    }                                                                                         \
    extern "C" __global__ void dequant_##S(const u8* w, u64 row_bytes, int r0, int k,         \
                                           float* dst) {                                      \
        wait_prior_grid();                                                                    \
        dequant_impl<F, OUT_F32>(w, row_bytes, r0, k, dst);                                   \
    }                                                                                         \
    extern "C" __global__ void dequant_f16_##S(const u8* w, u64 row_bytes, int r0, int k,     \
                                               u16* dst) {                                    \
        wait_prior_grid();                                                                    \
        dequant_impl<F, OUT_F16>(w, row_bytes, r0, k, dst);                                   \
    }
FOR_EACH_FORMAT(OPS_FORMAT_KERNELS)

#if SHARED_KERNELS  // the format-independent kernels (quant.cuh)

// y[i] = x[i] rounded to bf16 (to nearest, ties to even; NaN stays NaN): the activations of a
// tensor-core product with bf16 weights.
extern "C" __global__ void f32_to_bf16(const float* x, u16* y, u64 n) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = to_bf16(x[i]);
}

// y[i] = x[i] rounded to f16 (see to_f16): the activations of a tensor-core product with
// quantized weights dequantized to f16.
extern "C" __global__ void f32_to_f16(const float* x, u16* y, u64 n) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = to_f16(x[i]);
}

// RMSNorm of row blockIdx.x (dim values): x · 1/sqrt(mean(x²) + eps) · weight (weight may be
// null), written to out (add = 0) or added into it (add = 1); also stored into `rounded` as
// `round_kind` says: rounded (store_rounded) or as Q4_K tiles (ROUND_Q4K_TILES: add = 0, dim a
// multiple of 256, and 4·dim bytes of dynamic shared memory — the host's rule). Rows of a
// multiple of 4 values move as float4 (a decode step normalises single rows, so the block is
// wide and each thread touches few values: the kernel is latency-bound). `beside`: see
// start_step.
__device__ __forceinline__ void rms_norm_impl(const float* x, const float* weight, float eps,
                                              int dim, float* out, int add, u16* rounded,
                                              int round_kind) {
    __shared__ float red[32];
    extern __shared__ float row_s[];  // the row, for Q4_K tiles
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float ss = 0.f;
    if ((dim & 3) == 0) {
        int d4 = dim >> 2;
        for (int i = threadIdx.x; i < d4; i += blockDim.x) {
            float4 v = ((const float4*)xr)[i];
            ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
        }
        ss = block_sum(ss, red);
        float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = threadIdx.x; i < d4; i += blockDim.x) {
            float4 v = ((const float4*)xr)[i];
            v.x *= inv; v.y *= inv; v.z *= inv; v.w *= inv;
            if (weight) {
                float4 w = ((const float4*)weight)[i];
                v.x *= w.x; v.y *= w.y; v.z *= w.z; v.w *= w.w;
            }
            if (add) {
                float4 p = ((float4*)o)[i];
                v.x += p.x; v.y += p.y; v.z += p.z; v.w += p.w;
            }
            ((float4*)o)[i] = v;
            u64 at = (u64)blockIdx.x * dim + 4 * i;
            store_rounded(rounded, round_kind, at, v.x);
            store_rounded(rounded, round_kind, at + 1, v.y);
            store_rounded(rounded, round_kind, at + 2, v.z);
            store_rounded(rounded, round_kind, at + 3, v.w);
            if (round_kind == ROUND_Q4K_TILES) ((float4*)row_s)[i] = v;
        }
        if (round_kind == ROUND_Q4K_TILES) {
            __syncthreads();
            store_q4k_tiles(row_s, dim, (u8*)rounded + blockIdx.x * q4k_tiles_row_bytes(dim));
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * inv;
        if (weight) v *= weight[i];
        v = add ? o[i] + v : v;
        o[i] = v;
        store_rounded(rounded, round_kind, (u64)blockIdx.x * dim + i, v);
    }
}

extern "C" __global__ void rms_norm(const float* x, const float* weight, float eps, int dim,
                                    float* out, int add, u16* rounded, int round_kind,
                                    int beside) {
    start_step(beside);
    rms_norm_impl(x, weight, eps, dim, out, add, rounded, round_kind);
    end_step(beside);
}

// block_sum of two values at once (one pair of barriers). `red` holds 32 pairs.
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) red[w] = make_float2(a, b);
    __syncthreads();
    float2 t = lane < nw ? red[lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(t.x), warp_sum(t.y));
}

// Values per thread a residual_norm block holds in registers (rows up to 8 · 1024 wide).
#define RESIDUAL_NORM_PER_THREAD 8

// Row blockIdx.x: h = (h + y · rsqrt(mean(y²) + eps) · w) · scale; then, if w2 is not null,
// x = h · rsqrt(mean(h²) + eps) · w2 — a layer's post-norm, residual add and layer scalar with
// the next block's pre-norm — and, where w3 / w4 are not null, x3 / x4 likewise with gains w3 /
// w4 (more norms of the same h: a mixture-of-experts layer's router and expert inputs). Every
// load (y, h and the gains) is issued before the first reduction and the row stays in
// registers, so a row costs one memory round trip instead of three: at batch 1 this kernel
// runs three times a layer on one block and its latency is the cost.
// The row's final output (x, or h without w2) is also stored into `rounded` as `round_kind`
// says: rounded (store_rounded) or as Q4_K tiles (ROUND_Q4K_TILES: dim a multiple of 256 and
// 4·dim bytes of dynamic shared memory). Needs blockDim.x · RESIDUAL_NORM_PER_THREAD >= dim
// (checked by the host).
template <bool MIX, bool EXTRA>
__device__ __forceinline__ void residual_norm_impl(const float* y, const float* w,
                                                   const float* experts, const float* w_dense,
                                                   const float* w_experts, float eps, int dim,
                                                   float* h, float scale, const float* w2,
                                                   float* x, const float* w3, float* x3,
                                                   const float* w4, float* x4, u16* rounded,
                                                   int round_kind) {
    constexpr int P = RESIDUAL_NORM_PER_THREAD, PM = MIX ? P : 1, PE = EXTRA ? P : 1;
    wait_prior_grid();
    __shared__ float red[32];
    __shared__ float2 red2[32];
    u64 base = (u64)blockIdx.x * dim;
    float yv[P], hv[P], wv[P], w2v[P];
    float w3v[PE], w4v[PE];  // EXTRA: the extra norms' gains
    float ev[PM], wdv[PM], wev[PM];  // MIX: the experts' row and both gains
    float ss = 0.f, se = 0.f;
#pragma unroll
    for (int r = 0; r < P; r++) {
        int i = threadIdx.x + r * blockDim.x;
        bool in = i < dim;
        yv[r] = in ? y[base + i] : 0.f;
        hv[r] = in ? h[base + i] : 0.f;
        wv[r] = in ? w[i] : 0.f;
        w2v[r] = in && w2 ? w2[i] : 0.f;
        if constexpr (EXTRA) {
            w3v[r] = in && w3 ? w3[i] : 0.f;
            w4v[r] = in && w4 ? w4[i] : 0.f;
        }
        ss = fmaf(yv[r], yv[r], ss);
        if constexpr (MIX) {
            ev[r] = in ? experts[base + i] : 0.f;
            wdv[r] = in ? w_dense[i] : 0.f;
            wev[r] = in ? w_experts[i] : 0.f;
            se = fmaf(ev[r], ev[r], se);
        }
    }
    if constexpr (MIX) {
        const float2 sums = block_sum2(ss, se, red2);
        const float id = 1.f / sqrtf(sums.x / (float)dim + eps);
        const float ie = 1.f / sqrtf(sums.y / (float)dim + eps);
        ss = 0.f;
#pragma unroll
        for (int r = 0; r < P; r++) {
            yv[r] = yv[r] * id * wdv[r] + ev[r] * ie * wev[r];
            ss = fmaf(yv[r], yv[r], ss);
        }
    }
    ss = block_sum(ss, red);
    float inv = 1.f / sqrtf(ss / (float)dim + eps);
    float hs = 0.f;
#pragma unroll
    for (int r = 0; r < P; r++) {
        int i = threadIdx.x + r * blockDim.x;
        float v = (hv[r] + yv[r] * inv * wv[r]) * scale;
        hv[r] = v;
        if (i < dim) {
            h[base + i] = v;
            if (!w2) store_rounded(rounded, round_kind, base + i, v);
        }
        hs = fmaf(v, v, hs);
    }
    if (w2) {
        hs = block_sum(hs, red);
        float inv2 = 1.f / sqrtf(hs / (float)dim + eps);
#pragma unroll
        for (int r = 0; r < P; r++) {
            int i = threadIdx.x + r * blockDim.x;
            const float normed = hv[r] * inv2;
            hv[r] = normed * w2v[r];
            if (i < dim) {
                x[base + i] = hv[r];
                store_rounded(rounded, round_kind, base + i, hv[r]);
                if constexpr (EXTRA) {
                    if (w3) x3[base + i] = normed * w3v[r];
                    if (w4) x4[base + i] = normed * w4v[r];
                }
            }
        }
    }
    if (round_kind != ROUND_Q4K_TILES) return;
    extern __shared__ float row_s[];
#pragma unroll
    for (int r = 0; r < P; r++) {
        int i = threadIdx.x + r * blockDim.x;
        if (i < dim) row_s[i] = hv[r];
    }
    __syncthreads();
    store_q4k_tiles(row_s, dim, (u8*)rounded + blockIdx.x * q4k_tiles_row_bytes(dim));
}

extern "C" __global__ void residual_norm(const float* y, const float* w, float eps, int dim,
                                         float* h, float scale, const float* w2, float* x,
                                         u16* rounded, int round_kind) {
    residual_norm_impl<false, false>(y, w, nullptr, nullptr, nullptr, eps, dim, h, scale, w2, x,
                                     nullptr, nullptr, nullptr, nullptr, rounded, round_kind);
}

// residual_norm with up to two extra norms of h (w3 / x3, w4 / x4; a null gain: none) beside
// the next one, which must be given (w2 not null). A kernel of its own: the extras' registers
// and loads slowed the plain one (E4B Q4_K decode −3.5 %, docs/perf.md session 36).
extern "C" __global__ void residual_norm_extra(const float* y, const float* w, float eps,
                                               int dim, float* h, float scale, const float* w2,
                                               float* x, const float* w3, float* x3,
                                               const float* w4, float* x4, u16* rounded,
                                               int round_kind) {
    residual_norm_impl<false, true>(y, w, nullptr, nullptr, nullptr, eps, dim, h, scale, w2, x,
                                    w3, x3, w4, x4, rounded, round_kind);
}

// residual_norm of y = rms_norm(dense) · w_dense + rms_norm(experts) · w_experts (Gemma 4's
// mixture-of-experts layers: the dense feed-forward's and the experts' post-norms, summed, then
// the layer's post-norm): both rows' sums of squares in one reduction, then as residual_norm.
extern "C" __global__ void moe_residual_norm(const float* dense, const float* w_dense,
                                             const float* experts, const float* w_experts,
                                             const float* w, float eps, int dim, float* h,
                                             float scale, const float* w2, float* x,
                                             u16* rounded, int round_kind) {
    residual_norm_impl<true, false>(dense, w, experts, w_dense, w_experts, eps, dim, h, scale, w2,
                                    x, nullptr, nullptr, nullptr, nullptr, rounded, round_kind);
}

// Values of a head one lane of norm_rope_head holds (head dims up to MAX_HEAD_DIM = 512).
#define ROPE_PER_LANE 16

// What one lane of a warp needs to norm and turn a head besides its values: the norm weights
// of its values (1 without weights) and the cosine and sine of each of its pairs. All of it
// comes from weights, the RoPE frequencies and the step's positions, which no kernel writes,
// so a kernel computes it before it waits for the kernel ahead (wait_prior_grid): the
// double-precision sincos and these loads then overlap that kernel, and the head itself
// costs one round trip after the wait.
struct RopeLane {
    float w[ROPE_PER_LANE];
    float c[ROPE_PER_LANE / 2], s[ROPE_PER_LANE / 2];
};

// RopeLane of this lane for a head of head_dim values (norm weights norm_w, may be null) at
// position pos, its first `pairs` pairs (i, i + head_dim/2) turning by pos · freqs[i].
__device__ __forceinline__ RopeLane rope_lane(int head_dim, const float* norm_w,
                                              const float* freqs, int pairs, float pos) {
    int lane = threadIdx.x & 31;
    RopeLane rl;
#pragma unroll
    for (int r = 0; r < ROPE_PER_LANE; r++) {
        int i = lane + r * WARP;
        rl.w[r] = norm_w && i < head_dim ? norm_w[i] : 1.f;
    }
#pragma unroll
    for (int r = 0; r < ROPE_PER_LANE / 2; r++) {
        int i = lane + r * WARP;
        rl.c[r] = 1.f;  // unread past `pairs`: norm_rope_head leaves those pairs as they are
        rl.s[r] = 0.f;
        if (i < head_dim / 2 && i < pairs) {
            float ang = pos * freqs[i];
            double sd, cd;
            sincos((double)ang, &sd, &cd);
            rl.c[r] = (float)cd;
            rl.s[r] = (float)sd;
        }
    }
    return rl;
}

// One head by one warp: optional RMSNorm (with rl's weights when `norm`), then half-split
// RoPE of its first `pairs` pairs by rl's turns. Reads `src`, writes `dst` (may be `src`)
// and, if not null, `dst2`. `hv`: head_dim floats of shared memory.
__device__ __forceinline__ void norm_rope_head(const float* src, float* hv, int head_dim,
                                               bool norm, float eps, const RopeLane& rl,
                                               int pairs, float* dst, float* dst2) {
    int lane = threadIdx.x & 31;
    int half = head_dim / 2;
    float ss = 0.f;
#pragma unroll
    for (int r = 0; r < ROPE_PER_LANE; r++) {
        int i = lane + r * WARP;
        if (i < head_dim) {
            float v = src[i];
            hv[i] = v;
            ss = fmaf(v, v, ss);
        }
    }
    ss = warp_sum(ss);
    if (norm) {
        float inv = 1.f / sqrtf(ss / (float)head_dim + eps);
#pragma unroll
        for (int r = 0; r < ROPE_PER_LANE; r++) {
            int i = lane + r * WARP;
            if (i < head_dim) hv[i] = hv[i] * inv * rl.w[r];
        }
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < ROPE_PER_LANE / 2; r++) {
        int i = lane + r * WARP;
        if (i >= half) continue;
        float a = hv[i], b = hv[i + half];
        if (i < pairs) {
            float ra = a * rl.c[r] - b * rl.s[r], rb = b * rl.c[r] + a * rl.s[r];
            a = ra;
            b = rb;
        }
        dst[i] = a;
        dst[i + half] = b;
        if (dst2) {
            dst2[i] = a;
            dst2[i + half] = b;
        }
    }
}

// In place on head blockIdx.x (of n_heads per token): norm_rope_head at positions[token].
// Block: 32 threads; dynamic shared memory: head_dim floats.
extern "C" __global__ void head_norm_rope(float* x, int n_heads, int head_dim,
                                          const float* norm_w, float eps, const float* freqs,
                                          int pairs, const u32* positions) {
    extern __shared__ float hv[];
    int head = blockIdx.x, t = head / n_heads;
    RopeLane rl = rope_lane(head_dim, norm_w, freqs, pairs, (float)positions[t]);
    wait_prior_grid();
    float* p = x + (u64)head * head_dim;
    norm_rope_head(p, hv, head_dim, norm_w != nullptr, eps, rl, pairs, p, nullptr);
}

// A layer's queries and new keys / values in one launch: block blockIdx.x is head j of token
// t (n_heads query heads, then n_kv_heads key heads per token). Query heads: norm_rope_head
// in place. Key head g: its value head is copied to v_cache row slots[t] first (through a
// weightless RMSNorm when v_norm is set; its loads do not wait on the key's), then
// norm_rope_head in place and into k_cache row slots[t]. Block: 32 threads; dynamic shared
// memory: head_dim floats.
extern "C" __global__ void rope_write_kv(float* q, float* k, const float* v, int n_heads,
                                         int n_kv_heads, int head_dim, const float* q_norm,
                                         const float* k_norm, float eps, const float* freqs,
                                         int pairs, const u32* positions, const u32* slots,
                                         float* k_cache, float* v_cache, int v_norm) {
    extern __shared__ float hv[];
    int per_token = n_heads + n_kv_heads;
    int t = blockIdx.x / per_token, j = blockIdx.x % per_token;
    float pos = (float)positions[t];
    if (j < n_heads) {
        RopeLane rl = rope_lane(head_dim, q_norm, freqs, pairs, pos);
        wait_prior_grid();
        float* p = q + ((u64)t * n_heads + j) * head_dim;
        norm_rope_head(p, hv, head_dim, q_norm != nullptr, eps, rl, pairs, p, nullptr);
        return;
    }
    RopeLane rl = rope_lane(head_dim, k_norm, freqs, pairs, pos);
    u64 row = (u64)n_kv_heads * head_dim, head = (u64)(j - n_heads) * head_dim;
    u64 src = (u64)t * row + head, dst = (u64)slots[t] * row + head;
    wait_prior_grid();
    float inv = 1.f;
    if (v_norm) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < head_dim; i += WARP) ss = fmaf(v[src + i], v[src + i], ss);
        inv = 1.f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
    }
    for (int i = threadIdx.x; i < head_dim; i += WARP) v_cache[dst + i] = v[src + i] * inv;
    norm_rope_head(k + src, hv, head_dim, k_norm != nullptr, eps, rl, pairs, k + src,
                   k_cache + dst);
}

// k_cache[slots[t], :] = k[t, :] and likewise v, for token blockIdx.y.
extern "C" __global__ void write_kv(const float* k, const float* v, int row, const u32* slots,
                                    float* k_cache, float* v_cache) {
    wait_prior_grid();
    int t = blockIdx.y;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= row) return;
    u64 s = slots[t];
    k_cache[s * row + i] = k[(u64)t * row + i];
    v_cache[s * row + i] = v[(u64)t * row + i];
}

// gate[i] = gelu_tanh(gate[i]) · up[(i / rows) · stride + i % rows] for i < n (rows of `rows`
// values; `up`'s rows `stride` apart), also stored rounded as `round_kind` says.
extern "C" __global__ void gelu_tanh_mul(float* gate, const float* up, u64 n, u64 rows,
                                         u64 stride, u16* rounded, int round_kind) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = gelu_tanh(gate[i]) * up[(i / rows) * stride + i % rows];
    gate[i] = v;
    store_rounded(rounded, round_kind, i, v);
}

// gelu_tanh_mul over contiguous rows (up's rows as far apart as gate's), four values a thread:
// 16-byte loads and no index division. n4 = n / 4; gate, up and rounded 16-byte aligned.
extern "C" __global__ void gelu_tanh_mul4(float4* gate, const float4* up, u64 n4, u16* rounded,
                                          int round_kind) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    float4 g = gate[i], u = up[i];
    float4 v = make_float4(gelu_tanh(g.x) * u.x, gelu_tanh(g.y) * u.y, gelu_tanh(g.z) * u.z,
                           gelu_tanh(g.w) * u.w);
    gate[i] = v;
    if (round_kind != 0) {
        u32 lo = rounded_bits(round_kind, v.x) | ((u32)rounded_bits(round_kind, v.y) << 16);
        u32 hi = rounded_bits(round_kind, v.z) | ((u32)rounded_bits(round_kind, v.w) << 16);
        *(uint2*)(rounded + 4 * i) = make_uint2(lo, hi);
    }
}

// out[i] = bf16(gelu_tanh(g[i]) · u[i]) over bf16 values, eight a thread (n8 groups of eight,
// 16-byte aligned): the gated feed-forward's activations between bf16 products (ffn.rs).
extern "C" __global__ void gelu_tanh_mul_bf16(const uint4* g, const uint4* u, uint4* out,
                                              u64 n8) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    uint4 a = g[i], b = u[i];
    u32 ga[4] = {a.x, a.y, a.z, a.w}, ub[4] = {b.x, b.y, b.z, b.w}, r[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float lo = gelu_tanh(bf16_to_f32((u16)ga[j])) * bf16_to_f32((u16)ub[j]);
        float hi = gelu_tanh(bf16_to_f32((u16)(ga[j] >> 16))) * bf16_to_f32((u16)(ub[j] >> 16));
        r[j] = (u32)to_bf16(lo) | ((u32)to_bf16(hi) << 16);
    }
    out[i] = make_uint4(r[0], r[1], r[2], r[3]);
}

extern "C" __global__ void add(float* x, const float* y, u64 n) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void scale(float* x, float s, u64 n) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

extern "C" __global__ void softcap(float* x, float cap, u64 n) {
    wait_prior_grid();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

#endif  // SHARED_KERNELS
