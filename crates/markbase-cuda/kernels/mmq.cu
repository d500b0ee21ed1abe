// Products of 2–64 token rows a launch on the tensor cores (mma.sync m16n8k16, f32 sums):
// out[t, r] = Σ_k x[t, k] · w[r, k], for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 weights (dequantized
// to f16 in registers, f16 activations). The weights stream from memory once for all the tokens,
// straight into registers; the GEMVs they replace read each weight once a token row (their dot
// products grow with the tokens), and cuBLAS needs them dequantized into memory first. The walk is
// written over a format's unit (F: its loads, its products, its staging).
// Appended to gemv.cu's module (its Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 and Q5_0 units).
//
// The work is items — a row tile of one of the launch's matrices (up to 4 of one width: q, k,
// v or gate, up) over one split of the rows' units (blockIdx.y of the launch's `splits`) —
// and an item's units of F::K values (a Q4_K super-block). A block's 8 (to 16)
// warps walk the tiles grid-stride over the split's blocks, one item at a time, each warp a
// stream of units with F::AHEAD of them loaded into registers ahead of the one it
// multiplies (the first before waiting for the kernel ahead). The block first stages its
// split's activations for all the tokens in shared memory (the product's rounded copy,
// rounded.rs; by cp.async). With one split a warp stores its item's sums; with several it
// stores them as the split's part, and the item's last warp (a ticket a tile, reset by that
// warp) adds the parts in split order. Every run gives the same bits.
//
// A tile is 16 rows of one matrix, a lane (g = lane / 4, c = lane % 4) holding rows g and
// g + 8 of it. A gated launch (gate and up, `gated` 1) pairs them instead: tile τ's rows g are
// gate row 8τ + g and its rows g + 8 up row 8τ + g, so each lane holds both sums of an output
// and stores gelu_tanh(gate) · up rounded to the activations' 16-bit type (the rounded copy
// the down product reads) to out[0]. Within a unit the k order of a k16 slab is a
// permutation shared by the A (weight) and B (activation) fragments, so the sums are the
// product's.

#if (FORMAT_q4_k || FORMAT_q5_k || FORMAT_q6_k || FORMAT_q8_0 || FORMAT_q4_0 || FORMAT_q5_0) && \
    __CUDA_ARCH__ >= 800  // mma.sync m16n8k16, cp.async

// Units a warp has loaded ahead of the one it multiplies: Q4_K's (48 bytes a lane), Q8_0's
// (68 bytes a lane; two spilled 320 bytes at 4 n-tiles).
#ifndef MMQ_UNITS_AHEAD
#define MMQ_UNITS_AHEAD 2
#endif
#ifndef MMQ_Q8_0_UNITS_AHEAD
#define MMQ_Q8_0_UNITS_AHEAD 1
#endif
// Q5_K's (56 bytes a lane).
#ifndef MMQ_Q5K_UNITS_AHEAD
#define MMQ_Q5K_UNITS_AHEAD 1
#endif
// Q6_K's (56 bytes a lane).
#ifndef MMQ_Q6K_UNITS_AHEAD
#define MMQ_Q6K_UNITS_AHEAD 1
#endif
// Q4_0's and Q5_0's (72 / 88 bytes a lane; two spilled at 4 n-tiles).
#ifndef MMQ_LEGACY_UNITS_AHEAD
#define MMQ_LEGACY_UNITS_AHEAD 1
#endif
// Units loaded ahead by a warp of a launch of 8 n-tiles (every format). With one block of 8
// warps a multiprocessor (MMQ_WIDE_BLOCKS=1 MMQ_WIDE_WARPS=8) 2 fits every format without a
// spill; it ran E4B Q4_K_M's 64-sequence step 2–4 % slower than 1 in session 39, as fast as 1
// in session 44 and 4 % slower in session 48.
#ifndef MMQ_WIDE_UNITS_AHEAD
#define MMQ_WIDE_UNITS_AHEAD 1
#endif
// Blocks of a launch of 8 n-tiles resident on a multiprocessor: 1 (up to 255 registers a
// thread, 5 units of activations a block) or 2 (up to 128; 16–32 bytes of each format's
// item-end addresses spill, none in the units' loop; 3 units a block), with the host plan's
// `MMQ_WIDE_*` settings (mmq.rs `Tuning`). One block ran E4B Q4_K_M's 64-sequence step 10 %
// faster than two on the H100 in session 47 (fewer splits: the Q6_K LM head's split parts
// 335 → 134 MB), though two had won session 44's sweep by 6 % (docs/perf.md).
#ifndef MMQ_WIDE_BLOCKS
#define MMQ_WIDE_BLOCKS 1
#endif
// Warps of a block of a launch of 8 n-tiles (mmq.rs `Tuning::wide_warps`): with one block a
// multiprocessor 12, more warps a scheduler sharing the block's staged activations (up to 168
// registers a thread, no spills; E4B Q4_K_M's 64-sequence step 6 % faster than with 8 on the
// H100, gate + up 50.6 → 44.7 µs, docs/perf.md session 49), 8, or 16 (up to 128; 16–136
// bytes of item-end values spill; 2–6 % slower than 8); with two blocks 8.
#ifndef MMQ_WIDE_WARPS
#if MMQ_WIDE_BLOCKS == 1
#define MMQ_WIDE_WARPS 12
#else
#define MMQ_WIDE_WARPS 8
#endif
#endif
#if (MMQ_WIDE_WARPS != 8 && MMQ_WIDE_WARPS != 12 && MMQ_WIDE_WARPS != 16) || \
    (MMQ_WIDE_WARPS > 8 && MMQ_WIDE_BLOCKS > 1)
