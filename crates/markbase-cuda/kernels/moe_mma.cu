// The grouped MoE products on the tensor cores (mma.sync m16n8k16, f32 sums): each tile of up
// to 8 pairs of one expert (moe_group's tiles, one a block row of the grid) is the 8 columns
// of one n-tile, or a tile of up to 16 pairs two n-tiles (moe_mma_<format>_16: launches over
// quantized experts of more than 8 pairs an expert, moe.rs), so a warp streams 16 of the
// expert's rows, dequantized once, for all the tile's pairs.
// Weights go from memory straight into registers (bf16 and f16 as they are, Q4_0, Q5_0, Q5_1,
// Q8_0, Q4_K and Q5_K dequantized to f16 there); the activations are the gathered slot rows as
// 16-bit values (bf16 for bf16 weights, f16 otherwise: moe_gather_16), read through L1. The
// gated launch (gate and up) writes gelu_tanh(gate) · up rounded to 16 bits, the down launch's
// input; the down launch writes f32 rows for moe_combine. Appended to moe.cu's module; needs
// mma.cuh.
//
// A unit is 64 values of a row (MoeRows). Lane (g, c) holds rows g and g + 8 of its warp's
// tile (gated: gate row 8τ + g and up row 8τ + g), 16 values of each row per unit, as four k16
// slabs of 4 values: the permutation of k shared by the A (weights) and B (activations)
// fragments. The B fragment is the same 4 values of token g (the tile's pair g), two 16-byte
// loads a unit at the format's offsets. Q4_K and Q5_K take a super-block a unit instead
// (MoeKRows) in tiles of 8 pairs. Every run gives the same bits (one warp sums a tile's
// outputs).

#if (FORMAT_bf16 || FORMAT_f16 || FORMAT_q4_0 || FORMAT_q5_0 || FORMAT_q5_1 || FORMAT_q8_0 || \
     FORMAT_q4_k || FORMAT_q5_k) &&                                                            \
    __CUDA_ARCH__ >= 800

// The kernels of tiles of 16 pairs (moe_mma_<format>_16): their bound, MOE_WIDE_MIN_BLOCKS
// blocks of 8 warps a multiprocessor if set; and the Q4_K / Q5_K unit there, 64-value units
// (MoeK64Rows) or super-blocks (MoeKRows). One 26B-A4B layer's experts at 256 tokens
// (cuda_bench --moe, H100, docs/perf.md session 57), µs, Q4_K + Q5_0 / Q5_K + Q5_1 / Q4_K +
// Q8_0: 64-value units 562.4 / 577.8 / 550.7, super-blocks 637.4 / 607.6 / 629.1.
#ifdef MOE_WIDE_MIN_BLOCKS
#define MOE_MMA_WIDE __launch_bounds__(256, MOE_WIDE_MIN_BLOCKS)
#else
#define MOE_MMA_WIDE __launch_bounds__(256)
#endif
#ifndef MOE_WIDE_K_ROWS
#define MOE_WIDE_K_ROWS MoeK64Rows
#endif

