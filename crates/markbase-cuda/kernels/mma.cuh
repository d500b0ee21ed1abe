// Tensor-core and packed-f16 helpers shared by the tensor-core products (mmq.cu in the GEMV
// module, moe_mma.cu in the MoE module): mma.sync m16n8k16 with f32 sums, f16x2 arithmetic,
// the exact conversions of quant bytes to f16 pairs that both dequantize with, and the Q4_K /
// Q5_K super-blocks of a row pair both read (KQuantRows). Needs common.cuh and quant.cuh.

#if __CUDA_ARCH__ >= 800  // mma.sync m16n8k16

// The f16 pair (lo, hi) of two floats, saturating at ±65 504 (f16_range).
__device__ __forceinline__ u32 f16x2_sat(float lo, float hi) {
    u32 r;
#ifdef MB_EMU
    r = emu_pack(emu_sat(lo), emu_sat(hi));
#elif __CUDA_ARCH__ >= 900
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f16_range(hi)), "f"(f16_range(lo)));
#endif
    return r;
}

// a · b + c for f16 pairs, rounded once.
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
#ifdef MB_EMU
    return emu_h2_fma(a, b, c);
#else
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// a · b for f16 pairs.
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
#ifdef MB_EMU
    return emu_h2_mul(a, b);
#else
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#endif
}

// a − b for f16 pairs.
__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
#ifdef MB_EMU
    return emu_h2_sub(a, b);
#else
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#endif
}

// (a & b) | c.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
#ifdef MB_EMU
    return emu_lop3_ea(a, b, c);
#else
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// c += a · b on the tensor cores (16 × 16 f16 A, 16 × 8 f16 B, f32 C).
__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
#ifdef MB_EMU
    mb_emu::mma(c, a, b0, b1, false);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += a · b on the tensor cores (16 × 16 bf16 A, 16 × 8 bf16 B, f32 C).
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
#ifdef MB_EMU
    mb_emu::mma(c, a, b0, b1, true);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The nibbles of quant word q as exact f16 pairs: l0 = the low nibbles of bytes 0, 1, l1 of
// bytes 2, 3, h0 and h1 the high nibbles likewise. A nibble becomes the f16 1024 + n (1024 +
// 16n from the high nibble) by one lop3 with 0x6400, then n by a subtraction (or 1/16 · v −
// 64).
__device__ __forceinline__ void q4_nibbles_f16(u32 q, u32& l0, u32& l1, u32& h0, u32& h1) {
    // Bytes 0, 2, 1, 3: each 16-bit half then holds two consecutive weights.
    const u32 w = __byte_perm(q, 0, 0x3120), w8 = w >> 8;
    l0 = h2_sub(and_or(w, 0x000F000Fu, 0x64006400u), 0x64006400u);
    l1 = h2_sub(and_or(w8, 0x000F000Fu, 0x64006400u), 0x64006400u);
    h0 = h2_fma(and_or(w, 0x00F000F0u, 0x64006400u), 0x2C002C00u, 0xD400D400u);
    h1 = h2_fma(and_or(w8, 0x00F000F0u, 0x64006400u), 0x2C002C00u, 0xD400D400u);
}

// The f16 pair of word w's bytes b0, b1 (sel 0x4140) or b2, b3 (sel 0x4342), each less the
// f16 pair `bias` − 1024, times the broadcast f16 scale s, each rounded once: a byte b becomes
// the f16 1024 + b by a byte permutation with 0x64, then b − (bias − 1024) by an exact
// subtraction (bias 1024 + 32 for Q6_K's 6-bit values, 1024 + 16 for Q5_0's 5-bit ones).
__device__ __forceinline__ u32 byte_pair_f16(u32 w, u32 sel, u32 bias, u32 s) {
    return h2_mul(h2_sub(__byte_perm(w, 0x64646464u, sel), bias), s);
}

// The f16 pair of word w's unsigned bytes b0, b1 (sel 0x4140) or b2, b3 (sel 0x4342), each
// b · s + m rounded once (s, m broadcast f16 pairs): a byte b becomes the f16 1024 + b by a byte
// permutation with 0x64, then b by an exact subtraction.
__device__ __forceinline__ u32 byte_pair_f16_fma(u32 w, u32 sel, u32 s, u32 m) {
    return h2_fma(h2_sub(__byte_perm(w, 0x64646464u, sel), 0x64006400u), s, m);
}

// The f16 pair of quant word w's signed bytes b0, b1 (sel 0x4140) or b2, b3 (sel 0x4342)
// times the broadcast f16 scale s, each rounded once; w has its bytes offset by 128 (the
// stored bytes ^ 0x80808080), taken off as 1024 + 128.
__device__ __forceinline__ u32 q8_pair_f16(u32 w, u32 sel, u32 s) {
    return byte_pair_f16(w, sel, 0x64806480u, s);
}

// Word i (0..7) of a lane's 32 quant bytes of one row.
__device__ __forceinline__ u32 mmq_word(const uint4* q, int i) {
    const uint4 v = q[i >> 2];
    const int j = i & 3;
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Q4_K's and Q5_K's scales of chunks 2c (hi 0) and 2c + 1 (hi 1) of a lane's two rows (their
// super-blocks' 16-byte headers h) as broadcast f16 pairs: s[row][hi] = S = f16(d · scale),
// m[row][hi] = −M = −f16(dmin · min), each rounded once (saturating at ±65 504).
struct MmqKScales {
    u32 s[2][2], m[2][2];
};

__device__ __forceinline__ MmqKScales mmq_k_scales(const uint4* h, int c) {
    MmqKScales r;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float d = f16_to_f32((u16)(h[e].x & 0xffff)), dm = f16_to_f32((u16)(h[e].x >> 16));
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            float s, m;
            q4k_scale_min(h[e], 2 * c + hi, &s, &m);
            r.s[e][hi] = f16x2_sat(d * s, d * s);
            r.m[e][hi] = f16x2_sat(-(dm * m), -(dm * m));
        }
    }
    return r;
}