#error "MMQ_WIDE_WARPS is 8, or 12 or 16 with MMQ_WIDE_BLOCKS 1"
#endif
// Accumulator sets of a warp for up to 16 tokens (one for more): a unit's products go to two
// chains of dependent mma instructions, not one.
#ifndef MMQ_CHAINS
#define MMQ_CHAINS 2
#endif

// The old value of *t, incremented by one atomically with acquire-release order at GPU scope:
// the caller's writes (and those ordered before them) are visible to whichever thread takes a
// later ticket, and every write released with an earlier ticket is visible to the caller (in
// place of two sequentially consistent fences around a relaxed atomic: E4B Q4_K_M's 8- and
// 32-sequence steps 2–4 % faster, docs/perf.md session 44).
__device__ __forceinline__ u32 mmq_ticket(u32* t) {
#ifdef MB_EMU
    return atomicAdd(t, 1u);
#else
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(t) : "memory");
    return old;
#endif
}

// The 4 floats at p (16-byte aligned) that other warps wrote (read from L2, not from a stale
// L1 line).
__device__ __forceinline__ float4 mmq_ld4(const float* p) {
    float4 v;
#ifdef MB_EMU
    v = make_float4(p[0], p[1], p[2], p[3]);
#else
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
#endif
    return v;
}

// The activations every format's unit reads (256 values a unit): token t's unit in shared
// memory as the 4 lanes' groups of 64 values (lane c: the unit's chunks 2c and 2c + 1), 128
// bytes each padded to 144, so a quarter warp's 16-byte loads (2 tokens, 4 groups) hit 32
// different banks.
struct MmqSlots {
    // Values a unit covers.
    static constexpr int K = 256;
    // Shared memory a group, a token's unit of activations; its 16-byte pieces.
    static constexpr int GROUP_BYTES = 144, TOKEN_BYTES = 4 * GROUP_BYTES, PIECES = 32;

    // Where 16-byte piece `piece` of a token's unit (its values 8 · piece ..) lies in the
    // token's slot.
    static __device__ __forceinline__ int piece_at(int piece) {
        return (piece >> 3) * GROUP_BYTES + 16 * (piece & 7);
    }

    // A gated output as the activations' type (f16).
    static __device__ __forceinline__ u16 round(float v) { return to_f16(v); }