// 64-value units (MoeRows) a warp has loaded ahead of the one it multiplies. One 26B-A4B
// layer's experts for 64 tokens routed uniformly (cuda_bench --moe, H200), bf16 / Q8_0 / Q4_K
// (then of 64-value units) with Q8_0 down, µs:
// 2 ahead 398 / 391 / 378, 4 ahead 432 / 541 / 503, 6 ahead 443 / 462 / 417, 8 ahead 761 /
// 513 / 533 (more registers, fewer warps a multiprocessor).
#ifndef MOE_MMA_AHEAD
#define MOE_MMA_AHEAD 2
#endif
// Blocks of 8 warps a multiprocessor the kernels are compiled to fit (`__launch_bounds__`'
// minimum): 4 for Q8_0 and Q4_0 (64 registers or fewer; unbounded they take 68, 3 blocks), none for
// the others; MOE_MMA_MIN_BLOCKS, if set, for every format. One 26B-A4B layer's experts for 64
// tokens (cuda_bench --moe, H100, docs/perf.md session 55), µs unbounded → 4 blocks: Q8_0
// 454 → 432, Q4_0 366 → 338, but Q5_K + Q5_1 330 → 373 and Q4_K + Q8_0 384 → 401 (that
// Q4_K kernel shared its scales over a row pair's lanes, since undone; at 64 registers
// either Q4_K kernel spills).
#ifdef MOE_MMA_MIN_BLOCKS
#define MOE_MMA_FREE __launch_bounds__(256, MOE_MMA_MIN_BLOCKS)
#define MOE_MMA_FOUR __launch_bounds__(256, MOE_MMA_MIN_BLOCKS)
#else
#define MOE_MMA_FREE __launch_bounds__(256)
#define MOE_MMA_FOUR __launch_bounds__(256, 4)
#endif
// As-stored Q4_0 and Q5_0 rows read as whole words (1) or 16 bits at a time (0).
#ifndef MOE_STORED_WORDS
#define MOE_STORED_WORDS 1
#endif
// Super-block units a warp has loaded ahead of the one it multiplies (MoeKRows): one 26B-A4B
// layer's experts for 64 tokens (cuda_bench --moe, H100, docs/perf.md session 56), Q4_K +
// Q5_0 / Q5_K + Q5_1, µs: 1 ahead 280.0 / 284.7 (93 registers), 2 ahead 282.1 / 288.5 (126).
#ifndef MOE_K_AHEAD
#define MOE_K_AHEAD 1
#endif
// The Q4_K and Q5_K kernels' bound: MOE_K_MIN_BLOCKS blocks a multiprocessor, if set (3 with
// one unit ahead: 286.4 / 295.8 µs above).
#ifdef MOE_K_MIN_BLOCKS
#define MOE_MMA_K __launch_bounds__(256, MOE_K_MIN_BLOCKS)
#else
#define MOE_MMA_K MOE_MMA_FREE
#endif

// bf16 or f16 weights: a lane's 16 values of a unit are its 32 contiguous bytes 32c ...
template <bool BF16>
struct MoePlain {
    // Whether the products are bf16 (else f16); a lane's two 8-value activation pieces.
    static constexpr bool IS_BF16 = BF16;
    static __device__ __forceinline__ int piece(int c, int i) { return 16 * c + 8 * i; }

    struct Unit {
        uint4 v[2];
    };

    static __device__ __forceinline__ void load(const u8* row, int u, int, int c, Unit& a) {
        const uint4* p = (const uint4*)(row + 128 * (u64)u + 32 * c);
        a.v[0] = __ldg(p);
        a.v[1] = __ldg(p + 1);
    }

    // W[2s], W[2s + 1]: the lane's values 4s, 4s + 1 and 4s + 2, 4s + 3 of the unit (slab s).
    static __device__ __forceinline__ void slabs(const Unit& a, int, u32* W) {
        const uint4 v0 = a.v[0], v1 = a.v[1];
        W[0] = v0.x, W[1] = v0.y, W[2] = v0.z, W[3] = v0.w;
        W[4] = v1.x, W[5] = v1.y, W[6] = v1.z, W[7] = v1.w;
    }
};

// Q8_0 weights (rows as on the device, layout.rs): a unit is two blocks; lane c's 16 values
// are quants 16(c & 1) .. of block 2u + c / 2, times its scale, each weight rounded once to
// f16 (q8_pair_f16). The quants lie 16-byte aligned in whole groups of aligned rows, 4-byte
// aligned in rows of an even block count, 2-byte aligned in a row's last blocks otherwise.
struct MoeQ8_0 {
    static constexpr bool IS_BF16 = false;
    static __device__ __forceinline__ int piece(int c, int i) { return 16 * c + 8 * i; }

    struct Unit {
        u32 q[4];
        u32 d;
    };

