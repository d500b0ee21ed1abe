// Softmax attention over a slot-addressed KV cache (split-K "flash decoding"), GQA, optional
// sliding window and score soft-cap, over a paged cache. Query rows are grouped by sequence
// (rows seq_start[s] .. seq_start[s + 1] belong to sequence s); row t at position p sees keys
// j in [max(0, p − window + 1), p] of its sequence, key j living in cache slot
// block_tables[s · table_width + j / block_size] · block_size + j % block_size.
//
// attn_partial_V: one block per (token, query head, key split), its warps sharing the split's
// keys; lane l holds head dims [l·V, l·V + V) (V = head_dim / 32). Keys are visited four at a
// time with an online softmax. With one split the result is written straight to `out`;
// otherwise (m, l, acc[head_dim]) go to `part` and attn_combine merges them.
// attn_rope_partial_V: the same for a decode step from the raw query rows (and the raw new keys
// and values), normed, turned and written to the cache in the blocks (AttnRope, below), in
// place of rope_write_kv / head_norm_rope ahead of attn_partial. Needs common.cuh.

struct AttnArgs {
    const float* q;
    const float* k_cache;
    const float* v_cache;
    const u32* positions;
    const u32* seq_start;     // n_seqs + 1 entries
    const u32* block_tables;  // [n_seqs, table_width]
    float* out;
    float* part;
    int n_tokens, n_heads, n_kv_heads, head_dim;
    float scale;
    int window;     // 0 = none
    float softcap;  // 0 = none
    int n_seqs, table_width, block_size, chunk, splits;
    u16* rounded;    // the output's rounded copy (store_rounded, `round_kind`), like out
    int round_kind;  // 0: none (rounded.rs)
};

// Cache slot of key position j for a sequence whose block table is `table`.
__device__ __forceinline__ u64 kv_slot(const AttnArgs& a, const u32* table, int j) {
    return (u64)table[j / a.block_size] * (u64)a.block_size + (u64)(j % a.block_size);
}

template <int V>
__device__ __forceinline__ void load_v(const float* p, float* r) {
    if (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V / 4; i++) {
            float4 t = __ldg((const float4*)p + i);
            r[4 * i] = t.x; r[4 * i + 1] = t.y; r[4 * i + 2] = t.z; r[4 * i + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) r[i] = __ldg(p + i);
    }
}

// Cache slots of the KB keys from position j (kv_slot; a cache of 2^32 slots would hold at
// least 4 TB, so 32 bits hold any).
template <int KB>
__device__ __forceinline__ void kv_slots(const AttnArgs& a, const u32* table, int j, u32* slot) {
#pragma unroll
    for (int b = 0; b < KB; b++) slot[b] = (u32)kv_slot(a, table, j + b);
}

// Folds KB keys into a warp's online softmax (m, l, acc): `s` holds this lane's parts of their
// scores (reduced over the warp here), `vr` its values of them.
template <int V, int KB>
__device__ __forceinline__ void attn_fold(const AttnArgs& a, float* s, float (*vr)[V], float& m,
                                          float& l, float* acc) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int b = 0; b < KB; b++) s[b] += __shfl_xor_sync(0xffffffffu, s[b], o);
    }
    float mn = m;
#pragma unroll
    for (int b = 0; b < KB; b++) {
        s[b] *= a.scale;
        if (a.softcap > 0.f) s[b] = a.softcap * tanhf(s[b] / a.softcap);
        mn = fmaxf(mn, s[b]);
    }
    float corr = expf(m - mn);
    l *= corr;
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] *= corr;
#pragma unroll
    for (int b = 0; b < KB; b++) {
        float e = expf(s[b] - mn);
        l += e;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = fmaf(e, vr[b][i], acc[i]);
    }
    m = mn;
}

// Folds the KB keys in cache slots `slot` into this warp's online softmax (m, l, acc).
template <int V, int KB>
__device__ __forceinline__ void attn_keys(const AttnArgs& a, const u32* slot, int kvh, int lane,
                                          const float* qv, float& m, float& l, float* acc) {
    u64 kv_w = (u64)a.n_kv_heads * a.head_dim;
    float s[KB];
    // The values are loaded with the keys, before the scores' reductions: a decode row is a
    // chain of these groups, and their latency is its cost.
    float vr[KB][V];
#pragma unroll
    for (int b = 0; b < KB; b++) {
        u64 base = (u64)slot[b] * kv_w + (u64)kvh * a.head_dim + lane * V;
        float kr[V];
        load_v<V>(a.k_cache + base, kr);
        load_v<V>(a.v_cache + base, vr[b]);
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < V; i++) d = fmaf(qv[i], kr[i], d);
        s[b] = d;
    }
    attn_fold<V, KB>(a, s, vr, m, l, acc);
}