    // acc[h % CH][j] (n-tile j) += the A fragments of words 2ip and 2ip + 1 of a lane's two
    // chunks — A[word][chunk] = {row g first pair, row g + 8 first pair, row g second pair,
    // row g + 8 second pair}, word i holding the chunk's values 4i .. 4i + 3 — times the
    // activations of its group `xl` (lane (g, c): token 8j + g's group c).
    template <int NT, int CH>
    static __device__ __forceinline__ void mma(const u32 (*A)[2][4], const u8* xl, int ip,
                                               float (*acc)[NT][4]) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const u8* xt = xl + 8 * j * TOKEN_BYTES + 16 * ip;
            uint4 lo = *(const uint4*)xt, hi = *(const uint4*)(xt + 64);
            mma_f16(acc[0][j], A[0][0], lo.x, lo.y);
            mma_f16(acc[0][j], A[1][0], lo.z, lo.w);
            mma_f16(acc[1 % CH][j], A[0][1], hi.x, hi.y);
            mma_f16(acc[1 % CH][j], A[1][1], hi.z, hi.w);
        }
    }
};

// Two 32-value blocks' f16 scales of each of a lane's two rows (the word d[row]: the block's
// in the low half, the next one's in the high) as broadcast f16 pairs: s[row][block].
struct MmqBlockScales {
    u32 s[2][2];
};

__device__ __forceinline__ MmqBlockScales mmq_block_scales(const u32* d) {
    MmqBlockScales r;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        r.s[e][0] = (d[e] & 0xffffu) * 0x10001u;
        r.s[e][1] = (d[e] >> 16) * 0x10001u;
    }
    return r;
}

// Q4_K (FIFTH false) and Q5_K (true) weights: a unit is a super-block of the lane's two rows
// (KQuantRows, mma.cuh), on the staged activations.
template <bool FIFTH>
struct MmqK : MmqSlots, KQuantRows<FIFTH> {
    // Units a warp loads ahead.
    static constexpr int AHEAD = FIFTH ? MMQ_Q5K_UNITS_AHEAD : MMQ_UNITS_AHEAD;
};

// Q8_0 weights as regrouped on the device (layout.rs): a unit is a group of 8 blocks (256
// values, 272 bytes a row: 8 f16 scales, then the quants). A lane holds for each of its two
// rows the quants of chunks 2c and 2c + 1 (blocks of the group) and the word of their two
// scales; word i of a chunk's 32 quants gives its k16 slab's weights 4i .. 4i + 3, as for
// Q4_K. Dequantization: a quant q (signed byte, offset by 128) becomes the f16 1024 + 128 + q
// by a byte permutation with 0x64, then the exact q by a subtraction, then w = q · d rounded
// once to f16 (d the block's f16 scale as stored): the product's dequantized weights rounded
// to f16, which the tests model.
struct MmqQ8_0 : MmqSlots {
    // A unit's bytes in a row; units a warp loads ahead.
    static constexpr int UNIT_BYTES = 272, AHEAD = MMQ_Q8_0_UNITS_AHEAD;

    struct Unit {
        uint4 q[2][4];
        u32 d[2];
    };

    // The unit of rows `lo` and `hi` (each at the unit's first byte).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int c, Unit& a) {
        const u8* r[2] = {lo, hi};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            a.d[e] = __ldg((const u32*)r[e] + c);
#pragma unroll
            for (int i = 0; i < 4; i++) a.q[e][i] = __ldg((const uint4*)(r[e] + 16 + 64 * c) + i);
        }
    }

    // The chunks' scales as broadcast f16 pairs: s[row][hi].
    typedef MmqBlockScales Scales;
    static __device__ __forceinline__ Scales scales(const Unit& a, int) {
        return mmq_block_scales(a.d);
    }

    // The A fragments of words 2ip and 2ip + 1 of the lane's chunks (MmqSlots::mma's layout).
    static __device__ __forceinline__ void fragments(const Unit& a, const Scales& sc, int ip,
                                                     u32 (*A)[2][4]) {
#pragma unroll
        for (int wi = 0; wi < 2; wi++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {
                    u32 w = mmq_word(a.q[e] + 2 * hi, 2 * ip + wi) ^ 0x80808080u;
                    A[wi][hi][e] = q8_pair_f16(w, 0x4140u, sc.s[e][hi]);
                    A[wi][hi][2 + e] = q8_pair_f16(w, 0x4342u, sc.s[e][hi]);
                }
            }
        }
    }
};