    static __device__ __forceinline__ void load(const u8* row, int u, int k, int c, Unit& a) {
        const u8* q;
        const u8* d = q8_0_block(row, 2 * u + (c >> 1), k, &q);
        q += 16 * (c & 1);
        a.d = ld16(d);
        const u64 at = (u64)q;
        if ((at & 15) == 0) {
            const uint4 v = __ldg((const uint4*)q);
            a.q[0] = v.x, a.q[1] = v.y, a.q[2] = v.z, a.q[3] = v.w;
        } else if ((at & 3) == 0) {
#pragma unroll
            for (int i = 0; i < 4; i++) a.q[i] = __ldg((const u32*)q + i);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++)
                a.q[i] = (u32)ld16(q + 4 * i) | ((u32)ld16(q + 4 * i + 2) << 16);
        }
    }

    static __device__ __forceinline__ void slabs(const Unit& a, int, u32* W) {
        const u32 s = a.d * 0x10001u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = a.q[i] ^ 0x80808080u;
            W[2 * i] = q8_pair_f16(w, 0x4140u, s);
            W[2 * i + 1] = q8_pair_f16(w, 0x4342u, s);
        }
    }
};

// Bits 4i .. 4i + 3 of a 5-bit block's fifth-bit word `qh` (as stored: value j's at bit j) at
// bit 4 of bytes 0 .. 3, spread by one multiply (the shifted copies of the 4 bits do not overlap,
// so the product is their sum).
__device__ __forceinline__ u32 stored_fifth_bits(u32 qh, int i) {
    return ((((qh >> (4 * i)) & 15u) * 0x00204081u) & 0x01010101u) << 4;
}

// Q4_0 and Q5_0 weights: a unit is two blocks; lane c's 16 values are values 16(c & 1) .. of
// block 2u + c / 2, times its f16 scale d, each weight (q − 8) · d (Q4_0) or (q − 16) · d (Q5_0)
// rounded once to f16 (the reference's weights rounded to f16). Rows of whole 8-block units lie
// as laid out on the device (layout.rs: the lane's 16 values are one slot's nibbles, Q5_0's
// fifth bits that slot's word), other rows as stored (18- / 22-byte blocks, 2-byte aligned:
// whole words funnel-shifted into place; the low or high nibbles of the block's 16 quant
// bytes, bits 16(c & 1) .. of Q5_0's fifth-bit word).
template <int FMT>
struct MoeLegacy {
    static constexpr bool IS_BF16 = false;
    static constexpr bool FIFTH = FMT == F_Q5_0;
    static __device__ __forceinline__ int piece(int c, int i) { return 16 * c + 8 * i; }

    struct Unit {
        u32 q[4];
        u32 qh;
        u32 d;
        bool laid;
    };