// Warps of an attn_partial block (ATTN_ROW_WARPS in attention.rs): they share one row's key
// chunk, groups of four keys dealt round-robin, so a short decode row is a chain of one or two
// groups instead of all of them; the block merges their softmax states in shared memory.
#define ATTN_ROW_WARPS 8

// What attn_rope_partial adds to attn_partial (rope_attention in backend.rs, for decode steps:
// each sequence brings one query row, at its position p): the raw query rows in AttnArgs::q
// are normed and turned in the block (norm_rope_head's arithmetic, ops.cu), and with new keys
// the row's own key and value too — the split holding p folds key p into its softmax from
// registers, every split reads the cache only below p, and one block per (token, KV head)
// stores the key and value in cache row slots[t].
struct AttnRope {
    const float* k;       // raw new keys [n_tokens, n_kv_heads · head_dim]; null: none
    const float* v;       // new values, the same shape (raw with v_norm, else as stored)
    const float* q_norm;  // per-head norm weights [head_dim]
    const float* k_norm;
    float eps;
    const float* freqs;  // the RoPE frequencies of the `pairs` pairs that turn
    int pairs;
    int v_norm;       // 1: each value head through a weightless RMSNorm before it is stored
    const u32* slots;  // the cache row of each token's new key and value
};

// The warp of an attn_rope_partial block that takes the row's new key (first, before its
// keys from the cache): the last, which gets the fewest groups of four and no tail key.
#define ATTN_NEW_KEY_WARP (ATTN_ROW_WARPS - 1)

template <int V>
__device__ __forceinline__ void store_v(float* p, const float* r) {
    if (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V / 4; i++)
            ((float4*)p)[i] = make_float4(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) p[i] = r[i];
    }
}

// RMSNorm (weights w) and half-split RoPE (cosines c and sines s of the head's pairs; pairs
// that do not turn have 1 and 0) of the head a warp holds as attn_partial's lanes do: lane l
// holds dims [l·V, l·V + V), so pair (l mod 16)·V + i is value i of lanes l and l ^ 16. w, c
// and s in shared memory. The arithmetic is norm_rope_head's (ops.cu).
template <int V>
__device__ __forceinline__ void norm_rope_lane(float* x, const float* w, const float* c,
                                               const float* s, float eps, int head_dim) {
    int lane = threadIdx.x & 31;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < V; i++) ss = fmaf(x[i], x[i], ss);
    float inv = 1.f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
#pragma unroll
    for (int i = 0; i < V; i++) x[i] = x[i] * inv * w[lane * V + i];
    int pair = (lane & 15) * V;
#pragma unroll
    for (int i = 0; i < V; i++) {
        float o = __shfl_xor_sync(0xffffffffu, x[i], 16);
        float ci = c[pair + i], si = s[pair + i];
        x[i] = lane < 16 ? x[i] * ci - o * si : x[i] * ci + o * si;
    }
}

// attn_rope_partial's queries (and, in the warp with `key`, the row's new key kn and value
// vn): the norm weights and the turns at position pos go to shared memory before the wait for
// the kernel ahead (they come from weights, the RoPE table and the step's positions, which no
// kernel writes; the double-precision sincos then overlaps that kernel), the raw rows are
// loaded after it. Every thread of the block calls it.
template <int V>
__device__ __forceinline__ void attn_rope_prologue(const AttnArgs& a, const AttnRope& r, int t,
                                                   int row, int kvh, float pos, bool key,
                                                   float* qv, float* kn, float* vn) {
    __shared__ float wq[32 * V], wk[32 * V], cs[16 * V], sn[16 * V];
    int hd = a.head_dim, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        wq[i] = r.q_norm[i];
        if (r.k) wk[i] = r.k_norm[i];
    }
    for (int i = threadIdx.x; i < hd / 2; i += blockDim.x) {
        float c = 1.f, s = 0.f;
        if (i < r.pairs) {
            double sd, cd;
            sincos((double)(pos * r.freqs[i]), &sd, &cd);
            c = (float)cd;
            s = (float)sd;
        }
        cs[i] = c;
        sn[i] = s;
    }
    wait_prior_grid();
    load_v<V>(a.q + (u64)row * hd + lane * V, qv);
    if (key) {
        u64 src = ((u64)t * a.n_kv_heads + kvh) * hd + lane * V;
        load_v<V>(r.k + src, kn);
        load_v<V>(r.v + src, vn);
    }
    __syncthreads();
    norm_rope_lane<V>(qv, wq, cs, sn, r.eps, hd);
    if (!key) return;
    norm_rope_lane<V>(kn, wk, cs, sn, r.eps, hd);
    if (r.v_norm) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < V; i++) ss = fmaf(vn[i], vn[i], ss);
        float inv = 1.f / sqrtf(warp_sum(ss) / (float)hd + r.eps);