// Q6_K weights as laid out on the device (layout.rs): a unit is a super-block (256 values, 224
// bytes a row). A lane holds for each of its two rows the low-bit bytes of lane slots 2c and
// 2c + 1 — the 32 bytes whose low nibbles are chunk 2c's weights and high nibbles chunk
// 2c + 1's, as Q4_K's quant bytes — their high-bit words and their two header words (the
// chunks' 16-value scales and d). Word i of the 32 bytes gives each chunk's weights
// 4i .. 4i + 3 as unsigned 6-bit bytes (the high bits by a shift and a mask of the slot's
// word), which become the f16 1024 + q by a byte permutation with 0x64, then q − 32 by an
// exact subtraction, then w = (q − 32) · S rounded once to f16, with S = f16(d · scale)
// rounded once (saturating at ±65 504). Tests model exactly this rounding.
struct MmqQ6k : MmqSlots {
    // A unit's bytes in a row; units a warp loads ahead.
    static constexpr int UNIT_BYTES = 224, AHEAD = MMQ_Q6K_UNITS_AHEAD;

    struct Unit {
        uint4 q[2][2];
        uint4 hb[2];
        uint2 hd[2];
    };

    // The unit of rows `lo` and `hi` (each at the unit's first byte).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int c, Unit& a) {
        const u8* r[2] = {lo, hi};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            a.q[e][0] = __ldg((const uint4*)(r[e] + 32 * c));
            a.q[e][1] = __ldg((const uint4*)(r[e] + 32 * c + 16));
            a.hb[e] = __ldg((const uint4*)(r[e] + 128 + 16 * c));
            a.hd[e] = __ldg((const uint2*)(r[e] + 192 + 8 * c));
        }
    }

    // The scales of the lane's chunks' halves as broadcast f16 pairs: s[row][chunk][half].
    struct Scales {
        u32 s[2][2][2];
    };

    static __device__ __forceinline__ Scales scales(const Unit& a, int) {
        Scales r;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const u32 w[2] = {a.hd[e].x, a.hd[e].y};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float d = f16_to_f32((u16)(w[h] >> 16));
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {
                    float v = d * (float)(signed char)((w[h] >> (8 * hi)) & 0xff);
                    r.s[e][hi][h] = f16x2_sat(v, v);
                }
            }
        }
        return r;
    }

    // The A fragments of words 2ip and 2ip + 1 of the lane's chunks (MmqSlots::mma's layout).
    static __device__ __forceinline__ void fragments(const Unit& a, const Scales& sc, int ip,
                                                     u32 (*A)[2][4]) {
        const int h = ip >> 1;  // words 4h .. 4h + 3: the chunks' half h, lane slot 2c + h
#pragma unroll
        for (int wi = 0; wi < 2; wi++) {
            const int i = (2 * ip + wi) & 3;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const u32 q = mmq_word(a.q[e], 2 * ip + wi);
                const u32 h0 = h ? a.hb[e].z : a.hb[e].x, h1 = h ? a.hb[e].w : a.hb[e].y;
                const u32 lo = (q & 0x0F0F0F0Fu) | (((h0 >> (2 * i)) & 0x03030303u) << 4);
                const u32 up = ((q >> 4) & 0x0F0F0F0Fu) | (((h1 >> (2 * i)) & 0x03030303u) << 4);
                A[wi][0][e] = byte_pair_f16(lo, 0x4140u, 0x64206420u, sc.s[e][0][h]);
                A[wi][0][2 + e] = byte_pair_f16(lo, 0x4342u, 0x64206420u, sc.s[e][0][h]);
                A[wi][1][e] = byte_pair_f16(up, 0x4140u, 0x64206420u, sc.s[e][1][h]);
                A[wi][1][2 + e] = byte_pair_f16(up, 0x4342u, 0x64206420u, sc.s[e][1][h]);
            }
        }
    }
};

