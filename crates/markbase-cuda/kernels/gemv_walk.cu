// The gated feed-forward's first half for one token row of Q4_K, Q5_K or Q6_K weights, or of Q8_0,
// Q4_0 or Q5_0 weights of whole 256-value units (gemv_walk.rs): out[r] =
// gelu_tanh(gate_r · x) · (up_r · x); and the same walk over one matrix's two halves as its
// row pairs (an LM head: out[r] and out[rows + r]). Appended to gemv.cu's module.
//
// A warp takes a group of P row pairs, G = 2P rows (gate and up rows alternating). Their
// G·nb units (256 values: a Q4_K super-block, a Q8_0 group as regrouped on the device) are
// cut into 8 slices each, a lane's (`sub` = lane % 8) 32 values: 16 of chunk 2n and 16 of
// chunk 2n + 1, n = sub / 2 (Q4_K: 16 quant bytes, both chunks' nibbles; Q8_0: each chunk's 16
// quants). The slices are dealt to the lanes in order: lane l takes slices l, l + 32, l + 64,
// …, all at the same `sub` of their units, every 4th unit of the group's walk; G·nb a
// multiple of 4 gives every lane `per` = G·nb / 4 slices a group. The warps walk the groups
// grid-stride (the launch holds as many blocks as are resident), each lane's slices one stream
// across its groups with UNITS_AHEAD of them in flight in a ring: a slot is loaded with its
// next slice as soon as its slice is used, so no load waits for a batch and no registers are
// copied. A Q4_K slice in flight holds one word of its super-block's 16-byte header (the 8
// lanes of a super-block trade the words when they use it), a Q8_0 slice its chunks' scales.
//
// A slice's 32 weights meet their 16-bit activations (common.cuh, store_q4k_tiles) in exact
// integer dot products, `dp2a` (Q4_K: on the 4-bit values where they lie in the byte, the high
// nibbles as 16·q, the 16 folded into the scale; a high chunk's sum, up to 16 times larger, may
// round in its conversion to float past 2^24), then one scale (and Q4_K's min) a chunk. Each
// block holds the activations' tiles in shared memory: copied from the producer's tiles, or
// quantized from the row itself.
//
// Measured on the H200 (docs/perf.md, session 28): E4B's Q4_K gate + up 17.2 → 11.9 µs. The
// same walk for one matrix (q, k, v, o, down, the PLE products) measured slower than
// i16_rows, and reading the producer's tiles from global memory in place of shared memory
// slowed the step; for E4B's LM head (262 144 rows) it is 193.8 → 124.8 µs (1.9 → 3.0 TB/s,
// session 30). Slices in flight through a cp.async ring in shared memory in place of
// registers (4–16 slots a lane) made gate + up 11.8 → 13.9 µs (session 29).

// Slices a lane has in flight: Q4_K's (20 bytes each), Q8_0's (36 bytes each).
#ifndef Q4K_UNITS_AHEAD
#define Q4K_UNITS_AHEAD 5
#endif
#ifndef Q8_0_UNITS_AHEAD
#define Q8_0_UNITS_AHEAD 4
#endif
// Q5_K's (24 bytes each).
#ifndef Q5K_UNITS_AHEAD
#define Q5K_UNITS_AHEAD 4
#endif
// Q6_K's (28 bytes each).
#ifndef Q6K_UNITS_AHEAD
#define Q6K_UNITS_AHEAD 4
#endif
#if Q4K_UNITS_AHEAD < 1 || Q8_0_UNITS_AHEAD < 1 || Q6K_UNITS_AHEAD < 1 || Q5K_UNITS_AHEAD < 1
#error "the walks' UNITS_AHEAD must be at least 1"
#endif

// What a lane needs to pick its two chunks' 6-bit scales and mins out of a super-block's
// header (k_scale_min's packing) with two shifts and masks each: chunks 2n and 2n + 1 take
// bytes 2n, 2n + 1 of the scale words for n < 2, and for n ≥ 2 the low (scale) or high (min)
// nibbles of bytes 8 + 2(n − 2) .. plus the top two bits of the first words' bytes.
struct Q4kLaneScales {
    u32 shift, word_shift, mask, word_mask;
};