#pragma unroll
        for (int i = 0; i < V; i++) vn[i] *= inv;
    }
}

// Waits for the kernel ahead (wait_prior_grid) after reading what comes from the step's index
// arrays (positions, sequences, block tables: no kernel writes them) and finding the slots of
// the warp's first four keys, so a short decode row's chain after the wait starts at its keys.
// ROPE: attn_rope_partial (AttnRope), else r is unused.
template <int V, bool ROPE>
__device__ void attn_partial_impl(const AttnArgs& a, const AttnRope& r) {
    __shared__ float merge[ATTN_ROW_WARPS][2 + 32 * V];
    int row = blockIdx.x;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = row / a.n_heads, h = row % a.n_heads;
    int group = a.n_heads / a.n_kv_heads;
    int kvh = h / group;
    // The row's sequence: the last s with seq_start[s] <= t (empty sequences are skipped).
    int lo_s = 0, hi_s = a.n_seqs - 1;
    while (lo_s < hi_s) {
        int mid = (lo_s + hi_s + 1) >> 1;
        if ((int)a.seq_start[mid] <= t) lo_s = mid; else hi_s = mid - 1;
    }
    const u32* table = a.block_tables + (u64)lo_s * a.table_width;
    int p = (int)a.positions[t];
    int lo = a.window > 0 ? max(0, p - a.window + 1) : 0;
    int j0 = lo + blockIdx.y * a.chunk;
    int j1 = min(p, j0 + a.chunk - 1);
    // With new keys, key p comes from registers in the split that holds it (its warp
    // ATTN_NEW_KEY_WARP) and the cache is read only below p: its slot is being written.
    bool new_key = false;
    if (ROPE && r.k) {
        new_key = j0 <= p && p <= j1;
        j1 = min(j1, p - 1);
    }
    int groups = (j1 - j0 + 1) >> 2;  // negative chunks (past the row's keys) give none
    int tail = j0 + 4 * max(groups, 0) + warp;  // at most three keys: one a warp
    u32 slot[4];
    if (warp < groups) kv_slots<4>(a, table, j0 + 4 * warp, slot);
    float qv[V], acc[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.f;
    float m = NEG_INF, l = 0.f;
    if (ROPE) {
        bool key = new_key && warp == ATTN_NEW_KEY_WARP;
        u32 dst = key ? r.slots[t] : 0;
        float kn[V], vn[1][V];
        attn_rope_prologue<V>(a, r, t, row, kvh, (float)p, key, qv, kn, vn[0]);
        if (key) {
            // One block per (token, KV head) stores them: its group's first query head's.
            if (h % group == 0) {
                u64 at = ((u64)dst * a.n_kv_heads + kvh) * a.head_dim + lane * V;
                store_v<V>((float*)a.k_cache + at, kn);
                store_v<V>((float*)a.v_cache + at, vn[0]);
            }
            float s[1] = {0.f};
#pragma unroll
            for (int i = 0; i < V; i++) s[0] = fmaf(qv[i], kn[i], s[0]);
            attn_fold<V, 1>(a, s, vn, m, l, acc);
        }
    } else {
        wait_prior_grid();
        load_v<V>(a.q + (u64)row * a.head_dim + lane * V, qv);
    }
    for (int g = warp; g < groups; g += ATTN_ROW_WARPS) {
        attn_keys<V, 4>(a, slot, kvh, lane, qv, m, l, acc);
        if (g + ATTN_ROW_WARPS < groups) kv_slots<4>(a, table, j0 + 4 * (g + ATTN_ROW_WARPS), slot);
    }
    if (warp < 3 && tail <= j1) {
        kv_slots<1>(a, table, tail, slot);
        attn_keys<V, 1>(a, slot, kvh, lane, qv, m, l, acc);
    }
    if (lane == 0) {
        merge[warp][0] = m;
        merge[warp][1] = l;
    }
#pragma unroll
    for (int i = 0; i < V; i++) merge[warp][2 + lane * V + i] = acc[i];
    __syncthreads();
    // The block's softmax state: warps without keys (m = −inf, l = 0) weigh nothing.
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATTN_ROW_WARPS; w++)
        if (merge[w][1] > 0.f) mx = fmaxf(mx, merge[w][0]);
    float f[ATTN_ROW_WARPS], total = 0.f;
#pragma unroll
    for (int w = 0; w < ATTN_ROW_WARPS; w++) {
        f[w] = merge[w][1] > 0.f ? expf(merge[w][0] - mx) : 0.f;
        total = fmaf(f[w], merge[w][1], total);
    }
    float* pp = a.part + ((u64)row * a.splits + blockIdx.y) * (a.head_dim + 2);
    if (a.splits > 1 && threadIdx.x == 0) {
        pp[0] = mx;
        pp[1] = total;
    }
    for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_ROW_WARPS; w++) v = fmaf(f[w], merge[w][2 + d], v);
        if (a.splits == 1) {
            const u64 at = (u64)row * a.head_dim + d;
            a.out[at] = v / total;
            store_rounded(a.rounded, a.round_kind, at, v / total);
        } else {
            pp[2 + d] = v;
        }
    }
}

