// Dequantization of one 32-weight chunk of a stored row, for every weight format, and the
// warp-wide row dot product built on it. Layouts follow ggml (see markbase-core's quant module,
// whose reference dequantization the tests compare against).
//
// Format ids are the GGUF type ids. A "chunk" is 32 consecutive weights of a row: one block of
// the 32-weight formats, one eighth of a 256-weight K-quant super-block, or 32 plain values.

#define F_F32 0
#define F_F16 1
#define F_Q4_0 2
#define F_Q4_1 3
#define F_Q5_0 6
#define F_Q5_1 7
#define F_Q8_0 8
#define F_Q2_K 10
#define F_Q3_K 11
#define F_Q4_K 12
#define F_Q5_K 13
#define F_Q6_K 14
#define F_BF16 30

// Loads 2·N bytes starting at an even offset into `b` (little-endian u16 loads).
template <int N>
__device__ __forceinline__ void ld_bytes(const u8* p, u8* b) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        u16 v = ld16(p + 2 * i);
        b[2 * i] = (u8)(v & 0xff);
        b[2 * i + 1] = (u8)(v >> 8);
    }
}

// The 6-bit (scale, min) pair of sub-block j of a Q4_K / Q5_K super-block.
__device__ __forceinline__ void k_scale_min(const u8* sc, int j, int* s, int* m) {
    if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *s = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// Q8_0 rows as they lie on the device (layout.rs): each full group of 8 blocks (256 values) as
// its 8 f16 scales then its 256 quants, the blocks after the last full group as stored (scale,
// 32 quants). Returns the address of block c's scale in a row of k values (c and k counted from
// `row`, where a group starts) and sets *q to its quants'.
__device__ __forceinline__ const u8* q8_0_block(const u8* row, int c, int k, const u8** q) {
    const int full = k >> 8, g = c >> 3;
    if (g < full) {
        const u8* grp = row + 272 * (u64)g;
        *q = grp + 16 + 32 * (c & 7);
        return grp + 2 * (c & 7);
    }
    const u8* b = row + 272 * (u64)full + 34 * (c - 8 * full);
    *q = b + 2;
    return b;
}

// Weights 32·c .. 32·c + 31 of `row` (a row of `k` weights from `row` on) into w; for the float
// formats only the first `kv` (≤ 32) are read, the rest set to 0.
template <int FMT>
__device__ __forceinline__ void deq32(const u8* row, int c, int kv, int k, float* w) {
    if (FMT == F_F32) {
        const float* p = (const float*)row + 32 * c;
        if (kv == 32 && (k & 3) == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 v = __ldg((const float4*)p + i);
                w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) w[i] = i < kv ? __ldg(p + i) : 0.f;
        }
    } else if (FMT == F_F16 || FMT == F_BF16) {
        const u16* p = (const u16*)row + 32 * c;
        if (kv == 32 && (k & 7) == 0) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint4 v = __ldg((const uint4*)p + i);
                u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    u16 lo = (u16)(a[j] & 0xffff), hi = (u16)(a[j] >> 16);
                    w[8 * i + 2 * j] = FMT == F_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
                    w[8 * i + 2 * j + 1] = FMT == F_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) {
                u16 h = i < kv ? __ldg(p + i) : (u16)0;
                w[i] = FMT == F_F16 ? f16_to_f32(h) : bf16_to_f32(h);
            }
        }
    } else if ((FMT == F_Q4_0 || FMT == F_Q5_0) && (k & 255) == 0) {
        // Rows of whole 8-block units as laid out on the device (layout.rs): chunk c's halves
        // are lane slots 2n and 2n + 1 of its unit, its nibble the low (even c) or high one.
        const u8* u = row + (size_t)(c >> 3) * (FMT == F_Q4_0 ? 144 : 176);
        const int cc = c & 7, n = cc >> 1, odd = cc & 1;
        const float d = f16_to_f32(ld16(u + 2 * cc));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int s = 2 * n + h;
            // Plain loads: `row` may be a staged copy in shared memory.
            const uint4 q4 = ((const uint4*)(u + 16))[s];
            const u32 q[4] = {q4.x, q4.y, q4.z, q4.w};
            const u32 fw = FMT == F_Q5_0 ? ((const u32*)(u + 144))[s] : 0u;
#pragma unroll
            for (int m = 0; m < 16; m++) {
                int v = (q[m >> 2] >> (8 * (m & 3) + 4 * odd)) & 15;
                if (FMT == F_Q5_0) v |= ((fw >> (8 * (m & 3) + 4 * odd + (m >> 2))) & 1) << 4;
                w[16 * h + m] = (float)(v - (FMT == F_Q4_0 ? 8 : 16)) * d;
            }
        }
    } else if (FMT == F_Q4_0 || FMT == F_Q4_1) {
        const int bs = FMT == F_Q4_0 ? 18 : 20;
        const u8* b = row + (size_t)c * bs;
        float d = f16_to_f32(ld16(b));
        float m = FMT == F_Q4_1 ? f16_to_f32(ld16(b + 2)) : 0.f;
        u8 q[16];
        ld_bytes<8>(b + (FMT == F_Q4_0 ? 2 : 4), q);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (FMT == F_Q4_0) {
                w[j] = (float)((int)(q[j] & 15) - 8) * d;
                w[j + 16] = (float)((int)(q[j] >> 4) - 8) * d;
            } else {
                w[j] = (float)(q[j] & 15) * d + m;
                w[j + 16] = (float)(q[j] >> 4) * d + m;
            }
        }
    } else if (FMT == F_Q5_0 || FMT == F_Q5_1) {
        const int bs = FMT == F_Q5_0 ? 22 : 24;
        const int hoff = FMT == F_Q5_0 ? 2 : 4;
        const u8* b = row + (size_t)c * bs;
        float d = f16_to_f32(ld16(b));
        float m = FMT == F_Q5_1 ? f16_to_f32(ld16(b + 2)) : 0.f;
        u32 qh = (u32)ld16(b + hoff) | ((u32)ld16(b + hoff + 2) << 16);
        u8 q[16];
        ld_bytes<8>(b + hoff + 4, q);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int q0 = (q[j] & 15) | (((qh >> j) & 1) << 4);
            int q1 = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (FMT == F_Q5_0) {
                w[j] = (float)(q0 - 16) * d;
                w[j + 16] = (float)(q1 - 16) * d;
            } else {
                w[j] = (float)q0 * d + m;
                w[j + 16] = (float)q1 * d + m;
            }
        }
    } else if (FMT == F_Q8_0) {
        const u8* qs;
        float d = f16_to_f32(ld16(q8_0_block(row, c, k, &qs)));
        u8 q[32];
        ld_bytes<16>(qs, q);
#pragma unroll
        for (int j = 0; j < 32; j++) w[j] = (float)(signed char)q[j] * d;
    } else if (FMT == F_Q2_K) {
        const u8* b = row + (size_t)(c >> 3) * 84;
        int cc = c & 7, n = cc >> 2, kk = cc & 3;
        float d = f16_to_f32(ld16(b + 80)), dmin = f16_to_f32(ld16(b + 82));
        u16 scp = ld16(b + 2 * cc);
        int s0 = scp & 0xff, s1 = scp >> 8;
        u8 q[32];
        ld_bytes<16>(b + 16 + 32 * n, q);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int sc = l < 16 ? s0 : s1;
            w[l] = d * (float)(sc & 15) * (float)((q[l] >> (2 * kk)) & 3) - dmin * (float)(sc >> 4);
        }
    } else if (FMT == F_Q3_K) {
        const u8* b = row + (size_t)(c >> 3) * 110;
        int cc = c & 7, n = cc >> 2, kk = cc & 3;
        float d = f16_to_f32(ld16(b + 108));
        u8 sb[12];
        ld_bytes<6>(b + 96, sb);
        int sc[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int j = 2 * cc + h;
            int low = j < 8 ? (sb[j] & 15) : (sb[j - 8] >> 4);
            int high = (sb[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
            sc[h] = (low | (high << 4)) - 32;
        }
        u8 q[32], hm[32];
        ld_bytes<16>(b + 32 + 32 * n, q);
        ld_bytes<16>(b, hm);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> (2 * kk)) & 3;
            if (!(hm[l] & (1 << cc))) v -= 4;
            w[l] = d * (float)sc[l >> 4] * (float)v;
        }
    } else if (FMT == F_Q4_K || FMT == F_Q5_K) {
        // Q5_K as laid out on the device (layout.rs): Q4_K's header and quants, then a word of
        // fifth bits for each lane slot (chunk c's halves: slots 2n and 2n + 1).
        const int bs = FMT == F_Q4_K ? 144 : 176;
        const u8* b = row + (size_t)(c >> 3) * bs;
        int j = c & 7;
        float d = f16_to_f32(ld16(b)), dmin = f16_to_f32(ld16(b + 2));
        u8 sb[12];
        ld_bytes<6>(b + 4, sb);
        int s, m;
        k_scale_min(sb, j, &s, &m);
        float d1 = d * (float)s, m1 = dmin * (float)m;
        u8 q[32];
        ld_bytes<16>(b + 16 + 32 * (j >> 1), q);
        u32 fw[2] = {0, 0};
        if (FMT == F_Q5_K) {
            // Plain loads: `row` may be a staged copy in shared memory.
            const u32* f = (const u32*)(b + 144) + 2 * (j >> 1);
            fw[0] = f[0] >> (4 * (j & 1));
            fw[1] = f[1] >> (4 * (j & 1));
        }
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> (4 * (j & 1))) & 15;
            const int m = l & 15;
            if (FMT == F_Q5_K) v |= ((fw[l >> 4] >> (8 * (m & 3) + (m >> 2))) & 1) << 4;
            w[l] = d1 * (float)v - m1;
        }
    } else if (FMT == F_Q6_K) {
        // As laid out on the device (layout.rs): chunk c's halves are lane slots 2n and
        // 2n + 1 of its 224-byte super-block, its nibble the low (even c) or high one.
        const u8* b = row + (size_t)(c >> 3) * 224;
        int cc = c & 7, n = cc >> 1, odd = cc & 1;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int s = 2 * n + h;
            // Plain loads: `row` may be a staged copy in shared memory.
            u32 hd = ((const u32*)(b + 192))[s];
            u32 hw = ((const u32*)(b + 128 + 8 * s))[odd];
            uint4 q4 = ((const uint4*)b)[s];
            u32 q[4] = {q4.x, q4.y, q4.z, q4.w};
            float dd = f16_to_f32((u16)(hd >> 16)) * (float)(signed char)((hd >> (8 * odd)) & 0xff);
#pragma unroll
            for (int m = 0; m < 16; m++) {
                int lo = (q[m >> 2] >> (8 * (m & 3) + 4 * odd)) & 15;
                int hi = (hw >> (8 * (m & 3) + 2 * (m >> 2))) & 3;
                w[16 * h + m] = dd * (float)((lo | (hi << 4)) - 32);
            }
        }
    }
}

