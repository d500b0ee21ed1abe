// The CUDA C++ our kernel units use, for a C++ compiler on the CPU: a kernel unit compiled after
// this header runs on the calling thread, each thread of a block a fiber, the ready ones in
// turn (from the first, or descending from the last thread of the last block: a kernel that
// leans on one order fails in the other). A launch runs its blocks one at a time, or, resident
// (flag bit 1), all of them at once, their threads one round robin over the launch, so that
// blocks may wait for each other through global memory. Block barriers and warp collectives
// (shuffles, votes, mma.sync, ldmatrix) switch fibers until every thread they wait for has
// arrived; the last one to arrive does the collective's work for all. A spin-wait loop calls
// mb_emu::spin(), which lets the other fibers run. The inline PTX of the kernels has twins here
// (`emu_*`), chosen with `#ifdef MB_EMU` beside each `asm`; cp.async lands at the wait that
// covers it, a bulk copy when its mbarrier is next tested, and griddepcontrol, fences and
// prefetches do nothing (one kernel runs at a time).
// Shared memory: a `__shared__` array is a static of the unit (in section mb_shared: one copy,
// so a resident launch of several blocks refuses a unit that has one), the dynamic part an
// arena of each live block; both are poisoned (0xcd bytes) as a block starts. Errors (a
// collective some lanes of its mask never reach, a barrier that never fills, a lane that left,
// every live thread spinning) end the launch with a message instead of hanging.

#pragma once
#define MB_EMU 1
#define __CUDA_ARCH__ 900

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__ __attribute__((visibility("default")))
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared arrays live in a section of their own, which every block starts poisoned.
#define __shared__ static __attribute__((section("mb_shared")))
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

// Vector types with CUDA's sizes and alignments.
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

// The bounds of the unit's static shared arrays (the linker's, for a section named as an
// identifier; null where the unit has none).
extern "C" char __start_mb_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_mb_shared[] __attribute__((weak, visibility("hidden")));

namespace mb_emu {

// A fiber's saved execution context. On x86-64 a switch saves the callee-saved registers on
// the fiber's own stack and swaps stack pointers (no system call: ucontext's swapcontext saves
// the signal mask with one, a microsecond a switch, and a kernel's warp collectives switch
// thousands of times a unit); elsewhere ucontext.
#if defined(__x86_64__)
struct Context {
    void* sp;
};

extern "C" void mb_emu_switch(void** save_sp, void* sp);
asm(R"(
    .text
    .globl mb_emu_switch
    .hidden mb_emu_switch
    .type mb_emu_switch, @function
mb_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size mb_emu_switch, .-mb_emu_switch
)");

// A context that, switched to, enters entry() on the stack [stack, stack + bytes): the six
// saved registers (zeros), then entry as the return address, then a null one above it, so
// entry starts as if called (the stack pointer 8 past a 16-byte boundary).
inline void context_start(Context& c, char* stack, size_t bytes, void (*entry)()) {
    uintptr_t top = ((uintptr_t)stack + bytes) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)entry;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    c.sp = sp;
}

inline void context_switch(Context& from, Context& to) { mb_emu_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};

inline void context_start(Context& c, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = bytes;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}

inline void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// A cp.async a thread has issued and not yet waited for: its destination, the 16 bytes it
// copies (read at issue: no kernel writes what it copies while the copy is in flight), and its
// group (the thread's count of commits when it was issued).
struct Copy {
    char* dst;
    unsigned char bytes[16];
    int group;
};

struct Block;

// A thread of a block.
struct Fiber {
    Context ctx;
    char* stack;
    Block* block;  // its block
    uint3 tid;
    int lane, warp;  // warp: of the launch (the block's slot times its warps, plus its own)
    bool done;
    int waits;  // 0: runs; WAIT_BLOCK, WAIT_WARP, WAIT_NAMED + id or WAIT_GROUP + warpgroup
    std::vector<Copy> copies;
    int commits;
};

enum { WAIT_BLOCK = 1, WAIT_WARP = 2, WAIT_NAMED = 3, WAIT_GROUP = 19 };

// A live block: its index, dynamic shared memory, threads, and barriers.
struct Block {
    uint3 idx;
    char* shared;    // its arena of dynamic shared memory
    Fiber* fibers;   // its threads (Launch::threads of them)
    int live;        // its threads that have not left
    int at_barrier;  // those waiting at __syncthreads
    int named_arrived[16];
    int group_arrived[8];        // threads of each warpgroup at its wgmma
    void* group_records[8][128];  // their records
};

// A warp collective some lanes have reached: its lanes, those arrived, their records, and the
// work the last one does for all.
struct Pending {
    unsigned mask, arrived;
    void (*work)(void** records, unsigned mask);
    void* records[32];
};