// The head-dim-256 kernels are held to 80 registers (3 blocks a multiprocessor, as before its
// key slots were found ahead of the wait: the compiler's own choice was 88, 2 blocks); the
// head-dim-512 fused kernel to 128, 2 blocks like attn_partial_16 (its own choice was 141).
#define ATTN_KERNEL(V, BOUNDS, ROPE_BOUNDS)                                                    \
    extern "C" __global__ void BOUNDS attn_partial_##V(AttnArgs a) {                          \
        attn_partial_impl<V, false>(a, AttnRope{});                                           \
    }                                                                                         \
    extern "C" __global__ void ROPE_BOUNDS attn_rope_partial_##V(                             \
        AttnArgs a, const float* k, const float* v, const float* q_norm, const float* k_norm, \
        float eps, const float* freqs, int pairs, int v_norm, const u32* slots) {             \
        AttnRope r = {k, v, q_norm, k_norm, eps, freqs, pairs, v_norm, slots};                \
        attn_partial_impl<V, true>(a, r);                                                     \
    }
ATTN_KERNEL(1, , )
ATTN_KERNEL(2, , )
ATTN_KERNEL(4, , )
ATTN_KERNEL(8, __launch_bounds__(32 * ATTN_ROW_WARPS, 3), __launch_bounds__(32 * ATTN_ROW_WARPS, 3))
ATTN_KERNEL(16, , __launch_bounds__(32 * ATTN_ROW_WARPS, 2))

// Merges the `splits` partial results of each (token, head) row: one warp per row; the
// output's rounded copy as `round_kind` says (store_rounded).
extern "C" __global__ void attn_combine(const float* part, int rows, int splits, int head_dim,
                                        float* out, u16* rounded, int round_kind) {
    wait_prior_grid();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float* pr = part + (u64)row * splits * (head_dim + 2);
    float mx = NEG_INF;
    for (int s = 0; s < splits; s++)
        if (pr[s * (head_dim + 2) + 1] > 0.f) mx = fmaxf(mx, pr[s * (head_dim + 2)]);
    float total = 0.f;
    for (int s = 0; s < splits; s++) {
        float l = pr[s * (head_dim + 2) + 1];
        if (l > 0.f) total += l * expf(pr[s * (head_dim + 2)] - mx);
    }
    float inv = 1.f / total;
    for (int i = lane; i < head_dim; i += WARP) {
        float acc = 0.f;
        for (int s = 0; s < splits; s++) {
            const float* ps = pr + s * (head_dim + 2);
            if (ps[1] > 0.f) acc += ps[2 + i] * expf(ps[0] - mx);
        }
        out[(u64)row * head_dim + i] = acc * inv;
        store_rounded(rounded, round_kind, (u64)row * head_dim + i, acc * inv);
    }
}