// Q4_K (FIFTH false) and Q5_K (true) weights of two rows, lo and hi, for the tensor-core
// products (mmq.cu's MmqK, moe_mma.cu's MoeKRows). A unit is a super-block (256 values; Q4_K
// 144 bytes a row, Q5_K 176 as laid out on the device, layout.rs: Q4_K's header and quant
// bytes, then a word of fifth bits a lane slot). Lane c holds for each row the 16-byte header
// and quant bytes 32c .. 32c + 31: chunk 2c's 32 weights (low nibbles) and chunk 2c + 1's
// (high nibbles), so it needs one chunk pair's scales (Q5_K: and the fifth-bit words of lane
// slots 2c and 2c + 1). Word i of those bytes gives one k16 slab per chunk: its weights 4i,
// 4i + 1 in the A fragment's first k pair and 4i + 2, 4i + 3 in its second; the B fragment
// takes the same four activations of token g (the unit's values 64c + 4i .. of chunk 2c,
// 64c + 32 + 4i .. of chunk 2c + 1).
//
// Dequantization, Q4_K: a nibble n becomes the f16 1024 + n (or 1024 + 16n from the high
// nibble) by one lop3 with 0x6400, then the exact n by a subtraction (or 1/16 · v − 64). Q5_K:
// the 5-bit bytes (the fifth bits by a shift and a mask, as Q5_0's) become the f16 1024 + q by
// a byte permutation with 0x64, q by an exact subtraction. Then w = fma(q, S, −M) rounded once
// to f16, with S = f16(d · scale) and M = f16(dmin · min) (each rounded once, saturating at
// ±65 504). Tests model exactly this rounding.
template <bool FIFTH>
struct KQuantRows {
    // A unit's bytes in a row.
    static constexpr int UNIT_BYTES = FIFTH ? 176 : 144;

    struct Unit {
        uint4 h[2];
        uint4 q[2][2];
        uint2 f[2];
    };

    // The unit of rows `lo` and `hi` (each at the unit's first byte).
    static __device__ __forceinline__ void load(const u8* lo, const u8* hi, int c, Unit& a) {
        a.h[0] = __ldg((const uint4*)lo);
        a.h[1] = __ldg((const uint4*)hi);
        a.q[0][0] = __ldg((const uint4*)(lo + 16 + 32 * c));
        a.q[0][1] = __ldg((const uint4*)(lo + 32 + 32 * c));
        a.q[1][0] = __ldg((const uint4*)(hi + 16 + 32 * c));
        a.q[1][1] = __ldg((const uint4*)(hi + 32 + 32 * c));
        if (FIFTH) {
            a.f[0] = __ldg((const uint2*)(lo + 144 + 8 * c));
            a.f[1] = __ldg((const uint2*)(hi + 144 + 8 * c));
        }
    }

    // The lane's chunk pair's scales (MmqKScales).
    typedef MmqKScales Scales;
    static __device__ __forceinline__ Scales scales(const Unit& a, int c) {
        return mmq_k_scales(a.h, c);
    }

    // The A fragments of words 2ip and 2ip + 1 of the lane's chunks: A[word][chunk] = {row lo
    // first pair, row hi first pair, row lo second pair, row hi second pair}.
    static __device__ __forceinline__ void fragments(const Unit& a, const Scales& sc, int ip,
                                                     u32 (*A)[2][4]) {
#pragma unroll
        for (int wi = 0; wi < 2; wi++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const u32 q = mmq_word(a.q[e], 2 * ip + wi);
                if constexpr (FIFTH) {
                    const int i = (2 * ip + wi) & 3;  // word i of lane slot 2c + (ip >> 1)
                    const u32 f = ip >> 1 ? a.f[e].y : a.f[e].x;
                    u32 lo, up;
                    laid_five_bit_bytes(q, f, i, lo, up);
                    A[wi][0][e] = byte_pair_f16_fma(lo, 0x4140u, sc.s[e][0], sc.m[e][0]);
                    A[wi][0][2 + e] = byte_pair_f16_fma(lo, 0x4342u, sc.s[e][0], sc.m[e][0]);
                    A[wi][1][e] = byte_pair_f16_fma(up, 0x4140u, sc.s[e][1], sc.m[e][1]);
                    A[wi][1][2 + e] = byte_pair_f16_fma(up, 0x4342u, sc.s[e][1], sc.m[e][1]);
                } else {
                    u32 l0, l1, h0, h1;
                    q4_nibbles_f16(q, l0, l1, h0, h1);
                    A[wi][0][e] = h2_fma(l0, sc.s[e][0], sc.m[e][0]);
                    A[wi][0][2 + e] = h2_fma(l1, sc.s[e][0], sc.m[e][0]);
                    A[wi][1][e] = h2_fma(h0, sc.s[e][1], sc.m[e][1]);
                    A[wi][1][2 + e] = h2_fma(h1, sc.s[e][1], sc.m[e][1]);
                }
            }
        }
    }
};

#endif  // __CUDA_ARCH__ >= 800