    static __device__ __forceinline__ void load(const u8* row, int u, int k, int c, Unit& a) {
        const int blk = 2 * u + (c >> 1);
        a.laid = (k & 255) == 0;
        a.qh = 0;
        int shift;
        if (a.laid) {
            const u8* grp = row + (FIFTH ? 176 : 144) * (u64)(blk >> 3);
            const int b = blk & 7, s = (b & ~1) + (c & 1);
            shift = 4 * (b & 1);
            a.d = ld16(grp + 2 * b);
            const uint4 v = __ldg((const uint4*)(grp + 16) + s);
            a.q[0] = v.x, a.q[1] = v.y, a.q[2] = v.z, a.q[3] = v.w;
            if (FIFTH) a.qh = __ldg((const u32*)(grp + 144) + s) >> shift;
        } else {
            const u8* b = row + (FIFTH ? 22 : 18) * (u64)blk;
            shift = 4 * (c & 1);
            if (MOE_STORED_WORDS) {
                // Rows of whole units hold an even count of blocks, so (in a 4-byte aligned
                // row) an even block starts 4-byte aligned and an odd one 2 bytes past: the
                // words from the one at or before its start, each field funnel-shifted by t
                // bits out of two words.
                const u32* v = (const u32*)((u64)b & ~(u64)3);
                const u32 t = 8 * (u32)((u64)b & 3) + 16;  // 16 aligned, 32 two bytes past
                constexpr int WORDS = FIFTH ? 6 : 5;
                u32 word[WORDS];
#pragma unroll
                for (int j = 0; j < WORDS; j++) word[j] = __ldg(v + j);
                a.d = (word[0] >> (t - 16)) & 0xffffu;
                if (FIFTH) a.qh = __funnelshift_rc(word[0], word[1], t) >> (16 * (c & 1));
#pragma unroll
                for (int i = 0; i < 4; i++)
                    a.q[i] = FIFTH ? __funnelshift_rc(word[1 + i], word[2 + i], t)
                                   : __funnelshift_rc(word[i], word[i + 1], t);
            } else {
                const u8* qs = b + (FIFTH ? 6 : 2);
                a.d = ld16(b);
                if (FIFTH)
                    a.qh = ((u32)ld16(b + 2) | ((u32)ld16(b + 4) << 16)) >> (16 * (c & 1));
#pragma unroll
                for (int i = 0; i < 4; i++)
                    a.q[i] = (u32)ld16(qs + 4 * i) | ((u32)ld16(qs + 2 + 4 * i) << 16);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) a.q[i] >>= shift;
    }

    static __device__ __forceinline__ void slabs(const Unit& a, int, u32* W) {
        const u32 s = a.d * 0x10001u, bias = FIFTH ? 0x64106410u : 0x64086408u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // Q5_0's fifth bits of values 4i .. 4i + 3 to bit 4 of their bytes: laid out, bits
            // i, 8 + i, …; as stored, bits 4i .. 4i + 3.
            u32 w = a.q[i] & 0x0F0F0F0Fu;
            if (FIFTH)
                w |= a.laid ? ((a.qh >> i) & 0x01010101u) << 4 : stored_fifth_bits(a.qh, i);
            W[2 * i] = byte_pair_f16(w, 0x4140u, bias, s);
            W[2 * i + 1] = byte_pair_f16(w, 0x4342u, bias, s);
        }
    }
};

// Q5_1 weights as stored (24-byte blocks, 8-byte aligned in rows of whole 64-value units): a
// unit is two blocks; lane c's 16 values are values 16(c & 1) .. of block 2u + c / 2 (the low or
// high nibbles of its 16 quant bytes, bits 16(c & 1) .. of its fifth-bit word), each weight
// fma(q, d, m) rounded once to f16 (d and m its f16 scale and offset).
struct MoeQ5_1 {
    static constexpr bool IS_BF16 = false;
    static __device__ __forceinline__ int piece(int c, int i) { return 16 * c + 8 * i; }

    struct Unit {
        u32 q[4];
        u32 qh;
        u32 dm;
    };

    static __device__ __forceinline__ void load(const u8* row, int u, int, int c, Unit& a) {
        const u8* b = row + 24 * (u64)(2 * u + (c >> 1));
        const int shift = 4 * (c & 1);
        a.dm = __ldg((const u32*)b);
        a.qh = __ldg((const u32*)b + 1) >> (16 * (c & 1));
        const uint2 v0 = __ldg((const uint2*)(b + 8)), v1 = __ldg((const uint2*)(b + 16));
        a.q[0] = v0.x >> shift, a.q[1] = v0.y >> shift;
        a.q[2] = v1.x >> shift, a.q[3] = v1.y >> shift;
    }

    static __device__ __forceinline__ void slabs(const Unit& a, int, u32* W) {
        const u32 d = (a.dm & 0xffffu) * 0x10001u, m = (a.dm >> 16) * 0x10001u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = (a.q[i] & 0x0F0F0F0Fu) | stored_fifth_bits(a.qh, i);
            W[2 * i] = byte_pair_f16_fma(w, 0x4140u, d, m);
            W[2 * i + 1] = byte_pair_f16_fma(w, 0x4342u, d, m);
        }
    }
};

// Q4_K (FIFTH false) and Q5_K (true, as laid out on the device: layout.rs) weights: a unit is
// the chunk pair p = u % 4 of super-block u / 4 (its 32 quant bytes: chunk 2p in the low
// nibbles, 2p + 1 in the high; Q5_K's fifth bits in the words of lane slots 2p and 2p + 1).
// Lane c holds bytes 8c .. 8c + 7: values 8c .. 8c + 7 of each chunk (unit values 8c .. and
// 32 + 8c ..), each weight fma(q, S, −M) rounded once to f16 as mmq.cu's MmqK
// dequantize.
template <bool FIFTH>
struct MoeK {
    static constexpr bool IS_BF16 = false;
    static __device__ __forceinline__ int piece(int c, int i) { return 8 * c + 32 * i; }