// Σ_i w[i]·x[i] over one chunk of 32 (x already offset to the chunk; kv valid values).
__device__ __forceinline__ float dot32(const float* w, const float* x, int kv, int k) {
    float s = 0.f;
    if (kv == 32 && (k & 3) == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = __ldg((const float4*)x + i);
            s = fmaf(w[4 * i], v.x, s);
            s = fmaf(w[4 * i + 1], v.y, s);
            s = fmaf(w[4 * i + 2], v.z, s);
            s = fmaf(w[4 * i + 3], v.w, s);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (i < kv) s = fmaf(w[i], __ldg(x + i), s);
    }
    return s;
}

// The 8 weights of one 16-byte group of a 16-bit plain row (F16 / BF16) as floats.
template <int FMT>
__device__ __forceinline__ void unpack_group16(uint4 v, float* w) {
    u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u16 lo = (u16)(q[j] & 0xffff), hi = (u16)(q[j] >> 16);
        w[2 * j] = FMT == F_F16 ? f16_to_f32(lo) : bf16_to_f32(lo);
        w[2 * j + 1] = FMT == F_F16 ? f16_to_f32(hi) : bf16_to_f32(hi);
    }
}

// s + Σ_j w[j] · (a, b)[j], in order of j.
__device__ __forceinline__ float fma8(const float* w, float4 a, float4 b, float s) {
    s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s);
    s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
    s = fmaf(w[4], b.x, s); s = fmaf(w[5], b.y, s);
    s = fmaf(w[6], b.z, s); s = fmaf(w[7], b.w, s);
    return s;
}

// The 8 weights of group g (weights 8g .. 8g + 7) of a plain-float row as floats.
template <int FMT>
__device__ __forceinline__ void load_group(const u8* row, int g, float* w) {
    if (FMT == F_F32) {
        float4 a = __ldg((const float4*)row + 2 * g);
        float4 b = __ldg((const float4*)row + 2 * g + 1);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    } else {
        unpack_group16<FMT>(__ldg((const uint4*)row + g), w);
    }
}