__device__ __forceinline__ Q4kLaneScales q4k_lane_scales(int sub) {
    int n = sub >> 1, high = n >> 1, sh = 16 * (n & 1);
    return {(u32)(sh + 2 * high), (u32)sh, high ? 0x3030u : 0x3F3Fu, high ? 0x0F0Fu : 0u};
}

// The dot product of one unit — lane slot `sub`'s 16 quant bytes q of a super-block whose
// header is h — with its activations in shared memory: the tile slots xq[0], xq[8], xq[16],
// xq[24] and the halves' (d, d·Σq) at xm[0] (chunk 2n) and xm[2] (chunk 2n + 1).
__device__ __forceinline__ float q4k_unit_dot(uint4 q, uint4 h, const uint4* xq,
                                              const float2* xm, const Q4kLaneScales& c) {
    const uint4 x0 = xq[0], x1 = xq[8], x2 = xq[16], x3 = xq[24];
    const float2 m0 = xm[0], m1 = xm[2];
    const u32 xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const u32 xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
    const u32 w[4] = {q.x, q.y, q.z, q.w};
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 wl = w[i] & 0x0F0F0F0Fu, wh = w[i] & 0xF0F0F0F0u;
        lo = dp2a_hi(xa[2 * i + 1], wl, dp2a_lo(xa[2 * i], wl, lo));
        hi = dp2a_hi(xb[2 * i + 1], wh, dp2a_lo(xb[2 * i], wh, hi));
    }
    u32 sc = ((h.y >> c.shift) & c.mask) | ((h.w >> c.word_shift) & c.word_mask);
    u32 mn = ((h.z >> c.shift) & c.mask) | ((h.w >> (c.word_shift + 4)) & c.word_mask);
    float d = f16_to_f32((u16)(h.x & 0xffff)), dmin = f16_to_f32((u16)(h.x >> 16));
    float s = (float)(sc & 0xff) * m0.x * (float)lo +
              (float)(sc >> 8) * (m1.x * (1.f / 16.f)) * (float)hi;
    float m = (float)(mn & 0xff) * m0.y + (float)(mn >> 8) * m1.y;
    return d * s - dmin * m;
}

// The walk's formats: a lane's slice of a unit as loaded (Slice), what the lane keeps for its
// slot `sub` (Lane), the slice's load and its dot product with the slot's activations in
// shared memory (the tile slots xq[0], xq[8], xq[16], xq[24] and the halves' (d, d·Σq) at
// xm[0] for chunk 2n and xm[2] for chunk 2n + 1). Every lane of the warp calls `dot`.
struct WalkQ4k {
    static constexpr int UNIT_BYTES = 144, AHEAD = Q4K_UNITS_AHEAD;
    struct Slice {
        uint4 q;
        u32 hw;
    };
    typedef Q4kLaneScales Lane;
    static __device__ __forceinline__ Lane lane(int sub) { return q4k_lane_scales(sub); }

    // Slot `sub`'s 16 quant bytes of the super-block at `blk`, and word sub % 4 of its header.
    static __device__ __forceinline__ void load(const u8* blk, int sub, Slice& s) {
        s.q = __ldg((const uint4*)(blk + 16) + sub);
        s.hw = __ldg((const u32*)blk + (sub & 3));
    }

    static __device__ __forceinline__ float dot(const Slice& s, const uint4* xq, const float2* xm,
                                                const Lane& c) {
        int base = threadIdx.x & 24;
        uint4 h = make_uint4(__shfl_sync(0xffffffffu, s.hw, base),
                             __shfl_sync(0xffffffffu, s.hw, base + 1),
                             __shfl_sync(0xffffffffu, s.hw, base + 2),
                             __shfl_sync(0xffffffffu, s.hw, base + 3));
        return q4k_unit_dot(s.q, h, xq, xm, c);
    }
};

struct WalkQ8_0 {
    static constexpr int UNIT_BYTES = 272, AHEAD = Q8_0_UNITS_AHEAD;
    struct Slice {
        uint4 lo, hi;
        u32 d;
    };
    struct Lane {};
    static __device__ __forceinline__ Lane lane(int) { return {}; }

    // Slot `sub`'s 16 quants of chunks 2n and 2n + 1 of the group at `grp`, and their scales.
    static __device__ __forceinline__ void load(const u8* grp, int sub, Slice& s) {
        const int n = sub >> 1, half = sub & 1;
        s.lo = __ldg((const uint4*)(grp + 16 + 64 * n + 16 * half));
        s.hi = __ldg((const uint4*)(grp + 48 + 64 * n + 16 * half));
        s.d = __ldg((const u32*)grp + n);
    }

