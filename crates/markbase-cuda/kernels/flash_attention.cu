// Prefill attention, flash style (the backend's `attention_flash`), for compute capability 8.0
// and newer (cp.async, ldmatrix, mma.m16n8k16); on older devices the kernels compile empty and
// the backend takes the split-K kernel instead. Needs common.cuh.
//
// kv_gather_f16 copies the keys and values one sequence's rows see into contiguous f16 rows
// (key i = position k_lo + i; a row holds every KV head, `row` values). attn_flash_D then gives
// each block FA_ROWS query rows of one KV head — the (token, query head) pairs of that head's
// group, token-major, so 16 tokens of a 4-head group — and walks the keys they see FA_KEYS at a
// time: the keys and values of the next tile stream into shared memory (cp.async) while the
// tensor cores take the scores of this one (f16 inputs, f32 sums), an online softmax runs in
// registers, and the values are weighted on the tensor cores. No score leaves the
// multiprocessor. A warp holds 16 rows, and each row group has two warps: for head dim 512
// each takes the scores over half of the head dims (the pair adds its halves through shared
// memory) and half of the output dims; for smaller heads each takes half of every stage's
// keys (2 · FA_KEYS a stage), and the pair merges its softmax states at the end.
//
// Row t at position p sees key position j when j ≤ p and (window = 0 or j > p − window).
// Scores are scaled, then soft-capped when softcap > 0. The output is written in f32 and, with
// round_kind > 0, rounded for the next tensor-core product (store_rounded, rounded.rs).

#define FA_ROWS 64
#define FA_KEYS 32
// Warps sharing a row group's head dims (1 or 2): the scores' and the output's; with 1 the
// pair splits each stage's keys instead. Measured on the H200 (E4B prefill): head dim 512
// 245 -> 204 us a launch with pairs over the dims, 256 47.3 -> 49.9 us.
#define FLASH_HALVES(D) ((D) >= 512 ? 2 : 1)
#define LOG2E 1.4426950408889634f

// Two floats as packed f16 (to nearest): `lo` in the low half.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
#ifdef MB_EMU
    return emu_pack(lo, hi);
#else
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// pack_f16x2 of four floats (x, y | z, w), finite values beyond f16's range saturated to
// ±65504 as to_f16 does: queries, keys and values (cached f32) may exceed it, and an
// infinity would turn its whole row of scores into NaN. Probabilities (≤ 1) need not.
__device__ __forceinline__ uint2 pack_f16x4_saturated(float4 v) {
    return make_uint2(pack_f16x2(f16_range(v.x), f16_range(v.y)),
                      pack_f16x2(f16_range(v.z), f16_range(v.w)));
}

// kg[i, :] = k_cache[slot(k_lo + i), :] as f16 and likewise v, for key i = blockIdx.x; `row`
// values per key (a multiple of 4), the slot from the sequence's block table.
extern "C" __global__ void kv_gather_f16(const float* k_cache, const float* v_cache,
                                         const u32* table, int block_size, int row, int k_lo,
                                         uint2* kg, uint2* vg) {
    int j = k_lo + blockIdx.x;
    u64 slot = (u64)table[j / block_size] * (u64)block_size + (u64)(j % block_size);
    wait_prior_grid();
    const float4* ks = (const float4*)(k_cache + slot * row);
    const float4* vs = (const float4*)(v_cache + slot * row);
    uint2* kd = kg + (u64)blockIdx.x * (row / 4);
    uint2* vd = vg + (u64)blockIdx.x * (row / 4);
    for (int i = threadIdx.x; i < row / 4; i += blockDim.x) {
        float4 k = ks[i], v = vs[i];
        kd[i] = pack_f16x4_saturated(k);
        vd[i] = pack_f16x4_saturated(v);
    }
}

#if __CUDA_ARCH__ >= 800