// Plain-float rows (F32 / F16 / BF16) whose width is a multiple of 8, in groups of 8 weights:
// lane l of warp `part` (of `split` sharing the row) takes groups l + 32·(part + split·i), so
// each warp load instruction reads one contiguous span (512 bytes of 16-bit weights) and the
// matching activations two float4 per token. Returns this warp's partial sums. (Loading four
// groups per lane before using any was tried: 10–20 % slower on the H200's large matrices;
// streaming 16-bit rows through a per-lane shared-memory ring filled by `cp.async`, 13–22 %
// slower per step: docs/perf.md, sessions 15–16.)
// WHOLE: one warp per row (split 1, a constant stride the compiler pipelines; a runtime
// stride made the largest matrices 10–30 % slower).
template <int FMT, int NT, bool WHOLE>
__device__ __forceinline__ void float_row_part(const u8* row, const float* x, int k, int nt,
                                               int part, int split, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    int groups = k >> 3;
    int stride = WHOLE ? WARP : WARP * split;
    for (int g = (WHOLE ? 0 : part * WARP) + lane; g < groups; g += stride) {
        float w[8];
        load_group<FMT>(row, g, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float4* xp = (const float4*)(x + (u64)t * k) + 2 * g;
                acc[t] = fma8(w, __ldg(xp), __ldg(xp + 1), acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

// Adds group g's products to both rows' sums: a[t] += wa · x_t, b[t] += wb · x_t (t < nt),
// the group's activations loaded once for the two.
template <int NT>
__device__ __forceinline__ void pair_group_fma(const float* wa, const float* wb, const float* x,
                                               int k, int nt, int g, float* a, float* b) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            const float4* xp = (const float4*)(x + (u64)t * k) + 2 * g;
            float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
            a[t] = fma8(wa, x0, x1, a[t]);
            b[t] = fma8(wb, x0, x1, b[t]);
        }
    }
}

// Groups of each row float_row_pair loads before using any.
#ifndef GEMV_PAIR_UNROLL
#define GEMV_PAIR_UNROLL 2
#endif
#if GEMV_PAIR_UNROLL < 1
#error "GEMV_PAIR_UNROLL must be at least 1"
#endif

// float_row_part (one warp a row) of two plain-float rows of the same width, a gated
// feed-forward's gate and up rows, walked together: each step loads a group of both rows
// (twice the bytes in flight) and the activations once for the two. Each row's sums are the
// ones float_row_part gives it.
template <int FMT, int NT>
__device__ __forceinline__ void float_row_pair(const u8* row_a, const u8* row_b, const float* x,
                                               int k, int nt, float* a, float* b) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; t++) a[t] = b[t] = 0.f;
    int groups = k >> 3;
    int g = lane;
    // GEMV_PAIR_UNROLL groups of both rows loaded before any is used, then the rest one
    // group at a time; the sums are added in the same order either way. The compiler's own
    // loop kept one group a row in flight (its SASS); two made E4B bf16 tg32 +1.5 % and E2B
    // +1.9 %, four no more (H200, docs/perf.md, session 27).
    for (; g + (GEMV_PAIR_UNROLL - 1) * WARP < groups; g += GEMV_PAIR_UNROLL * WARP) {
        float wa[GEMV_PAIR_UNROLL][8], wb[GEMV_PAIR_UNROLL][8];
#pragma unroll
        for (int u = 0; u < GEMV_PAIR_UNROLL; u++) {
            load_group<FMT>(row_a, g + u * WARP, wa[u]);
            load_group<FMT>(row_b, g + u * WARP, wb[u]);
        }
#pragma unroll
        for (int u = 0; u < GEMV_PAIR_UNROLL; u++)
            pair_group_fma<NT>(wa[u], wb[u], x, k, nt, g + u * WARP, a, b);
    }
    for (; g < groups; g += WARP) {
        float wa[8], wb[8];
        load_group<FMT>(row_a, g, wa);
        load_group<FMT>(row_b, g, wb);
        pair_group_fma<NT>(wa, wb, x, k, nt, g, a, b);
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        a[t] = warp_sum(a[t]);
        b[t] = warp_sum(b[t]);
    }
}

// Dot products of one plain-float row (k a multiple of 8) with NT activation rows: one warp.
template <int FMT, int NT>
__device__ __forceinline__ void float_row_dot(const u8* row, const float* x, int k, int nt,
                                              float* acc) {
    float_row_part<FMT, NT, true>(row, x, k, nt, 0, 1, acc);
}

// Bytes of one block (as on the device: Q6_K's 224, layout.rs) and 32-weight chunks per block
// of a quantized format.
__host__ __device__ constexpr int fmt_block_bytes(int f) {
    return f == F_Q4_0 ? 18 : f == F_Q4_1 ? 20 : f == F_Q5_0 ? 22 : f == F_Q5_1 ? 24
         : f == F_Q8_0 ? 34 : f == F_Q2_K ? 84 : f == F_Q3_K ? 110 : f == F_Q4_K ? 144
         : f == F_Q5_K ? 176 : f == F_Q6_K ? 224 : 0;
}
__host__ __device__ constexpr int fmt_chunks_per_block(int f) { return f >= F_Q2_K && f <= F_Q6_K ? 8 : 1; }

// Shared-memory staging for quantized rows. The 8 warps of a block (256 threads, one weight
// row each) walk the row in tiles of 32 chunks (1024 weights) together: each warp copies its
// row's quantized bytes of the tile (one contiguous span, ≤ 1088 bytes for Q8_0) with
// coalesced loads, and the block copies the tile's activations once per token for all 8 rows
// (32 chunks × 36 floats, padded so float4 reads at a 144-byte lane stride do not conflict).
// Every warp of the block must call it (inactive ones with active = false): it synchronises
// the block.
#define STAGE_W_BYTES 1152
#define STAGE_X_STRIDE 36
#define STAGE_WARPS 8

// Copies token t's activations of chunks c0 .. c0 + nch into the block's tile.
__device__ __forceinline__ void stage_x(const float* x, int k, int t, int c0, int nch,
                                        float* xs) {
    const float4* xg = (const float4*)(x + (u64)t * k + 32 * c0);
    __syncthreads();
    for (int j = threadIdx.x; j < 256; j += blockDim.x)
        if ((j >> 3) < nch) *(float4*)(xs + (j >> 3) * STAGE_X_STRIDE + 4 * (j & 7)) = __ldg(xg + j);
    __syncthreads();
}