    static __device__ __forceinline__ float dot(const Slice& s, const uint4* xq, const float2* xm,
                                                const Lane&) {
        const uint4 x0 = xq[0], x1 = xq[8], x2 = xq[16], x3 = xq[24];
        const float2 m0 = xm[0], m1 = xm[2];
        const u32 xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        const u32 xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
        const u32 wl[4] = {s.lo.x, s.lo.y, s.lo.z, s.lo.w};
        const u32 wh[4] = {s.hi.x, s.hi.y, s.hi.z, s.hi.w};
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo = dp2a_hi_s8(xa[2 * i + 1], wl[i], dp2a_lo_s8(xa[2 * i], wl[i], lo));
            hi = dp2a_hi_s8(xb[2 * i + 1], wh[i], dp2a_lo_s8(xb[2 * i], wh[i], hi));
        }
        return f16_to_f32((u16)(s.d & 0xffff)) * m0.x * (float)lo +
               f16_to_f32((u16)(s.d >> 16)) * m1.x * (float)hi;
    }
};

// The dot product of a slot's 32 weights as unsigned bytes — lo[i] (chunk 2n) and hi[i]
// (chunk 2n + 1), four a word — each chunk's scale d and offset `off` (w = d·(q − off)), with
// the slot's activations in shared memory (as WalkQ4k's): the offset through the halves' sums.
__device__ __forceinline__ float unsigned_slot_dot(const u32* lo, const u32* hi, float d0,
                                                   float d1, float off, const uint4* xq,
                                                   const float2* xm) {
    const uint4 x0 = xq[0], x1 = xq[8], x2 = xq[16], x3 = xq[24];
    const float2 m0 = xm[0], m1 = xm[2];
    const u32 xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const u32 xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
    int sl = 0, sh = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        sl = dp2a_hi(xa[2 * i + 1], lo[i], dp2a_lo(xa[2 * i], lo[i], sl));
        sh = dp2a_hi(xb[2 * i + 1], hi[i], dp2a_lo(xb[2 * i], hi[i], sh));
    }
    return d0 * (m0.x * (float)sl - off * m0.y) + d1 * (m1.x * (float)sh - off * m1.y);
}

// Q5_K super-blocks as laid out on the device (layout.rs): a slot's 16 quant bytes (as Q4_K's)
// and its word of fifth bits, and one word of the super-block's 16-byte header (the 8 lanes of
// a super-block trade the words when they use it, as WalkQ4k's).
struct WalkQ5k {
    static constexpr int UNIT_BYTES = 176, AHEAD = Q5K_UNITS_AHEAD;
    struct Slice {
        uint4 q;
        u32 f, hw;
    };
    struct Lane {};
    static __device__ __forceinline__ Lane lane(int) { return {}; }

    static __device__ __forceinline__ void load(const u8* unit, int sub, Slice& s) {
        s.q = __ldg((const uint4*)(unit + 16) + sub);
        s.f = __ldg((const u32*)(unit + 144) + sub);
        s.hw = __ldg((const u32*)unit + (sub & 3));
    }