// The launch this OS thread runs.
struct Launch {
    dim3 grid, block;
    int threads, warps;  // of a block
    void (*body)(void*);
    void* ctx;
    std::vector<Block> blocks;     // the live ones: every block (resident), or the one running
    std::vector<Fiber> fibers;     // their threads, block by block
    std::vector<Pending> pending;  // per warp of the launch: up to 4 groups at once
    char* arenas;                  // the blocks' dynamic shared memory, one allocation
    Context scheduler;
    Fiber* current;
    int live;   // threads of the launch that have not left
    int spins;  // spin() calls in a row, with no barrier, collective or exit between
    bool ahead;  // each turn from the first ready thread (MB_EMU_AHEAD)
    bool spun;   // the thread just run returned by spin()
    bool descending;  // threads and blocks from the last
    bool resident;    // every block at once
    bool failed;
    char error[512];
};

inline thread_local Launch* launch = nullptr;
constexpr size_t STACK_BYTES = 256 * 1024;
constexpr int GROUPS = 4;

// Ends the launch with a message (the fiber never resumes).
[[noreturn]] inline void fail(const char* fmt, int a = 0, int b = 0, int c = 0) {
    Launch* L = launch;
    if (!L->failed) {
        L->failed = true;
        const uint3 bi = L->current->block->idx;
        int n = std::snprintf(L->error, sizeof L->error, "block (%u, %u, %u), thread %u: ", bi.x,
                              bi.y, bi.z, L->current->tid.x);
        std::snprintf(L->error + n, sizeof L->error - n, fmt, a, b, c);
    }
    context_switch(L->current->ctx, L->scheduler);
    std::abort();  // a failed launch never resumes its fibers
}

// Back to the scheduler until this fiber is woken (its `waits` cleared).
inline void wait_here(int what) {
    Launch* L = launch;
    L->current->waits = what;
    context_switch(L->current->ctx, L->scheduler);
}

// Wakes every fiber of the running fiber's block waiting at `what`.
inline void wake(int what) {
    Launch* L = launch;
    Fiber* f = L->current->block->fibers;
    for (int t = 0; t < L->threads; t++)
        if (f[t].waits == what) f[t].waits = 0;
}

inline Fiber& self() { return *launch->current; }

// A fiber arrived at a barrier or collective, or left: what spins wait for may have changed.
inline void progress() { launch->spins = 0; }

// The fiber of lane 0 of the launch's warp w, and in `lanes` how many lanes it has.
inline Fiber* warp_lanes(int w, int* lanes) {
    Launch* L = launch;
    const int first = 32 * (w % L->warps);
    *lanes = L->threads - first < 32 ? L->threads - first : 32;
    return &L->fibers[(size_t)(w / L->warps) * L->threads + first];
}

// Lanes of the launch's warp w that have left the kernel.
inline unsigned done_lanes(int w) {
    int n;
    const Fiber* f = warp_lanes(w, &n);
    unsigned m = n < 32 ? ~0u << n : 0;  // lanes past the block's threads
    for (int l = 0; l < n; l++)
        if (f[l].done) m |= 1u << l;
    return m;
}

// Meets the lanes of `mask` (which must hold this lane) at a collective; the last to arrive
// calls `work(records, mask)` with each lane's `record`, then all go on.
inline void warp_meet(unsigned mask, void* record, void (*work)(void**, unsigned)) {
    Launch* L = launch;
    Fiber& f = self();
    progress();
    if (!(mask & (1u << f.lane))) fail("a warp collective whose mask %#x lacks lane %d", mask, f.lane);
    if (mask & done_lanes(f.warp))
        fail("a warp collective of mask %#x waits for lanes that left (%#x)", mask,
             mask & done_lanes(f.warp));
    Pending* group = nullptr;
    for (int i = 0; i < GROUPS; i++) {
        Pending& p = L->pending[GROUPS * f.warp + i];
        if (p.arrived && p.mask == mask) group = &p;
    }
    if (!group)
        for (int i = 0; i < GROUPS && !group; i++)
            if (!L->pending[GROUPS * f.warp + i].arrived) group = &L->pending[GROUPS * f.warp + i];
    if (!group)
        fail("more than %d warp collectives of warp %d pending at once", GROUPS, f.warp % L->warps);
    if (group->arrived && group->work != work)
        fail("lanes of warp %d (mask %#x) meet at different collectives", f.warp % L->warps, mask);
    if (group->arrived & (1u << f.lane)) fail("lane %d arrives twice at one collective", f.lane);
    group->mask = mask;
    group->work = work;
    group->records[f.lane] = record;
    group->arrived |= 1u << f.lane;
    if (group->arrived != mask) {
        wait_here(WAIT_WARP);
        return;
    }
    work(group->records, mask);
    group->arrived = 0;
    int n;
    Fiber* lanes = warp_lanes(f.warp, &n);
    for (int l = 0; l < n; l++)
        if ((mask >> l & 1) && l != f.lane) lanes[l].waits = 0;
}

// __syncthreads: every live thread of the block.
inline void sync_block() {
    Block* B = self().block;
    progress();
    if (++B->at_barrier < B->live) {
        wait_here(WAIT_BLOCK);
        return;
    }
    B->at_barrier = 0;
    wake(WAIT_BLOCK);
}

