// Tensor-core and packed-f16 helpers shared by the tensor-core products (mmq.cu in the GEMV
// module, moe_mma.cu in the MoE module): mma.sync m16n8k16 with f32 sums, f16x2 arithmetic,
// and the exact conversions of quant bytes to f16 pairs that both dequantize with. Needs
// common.cuh.

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

#endif  // __CUDA_ARCH__ >= 800