    struct Unit {
        uint4 h;
        uint2 q;
        u32 f;
    };

    static __device__ __forceinline__ void load(const u8* row, int u, int, int c, Unit& a) {
        const u8* sb = row + (FIFTH ? 176 : 144) * (u64)(u >> 2);
        a.h = __ldg((const uint4*)sb);
        a.q = __ldg((const uint2*)(sb + 16 + 32 * (u & 3) + 8 * c));
        // Slot 2p + c / 2's word, its values 8(c & 1) .. (words 2(c & 1), + 1) at bits 0 ..
        if (FIFTH) a.f = __ldg((const u32*)(sb + 144) + 2 * (u & 3) + (c >> 1)) >> (2 * (c & 1));
    }

    static __device__ __forceinline__ void slabs(const Unit& a, int u, u32* W) {
        const int p = u & 3;
        const float d = f16_to_f32((u16)(a.h.x & 0xffff)), dm = f16_to_f32((u16)(a.h.x >> 16));
        u32 S[2], M[2];
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            float s, m;
            q4k_scale_min(a.h, 2 * p + hi, &s, &m);
            S[hi] = f16x2_sat(d * s, d * s);
            M[hi] = f16x2_sat(-(dm * m), -(dm * m));
        }
        const u32 q[2] = {a.q.x, a.q.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if constexpr (FIFTH) {
                u32 lo, up;
                laid_five_bit_bytes(q[i], a.f, i, lo, up);
                W[2 * i] = byte_pair_f16_fma(lo, 0x4140u, S[0], M[0]);
                W[2 * i + 1] = byte_pair_f16_fma(lo, 0x4342u, S[0], M[0]);
                W[4 + 2 * i] = byte_pair_f16_fma(up, 0x4140u, S[1], M[1]);
                W[4 + 2 * i + 1] = byte_pair_f16_fma(up, 0x4342u, S[1], M[1]);
            } else {
                u32 l0, l1, h0, h1;
                q4_nibbles_f16(q[i], l0, l1, h0, h1);
                W[2 * i] = h2_fma(l0, S[0], M[0]);
                W[2 * i + 1] = h2_fma(l1, S[0], M[0]);
                W[4 + 2 * i] = h2_fma(h0, S[1], M[1]);
                W[4 + 2 * i + 1] = h2_fma(h1, S[1], M[1]);
            }
        }
    }
};

// A row pair of a format W of 64-value units (MoePlain, MoeQ8_0, MoeLegacy, MoeQ5_1, MoeK):
// each row's unit loaded apart; a unit's product takes the lane's two 8-value activation
// pieces (W::piece) and W's four k16 slabs, into the two sums' chains by slab pair.
template <class W>
struct MoeRows {
    // Values a unit covers; whether the products are bf16 (else f16).
    static constexpr int K = 64;
    static constexpr bool IS_BF16 = W::IS_BF16;

    struct Unit {
        typename W::Unit r[2];
    };

    // Unit u of rows `lo` and `hi` (each at the row's first byte; `k` values a row).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int u, int k, int c,
                                                Unit& a) {
        W::load(lo, u, k, c, a.r[0]);
        W::load(hi, u, k, c, a.r[1]);
    }

    // acc[j] += unit u of the rows times n-tile j's slot row `xt[j]`'s values there (lane
    // (g, c): the n-tile's token g), the weights dequantized once for the NT n-tiles.
    template <int NT>
    static __device__ __forceinline__ void mul(const Unit& a, const u16* const* xt, int u, int c,
                                               float (*acc)[2][4]) {
        u32 B[NT][8];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const uint4 b0 = __ldg((const uint4*)(xt[j] + 64 * u + W::piece(c, 0)));
            const uint4 b1 = __ldg((const uint4*)(xt[j] + 64 * u + W::piece(c, 1)));
            B[j][0] = b0.x, B[j][1] = b0.y, B[j][2] = b0.z, B[j][3] = b0.w;
            B[j][4] = b1.x, B[j][5] = b1.y, B[j][6] = b1.z, B[j][7] = b1.w;
        }
        u32 wl[8], wh[8];
        W::slabs(a.r[0], u, wl);
        W::slabs(a.r[1], u, wh);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const u32 A[4] = {wl[2 * s], wh[2 * s], wl[2 * s + 1], wh[2 * s + 1]};