// bar.sync id, count.
inline void sync_named(int id, int count) {
    Block* B = self().block;
    progress();
    if (id < 0 || id >= 16) fail("named barrier %d out of range", id);
    if (++B->named_arrived[id] < count) {
        wait_here(WAIT_NAMED + id);
        return;
    }
    B->named_arrived[id] = 0;
    wake(WAIT_NAMED + id);
}

// For a spin-wait loop (`while (load_acquire(p) < target) SPIN();`): back to the scheduler,
// ready, to run again in turn after the other ready fibers. When every live thread of the
// launch has spun twice over with no barrier, collective or exit between (a thread that spins
// writes nothing the others wait for), no memory they wait for can change: the launch fails.
// (A thread that leaves one spin loop and enters another shows no progress here: such
// hand-offs chained against the scheduling order fail from the third on, unless a barrier or
// collective follows each wait.)
inline void spin() {
    Launch* L = launch;
    if (++L->spins > 2 * L->live) {
        if (L->resident) fail("every live thread spins, waiting for memory no thread will change");
        fail("every live thread spins, waiting for memory no thread will change (blocks that "
             "wait for each other need a resident launch)");
    }
    L->spun = true;
    context_switch(L->current->ctx, L->scheduler);
}

// Shared-memory addresses as 32 bits (cvta.to.shared): the pointer's low 28 bits, and in the
// top 4 the slot of its 256 MB page in this table.
inline thread_local uintptr_t shared_pages[16];
inline thread_local int shared_page_count = 0;

inline unsigned shared_handle(const void* p) {
    uintptr_t a = (uintptr_t)p, page = a >> 28;
    for (int i = 0; i < shared_page_count; i++)
        if (shared_pages[i] == page) return (unsigned)(i << 28) | (unsigned)(a & 0x0fffffffu);
    if (shared_page_count == 16) fail("more than 16 pages of shared memory");
    shared_pages[shared_page_count] = page;
    return (unsigned)(shared_page_count++ << 28) | (unsigned)(a & 0x0fffffffu);
}

inline void* shared_pointer(unsigned h) {
    if ((int)(h >> 28) >= shared_page_count) fail("shared address %#x was never handed out", h);
    return (void*)((shared_pages[h >> 28] << 28) | (h & 0x0fffffffu));
}

inline void* dynamic_shared() { return self().block->shared; }

}  // namespace mb_emu

#define threadIdx (mb_emu::self().tid)
#define blockIdx (mb_emu::self().block->idx)
#define blockDim (mb_emu::launch->block)
#define gridDim (mb_emu::launch->grid)

// ---- bits and numbers -----------------------------------------------------------------

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)(v >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
    return r;
}
// (hi:lo) >> min(shift, 32), the low word.
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (shift < 32 ? shift : 32));
}
template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() {}
inline void __threadfence_block() {}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }

// f16 <-> f32, to nearest with ties to even (beyond f16's range: infinity).
inline float emu_f16_to_f32(unsigned short h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY)
                        : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}

inline unsigned short emu_f32_to_f16(double v) {
    unsigned short sign = std::signbit(v) ? 0x8000 : 0;
    if (std::isnan(v)) return 0x7e00;
    double a = std::fabs(v);
    if (a >= 65520.0) return sign | 0x7c00;  // rounds past 65504
    if (a < std::ldexp(1.0, -14)) {          // subnormal: multiples of 2^-24
        double q = std::nearbyint(a * 16777216.0);
        return sign | (unsigned short)q;
    }
    int e;
    double fr = std::frexp(a, &e);          // a = fr · 2^e, fr in [0.5, 1)
    double q = std::nearbyint(fr * 2048.0);  // 11 significant bits
    if (q == 2048.0) { q = 1024.0; e++; }
    if (e + 14 > 30) return sign | 0x7c00;
    return sign | (unsigned short)((e + 14) << 10 | ((unsigned)q - 1024));
}

inline float emu_lo(unsigned x) { return emu_f16_to_f32((unsigned short)(x & 0xffff)); }
inline float emu_hi(unsigned x) { return emu_f16_to_f32((unsigned short)(x >> 16)); }
inline unsigned emu_pack(double lo, double hi) {
    return (unsigned)emu_f32_to_f16(lo) | (unsigned)emu_f32_to_f16(hi) << 16;
}
inline double emu_sat(double v) { return v != v ? v : v < -65504.0 ? -65504.0 : v > 65504.0 ? 65504.0 : v; }

inline unsigned emu_h2_fma(unsigned a, unsigned b, unsigned c) {
    return emu_pack((double)emu_lo(a) * emu_lo(b) + emu_lo(c), (double)emu_hi(a) * emu_hi(b) + emu_hi(c));
}
inline unsigned emu_h2_mul(unsigned a, unsigned b) {
    return emu_pack((double)emu_lo(a) * emu_lo(b), (double)emu_hi(a) * emu_hi(b));
}
inline unsigned emu_h2_sub(unsigned a, unsigned b) {
    return emu_pack((double)emu_lo(a) - emu_lo(b), (double)emu_hi(a) - emu_hi(b));
}
inline unsigned emu_lop3_ea(unsigned a, unsigned b, unsigned c) { return (a & b) | c; }