// The block's shared memory for staging NT token rows (defined below, after q4k_i16_tile).
template <int NT>
__device__ __forceinline__ uint4* block_stage();

template <int FMT, int NT>
__device__ __forceinline__ void staged_row_dot(bool active, const u8* row, const float* x, int k,
                                               int nt, float* acc) {
    u8(*wst)[STAGE_W_BYTES] = (u8(*)[STAGE_W_BYTES])block_stage<NT>();
    float* xst = (float*)(wst + STAGE_WARPS);
    const int TS = fmt_block_bytes(FMT), CPB = fmt_chunks_per_block(FMT);
    int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & (STAGE_WARPS - 1);
    u8* ws = wst[warp];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    int chunks = k >> 5;
    for (int c0 = 0; c0 < chunks; c0 += 32) {
        int nch = min(32, chunks - c0);
        float w[32];
        if (active) {
            const u8* src = row + (u64)(c0 / CPB) * TS;
            int nbytes = nch / CPB * TS;
            __syncwarp();
            if ((((u64)src) & 3) == 0 && (nbytes & 3) == 0) {
                for (int i = lane; i < (nbytes >> 2); i += WARP)
                    ((u32*)ws)[i] = __ldg((const u32*)src + i);
            } else {
                for (int i = lane; i < (nbytes >> 1); i += WARP)
                    ((u16*)ws)[i] = __ldg((const u16*)src + i);
            }
            __syncwarp();
            if (lane < nch) deq32<FMT>(ws, lane, 32, k - 32 * c0, w);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                stage_x(x, k, t, c0, nch, xst);
                if (active && lane < nch) {
                    const float4* xl = (const float4*)(xst + lane * STAGE_X_STRIDE);
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 v = xl[i];
                        s = fmaf(w[4 * i], v.x, s);
                        s = fmaf(w[4 * i + 1], v.y, s);
                        s = fmaf(w[4 * i + 2], v.z, s);
                        s = fmaf(w[4 * i + 3], v.w, s);
                    }
                    acc[t] += s;
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
}

// The 6-bit (scale, min) pair of sub-block j of a Q4_K super-block whose 16-byte header is
// `h` (d and dmin in h.x, the 12 scale bytes in h.y .. h.w), with shifts only (a runtime index
// into a byte array would go through local memory).
__device__ __forceinline__ void q4k_scale_min(uint4 h, int j, float* s, float* m) {
    int sh = 8 * (j & 3);
    u32 a = (h.y >> sh) & 0xff, b = (h.z >> sh) & 0xff, c = (h.w >> sh) & 0xff;
    bool low = j < 4;
    *s = (float)(low ? a & 63 : (c & 15) | ((a >> 6) << 4));
    *m = (float)(low ? b & 63 : (c >> 4) | ((b >> 6) << 4));
}

// Q4_K rows on 16-bit activations (the CPU path's scheme, act.rs), for NT = 1, 2, 4 or 8 token
// rows of which the first nt are present. The block stages the activations a tile of up to
// q4k_i16_tile(NT) super-blocks at a time, each token's 32 values as 16-bit integers q with a
// scale d = max|x| / 32767 (x ≈ d·q) and the sums d·Σq of each 16-value half; a lane's 4-bit
// weights times 16-bit values are then exact integer dot products, two a `dp2a` instruction,
// scaled once per 32-weight sub-block. A lane loads and unpacks its weights once for all the
// tokens, so a launch reads each weight once.
//
// A tile takes 640 bytes of shared memory per super-block and token (512 of values, 128 of
// scales and sums). One token stages 48 super-blocks (30 KB); NT tokens 48 / NT rounded up to a
// multiple of 8 (a warp's two passes of 4 super-blocks, so no lane idles in a full tile): 24,
// 16 and 8 super-blocks, 30, 40 and 40 KB, within the 48 KB of static shared memory a block may
// hold. `q4k_tile` in products.rs mirrors it.
__host__ __device__ constexpr int q4k_i16_tile(int nt) { return (48 / nt + 7) / 8 * 8; }

// Bytes of shared memory a block stages NT token rows in: i16_rows' tile (640 bytes a unit and
// token row), or staged_row_dot's weights and activations, whichever is more.
__host__ __device__ constexpr int block_stage_bytes(int nt) {
    return 640 * nt * q4k_i16_tile(nt) > STAGE_WARPS * STAGE_W_BYTES + 128 * STAGE_X_STRIDE
               ? 640 * nt * q4k_i16_tile(nt)
               : STAGE_WARPS * STAGE_W_BYTES + 128 * STAGE_X_STRIDE;
}

// One array for every staging path of NT token rows (i16_rows of any format and row count,
// staged_row_dot): a kernel that holds several of them, of which a launch takes one (Q8_0 rows
// of whole 256-value groups or not), holds the array once.
template <int NT>
__device__ __forceinline__ uint4* block_stage() {
    __shared__ uint4 stage[block_stage_bytes(NT) / 16];
    return stage;
}

// c + a.lo16 · b.byte0 + a.hi16 · b.byte1, a's halves signed, b's bytes unsigned (4-bit
// weights, or weights times 16): `dp2a.lo`.
__device__ __forceinline__ int dp2a_lo(u32 a, u32 b, int c) {
#ifdef MB_EMU
    return emu_dp2a(a, b, c, false, false);
#else
    int d;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// c + a.lo16 · b.byte2 + a.hi16 · b.byte3, a's halves signed, b's bytes unsigned: `dp2a.hi`.
__device__ __forceinline__ int dp2a_hi(u32 a, u32 b, int c) {
#ifdef MB_EMU
    return emu_dp2a(a, b, c, true, false);
#else
    int d;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// Stages super-blocks s0 .. s0 + ntb of the activation rows t < nt (row t at x + t·k) as
// 16-bit values for i16_rows, four threads a 32-value chunk of every row. Row t's tile
// starts at xq + 32·TILE·t and xm + 16·TILE·t (TILE = q4k_i16_tile(NT)); in it super-block b's
// 256 values take 32 slots of 16 bytes ordered as their readers load them (q4k_slot), and
// xm[2·c + half] = (d, d·Σq) of chunk c's half (quantize_group8): the layout of a producer's
// Q4_K tiles (common.cuh). Synchronises the block.
template <int NT>
__device__ __forceinline__ void stage_x_i16(const float* x, int k, int nt, int s0, int ntb,
                                            uint4* xq, float2* xm) {
    const int TILE = q4k_i16_tile(NT);
    __syncthreads();
    for (int j = threadIdx.x; j < 32 * ntb; j += blockDim.x) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) continue;
            const float4* xg = (const float4*)(x + (u64)t * k + 256 * (u64)s0);
            float4 a = __ldg(xg + 2 * j), b = __ldg(xg + 2 * j + 1);
            float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float d, dq;
            xq[32 * (TILE * t + (j >> 5)) + q4k_slot(j)] = quantize_group8(v, &d, &dq);
            if ((j & 1) == 0) xm[16 * TILE * t + (j >> 1)] = make_float2(d, dq);
        }
    }
    __syncthreads();
}

// c + a.lo16 · b.byte0 + a.hi16 · b.byte1 with b's bytes signed (Q8_0 quants): `dp2a.lo`.
__device__ __forceinline__ int dp2a_lo_s8(u32 a, u32 b, int c) {
#ifdef MB_EMU
    return emu_dp2a(a, b, c, false, true);
#else
    int d;
    asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// c + a.lo16 · b.byte2 + a.hi16 · b.byte3 with b's bytes signed: `dp2a.hi`.
__device__ __forceinline__ int dp2a_hi_s8(u32 a, u32 b, int c) {
#ifdef MB_EMU
    return emu_dp2a(a, b, c, true, true);
#else
    int d;
    asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// Formats whose rows of a multiple of 256 values run on 16-bit activations (i16_rows): Q4_K,
// Q6_K, Q4_0 and Q5_0 as laid out on the device, and Q8_0 as regrouped there (q8_0_block).
__host__ __device__ constexpr bool fmt_i16(int f) {
    return f == F_Q4_K || f == F_Q5_K || f == F_Q6_K || f == F_Q8_0 || f == F_Q4_0 ||
           f == F_Q5_0;
}

// Whether rows of format f, k values wide, run on 16-bit activations: Q4_K and Q6_K rows
// (always whole super-blocks), Q8_0, Q4_0 and Q5_0 rows of whole 256-value units.
__device__ __forceinline__ bool i16_takes(int f, int k) {
    return f == F_Q4_K || f == F_Q5_K || f == F_Q6_K ||
           ((f == F_Q8_0 || f == F_Q4_0 || f == F_Q5_0) && (k & 255) == 0);
}

// Bytes of a 256-value unit of an fmt_i16 row: a Q4_K super-block, a Q6_K one as on the
// device, a Q8_0 group, 8 Q4_0 or Q5_0 blocks.
__host__ __device__ constexpr int i16_unit_bytes(int f) {
    return f == F_Q4_K ? 144 : f == F_Q5_K ? 176 : f == F_Q6_K ? 224 : f == F_Q4_0 ? 144
         : f == F_Q5_0 ? 176 : 272;
}

// Whether an fmt_i16 format's weights enter `dp2a` as unsigned bytes, their offset (Q4_K's
// min, the others' −32, −8 or −16) through the activations' half sums: all but Q8_0.
__host__ __device__ constexpr bool i16_unsigned(int f) { return f != F_Q8_0; }

// Lane `sub`'s (of a unit's 8) share of one unit of one row: values 16·(sub & 1) .. + 15 of
// the unit's chunks 2·(sub >> 1) and the one after it (32-value chunks), and their scales.
// Q4_K: the 16 quant bytes holding both chunks' values (low and high nibbles) and the
// super-block's 16-byte header. Q5_K (layout.rs): the same, and the slot's word of fifth bits.
// Q6_K (layout.rs): the slot's 16 bytes of low 4 bits, its two words of high 2 bits and its
// word of two scales and d. Q4_0, Q5_0 (layout.rs): the slot's
// 16 bytes of nibbles, (Q5_0) its word of fifth bits, and the word of the two blocks' f16
// scales. Q8_0: each chunk's 16 quants and the word of their two f16 scales.
// The 5-bit bytes of quant word q, four a word: its low nibbles (lo: chunk or block 2n) and
// high nibbles (hi: 2n + 1) with their fifth bits from a lane slot's word f as laid out on the
// device (layout.rs, Q5_0 and Q5_K: word i's at bits i, 8 + i, 16 + i, 24 + i, the high
// chunk's 4 above them), so a shift and a mask line them up.
__device__ __forceinline__ void laid_five_bit_bytes(u32 q, u32 f, int i, u32& lo, u32& hi) {
    lo = (q & 0x0F0F0F0Fu) | (((f >> i) & 0x01010101u) << 4);
    hi = ((q >> 4) & 0x0F0F0F0Fu) | (((f >> (4 + i)) & 0x01010101u) << 4);
}

template <int FMT>
struct I16Slice;
template <>
struct I16Slice<F_Q4_K> {
    uint4 q, h;
};
template <>
struct I16Slice<F_Q5_K> {
    uint4 q, h;
    u32 f;
};
template <>
struct I16Slice<F_Q6_K> {
    uint4 q;
    uint2 h;
    u32 hd;
};
template <>
struct I16Slice<F_Q4_0> {
    uint4 q;
    u32 d;
};
template <>
struct I16Slice<F_Q5_0> {
    uint4 q;
    u32 h, d;
};
template <>
struct I16Slice<F_Q8_0> {
    uint4 lo, hi;
    u32 d;
};

// A Q6_K slice's 32 weights as unsigned 6-bit bytes, four a word: lo (chunk 2n) and hi
// (chunk 2n + 1) in the order of its 16 low-bit bytes, and the two chunks' d · scale.
__device__ __forceinline__ void q6k_unpack(const I16Slice<F_Q6_K>& s, u32* lo, u32* hi,
                                           float* d0, float* d1) {
    const u32 w[4] = {s.q.x, s.q.y, s.q.z, s.q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo[i] = (w[i] & 0x0F0F0F0Fu) | (((s.h.x >> (2 * i)) & 0x03030303u) << 4);
        hi[i] = ((w[i] >> 4) & 0x0F0F0F0Fu) | (((s.h.y >> (2 * i)) & 0x03030303u) << 4);
    }
    float d = f16_to_f32((u16)(s.hd >> 16));
    *d0 = d * (float)(signed char)(s.hd & 0xff);
    *d1 = d * (float)(signed char)((s.hd >> 8) & 0xff);
}

// A Q4_0 / Q5_0 slice's 32 weights as unsigned 4- or 5-bit bytes, four a word: lo (block 2n)
// and hi (block 2n + 1) in the order of its 16 bytes; and the blocks' scales.
template <int FMT>
__device__ __forceinline__ void legacy_unpack(const I16Slice<FMT>& s, u32* lo, u32* hi,
                                              float* d0, float* d1) {
    const u32 w[4] = {s.q.x, s.q.y, s.q.z, s.q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (FMT == F_Q5_0) {
            laid_five_bit_bytes(w[i], s.h, i, lo[i], hi[i]);
        } else {
            lo[i] = w[i] & 0x0F0F0F0Fu;
            hi[i] = (w[i] >> 4) & 0x0F0F0F0Fu;
        }
    }
    *d0 = f16_to_f32((u16)(s.d & 0xffff));
    *d1 = f16_to_f32((u16)(s.d >> 16));
}

// Loads lane `sub`'s slice of unit b of `row`.
template <int FMT>
__device__ __forceinline__ void i16_load(const u8* row, int b, int sub, I16Slice<FMT>& s) {
    const u8* unit = row + (u64)b * i16_unit_bytes(FMT);
    if constexpr (FMT == F_Q4_K) {
        s.q = __ldg((const uint4*)(unit + 16) + sub);
        s.h = __ldg((const uint4*)unit);
    } else if constexpr (FMT == F_Q5_K) {
        s.q = __ldg((const uint4*)(unit + 16) + sub);
        s.h = __ldg((const uint4*)unit);
        s.f = __ldg((const u32*)(unit + 144) + sub);
    } else if constexpr (FMT == F_Q6_K) {
        s.q = __ldg((const uint4*)unit + sub);
        s.h = __ldg((const uint2*)(unit + 128) + sub);
        s.hd = __ldg((const u32*)(unit + 192) + sub);
    } else if constexpr (FMT == F_Q4_0 || FMT == F_Q5_0) {
        s.q = __ldg((const uint4*)(unit + 16) + sub);
        s.d = __ldg((const u32*)unit + (sub >> 1));
        if constexpr (FMT == F_Q5_0) s.h = __ldg((const u32*)(unit + 144) + sub);
    } else {
        const int n = sub >> 1, half = sub & 1;
        s.lo = __ldg((const uint4*)(unit + 16 + 64 * n + 16 * half));
        s.hi = __ldg((const uint4*)(unit + 48 + 64 * n + 16 * half));
        s.d = __ldg((const u32*)unit + n);
    }
}

// Adds to acc[r][t] (t < nt) the products of R rows' unit b of the staged tile (lane `sub`'s
// slices s[r], i16_load) with token t's staged activations; the weights are unpacked once for
// all the tokens. TILES: xq and xm are a producer's tiles of one token row in global memory
// (NT = 1).
template <int FMT, int NT, int R, bool TILES = false>
__device__ __forceinline__ void i16_block(const I16Slice<FMT>* s, const uint4* xq,
                                          const float2* xm, int b, int sub, int nt,
                                          float (*acc)[NT]) {
    const int TILE = q4k_i16_tile(NT);
    int n = sub >> 1, half = sub & 1;
    // Per row: the weights of chunk 2n and of chunk 2n + 1 as bytes (Q4_K: the low and high
    // nibbles), and each chunk's scale (and Q4_K's min term).
    u32 lo[R][4], hi[R][4];
    float d0[R], c0[R], d1[R], c1[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        if constexpr (FMT == F_Q4_K || FMT == F_Q5_K) {
            u32 w[4] = {s[r].q.x, s[r].q.y, s[r].q.z, s[r].q.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if constexpr (FMT == F_Q5_K) {
                    laid_five_bit_bytes(w[i], s[r].f, i, lo[r][i], hi[r][i]);
                } else {
                    lo[r][i] = w[i] & 0x0F0F0F0Fu;
                    hi[r][i] = (w[i] >> 4) & 0x0F0F0F0Fu;
                }
            }
            float d = f16_to_f32((u16)(s[r].h.x & 0xffff)),
                  dmin = f16_to_f32((u16)(s[r].h.x >> 16));
            float sc, mn;
            q4k_scale_min(s[r].h, 2 * n, &sc, &mn);
            d0[r] = d * sc;
            c0[r] = dmin * mn;
            q4k_scale_min(s[r].h, 2 * n + 1, &sc, &mn);
            d1[r] = d * sc;
            c1[r] = dmin * mn;
        } else if constexpr (FMT == F_Q6_K) {
            q6k_unpack(s[r], lo[r], hi[r], &d0[r], &d1[r]);
            // w = d·scale·(q − 32): the −32 through the activations' sums, as Q4_K's min.
            c0[r] = 32.f * d0[r];
            c1[r] = 32.f * d1[r];
        } else if constexpr (FMT == F_Q4_0 || FMT == F_Q5_0) {
            legacy_unpack<FMT>(s[r], lo[r], hi[r], &d0[r], &d1[r]);
            // w = d·(q − 8) (Q4_0) or d·(q − 16) (Q5_0).
            const float off = FMT == F_Q4_0 ? 8.f : 16.f;
            c0[r] = off * d0[r];
            c1[r] = off * d1[r];
        } else {
            u32 a[4] = {s[r].lo.x, s[r].lo.y, s[r].lo.z, s[r].lo.w};
            u32 b4[4] = {s[r].hi.x, s[r].hi.y, s[r].hi.z, s[r].hi.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                lo[r][i] = a[i];
                hi[r][i] = b4[i];
            }
            d0[r] = f16_to_f32((u16)(s[r].d & 0xffff));
            d1[r] = f16_to_f32((u16)(s[r].d >> 16));
            c0[r] = c1[r] = 0.f;
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= nt) continue;
        const uint4* xl = xq + 32 * (TILE * t + b) + sub;
        const float2* ml = xm + 16 * (TILE * t + b) + 4 * n + half;
        uint4 x0, x1, x2, x3;
        float2 m0, m1;
        if (TILES) {
            x0 = __ldg(xl), x1 = __ldg(xl + 8), x2 = __ldg(xl + 16), x3 = __ldg(xl + 24);
            m0 = __ldg(ml), m1 = __ldg(ml + 2);
        } else {
            x0 = xl[0], x1 = xl[8], x2 = xl[16], x3 = xl[24];
            m0 = ml[0], m1 = ml[2];
        }
        u32 xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        u32 xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
#pragma unroll
        for (int r = 0; r < R; r++) {
            int sl = 0, sh = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if constexpr (i16_unsigned(FMT)) {
                    sl = dp2a_hi(xa[2 * i + 1], lo[r][i], dp2a_lo(xa[2 * i], lo[r][i], sl));
                    sh = dp2a_hi(xb[2 * i + 1], hi[r][i], dp2a_lo(xb[2 * i], hi[r][i], sh));
                } else {
                    sl = dp2a_hi_s8(xa[2 * i + 1], lo[r][i], dp2a_lo_s8(xa[2 * i], lo[r][i], sl));
                    sh = dp2a_hi_s8(xb[2 * i + 1], hi[r][i], dp2a_lo_s8(xb[2 * i], hi[r][i], sh));
                }
            }
            if constexpr (i16_unsigned(FMT)) {
                acc[r][t] += d0[r] * m0.x * (float)sl - c0[r] * m0.y;
                acc[r][t] += d1[r] * m1.x * (float)sh - c1[r] * m1.y;
            } else {
                acc[r][t] += d0[r] * m0.x * (float)sl;
                acc[r][t] += d1[r] * m1.x * (float)sh;
            }
        }
    }
}

// Loads lane `sub`'s slices of units b0 and b1 (when below `end`) of R rows into s[0..1][r].
template <int FMT, int R>
__device__ __forceinline__ void i16_load_pair(const u8* const* rows, int end, int b0, int b1,
                                              int sub, I16Slice<FMT> (*s)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        i16_load<FMT>(rows[r], b0, sub, s[0][r]);
        if (b1 < end) i16_load<FMT>(rows[r], b1, sub, s[1][r]);
    }
}

// Lane `sub`'s slices of a pair of passes of R rows (i16_load_pair), loaded ahead of their use.
template <int FMT, int R>
struct I16Pair {
    I16Slice<FMT> s[2][R];
};

// i16_rows for one token row whose activations a producer already wrote as Q4_K tiles (`xt`,
// common.cuh, store_q4k_tiles): the lane's passes from unit `first` on, `pass` apart, each
// next pair loaded before the one it holds is used, the first before the wait. The lanes read
// the tiles from L1 / L2 where they use them: no staging, no barrier.
template <int FMT, int R, bool WAITS>
__device__ __forceinline__ void i16_rows_tiles(bool active, const u8* const* rows,
                                               const uint4* xt, int k, int part, int split,
                                               float (*acc)[1]) {
    int lane = threadIdx.x & 31, sub = lane & 7;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.f;
    int nb = k >> 8, first = 4 * part + (lane >> 3), pass = 4 * split;
    I16Pair<FMT, R> p;
    if (active && first < nb) i16_load_pair<FMT, R>(rows, nb, first, first + pass, sub, p.s);
    if (WAITS) wait_prior_grid();
    const float2* xm = (const float2*)(xt + 32 * nb);
    if (active) {
        for (int b0 = first; b0 < nb; b0 += 2 * pass) {
            I16Pair<FMT, R> c = p;
            int ahead = b0 + 2 * pass;
            if (ahead < nb) i16_load_pair<FMT, R>(rows, nb, ahead, ahead + pass, sub, p.s);
            i16_block<FMT, 1, R, true>(c.s[0], xt, xm, b0, sub, 1, acc);
            if (b0 + pass < nb) i16_block<FMT, 1, R, true>(c.s[1], xt, xm, b0 + pass, sub, 1, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = warp_sum(acc[r][0]);
}

// Dot products of R rows of an fmt_i16 format (k weights each, a multiple of 256) with the
// activation rows x[t·k ..] (t < nt ≤ NT), on 16-bit activations (see q4k_i16_tile); R rows of
// one warp share the activation reads (R = 2: the gate and up rows of a gated feed-forward).
// `split` warps may share the rows, each taking every split-th pass of 4 units of a tile (the
// caller adds their sums; beyond q4k_i16_tile(NT) / 4 warps some would have no pass). A lane
// works through pairs of passes; for one token row it loads the weights of its next pair (in
// this tile or the next) before it uses the ones it holds, so a weight load's latency overlaps
// the work before it, and the first pair before the activations are staged. WAITS: waits for
// the kernel ahead (wait_prior_grid) first — for one token row after those first loads, which
// then overlap that kernel's end. Every warp of the block must call it (active = false where
// it has no row): it synchronises the block around each tile's staging. One token row with
// `xt` (not null: its producer's Q4_K tiles) takes i16_rows_tiles instead.
template <int FMT, int NT, int R, bool WAITS = false>
__device__ __forceinline__ void i16_rows(bool active, const u8* const* rows, const float* x,
                                         int k, int nt, int part, int split, float (*acc)[NT],
                                         const uint4* xt = nullptr) {
    if constexpr (NT == 1) {
        if (xt) {
            i16_rows_tiles<FMT, R, WAITS>(active, rows, xt, k, part, split, acc);
            return;
        }
    }
    const int TILE = q4k_i16_tile(NT);
    uint4* xq = block_stage<NT>();
    float2* xm = (float2*)(xq + NT * TILE * 32);
    int lane = threadIdx.x & 31, sub = lane & 7;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
    // Loading ahead holds two pairs' weights at once: for one token row that made E4B's
    // down product 19 % faster on the H200; for 8 (with the first loads also before the wait)
    // the batch-8 step was 12 % slower (docs/perf.md, session 16), so there a pair is loaded
    // where it is used.
    const bool AHEAD = NT == 1;
    int nb = k >> 8, first = 4 * part + (lane >> 3), pass = 4 * split;
    I16Slice<FMT> s[2][R];
    if (AHEAD && active && first < min(TILE, nb))
        i16_load_pair<FMT, R>(rows, min(TILE, nb), first, first + pass, sub, s);
    if (WAITS) wait_prior_grid();
    for (int s0 = 0; s0 < nb; s0 += TILE) {
        int ntb = min(TILE, nb - s0);
        stage_x_i16<NT>(x, k, nt, s0, ntb, xq, xm);
        if (!active) continue;
        for (int b0 = first; b0 < ntb; b0 += 2 * pass) {
            // The pair used now (cs) and, loading ahead, the next one (s after it).
            I16Slice<FMT> cs[2][R];
            if (AHEAD) {
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int r = 0; r < R; r++) cs[i][r] = s[i][r];
                // Every tile but the last has a pair for each lane (TILE ≥ pass > first), so the
                // pair loaded ahead for the next tile is that tile's first.
                int next = b0 + 2 * pass, next_s0 = s0;
                if (next >= ntb) {
                    next_s0 = s0 + TILE;
                    next = first;
                }
                next += next_s0;
                if (next < nb)
                    i16_load_pair<FMT, R>(rows, min(nb, next_s0 + TILE), next, next + pass, sub, s);
            } else {
                i16_load_pair<FMT, R>(rows, s0 + ntb, s0 + b0, s0 + b0 + pass, sub, cs);
            }
            i16_block<FMT, NT, R>(cs[0], xq, xm, b0, sub, nt, acc);
            if (b0 + pass < ntb) i16_block<FMT, NT, R>(cs[1], xq, xm, b0 + pass, sub, nt, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = warp_sum(acc[r][t]);
}

// i16_rows of one row.
template <int FMT, int NT, bool WAITS>
__device__ __forceinline__ void i16_row_dot(bool active, const u8* row, const float* x, int k,
                                            int nt, float* acc, const uint4* xt) {
    float a[1][NT];
    i16_rows<FMT, NT, 1, WAITS>(active, &row, x, k, nt, 0, 1, a, xt);
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = a[0][t];
}

// Dot products of one stored row (k weights) with NT activation rows x[t·k ..] (t < nt),
// computed by one warp of a 256-thread block; every lane returns the sums. Every warp of the
// block must call it (with active = false where it has no row): the quantized paths
// synchronise the block. Plain floats of a width that is a multiple of 8 and every quantized
// format take the coalesced paths above (Q4_K rows and Q8_0 rows of a multiple of 256 values
// i16_rows, the other quantized rows staged_row_dot); other plain rows fall back to a chunk per
// lane. WAITS: it waits for the kernel ahead (wait_prior_grid) itself, i16_rows after their
// first weight loads. `xt`: the activations' Q4_K tiles for one token row, or null.
template <int FMT, int NT, bool WAITS = false>
__device__ __forceinline__ void warp_row_dot(bool active, const u8* row, const float* x, int k,
                                             int nt, float* acc, const uint4* xt = nullptr) {
    const bool i16 = i16_takes(FMT, k);
    if (WAITS && !i16) wait_prior_grid();
    if constexpr (FMT == F_F32 || FMT == F_F16 || FMT == F_BF16) {
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = 0.f;
        if (!active) return;
        if ((k & 7) == 0) {
            float_row_dot<FMT, NT>(row, x, k, nt, acc);
            return;
        }
        int lane = threadIdx.x & 31;
        int chunks = (k + 31) >> 5;
        for (int c = lane; c < chunks; c += WARP) {
            float w[32];
            int kv = min(32, k - 32 * c);
            deq32<FMT>(row, c, kv, k, w);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < nt) acc[t] += dot32(w, x + (u64)t * k + 32 * c, kv, k);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
    } else if constexpr (fmt_i16(FMT)) {
        if (i16)
            i16_row_dot<FMT, NT, WAITS>(active, row, x, k, nt, acc, xt);
        else
            staged_row_dot<FMT, NT>(active, row, x, k, nt, acc);
    } else {
        staged_row_dot<FMT, NT>(active, row, x, k, nt, acc);
    }
}

// warp_row_dot of two rows of the same format and width (a gated feed-forward's gate and up
// rows): plain-float rows (width a multiple of 8) and i16_rows share their activation reads,
// other rows take two passes. WAITS as for warp_row_dot.
template <int FMT, int NT, bool WAITS = false>
__device__ __forceinline__ void warp_row_pair_dot(bool active, const u8* row_a, const u8* row_b,
                                                  const float* x, int k, int nt, float* a,
                                                  float* b) {
    const bool i16 = i16_takes(FMT, k);
    if (WAITS && !i16) wait_prior_grid();
    if ((FMT == F_F32 || FMT == F_F16 || FMT == F_BF16) && (k & 7) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) a[t] = b[t] = 0.f;
        if (active) float_row_pair<FMT, NT>(row_a, row_b, x, k, nt, a, b);
    } else if (i16) {
        if constexpr (fmt_i16(FMT)) {
            const u8* rows[2] = {row_a, row_b};
            float ab[2][NT];
            i16_rows<FMT, NT, 2, WAITS>(active, rows, x, k, nt, 0, 1, ab);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                a[t] = ab[0][t];
                b[t] = ab[1][t];
            }
        }
    } else {
        warp_row_dot<FMT, NT>(active, row_a, x, k, nt, a);
        warp_row_dot<FMT, NT>(active, row_b, x, k, nt, b);
    }
}

// Compilation units (sources.rs, `Unit`): a module's per-format kernels compile one format a
// unit, in parallel. sources.rs defines FORMAT_<suffix> as 1 or 0 for every format (all 1 for
// a whole module, one for a format's unit, none for the unit of a module's format-independent
// kernels) and SHARED_KERNELS as 1 or 0 (the .cu files guard their format-independent kernels
// with `#if SHARED_KERNELS`); FOR_EACH_FORMAT instantiates the formats that are 1.
#define MB_CAT_(a, b) a##b
#define MB_CAT(a, b) MB_CAT_(a, b)
#define MB_WHEN_0(x)
#define MB_WHEN_1(x) x
// MACRO(S, F) when format S is on.
#define FORMAT_IF(S, F, MACRO) MB_CAT(MB_WHEN_, FORMAT_##S)(MACRO(S, F))

// Instantiates `MACRO(name_suffix, FMT)` for every supported weight format (that is on).
#define FOR_EACH_FORMAT(MACRO)         \
    FORMAT_IF(f32, F_F32, MACRO)       \
    FORMAT_IF(f16, F_F16, MACRO)       \
    FORMAT_IF(bf16, F_BF16, MACRO)     \
    FORMAT_IF(q4_0, F_Q4_0, MACRO)     \
    FORMAT_IF(q4_1, F_Q4_1, MACRO)     \
    FORMAT_IF(q5_0, F_Q5_0, MACRO)     \
    FORMAT_IF(q5_1, F_Q5_1, MACRO)     \
    FORMAT_IF(q8_0, F_Q8_0, MACRO)     \
    FORMAT_IF(q2_k, F_Q2_K, MACRO)     \
    FORMAT_IF(q3_k, F_Q3_K, MACRO)     \
    FORMAT_IF(q4_k, F_Q4_K, MACRO)     \
    FORMAT_IF(q5_k, F_Q5_K, MACRO)     \
    FORMAT_IF(q6_k, F_Q6_K, MACRO)
