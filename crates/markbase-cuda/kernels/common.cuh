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

// Programmatic dependent launch (compute capability 9.0 and newer; the backend launches every
// kernel with it there): a kernel may start while the one ahead of it in the stream is still
// running. Every kernel calls this before it reads or writes anything another operation
// touches: it waits until the kernel ahead has finished and its writes are visible, then lets
// the next kernel launch, so its blocks are resident and waiting when this one ends. Loads may
// come before it only from what no kernel writes: weights (and tables made at load, such as
// RoPE frequencies), and the step's index arrays (tokens, positions, cache slots, block
// tables), which the host copies in stream order before any kernel that reads them can start
// (graph.rs: a copy is a full dependency, and a kernel can start early only once the kernel
// ahead of it has passed this wait). No-op elsewhere.
__device__ __forceinline__ void wait_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
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
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(v));
    return h;
}

// v rounded as `kind` (1 bf16, 2 f16) says: the rounded copy of an activation that a
// tensor-core product reads next (rounded.rs).
__device__ __forceinline__ u16 rounded_bits(int kind, float v) {
    return kind == 1 ? to_bf16(v) : to_f16(v);
}

// v rounded into r[i] as `kind` says (0: not at all).
__device__ __forceinline__ void store_rounded(u16* r, int kind, u64 i, float v) {
    if (kind != 0) r[i] = rounded_bits(kind, v);
}