// dp2a: c + a's 16-bit halves (signed) times b's bytes 0, 1 (lo) or 2, 3 (hi), signed or not.
inline int emu_dp2a(unsigned a, unsigned b, int c, bool hi, bool b_signed) {
    int r = c;
    for (int i = 0; i < 2; i++) {
        int ah = (short)(a >> (16 * i));
        unsigned byte = (b >> (8 * (i + (hi ? 2 : 0)))) & 0xff;
        int bb = b_signed ? (int)(signed char)byte : (int)byte;
        r += ah * bb;
    }
    return r;
}

// ---- warp collectives ------------------------------------------------------------------

namespace mb_emu {

template <class T>
struct Shuffle {
    T value, out;
    int source;  // the lane to read (out of [0, 32) or outside the mask: keep one's own)
};

template <class T>
inline void shuffle_work(void** r, unsigned mask) {
    for (int l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        auto* me = (Shuffle<T>*)r[l];
        int s = me->source;
        me->out = s >= 0 && s < 32 && (mask >> s & 1) ? ((Shuffle<T>*)r[s])->value : me->value;
    }
}

template <class T>
inline T shuffle(unsigned mask, T v, int source) {
    Shuffle<T> rec{v, v, source};
    warp_meet(mask, &rec, shuffle_work<T>);
    return rec.out;
}

struct Match {
    unsigned long long value;
    unsigned out;
};

inline void match_work(void** r, unsigned mask) {
    for (int l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        auto* me = (Match*)r[l];
        me->out = 0;
        for (int o = 0; o < 32; o++)
            if ((mask >> o & 1) && ((Match*)r[o])->value == me->value) me->out |= 1u << o;
    }
}

// A ballot: each lane's predicate in `value`; every lane gets the mask of those set.
inline void ballot_work(void** r, unsigned mask) {
    unsigned all = 0;
    for (int o = 0; o < 32; o++)
        if ((mask >> o & 1) && ((Match*)r[o])->value) all |= 1u << o;
    for (int l = 0; l < 32; l++)
        if (mask >> l & 1) ((Match*)r[l])->out = all;
}

inline void nothing_work(void**, unsigned) {}

}  // namespace mb_emu