#pragma unroll
            for (int j = 0; j < NT; j++) {
                if constexpr (W::IS_BF16)
                    mma_bf16(acc[j][s >> 1], A, B[j][2 * s], B[j][2 * s + 1]);
                else
                    mma_f16(acc[j][s >> 1], A, B[j][2 * s], B[j][2 * s + 1]);
            }
        }
    }
};

// A row pair of Q4_K (FIFTH false) or Q5_K (true) experts, a super-block a unit (KQuantRows,
// mma.cuh): lane c decodes the scales of its one chunk pair of each row a super-block (MoeK's
// 64-value units decode two a unit, the same for all four lanes) and reads its 64 contiguous
// activations there, values 64c .. 64c + 63 of token g's slot row. 96 SASS instructions a 64
// values against MoeK's 182, but 93 registers against 77 in session 56 (2 blocks of 8 warps a
// multiprocessor, not 3; since session 57's n-tile template ptxas gives moe_mma_q4_k 127). One 26B-A4B layer's experts (cuda_bench --moe, H100, docs/perf.md session 56), Q4_K
// + Q5_0 / Q5_K + Q5_1, µs: 64 tokens 315.4 / 334.6 → 280.0 / 284.7; 256 tokens (2–3 tiles
// of 8 an expert) 631.1 / 680.2 → 654.1 / 647.6, where more tiles leave more blocks to keep
// resident; such launches now take tiles of 16 pairs, in MoeK's units (MOE_WIDE_K_ROWS).
template <bool FIFTH>
struct MoeKRows {
    // Values a unit covers; the products are f16.
    static constexpr int K = 256;
    static constexpr bool IS_BF16 = false;
    typedef KQuantRows<FIFTH> R;
    typedef typename R::Unit Unit;

    // Unit u of rows `lo` and `hi` (each at the row's first byte).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int u, int, int c,
                                                Unit& a) {
        const u64 at = (u64)u * R::UNIT_BYTES;
        R::load(lo + at, hi + at, c, a);
    }

    // acc[j][h] += unit u's chunk 2c + h of the rows times n-tile j's slot row `xt[j]`'s
    // values there. One n-tile loads its 8 activation pieces first; two load a piece pair a
    // fragment step (fewer registers), the fragments built once for both.
    template <int NT>
    static __device__ __forceinline__ void mul(const Unit& a, const u16* const* xt, int u, int c,
                                               float (*acc)[2][4]) {
        if constexpr (NT == 1) {
            const uint4* x = (const uint4*)(xt[0] + 256 * u + 64 * c);
            uint4 b[8];
#pragma unroll
            for (int m = 0; m < 8; m++) b[m] = __ldg(x + m);
            const typename R::Scales sc = R::scales(a, c);
#pragma unroll
            for (int ip = 0; ip < 4; ip++) {
                u32 A[2][2][4];
                R::fragments(a, sc, ip, A);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint4 v = b[4 * h + ip];
                    mma_f16(acc[0][h], A[0][h], v.x, v.y);
                    mma_f16(acc[0][h], A[1][h], v.z, v.w);
                }
            }
        } else {
            const typename R::Scales sc = R::scales(a, c);
#pragma unroll
            for (int ip = 0; ip < 4; ip++) {
                uint4 b[NT][2];
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        b[j][h] = __ldg((const uint4*)(xt[j] + 256 * u + 64 * c) + 4 * h + ip);
                u32 A[2][2][4];
                R::fragments(a, sc, ip, A);
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        mma_f16(acc[j][h], A[0][h], b[j][h].x, b[j][h].y);
                        mma_f16(acc[j][h], A[1][h], b[j][h].z, b[j][h].w);
                    }
            }
        }
    }
};