// Q4_0 and Q5_0 weights of rows of whole 8-block units as laid out on the device (layout.rs): a
// unit is 8 blocks (256 values; 144 / 176 bytes a row). A lane holds for each of its two rows
// the 32 nibble bytes of lane slots 2c and 2c + 1 — blocks 2c (low nibbles) and 2c + 1 (high)
// as Q4_K's quant bytes — (Q5_0) their two words of fifth bits, and the word of the two
// blocks' f16 scales. Q4_0: a nibble becomes the exact q − 8 as Q4_K's become q; Q5_0: the
// 5-bit bytes become f16 1024 + q by a byte permutation, q − 16 by an exact subtraction; then
// w = (q − off) · d rounded once: the reference's weights rounded to f16.
template <int FMT>
struct MmqLegacy : MmqSlots {
    // A unit's bytes in a row; units a warp loads ahead.
    static constexpr int UNIT_BYTES = FMT == F_Q4_0 ? 144 : 176, AHEAD = MMQ_LEGACY_UNITS_AHEAD;

    struct Unit {
        uint4 q[2][2];
        uint2 fw[2];
        u32 d[2];
    };

    // The unit of rows `lo` and `hi` (each at the unit's first byte).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int c, Unit& a) {
        const u8* r[2] = {lo, hi};
#pragma unroll
        for (int e = 0; e < 2; e++) {
            a.q[e][0] = __ldg((const uint4*)(r[e] + 16 + 32 * c));
            a.q[e][1] = __ldg((const uint4*)(r[e] + 32 + 32 * c));
            a.d[e] = __ldg((const u32*)r[e] + c);
            if (FMT == F_Q5_0) a.fw[e] = __ldg((const uint2*)(r[e] + 144 + 8 * c));
        }
    }

    // The blocks' scales as broadcast f16 pairs: s[row][block].
    typedef MmqBlockScales Scales;
    static __device__ __forceinline__ Scales scales(const Unit& a, int) {
        return mmq_block_scales(a.d);
    }

    // The A fragments of words 2ip and 2ip + 1 of the lane's blocks (MmqSlots::mma's layout).
    static __device__ __forceinline__ void fragments(const Unit& a, const Scales& sc, int ip,
                                                     u32 (*A)[2][4]) {
        const int h = ip >> 1;  // words 4h .. 4h + 3: the blocks' half h, lane slot 2c + h
#pragma unroll
        for (int wi = 0; wi < 2; wi++) {
            const int i = (2 * ip + wi) & 3;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const u32 q = mmq_word(a.q[e], 2 * ip + wi);
                if constexpr (FMT == F_Q4_0) {
                    // As q4_nibbles_f16, but q − 8: 1024 + q − 1032, (1024 + 16q) / 16 − 72.
                    const u32 v = __byte_perm(q, 0, 0x3120), v8 = v >> 8;
                    const u32 l0 = h2_sub(and_or(v, 0x000F000Fu, 0x64006400u), 0x64086408u);
                    const u32 l1 = h2_sub(and_or(v8, 0x000F000Fu, 0x64006400u), 0x64086408u);
                    const u32 h0 =
                        h2_fma(and_or(v, 0x00F000F0u, 0x64006400u), 0x2C002C00u, 0xD480D480u);
                    const u32 h1 =
                        h2_fma(and_or(v8, 0x00F000F0u, 0x64006400u), 0x2C002C00u, 0xD480D480u);
                    A[wi][0][e] = h2_mul(l0, sc.s[e][0]);
                    A[wi][0][2 + e] = h2_mul(l1, sc.s[e][0]);
                    A[wi][1][e] = h2_mul(h0, sc.s[e][1]);
                    A[wi][1][2 + e] = h2_mul(h1, sc.s[e][1]);
                } else {
                    const u32 f = h ? a.fw[e].y : a.fw[e].x;
                    u32 lo, up;
                    laid_five_bit_bytes(q, f, i, lo, up);
                    A[wi][0][e] = byte_pair_f16(lo, 0x4140u, 0x64106410u, sc.s[e][0]);
                    A[wi][0][2 + e] = byte_pair_f16(lo, 0x4342u, 0x64106410u, sc.s[e][0]);
                    A[wi][1][e] = byte_pair_f16(up, 0x4140u, 0x64106410u, sc.s[e][1]);
                    A[wi][1][2 + e] = byte_pair_f16(up, 0x4342u, 0x64106410u, sc.s[e][1]);
                }
            }
        }
    }
};