// Width-32 shuffles (every kernel here shuffles whole warps).
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    int lane = mb_emu::self().lane, base = lane & ~(width - 1);
    return mb_emu::shuffle(mask, v, base + (src & (width - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int x, int width = 32) {
    int lane = mb_emu::self().lane;
    return mb_emu::shuffle(mask, v, (lane ^ x) < ((lane & ~(width - 1)) + width) ? lane ^ x : lane);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = mb_emu::self().lane;
    return mb_emu::shuffle(mask, v, (lane & (width - 1)) >= (int)d ? lane - (int)d : lane);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = mb_emu::self().lane;
    return mb_emu::shuffle(mask, v, (lane & (width - 1)) + (int)d < width ? lane + (int)d : lane);
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
    mb_emu::Match rec{(unsigned long long)v, 0};
    mb_emu::warp_meet(mask, &rec, mb_emu::match_work);
    return rec.out;
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    mb_emu::Match rec{(unsigned long long)(predicate != 0), 0};
    mb_emu::warp_meet(mask, &rec, mb_emu::ballot_work);
    return rec.out;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    mb_emu::warp_meet(mask, nullptr, mb_emu::nothing_work);
}
inline void __syncthreads() { mb_emu::sync_block(); }

// Atomics (one fiber runs at a time: plain read-modify-writes).
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }
inline unsigned atomicOr(unsigned* p, unsigned v) { unsigned o = *p; *p = o | v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    unsigned long long o = *p;
    *p = o + v;
    return o;
}
inline unsigned atomicMax(unsigned* p, unsigned v) { unsigned o = *p; *p = o > v ? o : v; return o; }
inline int atomicMax(int* p, int v) { int o = *p; *p = o > v ? o : v; return o; }

// ---- tensor cores ----------------------------------------------------------------------

namespace mb_emu {

// One lane's part of mma.sync m16n8k16 (row-major A, column-major B, f32 C): lane (g, c) =
// (lane / 4, lane % 4) holds A rows g, g + 8 at k 2c, 2c + 1 (a[0], a[1]) and 2c + 8, 2c + 9
// (a[2], a[3]); B k 2c, 2c + 1 (b[0]) and 2c + 8, 2c + 9 (b[1]) of column g; C rows g, g + 8
// at columns 2c, 2c + 1.
struct Mma {
    float* c;
    unsigned a[4], b[2];
    bool bf16;
};

inline float emu_bf16(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// Half `h` (0: the low 16 bits) of a fragment register `w`, an f16 or (bf16) a bf16 value.
inline float fragment_half(unsigned w, int h, bool bf16) {
    const unsigned short v = (unsigned short)(w >> (16 * h));
    return bf16 ? emu_bf16(v) : emu_f16_to_f32(v);
}

// Lane `l`'s A fragment `a` (mma.sync m16n8k16's: rows g, g + 8 at k 2c, 2c + 1 and 2c + 8,
// 2c + 9) into A's rows `row0` .. row0 + 15, as floats.
inline void fragment_a(float (*A)[16], int row0, int l, const unsigned* a, bool bf16) {
    const int g = row0 + (l >> 2), c = l & 3;
    for (int h = 0; h < 2; h++) {
        A[g][2 * c + h] = fragment_half(a[0], h, bf16);
        A[g + 8][2 * c + h] = fragment_half(a[1], h, bf16);
        A[g][2 * c + 8 + h] = fragment_half(a[2], h, bf16);
        A[g + 8][2 * c + 8 + h] = fragment_half(a[3], h, bf16);
    }
}

inline void mma_work(void** r, unsigned) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        auto* m = (Mma*)r[l];
        int g = l >> 2, c = l & 3;
        fragment_a(A, 0, l, m->a, m->bf16);
        for (int h = 0; h < 2; h++) {
            B[2 * c + h][g] = fragment_half(m->b[0], h, m->bf16);
            B[2 * c + 8 + h][g] = fragment_half(m->b[1], h, m->bf16);
            C[g][2 * c + h] = m->c[h];
            C[g + 8][2 * c + h] = m->c[2 + h];
        }
    }
    for (int l = 0; l < 32; l++) {
        auto* m = (Mma*)r[l];
        int g = l >> 2, c = l & 3;
        for (int i = 0; i < 4; i++) {
            int row = g + 8 * (i >> 1), col = 2 * c + (i & 1);
            double s = C[row][col];
            for (int k = 0; k < 16; k++) s += (double)A[row][k] * B[k][col];
            m->c[i] = (float)s;
        }
    }
}

inline void mma(float* c, const unsigned* a, unsigned b0, unsigned b1, bool bf16) {
    Mma rec{c, {a[0], a[1], a[2], a[3]}, {b0, b1}, bf16};
    warp_meet(0xffffffffu, &rec, mma_work);
}

// One thread's part of wgmma.mma_async m64nNk16 (f32 += f16 · f16) with A from registers: its
// four f16 pairs of A (as mma.sync m16n8k16's A, of its warp's 16 of the 64 rows), its N / 2
// accumulators (mma.sync's C layout, one n-tile of 8 columns after another), and B: core
// matrices of 8 columns (N) × 8 k values (16 bytes a column) from `b`, `lbo` bytes apart along
// K and `sbo` along N (K-major, no swizzle: the descriptor's fields).
struct GroupMma {
    float* d;
    unsigned a[4];
    const unsigned char* b;
    unsigned lbo, sbo;
    int n;
};

inline void group_mma_work(void** r) {
    const auto* first = (const GroupMma*)r[0];
    const int n = first->n;
    float A[64][16], B[16][256];
    for (int t = 0; t < 128; t++) {
        const auto* m = (const GroupMma*)r[t];
        if (m->b != first->b || m->lbo != first->lbo || m->sbo != first->sbo || m->n != n)
            fail("threads of a warpgroup issue different wgmma operands (thread %d of the group)",
                 t);
        fragment_a(A, 16 * (t >> 5), t & 31, m->a, false);
    }
    for (int k = 0; k < 16; k++)
        for (int col = 0; col < n; col++) {
            unsigned short h;
            std::memcpy(&h, first->b + (col >> 3) * first->sbo + (k >> 3) * first->lbo +
                                (col & 7) * 16 + (k & 7) * 2, 2);
            B[k][col] = emu_f16_to_f32(h);
        }
    for (int t = 0; t < 128; t++) {
        auto* m = (GroupMma*)r[t];
        const int row = 16 * (t >> 5) + ((t & 31) >> 2), c = t & 3;
        for (int j = 0; j < n / 8; j++)
            for (int i = 0; i < 4; i++) {
                const int rr = row + 8 * (i >> 1), col = 8 * j + 2 * c + (i & 1);
                double s = m->d[4 * j + i];
                for (int k = 0; k < 16; k++) s += (double)A[rr][k] * B[k][col];
                m->d[4 * j + i] = (float)s;
            }
    }
}

// wgmma.mma_async (GroupMma's operands): the warpgroup's 128 threads meet; the last to arrive
// multiplies for all, at once (so wgmma.fence, commit_group and wait_group do nothing here).
inline void wgmma_f16(float* d, const unsigned* a, const void* b, unsigned lbo, unsigned sbo,
                      int n) {
    Fiber& f = self();
    Block* B = f.block;
    progress();
    const int group = (int)(f.tid.x >> 7), t = (int)(f.tid.x & 127);
    if (launch->block.y != 1 || launch->block.z != 1 || launch->threads < 128 * (group + 1))
        fail("a wgmma in a block of %d threads (whole warpgroups of a 1-D block only)",
             launch->threads);
    if (n % 8 || n < 8 || n > 256) fail("a wgmma of N %d", n);
    GroupMma rec{d, {a[0], a[1], a[2], a[3]}, (const unsigned char*)b, lbo, sbo, n};
    B->group_records[group][t] = &rec;
    if (++B->group_arrived[group] < 128) {
        wait_here(WAIT_GROUP + group);
        return;
    }
    group_mma_work(B->group_records[group]);
    B->group_arrived[group] = 0;
    wake(WAIT_GROUP + group);
}

// ldmatrix m8n8.x4 (b16): lanes 8i .. 8i + 7 give the row addresses of matrix i; lane l gets
// in r[i] matrix i's row l / 4, columns 2(l % 4), +1 (trans: column l / 4, rows 2(l % 4), +1).
struct Ldsm {
    unsigned address;
    unsigned* r;
    bool trans;
};

inline void ldsm_work(void** rec, unsigned) {
    for (int l = 0; l < 32; l++) {
        auto* me = (Ldsm*)rec[l];
        for (int i = 0; i < 4; i++) {
            unsigned short e[2];
            for (int h = 0; h < 2; h++) {
                int row = me->trans ? 2 * (l & 3) + h : l >> 2;
                int col = me->trans ? l >> 2 : 2 * (l & 3) + h;
                const auto* p = (const unsigned short*)shared_pointer(((Ldsm*)rec[8 * i + row])->address);
                e[h] = p[col];
            }
            me->r[i] = (unsigned)e[0] | (unsigned)e[1] << 16;
        }
    }
}

inline void ldsm(unsigned address, unsigned* r, bool trans) {
    Ldsm rec{address, r, trans};
    warp_meet(0xffffffffu, &rec, ldsm_work);
}

// cp.async of 16 bytes: `bytes` of them from `src`, the rest zeros. The shared memory is
// written only when a cp.async.wait_group covers the copy (as late as the PTX allows), so a
// read before its wait sees the old bytes.
inline void cp_async16(unsigned dst, const void* src, int bytes) {
    Fiber& f = self();
    Copy c;
    c.dst = (char*)shared_pointer(dst);
    std::memcpy(c.bytes, src, bytes);
    std::memset(c.bytes + bytes, 0, 16 - bytes);
    c.group = f.commits;
    f.copies.push_back(c);
}

// cp.async.commit_group: the copies issued since the last commit form a group.
inline void cp_async_commit() { self().commits++; }

// cp.async.wait_group n: every committed group but the newest n has landed.
inline void cp_async_wait(int n) {
    Fiber& f = self();
    std::vector<Copy> left;
    for (const Copy& c : f.copies) {
        if (c.group < f.commits - n)
            std::memcpy(c.dst, c.bytes, 16);
        else
            left.push_back(c);
    }
    f.copies.swap(left);
}

// ---- bulk copies and mbarriers (compute capability 9.0) ---------------------------------

// An mbarrier as the emulator keeps it in its 8 bytes of shared memory: the transaction
// bytes still expected, the arrivals still expected in this phase, the arrivals a phase, and
// the phase's parity.
struct Mbar {
    int tx;
    unsigned short left;
    unsigned char count, phase;
};
static_assert(sizeof(Mbar) == 8, "an mbarrier is 8 bytes");

// A bulk copy on its way: its bytes (read when issued), where they land, and the mbarrier whose
// transaction count they complete. They land when a thread next tests that mbarrier.
struct Bulk {
    char* dst;
    Mbar* bar;
    std::vector<char> bytes;
};

inline thread_local std::vector<Bulk> bulks;

inline Mbar* mbar_at(unsigned bar) { return (Mbar*)shared_pointer(bar); }

// mbarrier.init: a fresh mbarrier for `count` arrivals a phase (at most 255 here).
inline void mbar_init(unsigned bar, unsigned count) {
    if (count == 0 || count > 255) fail("mbarrier of %d arrivals", (int)count);
    *mbar_at(bar) = Mbar{0, (unsigned short)count, (unsigned char)count, 0};
}

// The phase completes once its arrivals and transaction bytes are all in.
inline void mbar_settle(Mbar* m) {
    if (m->left == 0 && m->tx == 0) {
        m->phase ^= 1;
        m->left = m->count;
    }
}

// mbarrier.arrive.expect_tx: `bytes` more transaction bytes expected, and one arrival.
inline void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    Mbar* m = mbar_at(bar);
    if (m->left == 0) fail("mbarrier arrival past its count");
    m->tx += (int)bytes;
    m->left--;
    mbar_settle(m);
}