// out for tile blockIdx.y's pairs and warp τ's rows of the tile's expert: gated, outputs
// 8τ .. 8τ + 7 of `rows` (the expert's gate rows then its up rows, 2·rows of them) as
// rounded_bits(out_kind, gelu_tanh(gate) · up) into the u16 rows [slot][rows]; otherwise rows
// 16τ .. 16τ + 15 of the expert's `rows` as floats into [slot][rows]. x: the slots' 16-bit
// activation rows, k values each (k a multiple of P::K). Without `tiles` (the per-pair path)
// tile p is pair p alone, its expert ids[p] (a bad id: outputs of 0). P: a row pair's units
// (MoeRows, MoeKRows). NT: n-tiles of 8 pairs a tile (1, or 2 for moe_group's tiles of 16).
template <class P, int NT>
__device__ void moe_mma_impl(const u8* w, u64 row_bytes, int k, int rows, const u16* x,
                             const int* tiles, const float* ids, int n_experts, u32* err,
                             int gated, int out_kind, void* out) {
    constexpr int D = P::K == 256 ? MOE_K_AHEAD : MOE_MMA_AHEAD;
    wait_prior_grid();
    int e, s0, nt, units = k / P::K;
    if (tiles) {
        const int* tile = tiles + 3 * blockIdx.y;
        e = tile[0], s0 = tile[1], nt = tile[2];
        if (nt == 0) return;  // the whole block: past the last tile
    } else {
        e = expert_of(ids, blockIdx.y, n_experts, err), s0 = blockIdx.y, nt = 1;
        if (e < 0) e = 0, units = 0;  // no products: every output 0
    }
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tau = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int per = gated ? 8 : 16;
    if (tau * per >= rows) return;
    const u8* base = w + (u64)e * (gated ? 2 : 1) * rows * row_bytes;
    const int rl = min(per * tau + g, rows - 1), rh = gated ? rows + rl : min(rl + 8, rows - 1);
    const u8* lo = base + (u64)rl * row_bytes;
    const u8* hi = base + (u64)rh * row_bytes;
    const u16* xt[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) xt[j] = x + (u64)(s0 + min(8 * j + g, nt - 1)) * k;

    typename P::Unit a[D];
#pragma unroll
    for (int j = 0; j < D; j++)
        if (j < units) P::load(lo, hi, j, k, c, a[j]);
    float acc[NT][2][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) acc[j][0][v] = acc[j][1][v] = 0.f;
    for (int q = 0; q < units; q += D) {
#pragma unroll
        for (int j = 0; j < D; j++) {
            const int u = q + j;
            if (u < units) {
                P::template mul<NT>(a[j], xt, u, c, acc);
                if (u + D < units) P::load(lo, hi, u + D, k, c, a[j]);
            }
        }
    }
    // Lane (g, c), n-tile j: acc v = 0, 1 row g and v = 2, 3 row g + 8, of the tile's pairs
    // 8j + 2c and 8j + 2c + 1.
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int v = 0; v < 4; v++) acc[j][0][v] += acc[j][1][v];
        if (gated) {
            const int i = 8 * tau + g;
#pragma unroll
            for (int v = 0; v < 2; v++) {
                const int t = 8 * j + 2 * c + v;
                if (i < rows && t < nt)
                    ((u16*)out)[(u64)(s0 + t) * rows + i] =
                        rounded_bits(out_kind, gelu_tanh(acc[j][0][v]) * acc[j][0][v + 2]);
            }
        } else {
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int r = 16 * tau + g + 8 * (v >> 1), t = 8 * j + 2 * c + (v & 1);
                if (r < rows && t < nt) ((float*)out)[(u64)(s0 + t) * rows + r] = acc[j][0][v];
            }
        }
    }
}