    // d·scale·Σ q·x − dmin·min·Σ x a chunk half (Q4_K's form, on 5-bit values).
    static __device__ __forceinline__ float dot(const Slice& s, const uint4* xq, const float2* xm,
                                                const Lane&) {
        const int base = threadIdx.x & 24, n = (threadIdx.x & 7) >> 1;
        const uint4 h = make_uint4(__shfl_sync(0xffffffffu, s.hw, base),
                                   __shfl_sync(0xffffffffu, s.hw, base + 1),
                                   __shfl_sync(0xffffffffu, s.hw, base + 2),
                                   __shfl_sync(0xffffffffu, s.hw, base + 3));
        const uint4 x0 = xq[0], x1 = xq[8], x2 = xq[16], x3 = xq[24];
        const float2 m0 = xm[0], m1 = xm[2];
        const u32 xa[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        const u32 xb[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
        const u32 w[4] = {s.q.x, s.q.y, s.q.z, s.q.w};
        int sl = 0, sh = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo, hi;
            laid_five_bit_bytes(w[i], s.f, i, lo, hi);
            sl = dp2a_hi(xa[2 * i + 1], lo, dp2a_lo(xa[2 * i], lo, sl));
            sh = dp2a_hi(xb[2 * i + 1], hi, dp2a_lo(xb[2 * i], hi, sh));
        }
        const float d = f16_to_f32((u16)(h.x & 0xffff)), dmin = f16_to_f32((u16)(h.x >> 16));
        float sc0, mn0, sc1, mn1;
        q4k_scale_min(h, 2 * n, &sc0, &mn0);
        q4k_scale_min(h, 2 * n + 1, &sc1, &mn1);
        return d * sc0 * m0.x * (float)sl - dmin * mn0 * m0.y + d * sc1 * m1.x * (float)sh -
               dmin * mn1 * m1.y;
    }
};

// Q6_K super-blocks as laid out on the device (layout.rs): a slot's 16 bytes of low bits, two
// words of high bits and its word of scales and d, all its own (no trading between lanes).
struct WalkQ6k {
    static constexpr int UNIT_BYTES = 224, AHEAD = Q6K_UNITS_AHEAD;
    typedef I16Slice<F_Q6_K> Slice;
    struct Lane {};
    static __device__ __forceinline__ Lane lane(int) { return {}; }

    static __device__ __forceinline__ void load(const u8* unit, int sub, Slice& s) {
        i16_load<F_Q6_K>(unit, 0, sub, s);
    }

    // d·scale·Σ (q − 32)·x a chunk half: the −32 through the activations' sums (xm .y).
    static __device__ __forceinline__ float dot(const Slice& s, const uint4* xq, const float2* xm,
                                                const Lane&) {
        u32 lo[4], hi[4];
        float d0, d1;
        q6k_unpack(s, lo, hi, &d0, &d1);
        return unsigned_slot_dot(lo, hi, d0, d1, 32.f, xq, xm);
    }
};

// Q4_0 and Q5_0 rows of whole 8-block units as laid out on the device (layout.rs): a slot's
// 16 bytes of nibbles, (Q5_0) its word of fifth bits, and the word of its two blocks' scales.
template <int FMT>
struct WalkLegacy {
    static constexpr int UNIT_BYTES = FMT == F_Q4_0 ? 144 : 176, AHEAD = Q4K_UNITS_AHEAD;
    typedef I16Slice<FMT> Slice;
    struct Lane {};
    static __device__ __forceinline__ Lane lane(int) { return {}; }

    static __device__ __forceinline__ void load(const u8* unit, int sub, Slice& s) {
        i16_load<FMT>(unit, 0, sub, s);
    }

    // d·Σ (q − 8)·x (Q4_0) or d·Σ (q − 16)·x (Q5_0) a block half: the offset through the
    // activations' sums (xm .y).
    static __device__ __forceinline__ float dot(const Slice& s, const uint4* xq, const float2* xm,
                                                const Lane&) {
        u32 lo[4], hi[4];
        float d0, d1;
        legacy_unpack<FMT>(s, lo, hi, &d0, &d1);
        return unsigned_slot_dot(lo, hi, d0, d1, FMT == F_Q4_0 ? 8.f : 16.f, xq, xm);
    }
};

// Unit s of a G-row group's walk over its rows of nb units each: row *g, unit *b of it
// (s < G·nb; compares, no division).
template <int G>
__device__ __forceinline__ void walk_at(int s, int nb, int* g, int* b) {
    int r = 0;
#pragma unroll
    for (int i = 1; i < G; i++) r += s >= i * nb;
    *g = r;
    *b = s - r * nb;
}

// Every block's copy of the activation row x (k values) as Q4_K tiles in `smem` (640 bytes a
// unit): the producer's tiles `xt` copied, or (xt null) x quantized. Synchronises the
// block; every warp of the block calls it.
__device__ __forceinline__ void stage_tiles(const float* x, int k, const uint4* xt,
                                                uint4* smem) {
    if (xt) {
        for (int i = threadIdx.x; i < 40 * (k >> 8); i += blockDim.x) smem[i] = __ldg(xt + i);
    } else {
        store_q4k_tiles(x, k, (u8*)smem);
    }
    __syncthreads();
}

// The walk's rows: `rows` row pairs of two matrices (the gate and up matrices, or one matrix's
// two halves), P pairs a group (rows 2p and 2p + 1 of group `grp` are row P·grp + p of the
// first and of the second; pairs past the end repeat the last one, and their results are not
// stored).
template <int P>
struct WalkRows {
    const u8 *gate, *up;
    u64 row_bytes;
    int rows;