// acc[h % CH][j] (n-tile j) += unit a's chunk 2c + h (lane (g, c)) times the staged activations
// of its 256 values `xs` (token 8j + g's group c).
template <class F, int NT, int CH>
__device__ __forceinline__ void mmq_mul(const typename F::Unit& a, const u8* xs, int g, int c,
                                        float (*acc)[NT][4]) {
    const typename F::Scales sc = F::scales(a, c);
    const u8* xl = xs + g * F::TOKEN_BYTES + c * F::GROUP_BYTES;
#pragma unroll
    for (int ip = 0; ip < 4; ip++) {
        u32 A[2][2][4];
        F::fragments(a, sc, ip, A);
        MmqSlots::mma<NT, CH>(A, xl, ip, acc);
    }
}

// A warp's place in its stream of units: its item (a row tile, over the block's split) — the
// tile's first row, its output and rows, the bytes of its lane's two rows — and the unit of
// the split.
struct MmqCursor {
    int tile, i;
    int r0, rows;
    u64 out;
    const u8* lo;
    const u8* hi;
};

// Points cursor u at tile `tile` (of all the launch's tiles, in order), unit 0; constant
// indices into `p` (a runtime index copies it to the stack).
__device__ __forceinline__ void mmq_seek(const Products& p, int gated, u64 row_bytes, int g,
                                         int tile, MmqCursor& u) {
    u.tile = tile;
    u.i = 0;
    u.out = p.out[0];
    u.rows = p.rows[0];
    if (gated) {
        u.r0 = 8 * tile;
        const u64 at = (u64)min(u.r0 + g, u.rows - 1) * row_bytes;
        u.lo = (const u8*)p.w[0] + at;
        u.hi = (const u8*)p.w[1] + at;
        return;
    }
    u64 w = p.w[0];
    int t = tile;
#pragma unroll
    for (int i = 1; i < 4; i++) {
        int tiles = (u.rows + 15) >> 4;
        if (i < p.count && t >= tiles) {
            t -= tiles;
            w = p.w[i];
            u.out = p.out[i];
            u.rows = p.rows[i];
        }
    }
    u.r0 = 16 * t;
    u.lo = (const u8*)w + (u64)min(u.r0 + g, u.rows - 1) * row_bytes;
    u.hi = (const u8*)w + (u64)min(u.r0 + g + 8, u.rows - 1) * row_bytes;
}

// Moves cursor u to the next unit: the next of the split, or unit 0 of the warp's next tile
// (`stride` tiles on).
__device__ __forceinline__ void mmq_next(const Products& p, int gated, u64 row_bytes, int g,
                                         int count, int stride, MmqCursor& u) {
    if (++u.i == count) mmq_seek(p, gated, row_bytes, g, u.tile + stride, u);
}

// Output r of token t from its sums: the row's sum, or (gated) gelu_tanh(gate) · up rounded.
template <class F>
__device__ __forceinline__ void mmq_put(const MmqCursor& u, int gated, int t, int r, float a,
                                        float b) {
    if (gated)
        ((u16*)u.out)[(u64)t * u.rows + r] = F::round(gelu_tanh(a) * b);
    else
        ((float*)u.out)[(u64)t * u.rows + r] = a;
}

// Stores the warp's sums of item u as outputs (lane (g, c): the tile's rows g, g + 8 — v 0, 1
// and 2, 3 — for tokens 8j + 2c + (v & 1)). The gated tile's rows 0..7 are gate rows, 8..15
// the up rows of the same outputs.
template <class F, int NT>
__device__ __forceinline__ void mmq_outputs(const MmqCursor& u, int gated, float (*acc)[4],
                                            int n, int g, int c) {
    const int rows = u.rows;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) {
            int t = 8 * j + 2 * c + (v & 1);
            if (gated) {
                if (v < 2 && u.r0 + g < rows && t < n)
                    mmq_put<F>(u, 1, t, u.r0 + g, acc[j][v], acc[j][v + 2]);
            } else {
                int r = u.r0 + g + 8 * (v >> 1);
                if (r < rows && t < n) mmq_put<F>(u, 0, t, r, acc[j][v], 0.f);
            }
        }
}