// cp.async.bulk global → shared of `bytes` (a multiple of 16) completing on mbarrier `bar`.
inline void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    if (bytes % 16 != 0 || (dst & 15) != 0 || ((uintptr_t)src & 15) != 0)
        fail("bulk copy of %d bytes to %#x: sizes and addresses are multiples of 16", (int)bytes,
             (int)dst);
    Bulk b{(char*)shared_pointer(dst), mbar_at(bar), std::vector<char>(bytes)};
    std::memcpy(b.bytes.data(), src, bytes);
    bulks.push_back(std::move(b));
}

// mbarrier.try_wait.parity: lands the copies on `bar`, then whether its phase of parity
// `parity` has completed.
inline bool mbar_try_wait(unsigned bar, unsigned parity) {
    Mbar* m = mbar_at(bar);
    std::vector<Bulk> left;
    for (Bulk& b : bulks) {
        if (b.bar == m) {
            std::memcpy(b.dst, b.bytes.data(), b.bytes.size());
            m->tx -= (int)b.bytes.size();
        } else {
            left.push_back(std::move(b));
        }
    }
    bulks.swap(left);
    mbar_settle(m);
    return m->phase != (parity & 1);
}

// ---- the launch ------------------------------------------------------------------------

inline void fiber_entry() {
    Launch* L = launch;
    L->body(L->ctx);
    Fiber& f = self();
    Block* B = f.block;
    f.done = true;
    L->live--;
    B->live--;
    progress();
    for (int i = 0; i < GROUPS; i++) {
        Pending& p = L->pending[GROUPS * f.warp + i];
        if (p.arrived && (p.mask >> f.lane & 1))
            fail("lane %d left while lanes %#x of its warp wait for it at a collective", f.lane,
                 p.arrived);
    }
    if (B->at_barrier > 0 && B->at_barrier == B->live) {
        B->at_barrier = 0;
        wake(WAIT_BLOCK);
    }
    context_switch(f.ctx, L->scheduler);
}