    __device__ void of(int grp, const u8** r) const {
#pragma unroll
        for (int p = 0; p < P; p++) {
            u64 off = (u64)min(P * grp + p, rows - 1) * row_bytes;
            r[2 * p] = gate + off;
            r[2 * p + 1] = up + off;
        }
    }
};

// A lane's place in its stream of units: group `grp`, its j-th unit of it (of `per`), and
// the group's 2P rows.
template <int P>
struct WalkCursor {
    int grp, j;
    const u8* rows[2 * P];
};

// Moves cursor c to its next slice: the next of its group, or the first of the warp's next
// group (`warps` on).
template <int P>
__device__ __forceinline__ void walk_next(WalkCursor<P>& c, int per, int warps,
                                                const WalkRows<P>& rows) {
    if (++c.j == per) {
        c.j = 0;
        c.grp += warps;
        rows.of(c.grp, c.rows);
    }
}

// Loads the slice under cursor c — slot `sub` of unit first + 4·j of its group's walk.
template <class W, int P>
__device__ __forceinline__ void walk_load(const WalkCursor<P>& c, int first, int nb, int sub,
                                          typename W::Slice& s) {
    int g, b;
    walk_at<2 * P>(first + 4 * c.j, nb, &g, &b);
    const u8* row = c.rows[0];
#pragma unroll
    for (int i = 1; i < 2 * P; i++)
        if (g == i) row = c.rows[i];  // a select chain: an indexed pointer goes to the stack
    W::load(row + (u64)b * W::UNIT_BYTES, sub, s);
}

// Uses the slice under cursor c: adds its dot product to acc[its row]; after the group's last
// slice, stores the group's results (lane 0) and clears acc. GATED: out[r] = gelu_tanh(gate_r ·
// x) · (up_r · x); else the two rows' products apart, out[r] and out[rows + r] (one matrix
// walked as two halves, gemv_halves_walk below).
template <class W, int P, bool GATED>
__device__ __forceinline__ void walk_use(const WalkCursor<P>& c, const typename W::Slice& s,
                                         int first, int nb, int per, const uint4* xq,
                                         const float2* xm, const typename W::Lane& sc, int rows,
                                         float* out, float* acc) {
    int g, b;
    walk_at<2 * P>(first + 4 * c.j, nb, &g, &b);
    float v = W::dot(s, xq + 32 * b, xm + 16 * b, sc);
#pragma unroll
    for (int i = 0; i < 2 * P; i++) acc[i] += g == i ? v : 0.f;
    if (c.j == per - 1) {
#pragma unroll
        for (int i = 0; i < 2 * P; i++) acc[i] = warp_sum(acc[i]);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                int r = P * c.grp + p;
                if (r < rows && GATED) out[r] = gelu_tanh(acc[2 * p]) * acc[2 * p + 1];
                if (r < rows && !GATED) {
                    out[r] = acc[2 * p];
                    out[rows + r] = acc[2 * p + 1];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 2 * P; i++) acc[i] = 0.f;
    }
}

// out[r] = gelu_tanh(gate_r · x) · (up_r · x) for r < rows (k values a row; 2P·k / 1024
// whole), the activations from the tiles `xt` or (null) x: the walk described at the top.
// Not GATED: out[r] = gate_r · x and out[rows + r] = up_r · x.
template <class W, int P, bool GATED>
__device__ void gemv_walk(const WalkRows<P>& rows, const float* x, int k,
                              const uint4* xt, float* out) {
    const int A = W::AHEAD;
    extern __shared__ uint4 walk_staged[];
    int lane = threadIdx.x & 31, sub = lane & 7, nb = k >> 8, per = 2 * P * nb / 4;
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = (gridDim.x * blockDim.x) >> 5;
    int groups = (rows.rows + P - 1) / P;
    // The warp's slices (the same count on every lane): `per` for each of its groups.
    int mine = warp < groups ? (groups - warp + warps - 1) / warps * per : 0;
    int first = lane >> 3;
    const typename W::Lane sc = W::lane(sub);
    WalkCursor<P> load{warp, 0, {}};
    rows.of(warp, load.rows);
    WalkCursor<P> use = load;
    typename W::Slice q[A];
#pragma unroll
    for (int j = 0; j < A; j++) {
        if (j < mine) {
            walk_load<W, P>(load, first, nb, sub, q[j]);
            walk_next<P>(load, per, warps, rows);
        }
    }
    wait_prior_grid();
    stage_tiles(x, k, xt, walk_staged);
    const uint4* xq = walk_staged + sub;
    const float2* xm = (const float2*)(walk_staged + 32 * nb) + 4 * (sub >> 1) + (sub & 1);
    float acc[2 * P];
#pragma unroll
    for (int g = 0; g < 2 * P; g++) acc[g] = 0.f;
    // Trips whose A slices and the A loads after them all exist, then the rest with checks.
    int i = 0;
    for (; i + 2 * A <= mine; i += A) {
#pragma unroll
        for (int j = 0; j < A; j++) {
            walk_use<W, P, GATED>(use, q[j], first, nb, per, xq, xm, sc, rows.rows, out, acc);
            walk_next<P>(use, per, warps, rows);
            walk_load<W, P>(load, first, nb, sub, q[j]);
            walk_next<P>(load, per, warps, rows);
        }
    }
    for (; i < mine; i += A) {
#pragma unroll
        for (int j = 0; j < A; j++) {
            if (i + j < mine) {
                walk_use<W, P, GATED>(use, q[j], first, nb, per, xq, xm, sc, rows.rows, out,
                                      acc);
                walk_next<P>(use, per, warps, rows);
                if (i + j + A < mine) {
                    walk_load<W, P>(load, first, nb, sub, q[j]);
                    walk_next<P>(load, per, warps, rows);
                }
            }
        }
    }
}

// The kernels, P = 1 or 2 row pairs a warp's group; blocks of 8 warps with 640 bytes of
// dynamic shared memory a unit of the row. gemv_halves_walk: one matrix of 2·rows rows (w) as
// the walk's pairs, row r with row rows + r (the LM head's product), held to 85 registers so
// three blocks fit a multiprocessor as for the gated walk (its own choice, 92, fits two).
#define GEMV_WALK_KERNELS(S, W, P)                                                            \
    extern "C" __global__ void gemv_gelu_walk_##S##_##P(const u8* gate, const u8* up,         \
                                                        u64 row_bytes, int rows, int k,       \
                                                        const float* x, float* out,           \
                                                        const uint4* xt) {                    \
        gemv_walk<W, P, true>(WalkRows<P>{gate, up, row_bytes, rows}, x, k, xt, out);         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 3)                                      \
        gemv_halves_walk_##S##_##P(const u8* w, u64 row_bytes, int rows, int k,               \
                                   const float* x, float* out, const uint4* xt) {             \
        WalkRows<P> halves{w, w + (u64)rows * row_bytes, row_bytes, rows};                    \
        gemv_walk<W, P, false>(halves, x, k, xt, out);                                        \
    }