// Whether the calling warp, its split's part of tile `tile` written, is the tile's last split
// (a ticket a tile, which that warp resets); if so every split's part is visible to all its
// lanes.
__device__ __forceinline__ bool mmq_last_split(u32* tickets, int tile, int splits) {
    __syncwarp();  // every lane's part written before lane 0 takes the ticket
    u32 ticket = 0;
    if ((threadIdx.x & 31) == 0) ticket = mmq_ticket(&tickets[tile]);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != (u32)splits - 1) return false;
    if ((threadIdx.x & 31) == 0) tickets[tile] = 0;
    __syncwarp();  // the other splits' parts, acquired by lane 0's ticket, for every lane
    return true;
}

// Stores the warp's sums of item u as its split's part in fragment order (a float4 a lane and
// n-tile: parts[split][tile][n-tile][lane], 8 · NT token slots a tile whatever n is) and
// returns whether it was the tile's last split; if so acc holds the sum of every split's part,
// added in split order (every run the same bits), each split's loads all in flight at once.
template <int NT>
__device__ __forceinline__ bool mmq_gather(const MmqCursor& u, float (*acc)[4], int tiles,
                                           float* parts, u32* tickets, int splits) {
    const u64 stride = (u64)tiles * NT * 128;  // floats a split
    const u64 mine = ((u64)u.tile * NT * 32 + (threadIdx.x & 31)) * 4;
    float* part = parts + blockIdx.y * stride + mine;
#pragma unroll
    for (int j = 0; j < NT; j++)
        *(float4*)(part + 128 * j) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    if (!mmq_last_split(tickets, u.tile, splits)) return false;
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const float* at = parts + mine;
    for (int q = 0; q < splits; q++, at += stride) {
        float4 v[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) v[j] = mmq_ld4(at + 128 * j);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            acc[j][0] += v[j].x;
            acc[j][1] += v[j].y;
            acc[j][2] += v[j].z;
            acc[j][3] += v[j].w;
        }
    }
    return true;
}

// Stores the warp's sums of item u: as outputs (mmq_outputs), or with several splits as this
// split's part, the item's last warp adding the parts in split order (mmq_gather).
template <class F, int NT>
__device__ __forceinline__ void mmq_store(const MmqCursor& u, int gated, float (*acc)[4], int n,
                                          int tiles, float* parts, u32* tickets, int splits,
                                          int g, int c) {
    if (splits > 1 && !mmq_gather<NT>(u, acc, tiles, parts, tickets, splits)) return;
    mmq_outputs<F, NT>(u, gated, acc, n, g, c);
}

// The warps of the launch walk the row tiles of `p`'s matrices grid-stride over the blocks of
// their split (blockIdx.y: units blockIdx.y · per_split ..), each through its units with
// F::AHEAD of them loaded ahead. The block stages its split's activations once: token t's
// unit i at (i · 8NT + t) · F::TOKEN_BYTES.
template <class F, int NT>
__device__ void mmq_impl(const Products& p, u64 row_bytes, int k, const u16* xh, int n,
                         int gated, float* parts, u32* tickets, int splits, int per_split) {
    constexpr int D = NT > 4 ? MMQ_WIDE_UNITS_AHEAD : F::AHEAD;
    extern __shared__ uint4 mmq_smem[];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int sb0 = blockIdx.y * per_split, count = min(k / F::K, sb0 + per_split) - sb0;
    const int stride = gridDim.x * (blockDim.x >> 5);
    const int first = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int tiles = 0;
    if (gated) {
        tiles = (p.rows[0] + 7) >> 3;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < p.count) tiles += (p.rows[i] + 15) >> 4;
    }
    const int mine = first < tiles ? (tiles - first + stride - 1) / stride * count : 0;

    MmqCursor load, use;
    mmq_seek(p, gated, row_bytes, g, first, load);
    use = load;
    typename F::Unit a[D];