// Starts the block of linear index `index` in slot `slot` of the launch: its threads' fibers
// at the kernel's entry, its barriers and its warps' collectives empty.
inline void start_block(Launch* L, int slot, unsigned index) {
    const dim3 g = L->grid;
    Block& B = L->blocks[slot];
    B.idx = {index % g.x, index / g.x % g.y, index / (g.x * g.y)};
    B.fibers = &L->fibers[(size_t)slot * L->threads];
    B.live = L->threads;
    B.at_barrier = 0;
    for (int& a : B.named_arrived) a = 0;
    for (int& a : B.group_arrived) a = 0;
    for (int t = 0; t < L->threads; t++) {
        Fiber& f = B.fibers[t];
        f.block = &B;
        f.tid = {(unsigned)t % L->block.x, (unsigned)t / L->block.x % L->block.y,
                 (unsigned)t / (L->block.x * L->block.y)};
        f.lane = t & 31;
        f.warp = slot * L->warps + (t >> 5);
        f.done = false;
        f.waits = 0;
        f.copies.clear();
        f.commits = 0;
        context_start(f.ctx, f.stack, STACK_BYTES, fiber_entry);
    }
    Pending* pending = &L->pending[(size_t)slot * L->warps * GROUPS];
    for (int i = 0; i < L->warps * GROUPS; i++) pending[i].arrived = 0;
}

// Runs the started blocks' fibers until all have left: 0, or -1 with L->error set.
inline int run_fibers(Launch* L) {
    const int n = (int)L->fibers.size();
    L->live = n;
    L->spins = 0;
    // Round robin over the ready threads, from the first (or the last) on.
    int next = L->descending ? n - 1 : 0;
    while (L->live > 0) {
        int pick = -1;
        for (int i = 0; i < n; i++) {
            const int t = L->descending ? (next - i + n) % n : (next + i) % n;
            if (!L->fibers[t].done && !L->fibers[t].waits) {
                pick = t;
                break;
            }
        }
        if (pick < 0) {
            const Block* B = &L->blocks[0];
            while (B->live == 0) B++;  // the first block that has not ended
            std::snprintf(L->error, sizeof L->error,
                          "block (%u, %u, %u): %d threads wait at barriers or collectives that "
                          "never fill",
                          B->idx.x, B->idx.y, B->idx.z, B->live);
            return -1;
        }
        L->current = &L->fibers[pick];
        L->spun = false;
        context_switch(L->scheduler, L->fibers[pick].ctx);
        if (L->failed) return -1;
        // Round robin; ahead, back to the first thread unless this one spun (then the next
        // ones get their turn, or it would spin alone).
        if (L->ahead && !L->spun)
            next = L->descending ? n - 1 : 0;
        else
            next = L->descending ? (pick - 1 + n) % n : (pick + 1) % n;
    }
    return 0;
}

