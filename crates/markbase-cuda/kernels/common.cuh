// Shared definitions, prepended to every kernel source before NVRTC compiles it.
// No #include: every type and conversion here is spelled out, so compiling needs only NVRTC
// (no toolkit headers).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF (__int_as_float(0xff800000))

// Error codes a kernel can raise into the backend's error word (checked at the next read).
#define MB_ERR_EXPERT_ID 1
#define MB_ERR_SAMPLE_STALL 2

// Programmatic dependent launch (compute capability 9.0 and newer; the backend launches every
// kernel with it there): a kernel may start while the one ahead of it in the stream is still
// running. Every kernel calls this before it reads or writes anything another operation
// touches: it waits until the kernel ahead has finished and its writes are visible, then lets
// the next kernel launch, so its blocks are resident and waiting when this one ends. Loads may
// come before it only from what no kernel writes: weights (and tables made at load, such as
// RoPE frequencies), and the step's index arrays (tokens, positions, cache slots, block
// tables), which the host copies in stream order before any kernel that reads them can start
// (graph.rs: a copy is a full dependency, and a kernel can start early only once the kernel
// ahead of it has passed this wait). No-op elsewhere (and in the CPU emulator, markbase-kernel-emu,
// which runs one kernel at a time).
__device__ __forceinline__ void wait_prior_grid() {
#if __CUDA_ARCH__ >= 900 && !MB_EMU
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel the host launched beside the one ahead of it (`beside` = 1: it neither reads what
// that kernel writes nor writes what it reads or writes; CudaBackend::take_beside) calls
// start_step first and end_step last: it lets the next kernel launch at once and waits for the
// kernel ahead only at its end, so the two run at the same time and its own completion still
// implies that kernel's (the next kernel's wait covers both). What it reads was written before
// the kernel ahead passed its own wait, which came before this kernel could start. With
// `beside` = 0 these are wait_prior_grid and nothing.
__device__ __forceinline__ void start_step(int beside) {
#if __CUDA_ARCH__ >= 900 && !MB_EMU
    if (beside) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        return;
    }
#endif
    wait_prior_grid();
}

__device__ __forceinline__ void end_step(int beside) {
#if __CUDA_ARCH__ >= 900 && !MB_EMU
    if (beside) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The shared-memory address of generic pointer p (into shared memory), for cp.async and
// ldmatrix.
__device__ __forceinline__ u32 shared_address(const void* p) {
#ifdef MB_EMU
    return mb_emu::shared_handle(p);
#else
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
#endif
}

// cp.async (compute capability 8.0 and newer): 16 bytes from global memory (16-byte aligned,
// through L2 only) to shared address `dst` (shared_address), landing once a later
// cp_async_wait covers the copy's group.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
#ifdef MB_EMU
    mb_emu::cp_async16(dst, src, 16);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}

// As cp_async16, but only the first `bytes` (0 or 16) come from src; the rest are zeros.
__device__ __forceinline__ void cp_async16_fill(u32 dst, const void* src, int bytes) {
#ifdef MB_EMU
    mb_emu::cp_async16(dst, src, bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
#endif
}

// Closes the thread's copies issued since the last commit into a group.
__device__ __forceinline__ void cp_async_commit() {
#ifdef MB_EMU
    mb_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until every committed group of the thread's copies but the newest N has landed (in
// the thread's view; a barrier makes them every thread's).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef MB_EMU
    mb_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// mbarriers and bulk copies (compute capability 9.0): a bulk copy (`cp.async.bulk`, the 1-D
// form of TMA) of whole 16-byte pieces from global to shared memory, its bytes counted on an
// mbarrier in shared memory that threads wait on by phase parity.

// Initializes the mbarrier at shared address `bar` for `count` arrivals a phase.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
#ifdef MB_EMU
    mb_emu::mbar_init(bar, count);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes the thread's mbarrier initializations visible to bulk copies (before a barrier).
__device__ __forceinline__ void mbar_init_fence() {
#ifndef MB_EMU
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival on mbarrier `bar`, expecting `bytes` more bytes of bulk copies this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
#ifdef MB_EMU
    mb_emu::mbar_arrive_expect_tx(bar, bytes);
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}

// Waits until the phase of parity `parity` of mbarrier `bar` has completed (its copies landed,
// visible to this thread).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
#ifdef MB_EMU
    while (!mb_emu::mbar_try_wait(bar, parity)) mb_emu::spin();
#else
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

// Orders the thread's earlier shared-memory accesses before its later bulk copies' writes.
__device__ __forceinline__ void bulk_fence() {
#ifndef MB_EMU
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// A bulk copy of `bytes` (a multiple of 16; addresses 16-byte aligned) from global memory to
// shared address `dst`, completing on mbarrier `bar` (whose phase expects them).
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
#ifdef MB_EMU
    mb_emu::bulk_copy(dst, src, bytes, bar);
#else
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef MB_EMU
    return emu_f16_to_f32(h);
#else
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
#endif
}

// A 16-bit load from global or shared memory (generic address); every stored block offset
// used here is even.
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const unsigned short*)p; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (every thread gets the total). `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

// Exclusive prefix sum of v over the block's threads in thread order, and the block's total in
// *total (every thread of the block must call it). `red` holds 32 values.
template <class T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* red, T* total) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        T u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    __syncthreads();
    if (lane == WARP - 1) red[w] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (int i = 0; i < nw; i++) {
        before += i < w ? red[i] : 0;
        all += red[i];
    }
    *total = all;
    return before + incl - v;
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float c = 0.7978845608f;  // sqrt(2/pi)
    return 0.5f * x * (1.f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// f32 to bf16, to nearest with ties to even (NaN stays NaN).
__device__ __forceinline__ u16 to_bf16(float v) {
    u32 b = __float_as_uint(v);
    return (b & 0x7fffffffu) > 0x7f800000u ? (u16)((b >> 16) | 0x40u)
                                           : (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// v clamped to f16's finite range, ±65504 (NaN stays NaN).
__device__ __forceinline__ float f16_range(float v) {
    return v == v ? fminf(fmaxf(v, -65504.f), 65504.f) : v;
}

// f32 to f16, to nearest with ties to even; finite values beyond f16's range saturate to
// ±65504 (NaN stays NaN).
__device__ __forceinline__ u16 to_f16(float v) {
    v = f16_range(v);
#ifdef MB_EMU
    return emu_f32_to_f16(v);
#else
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
    return h;
#endif
}

// v rounded as `kind` (1 bf16, 2 f16) says: the rounded copy of an activation that a
// tensor-core product reads next (rounded.rs).
__device__ __forceinline__ u16 rounded_bits(int kind, float v) {
    return kind == 1 ? to_bf16(v) : to_f16(v);
}

// v rounded into r[i] as `kind` says (0: not at all; ROUND_Q4K_TILES, below, is written by
// store_q4k_tiles).
__device__ __forceinline__ void store_rounded(u16* r, int kind, u64 i, float v) {
    if (kind == 1 || kind == 2) r[i] = rounded_bits(kind, v);
}

// Kind 3 of a producer's extra copy (rounded.rs): its rows as the 16-bit tiles a one-token
// Q4_K or Q8_0 GEMV reads instead of staging its activations (quant.cuh, i16_rows_tiles). A row of
// dim values (a multiple of 256) takes 640 bytes a 256-value super-block: first every
// super-block's 32 slots of 8 values (512 bytes each, in the order the readers load them,
// q4k_slot), then a float2 (d, d·Σq) for every 16-value half of every 32-value chunk, d =
// max|x| / 32767 over the chunk and q = x / d rounded to nearest (quantize_group8).
#define ROUND_Q4K_TILES 3

// Bytes a row of `dim` values takes as Q4_K tiles.
__device__ __forceinline__ u64 q4k_tiles_row_bytes(int dim) { return 640 * (u64)(dim >> 8); }

// The slot (of its super-block's 32, 16 bytes each) of 8-value group j (of a row, or of a
// staged tile) in the order a one-token Q4_K GEMV's lanes load them: of the super-block's 8
// lanes, lane `sub` loads in its i-th load (slot 8·i + sub) the 8 values it needs — i = 0, 1
// from low-nibble chunk 2·(sub / 2), values 16·(sub % 2) + 8·i ..; i = 2, 3 from the
// high-nibble chunk after it — so 8 lanes read 128 consecutive bytes.
__device__ __forceinline__ int q4k_slot(int j) {
    int c = (j >> 2) & 7, p = j & 3;
    return 8 * (2 * (c & 1) + (p & 1)) + 2 * (c >> 1) + (p >> 1);
}

// The 16-bit form of 8 values v, group p = (lane % 4) of a 32-value chunk whose 4 groups lie
// in 4 consecutive lanes (every lane of the warp calls it): the integers q packed in order,
// *d = the chunk's max|x| / 32767 (x ≈ d·q, to nearest), *dq = d·Σq over the lane's 16-value
// half (groups p and p ^ 1).
__device__ __forceinline__ uint4 quantize_group8(const float* v, float* d, float* dq) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    float inv = m > 0.f ? 32767.f / m : 0.f;
    // v·inv + 1.5·2^23 rounds to an integer whose low 16 bits are q in two's complement; sums
    // of q are exact in a float.
    u32 h[8];
    float qs = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float f = fmaf(v[i], inv, 12582912.f);
        qs += f - 12582912.f;
        h[i] = __float_as_uint(f);
    }
    qs += __shfl_xor_sync(0xffffffffu, qs, 1);
    *d = m * (1.f / 32767.f);
    *dq = *d * qs;
    return make_uint4(__byte_perm(h[0], h[1], 0x5410), __byte_perm(h[2], h[3], 0x5410),
                      __byte_perm(h[4], h[5], 0x5410), __byte_perm(h[6], h[7], 0x5410));
}

// Stores the row of `dim` values at xs (shared memory, written before a __syncthreads; dim a
// multiple of 256) as Q4_K tiles at `tiles`. Every thread of the block calls it (blockDim.x a
// multiple of 32): a thread quantizes 8 values at a time.
__device__ __forceinline__ void store_q4k_tiles(const float* xs, int dim, u8* tiles) {
    uint4* q = (uint4*)tiles;
    float2* dq = (float2*)(tiles + 2 * (u64)dim);
    for (int j = threadIdx.x; j < dim >> 3; j += blockDim.x) {
        float4 a = ((const float4*)xs)[2 * j], b = ((const float4*)xs)[2 * j + 1];
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float d, s;
        q[32 * (j >> 5) + q4k_slot(j)] = quantize_group8(v, &d, &s);
        if ((j & 1) == 0) dq[j >> 1] = make_float2(d, s);
    }
}