#pragma unroll
    for (int j = 0; j < D; j++)
        if (j < mine) {
            const u64 at = (u64)(sb0 + load.i) * F::UNIT_BYTES;
            F::load(load.lo + at, load.hi + at, c, a[j]);
            mmq_next(p, gated, row_bytes, g, count, stride, load);
        }
    wait_prior_grid();
    const u32 smem = shared_address(mmq_smem);
    // A lane stages a 16-byte piece and a warp a token (12 SASS instructions a copy).
    static_assert(F::PIECES == 32, "a lane a piece");
    {
        const int piece = lane, warps = blockDim.x >> 5, t0 = threadIdx.x >> 5;
        const u64 step = (u64)warps * k;
        for (int i = 0; i < count; i++) {
            u32 to = smem + (i * 8 * NT + t0) * F::TOKEN_BYTES + F::piece_at(piece);
            const u16* from = xh + (u64)t0 * k + (sb0 + i) * F::K + 8 * piece;
            for (int t = t0; t < n; t += warps, to += warps * F::TOKEN_BYTES, from += step)
                cp_async16(to, from);
        }
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    constexpr int CH = NT <= 2 ? MMQ_CHAINS : 1;
    float acc[CH][NT][4];
#pragma unroll
    for (int h = 0; h < CH; h++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[h][j][0] = acc[h][j][1] = acc[h][j][2] = acc[h][j][3] = 0.f;
    for (int q = 0; q < mine; q += D) {
#pragma unroll
        for (int j = 0; j < D; j++) {
            if (q + j < mine) {
                mmq_mul<F, NT, CH>(a[j], (const u8*)mmq_smem + use.i * 8 * NT * F::TOKEN_BYTES,
                                   g, c, acc);
                if (use.i == count - 1) {
#pragma unroll
                    for (int h = 1; h < CH; h++)
#pragma unroll
                        for (int t = 0; t < NT; t++)
#pragma unroll
                            for (int v = 0; v < 4; v++) acc[0][t][v] += acc[h][t][v];
                    mmq_store<F, NT>(use, gated, acc[0], n, tiles, parts, tickets, splits, g, c);
#pragma unroll
                    for (int h = 0; h < CH; h++)
#pragma unroll
                        for (int t = 0; t < NT; t++)
                            acc[h][t][0] = acc[h][t][1] = acc[h][t][2] = acc[h][t][3] = 0.f;
                }
                mmq_next(p, gated, row_bytes, g, count, stride, use);
                if (q + j + D < mine) {
                    const u64 at = (u64)(sb0 + load.i) * F::UNIT_BYTES;
                    F::load(load.lo + at, load.hi + at, c, a[j]);
                    mmq_next(p, gated, row_bytes, g, count, stride, load);
                }
            }
        }
    }
}

// The kernels mmq_<format>_<NT> for NT n-tiles (up to 8 · NT token rows); blocks of 256
// threads (8 n-tiles: 32 · MMQ_WIDE_WARPS) with 8·NT · per_split · F::TOKEN_BYTES of dynamic
// shared memory, two a multiprocessor (8 n-tiles: MMQ_WIDE_BLOCKS).
#define MMQ_KERNEL(SUFFIX, F, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(NT > 4 ? 32 * MMQ_WIDE_WARPS : 256,           \
                                                 NT > 4 ? MMQ_WIDE_BLOCKS : 2)                 \
        mmq_##SUFFIX##_##NT(Products p, u64 row_bytes, int k, const u16* xh, int n, int gated, \
                            float* parts, u32* tickets, int splits, int per_split) {           \
        mmq_impl<F, NT>(p, row_bytes, k, xh, n, gated, parts, tickets, splits, per_split);     \
    }
// All four n-tile counts of a format.
#define MMQ_KERNELS(SUFFIX, F) \
    MMQ_KERNEL(SUFFIX, F, 1)   \
    MMQ_KERNEL(SUFFIX, F, 2)   \
    MMQ_KERNEL(SUFFIX, F, 4)   \
    MMQ_KERNEL(SUFFIX, F, 8)
#if FORMAT_q4_k
MMQ_KERNELS(q4_k, MmqK<false>)
#endif
#if FORMAT_q5_k
MMQ_KERNELS(q5_k, MmqK<true>)
#endif
#if FORMAT_q6_k
MMQ_KERNELS(q6_k, MmqQ6k)
#endif
#if FORMAT_q4_0
MMQ_KERNELS(q4_0, MmqLegacy<F_Q4_0>)
#endif
#if FORMAT_q5_0
MMQ_KERNELS(q5_0, MmqLegacy<F_Q5_0>)
#endif
#if FORMAT_q8_0
MMQ_KERNELS(q8_0, MmqQ8_0)
#endif

#endif
