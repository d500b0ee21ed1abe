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

// Hopper's warpgroup products (wgmma, compiled for sm_90a, and in the CPU emulator): the 4
// warps of a warpgroup (threads 128w .. 128w + 127 of a 1-D block) multiply a 64 × 16 f16 A —
// from registers, each warp's 16 rows as mma_f16's A fragments — by a 16 × N f16 B in shared
// memory, adding into f32 accumulators laid out as mma_f16's C, N / 8 n-tiles one after
// another. Asynchronous on the GPU: wgmma_fence before a batch whose A or accumulators other
// instructions wrote, wgmma_commit after it, wgmma_wait<N> before touching them again.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(MB_EMU)
#define MB_HAS_WGMMA 1

// B of a wgmma: core matrices of 8 columns (N) × 8 k values, 16 bytes a column, `lbo` bytes
// apart along K and `sbo` along N (K-major, no swizzle), from shared address `at` (16-byte
// aligned): the matrix descriptor (address, leading and stride byte offsets, each / 16).
struct WgmmaB {
#ifdef MB_EMU
    u32 at, lbo, sbo;
#else
    u64 desc;
#endif
};

__device__ __forceinline__ WgmmaB wgmma_b(u32 at, u32 lbo, u32 sbo) {
#ifdef MB_EMU
    return WgmmaB{at, lbo, sbo};
#else
    return WgmmaB{(u64)((at & 0x3FFFF) >> 4) | (u64)(lbo >> 4) << 16 | (u64)(sbo >> 4) << 32};
#endif
}

// B moved `bytes` on (a multiple of 16, within the descriptor's 18-bit address).
__device__ __forceinline__ WgmmaB wgmma_b_at(WgmmaB b, u32 bytes) {
#ifdef MB_EMU
    b.at += bytes;
#else
    b.desc += bytes >> 4;
#endif
    return b;
}

__device__ __forceinline__ void wgmma_fence() {
#ifndef MB_EMU
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifndef MB_EMU
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most N committed batches of the warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifndef MB_EMU
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving d's 32 accumulators, or instructions that read them, into
// or across a wgmma batch (which would make it wait for each wgmma): a fence for the
// registers, placed before a batch's wgmma_fence and after each wgmma_wait.
__device__ __forceinline__ void wgmma_hold(float* d) {
#ifndef MB_EMU
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// d[0..31] += A (a, this thread's fragment) · B (16 × 64).
__device__ __forceinline__ void wgmma_m64n64k16(float* d, const u32* a, WgmmaB b) {
#ifdef MB_EMU
    mb_emu::wgmma_f16(d, a, mb_emu::shared_pointer(b.at), b.lbo, b.sbo, 64);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b.desc), "r"(1));
#endif
}

#endif  // sm_90a or the emulator

#endif  // __CUDA_ARCH__ >= 800