// Checks and allocates the launch of `blocks` blocks whose live ones `L` holds: 0, or -1 with
// a message in `error`.
inline int prepare(Launch* L, unsigned long long blocks, size_t shared_bytes, char* error,
                   size_t error_len) {
    const size_t threads = (size_t)L->block.x * L->block.y * L->block.z;
    if (threads == 0 || threads > 1024 || shared_bytes > 232448) {
        std::snprintf(error, error_len, "a block of %zu threads with %zu bytes of shared memory",
                      threads, shared_bytes);
        return -1;
    }
    const size_t slots = L->resident ? blocks : 1;
    // A block's arena, in whole 4 KB pages (one at least: each block's own address).
    const size_t stride = shared_bytes ? (shared_bytes + 4095) & ~(size_t)4095 : 4096;
    if (L->resident) {
        if (blocks > 65536 || blocks * threads > 65536) {
            std::snprintf(error, error_len,
                          "a resident launch of %llu blocks of %zu threads: more than 65536 "
                          "threads (each a fiber with a stack of its own)",
                          blocks, threads);
            return -1;
        }
        if (slots * stride > (size_t)1 << 28) {
            std::snprintf(error, error_len,
                          "a resident launch of %llu blocks needs %zu bytes of dynamic shared "
                          "memory (%zu a block, in 4 KB pages): more than 256 MB",
                          blocks, slots * stride, stride);
            return -1;
        }
        const size_t statics = __start_mb_shared ? __stop_mb_shared - __start_mb_shared : 0;
        if (blocks > 1 && statics > 0) {
            std::snprintf(error, error_len,
                          "a resident launch of %llu blocks: the unit has static __shared__ "
                          "arrays (%zu bytes), one copy for all blocks; a resident launch of "
                          "more than one block takes dynamic shared memory only",
                          blocks, statics);
            return -1;
        }
    }
    L->threads = (int)threads;
    L->warps = (int)((threads + 31) / 32);
    bulks.clear();  // a failed launch may have left copies on their way
    L->blocks.resize(slots);
    L->fibers.resize(slots * threads);
    L->pending.resize(slots * L->warps * GROUPS);
    for (Fiber& f : L->fibers)
        if (!(f.stack = (char*)std::malloc(STACK_BYTES))) {
            std::snprintf(error, error_len, "no memory for %zu fiber stacks", L->fibers.size());
            return -1;
        }
    // Every arena in one allocation aligned to a power of two at least its size (1 MB at
    // least): their 32-bit shared addresses never cross a 256 MB page.
    size_t align = 1 << 20;
    while (align < slots * stride) align <<= 1;
    L->arenas = (char*)std::aligned_alloc(align, align);
    if (!L->arenas) {
        std::snprintf(error, error_len, "no memory for %zu bytes of shared memory", align);
        return -1;
    }
    for (size_t b = 0; b < slots; b++) L->blocks[b].shared = L->arenas + b * stride;
    return 0;
}

// Poisons the live blocks' shared memory, static and dynamic: not zeros, and not the last
// block's bytes, so that stale reads show.
inline void poison_shared(Launch* L, size_t shared_bytes) {
    for (Block& B : L->blocks) std::memset(B.shared, 0xcd, shared_bytes);
    if (__start_mb_shared) std::memset(__start_mb_shared, 0xcd, __stop_mb_shared - __start_mb_shared);
}

}  // namespace mb_emu

// Bits of mb_emu_launch's `flags`.
enum { MB_EMU_DESCENDING = 1, MB_EMU_RESIDENT = 2, MB_EMU_AHEAD = 4 };

// Runs the launch grid × block with `shared_bytes` of dynamic shared memory, every thread
// calling body(ctx) (which calls the kernel): 0, or -1 with a message in `error`. `flags`:
// MB_EMU_DESCENDING runs blocks and threads from the last; MB_EMU_RESIDENT runs every block
// at once (their threads one round robin, block by block) instead of one block after another;
// MB_EMU_AHEAD gives each turn to the first ready thread in that order (after a spin, to the
// next): the first blocks run ahead of the others as far as they can.
extern "C" __attribute__((visibility("default"))) int mb_emu_launch(
    const unsigned* grid, const unsigned* block, size_t shared_bytes, unsigned flags,
    void (*body)(void*), void* ctx, char* error, size_t error_len) {
    using namespace mb_emu;
    Launch L{};
    L.grid = {grid[0], grid[1], grid[2]};
    L.block = {block[0], block[1], block[2]};
    L.body = body;
    L.ctx = ctx;
    L.descending = (flags & MB_EMU_DESCENDING) != 0;
    L.resident = (flags & MB_EMU_RESIDENT) != 0;
    L.ahead = (flags & MB_EMU_AHEAD) != 0;
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    int rc = prepare(&L, blocks, shared_bytes, error, error_len);
    if (rc == 0) {
        Launch* outer = launch;
        launch = &L;
        shared_page_count = 0;
        if (L.resident && blocks > 0) {
            for (unsigned b = 0; b < blocks; b++) start_block(&L, (int)b, b);
            poison_shared(&L, shared_bytes);
            rc = run_fibers(&L);
        }
        for (unsigned long long b = 0; !L.resident && b < blocks && rc == 0; b++) {
            start_block(&L, 0, (unsigned)(L.descending ? blocks - 1 - b : b));
            poison_shared(&L, shared_bytes);
            rc = run_fibers(&L);
        }
        launch = outer;
        if (rc != 0) std::snprintf(error, error_len, "%s", L.error);
    }
    for (Fiber& f : L.fibers) std::free(f.stack);
    std::free(L.arenas);
    return rc;
}