__device__ __forceinline__ void ldsm_x4(u32 a, u32* r) {
#ifdef MB_EMU
    mb_emu::ldsm(a, r, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

__device__ __forceinline__ void ldsm_x4_trans(u32 a, u32* r) {
#ifdef MB_EMU
    mb_emu::ldsm(a, r, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// c += a · b on the tensor cores: a 16 × 16 (row-major fragments), b 16 × 8 (column-major),
// f16 inputs, f32 sums.
__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
#ifdef MB_EMU
    mb_emu::mma(c, a, b0, b1, false);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

#endif

struct FlashArgs {
    const float* q;         // the sequence's first query row: [rows][n_heads · D]
    const u16* kg;          // gathered keys, f16: [n_keys][n_kv_heads · D]
    const u16* vg;          // gathered values, likewise
    float* out;             // the sequence's first output row, like q
    u16* rounded;           // its rounded copy (store_rounded, `round_kind`), like out
    const u32* positions;   // the sequence's rows' positions
    int n_rows, n_heads, n_kv_heads, k_lo, n_keys, window, round_kind;
    float scale, softcap;
};

// Queues the cp.async copies of keys [i0, i0 + SK) of KV head `g` into `ks` / `vs` (SK rows
// of LD halves); keys past n_keys are zeros.
template <int D, int LD, int THREADS, int SK>
__device__ __forceinline__ void flash_load_tile(const FlashArgs& a, int g, int i0, u16* ks,
                                                u16* vs) {
#if __CUDA_ARCH__ >= 800
    const int chunks = D / 8;  // 16-byte pieces of a key's head
    u64 row = (u64)a.n_kv_heads * D;
    static_assert(SK * chunks % THREADS == 0, "whole rounds of copies");
#pragma unroll
    for (int it = 0; it < SK * chunks / THREADS; it++) {
        int c = threadIdx.x + it * THREADS;
        int kr = c / chunks, piece = c % chunks;
        int i = i0 + kr;
        bool in = i < a.n_keys;
        u64 off = in ? (u64)i * row + (u64)g * D + piece * 8 : 0;
        cp_async16_fill(shared_address(ks + kr * LD + piece * 8), a.kg + off, in ? 16 : 0);
        cp_async16_fill(shared_address(vs + kr * LD + piece * 8), a.vg + off, in ? 16 : 0);
    }
    cp_async_commit();
#endif
}

template <int D>
__device__ __forceinline__ void attn_flash_impl(const FlashArgs& a) {
#if __CUDA_ARCH__ >= 800
    // A row group's two warps split the head dims (HALVES = 2: the scores' and the output's)
    // or the keys of each stage (KSPLIT = 2: FA_KEYS each, merged at the end).
    constexpr int HALVES = FLASH_HALVES(D);
    constexpr int KSPLIT = 3 - HALVES;
    constexpr int DO = D / HALVES;  // head dims a warp takes: of the scores, of the output
    constexpr int SK = FA_KEYS * KSPLIT;  // keys a stage
    constexpr int THREADS = 256;
    constexpr int LD = D + 8;  // halves a shared row: 16 spare bytes keep ldmatrix conflict-free
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* qs = fa_smem;
    u16* ks = qs + FA_ROWS * LD;   // [2][SK][LD]
    u16* vs = ks + 2 * SK * LD;    // [2][SK][LD]
    float* part = (float*)(vs + 2 * SK * LD);  // HALVES = 2: [warps][16 scores][32 lanes]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rg = warp & 3, half = warp >> 2;  // row group (16 rows), half of dims or keys
    const int g = blockIdx.y;
    const int group = a.n_heads / a.n_kv_heads;
    // The longest tiles (latest tokens) first.
    const int r0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;

    // Positions: the block's range (each warp reduces all of it) and this lane's two rows.
    const int tok_lo = r0 / group, tok_hi = min((r0 + FA_ROWS - 1) / group, a.n_rows - 1);
    int pmin = 0x7fffffff, pmax = -1;
    for (int t = tok_lo + lane; t <= tok_hi; t += WARP) {
        int p = (int)a.positions[t];
        pmin = min(pmin, p);
        pmax = max(pmax, p);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        pmin = min(pmin, __shfl_xor_sync(0xffffffffu, pmin, o));
        pmax = max(pmax, __shfl_xor_sync(0xffffffffu, pmax, o));
    }
    int my_pos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int t = (r0 + rg * 16 + (lane >> 2) + 8 * h) / group;
        my_pos[h] = t < a.n_rows ? (int)a.positions[t] : -0x40000000;  // sees no key
    }
    const int first_pos = a.window > 0 ? max(0, pmin - a.window + 1) : 0;
    const int kt0 = max(0, first_pos - a.k_lo) / SK, kt1 = (pmax - a.k_lo) / SK;

    wait_prior_grid();
    flash_load_tile<D, LD, THREADS, SK>(a, g, kt0 * SK, ks, vs);

    // The block's query rows as f16 (rows past the sequence are zeros), QB loads in flight a
    // thread.
    const u64 qrow = (u64)a.n_heads * D;
    constexpr int QN = FA_ROWS * D / 4 / THREADS, QB = QN < 8 ? QN : 8;
#pragma unroll 1
    for (int b = 0; b < QN; b += QB) {
        float4 v[QB];
#pragma unroll
        for (int i = 0; i < QB; i++) {
            int c = threadIdx.x + (b + i) * THREADS;
            int r = c / (D / 4), d = (c % (D / 4)) * 4;
            int pair = r0 + r, t = pair / group, head = g * group + pair % group;
            v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t < a.n_rows) v[i] = *(const float4*)(a.q + t * qrow + (u64)head * D + d);
        }
#pragma unroll
        for (int i = 0; i < QB; i++) {
            int c = threadIdx.x + (b + i) * THREADS;
            int r = c / (D / 4), d = (c % (D / 4)) * 4;
            *(uint2*)(qs + r * LD + d) = pack_f16x4_saturated(v[i]);
        }
    }

    float o[DO / 8][4];
#pragma unroll
    for (int n = 0; n < DO / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    // ldmatrix addresses: this lane's row of the A tile (queries), of a key pair-tile, of a
    // value tile (transposed).
    const u32 q_addr =
        shared_address(qs + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8);
    // (With KSPLIT = 2 a warp's keys are the second FA_KEYS of a stage for half = 1.)
    const int key_half = KSPLIT == 2 ? half * FA_KEYS : 0, dim_half = HALVES == 2 ? half * DO : 0;
    const u32 k_addr = shared_address(ks + (key_half + (lane & 7) + (lane >> 4) * 8) * LD +
                                      ((lane >> 3) & 1) * 8);
    const u32 v_addr = shared_address(vs + (key_half + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                      dim_half + (lane >> 4) * 8);

    for (int kt = kt0; kt <= kt1; kt++) {
        const int stage = (kt - kt0) & 1;
        if (kt < kt1) {
            flash_load_tile<D, LD, THREADS, SK>(a, g, (kt + 1) * SK, ks + (stage ^ 1) * SK * LD,
                                                vs + (stage ^ 1) * SK * LD);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u32 kst = k_addr + stage * SK * LD * 2, vst = v_addr + stage * SK * LD * 2;

        // Scores of the warp's 16 rows against the tile's 32 keys.
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
        for (int kc = dim_half / 16; kc < (dim_half + DO) / 16; kc++) {
            u32 qa[4], kb[4];
            ldsm_x4(q_addr + kc * 32, qa);
#pragma unroll
            for (int p = 0; p < 2; p++) {
                ldsm_x4(kst + (p * 16 * LD + kc * 16) * 2, kb);
                mma_f16(s[2 * p], qa, kb[0], kb[1]);
                mma_f16(s[2 * p + 1], qa, kb[2], kb[3]);
            }
        }

        if (HALVES == 2) {
            // Each warp of the row group's pair holds the scores over its half of the head
            // dims: swap halves through shared memory (a + b == b + a, so both warps get the
            // same sums) — the pair's own barrier, then the other warp's slot.
            float* mine = part + warp * 16 * WARP + lane;
            const float* other = part + (warp ^ 4) * 16 * WARP + lane;
#pragma unroll
            for (int i = 0; i < 16; i++) mine[i * WARP] = s[i >> 2][i & 3];
#ifdef MB_EMU
            mb_emu::sync_named(1 + rg, 64);
#else
            asm volatile("bar.sync %0, 64;" ::"r"(1 + rg) : "memory");
#endif
#pragma unroll
            for (int i = 0; i < 16; i++) s[i >> 2][i & 3] += other[i * WARP];
        }

        // Scale, cap, mask — only at the edges: a tile every row of the block sees whole
        // needs no mask (rows past the sequence have zero queries and are not written) — then
        // the online softmax of rows lane/4 (h = 0) and lane/4 + 8 (h = 1).
        const int i0 = kt * SK + key_half;  // the warp's first key
        const int j0 = a.k_lo + i0;
        const bool whole = j0 + FA_KEYS - 1 <= pmin && i0 + FA_KEYS <= a.n_keys &&
                           (a.window == 0 || j0 > pmax - a.window);
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 4; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int h = e >> 1;
                float v = s[n][e] * a.scale;
                if (a.softcap > 0.f) v = a.softcap * tanhf(v / a.softcap);
                if (!whole) {
                    int j = j0 + n * 8 + (lane & 3) * 2 + (e & 1);
                    bool seen = j <= my_pos[h] && (a.window == 0 || j > my_pos[h] - a.window);
                    v = seen ? v : NEG_INF;
                }
                s[n][e] = v;
                mx[h] = fmaxf(mx[h], v);
            }
        }
        float base[2], alpha[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            float m_new = fmaxf(m[h], mx[h]);
            base[h] = m_new == NEG_INF ? 0.f : m_new;  // a row that has seen no key yet
            alpha[h] = exp2f((m[h] - base[h]) * LOG2E);
            m[h] = m_new;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < DO / 8; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        u32 pa[2][4];  // probabilities as the A fragments of two 16-key steps
        const float shift[2] = {base[0] * LOG2E, base[1] * LOG2E};
#pragma unroll
        for (int n = 0; n < 4; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[n][e] = exp2f(fmaf(s[n][e], LOG2E, -shift[e >> 1]));
                l[e >> 1] += s[n][e];
            }
            pa[n >> 1][(n & 1) * 2] = pack_f16x2(s[n][0], s[n][1]);
            pa[n >> 1][(n & 1) * 2 + 1] = pack_f16x2(s[n][2], s[n][3]);
        }

        // Values weighted by the probabilities: this warp's DO output dims.
#pragma unroll
        for (int j = 0; j < 2; j++) {
#pragma unroll
            for (int dp = 0; dp < DO / 16; dp++) {
                u32 vb[4];
                ldsm_x4_trans(vst + (j * 16 * LD + dp * 16) * 2, vb);
                mma_f16(o[2 * dp], pa[j], vb[0], vb[1]);
                mma_f16(o[2 * dp + 1], pa[j], vb[2], vb[3]);
            }
        }
        __syncthreads();
    }

    if (KSPLIT == 2) {
        // The pair's halves of the keys: warps of half 1 leave (m, l, o) in shared memory
        // (the tiles are free now), warps of half 0 merge them and write the rows.
        __syncthreads();
        float* st = (float*)fa_smem + rg * (DO / 2 + 4) * WARP + lane;
        if (half == 1) {
#pragma unroll
            for (int n = 0; n < DO / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[(n * 4 + e) * WARP] = o[n][e];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                st[(DO / 2 + h) * WARP] = m[h];
                st[(DO / 2 + 2 + h) * WARP] = l[h];
            }
        }
        __syncthreads();
        if (half == 1) return;
        float mine[2], theirs[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float m1 = st[(DO / 2 + h) * WARP], mm = fmaxf(m[h], m1);
            float base = mm == NEG_INF ? 0.f : mm;
            mine[h] = exp2f((m[h] - base) * LOG2E);
            theirs[h] = exp2f((m1 - base) * LOG2E);
            l[h] = l[h] * mine[h] + st[(DO / 2 + 2 + h) * WARP] * theirs[h];
        }
#pragma unroll
        for (int n = 0; n < DO / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[n][e] = o[n][e] * mine[e >> 1] + st[(n * 4 + e) * WARP] * theirs[e >> 1];
    }

    // Row sums across the quad, then the normalised rows out.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int pair = r0 + rg * 16 + (lane >> 2) + 8 * h;
        int t = pair / group, head = g * group + pair % group;
        if (t >= a.n_rows) continue;
        float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        u64 at = t * qrow + (u64)head * D + dim_half + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < DO / 8; n++) {
            float x = o[n][2 * h] * inv, y = o[n][2 * h + 1] * inv;
            *(float2*)(a.out + at + n * 8) = make_float2(x, y);
            store_rounded(a.rounded, a.round_kind, at + n * 8, x);
            store_rounded(a.rounded, a.round_kind, at + n * 8 + 1, y);
        }
    }
#endif
}

// Blocks of 256 threads (a pair of warps for each of 4 row groups); shared memory (FA_ROWS +
// 4 · SK) · (D + 8) halves, plus 2 KiB a warp for the swapped scores of head dim 512, set at
// launch (flash_kernel in attention_flash.rs).
#define FLASH_KERNEL(D, THREADS, MIN_BLOCKS)                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) attn_flash_##D(        \
        const float* q, const u16* kg, const u16* vg, float* out, u16* rounded,              \
        const u32* positions, int n_rows, int n_heads, int n_kv_heads, int k_lo, int n_keys, \
        int window, int round_kind, float scale, float softcap) {                            \
        FlashArgs a = {q,      kg,     vg,     out,    rounded,    positions, n_rows, n_heads,  \
                       n_kv_heads, k_lo, n_keys, window, round_kind, scale, softcap};       \
        attn_flash_impl<D>(a);                                                               \
    }
FLASH_KERNEL(32, 256, 1)
FLASH_KERNEL(64, 256, 1)
FLASH_KERNEL(128, 256, 1)
FLASH_KERNEL(256, 256, 1)
FLASH_KERNEL(512, 256, 1)