#if FORMAT_q4_k
GEMV_WALK_KERNELS(q4_k, WalkQ4k, 1)
GEMV_WALK_KERNELS(q4_k, WalkQ4k, 2)
#endif
#if FORMAT_q8_0
GEMV_WALK_KERNELS(q8_0, WalkQ8_0, 1)
GEMV_WALK_KERNELS(q8_0, WalkQ8_0, 2)
#endif
#if FORMAT_q5_k
GEMV_WALK_KERNELS(q5_k, WalkQ5k, 1)
GEMV_WALK_KERNELS(q5_k, WalkQ5k, 2)
#endif
#if FORMAT_q6_k
GEMV_WALK_KERNELS(q6_k, WalkQ6k, 1)
GEMV_WALK_KERNELS(q6_k, WalkQ6k, 2)
#endif
#if FORMAT_q4_0
GEMV_WALK_KERNELS(q4_0, WalkLegacy<F_Q4_0>, 1)
GEMV_WALK_KERNELS(q4_0, WalkLegacy<F_Q4_0>, 2)
#endif
#if FORMAT_q5_0
GEMV_WALK_KERNELS(q5_0, WalkLegacy<F_Q5_0>, 1)
GEMV_WALK_KERNELS(q5_0, WalkLegacy<F_Q5_0>, 2)
#endif