// The kernels moe_mma_<format> (tiles of up to 8 pairs, or single pairs) and, for quantized
// formats, moe_mma_<format>_16 (moe_group's tiles of up to 16 pairs, two n-tiles a warp; bf16
// and f16 experts keep tiles of 8, moe.rs `WIDE_TILE`): blocks of 256
// threads (8 warps, each a tile of rows), grid (row blocks, most tiles or pairs).
#define MOE_MMA_KERNEL_NT(NAME, W, NT, BOUNDS)                                                 \
    extern "C" __global__ void BOUNDS NAME(const u8* w, u64 row_bytes, int k, int rows,        \
                                           const u16* x, const int* tiles, const float* ids,   \
                                           int n_experts, u32* err, int gated, int out_kind,   \
                                           void* out) {                                        \
        moe_mma_impl<W, NT>(w, row_bytes, k, rows, x, tiles, ids, n_experts, err, gated,       \
                            out_kind, out);                                                    \
    }
#define MOE_MMA_KERNEL(SUFFIX, W, BOUNDS) MOE_MMA_KERNEL_NT(moe_mma_##SUFFIX, W, 1, BOUNDS)
#define MOE_MMA_KERNELS(SUFFIX, W, BOUNDS) \
    MOE_MMA_KERNEL(SUFFIX, W, BOUNDS)      \
    MOE_MMA_KERNEL_NT(moe_mma_##SUFFIX##_16, W, 2, MOE_MMA_WIDE)
#if FORMAT_bf16
MOE_MMA_KERNEL(bf16, MoeRows<MoePlain<true>>, MOE_MMA_FREE)
#endif
#if FORMAT_f16
MOE_MMA_KERNEL(f16, MoeRows<MoePlain<false>>, MOE_MMA_FREE)
#endif
#if FORMAT_q4_0
MOE_MMA_KERNELS(q4_0, MoeRows<MoeLegacy<F_Q4_0>>, MOE_MMA_FOUR)
#endif
#if FORMAT_q5_0
MOE_MMA_KERNELS(q5_0, MoeRows<MoeLegacy<F_Q5_0>>, MOE_MMA_FREE)
#endif
#if FORMAT_q5_1
MOE_MMA_KERNELS(q5_1, MoeRows<MoeQ5_1>, MOE_MMA_FREE)
#endif
#if FORMAT_q8_0
MOE_MMA_KERNELS(q8_0, MoeRows<MoeQ8_0>, MOE_MMA_FOUR)
#endif
// Q4_K and Q5_K: super-block units in tiles of 8 pairs (moe_mma_<format>), and in tiles of 16
// the units MOE_WIDE_K_ROWS says (moe_mma_<format>_16).
template <bool FIFTH>
using MoeK64Rows = MoeRows<MoeK<FIFTH>>;
#if FORMAT_q4_k
MOE_MMA_KERNEL(q4_k, MoeKRows<false>, MOE_MMA_K)
MOE_MMA_KERNEL_NT(moe_mma_q4_k_16, MOE_WIDE_K_ROWS<false>, 2, MOE_MMA_WIDE)
#endif
#if FORMAT_q5_k
MOE_MMA_KERNEL(q5_k, MoeKRows<true>, MOE_MMA_K)
MOE_MMA_KERNEL_NT(moe_mma_q5_k_16, MOE_WIDE_K_ROWS<true>, 2, MOE_MMA_WIDE)
#endif

#endif

#if SHARED_KERNELS  // format-independent (quant.cuh)
// xh[s, :] = x[order[s] / top_k, :] rounded as `kind` says (rounded_bits: 1 bf16, 2 f16): each
// slot's token row for the tensor-core products. One block per slot.
extern "C" __global__ void moe_gather_16(const float* x, int d, int top_k, const int* order,
                                         int kind, u16* xh) {
    wait_prior_grid();
    u64 s = blockIdx.x;
    int p = order[s];
    if (p < 0) return;
    const float* src = x + (u64)(p / top_k) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) xh[s * d + i] = rounded_bits(kind, src[i]);
}
#endif  // SHARED_KERNELS
