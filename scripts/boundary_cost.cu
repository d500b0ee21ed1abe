// What one dependent all-to-all boundary costs on this GPU, and whether a hop's weight bytes
// stream through it. Every block of a grid of one block a multiprocessor reads the whole
// vector the hop before wrote (D 32-bit words, through L2), sums it, and writes its own slice
// of the next vector from that sum. A batch-1 decode step is a chain of such boundaries (each
// product needs all of its input vector: q/k/v, o, gate + up, down, the per-layer-input pair),
// so the time a boundary takes, times the boundaries a step has, is a floor under the step's
// time beyond its bytes unless the bytes stream through the boundaries (docs/perf.md, sessions
// 66 and 67). Timed over HOPS boundaries:
//   graph+PDL   a CUDA graph of HOPS launches with programmatic dependent launch (what the
//               backend replays): griddepcontrol.wait, then launch_dependents, then the hop;
//   graph       the same graph without it (each launch waits for the one ahead to end);
//   persistent  one launch; between hops a grid-wide barrier (a fence, one atomic add a block,
//               thread 0 polling the count) — the chain's hand-over (sessions 44, 58–61);
//   barrier     the persistent barrier alone, no vector read or written;
// then hops that also stream a product's bytes: graph+PDL hops whose first loads go out before
// the wait (the next kernel launched early or late), and persistent hops fed by a producer warp
// that copies every hop's weights into a ring of shared memory as fast as slots free up, with
// the whole hand-over (barrier forms 0 and 2), the barrier alone (forms 0–3), a spin in its
// place, no boundary, or a hand-over of tagged words with no barrier and no fence (session 67:
// the ring streams through a spin, not through any hand-over of data).
// Integer sums wrap, so every order gives the same words: the host replays the hops and checks
// the last vector (the tagged hops' words and tags too), so a boundary that let a block read
// too early fails the run.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/boundary_cost scripts/boundary_cost.cu && /tmp/boundary_cost
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
// The backend's device helpers (mbarriers, bulk copies, shared addresses).
#include "../crates/markbase-cuda/kernels/common.cuh"
#include "cuda_check.cuh"

constexpr int THREADS = 256, HOPS = 420, REPEATS = 15;

__host__ __device__ unsigned next_word(unsigned sum, unsigned i) {
    return sum * 2654435761u + i;
}

// A barrier of the block's first THREADS threads (named barrier 1): the whole block in every
// kernel but `streamed`, whose producer warp takes no part.
__device__ __forceinline__ void workers_sync() {
    asm volatile("bar.sync 1, %0;" ::"r"(THREADS) : "memory");
}

// The sum of the block's first THREADS threads' `s` (each of them gets it).
__device__ unsigned block_total(unsigned s) {
    __shared__ unsigned part[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
    workers_sync();
    unsigned t = 0;
    for (int w = 0; w < THREADS / 32; w++) t += part[w];
    workers_sync();
    return t;
}

// The sum of x[0..d) over the block's first THREADS threads (each of them gets it).
__device__ unsigned block_sum(const unsigned* x, int d) {
    unsigned s = 0;
    for (int i = threadIdx.x; i < d; i += THREADS) s += __ldcg(x + i);
    return block_total(s);
}

// The first and one-past-last index of block b's slice of a vector of d words.
__device__ int2 slice_of(int d) {
    int chunk = (d + gridDim.x - 1) / gridDim.x;
    int lo = blockIdx.x * chunk;
    return make_int2(lo, min(d, lo + chunk));
}

// Block b's slice of the next vector.
__device__ void write_slice(unsigned* y, int d, unsigned sum) {
    int2 r = slice_of(d);
    for (int i = r.x + threadIdx.x; i < r.y; i += THREADS) __stcg(y + i, next_word(sum, i));
}

// One boundary: with `per_block` > 0 the block also streams its share of `w` (16-byte
// words), the first AHEAD of each thread's loads issued before the wait — the weights of a
// product, which no kernel writes — and the rest after it, UNROLL loads in flight a thread.
// `late`: the next kernel may launch only once this block has streamed its share
// (griddepcontrol.launch_dependents after the loop, not right after the wait), so the next
// kernel's loads before its wait are issued as this one ends rather than as it begins.
constexpr int UNROLL = 8;

template <int AHEAD>
__global__ void hop(const unsigned* x, unsigned* y, int d, int pdl, const uint4* w,
                    long long per_block, int late) {
    const uint4* mine = w + blockIdx.x * per_block;
    uint4 ahead[AHEAD];
#pragma unroll
    for (int k = 0; k < AHEAD; k++) {
        long long i = threadIdx.x + (long long)k * THREADS;
        ahead[k] = i < per_block ? __ldcs(mine + i) : make_uint4(0, 0, 0, 0);
    }
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        if (!late) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    unsigned sum = block_sum(x, d), acc = 0;
#pragma unroll
    for (int k = 0; k < AHEAD; k++) acc += ahead[k].x ^ ahead[k].y ^ ahead[k].z ^ ahead[k].w;
    for (long long i = threadIdx.x + (long long)AHEAD * THREADS; i < per_block;
         i += (long long)UNROLL * THREADS) {
        uint4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            long long j = i + (long long)k * THREADS;
            v[k] = j < per_block ? __ldcs(mine + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++) acc += v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (pdl && late) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // The weights' sum must not be dropped, nor change the vector: `w` is all 0x01 bytes, so
    // acc never equals this marker.
    if (acc == 0xdeadbeefu) y[0] = acc;
    write_slice(y, d, sum);
}

// The copy rate's reference: `n` 16-byte words of `w` read by one launch.
__global__ void stream(const uint4* w, long long n, unsigned* sink) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)THREADS + threadIdx.x; i < n;
         i += (long long)gridDim.x * THREADS * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            long long j = i + (long long)k * gridDim.x * THREADS;
            v[k] = j < n ? __ldcs(w + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++) acc += v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

// Every block's first THREADS threads wait here until `target` arrivals have been counted.
// `kind` 0: a full fence, one atomic add, thread 0 polling the count, a full fence;
// 1: the add and the polling without fences (no ordering: for hops that hand nothing over);
// 2: a release add and acquire polls (fence.acq_rel only where the data needs it);
// 3: kind 0 with a 64 ns sleep between polls.
__device__ void grid_barrier(unsigned* count, unsigned target, int kind = 0) {
    workers_sync();
    if (threadIdx.x == 0) {
        if (kind == 2) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
            unsigned seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                             : "=r"(seen)
                             : "l"(count)
                             : "memory");
            } while (seen < target);
        } else {
            if (kind != 1) __threadfence();
            atomicAdd(count, 1u);
            while (*(volatile unsigned*)count < target) {
                if (kind == 3) __nanosleep(64);
            }
            if (kind != 1) __threadfence();
        }
    }
    workers_sync();
}

__global__ void persistent(unsigned* a, unsigned* b, int d, int hops, unsigned* count,
                           int exchange) {
    for (int h = 0; h < hops; h++) {
        unsigned* x = h % 2 ? b : a;
        unsigned* y = h % 2 ? a : b;
        if (exchange) write_slice(y, d, block_sum(x, d));
        grid_barrier(count, (unsigned)(h + 1) * gridDim.x);
    }
}

// A hand-over with no barrier and no fence (boundary 4): each word of a vector travels with
// the hop that wrote it, as one 64-bit relaxed store (the word above, its tag below), and a
// reader loads its words TAGGED_AHEAD at a time and loads again each one whose tag is not yet
// the hop's own.
constexpr int TAGGED_AHEAD = 10;

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The sum of the words of x[0..d) tagged `tag`, over the block's first THREADS threads.
__device__ unsigned tagged_sum(const unsigned long long* x, int d, unsigned tag) {
    unsigned s = 0;
    for (int i0 = threadIdx.x; i0 < d; i0 += TAGGED_AHEAD * THREADS) {
        unsigned long long v[TAGGED_AHEAD];
#pragma unroll
        for (int k = 0; k < TAGGED_AHEAD; k++) {
            int i = i0 + k * THREADS;
            v[k] = i < d ? load_relaxed(x + i) : tag;
        }
#pragma unroll
        for (int k = 0; k < TAGGED_AHEAD; k++) {
            int i = i0 + k * THREADS;
            while ((unsigned)v[k] != tag) v[k] = load_relaxed(x + i);
            s += (unsigned)(v[k] >> 32);
        }
    }
    return block_total(s);
}

// Block b's slice of the next vector, tagged `tag`.
__device__ void write_tagged_slice(unsigned long long* y, int d, unsigned sum, unsigned tag) {
    int2 r = slice_of(d);
    for (int i = r.x + threadIdx.x; i < r.y; i += THREADS) {
        unsigned long long v = ((unsigned long long)next_word(sum, i) << 32) | tag;
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(y + i), "l"(v) : "memory");
    }
}

// The first vector of a tagged run, tagged `tag`.
__global__ void tagged_first(unsigned long long* x, int d, unsigned tag) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        x[i] = ((unsigned long long)(i * 7u + 1u) << 32) | tag;
}

// The cycles of `streamed`'s stand-in for a barrier (boundary 3): ≈ 1.5 µs at 1.98 GHz.
constexpr long long SPIN_CYCLES = 2900;

// The hops of `persistent` with weights streamed by a producer of their own: in each block
// one lane of an extra warp copies the block's share of every hop's weights, hop after hop,
// into a ring of `stages` slots of `stage` bytes of shared memory by bulk copies (TMA), as
// fast as slots are free; the block's THREADS consumer threads take that hop's slots from the
// ring and free them around the hop's boundary. The producer never waits for a boundary, only
// for a free slot, so its copies may keep the memory busy while the consumers hand a vector
// over; with `inflight` > 0 it also waits until no more than `inflight` of its copies are in
// flight, so that free slots are left to copy into while the consumers hand over. `boundary`:
// 0 none; 1 the grid barrier alone (form `barrier_kind`); 2 the whole
// hand-over (sum, slice, barrier); 3 a spin of SPIN_CYCLES instead; 4 the tagged hand-over
// (hop h reads words tagged tag0 + h).
__global__ void streamed(unsigned* a, unsigned* b, int d, int hops, unsigned* count,
                         unsigned tag0, const uint4* w, long long per_block, long long places,
                         int stages, int stage, int inflight, int boundary, int barrier_kind) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[16], empty[16];
    const long long bytes = per_block * 16;
    const int chunks = (int)((bytes + stage - 1) / stage);
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; i++) {
            mbar_init(shared_address(&full[i]), 1);
            mbar_init(shared_address(&empty[i]), THREADS / 32);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x >= THREADS) {  // the producer warp
        if (threadIdx.x != THREADS) return;
        long long it = 0;
        for (int h = 0; h < hops; h++) {
            const unsigned char* src =
                (const unsigned char*)(w + (h % places) * per_block * gridDim.x) +
                blockIdx.x * bytes;
            for (int c = 0; c < chunks; c++, it++) {
                int slot = (int)(it % stages);
                long long round = it / stages;
                if (round > 0) mbar_wait(shared_address(&empty[slot]), (u32)((round - 1) & 1));
                if (inflight && it >= inflight) {  // copy it − inflight has landed
                    long long j = it - inflight;
                    mbar_wait(shared_address(&full[j % stages]), (u32)((j / stages) & 1));
                }
                u32 n = (u32)min((long long)stage, bytes - (long long)c * stage);
                u32 bar = shared_address(&full[slot]);
                mbar_arrive_expect_tx(bar, n);
                bulk_copy(shared_address(ring + slot * stage), src + (long long)c * stage, n, bar);
            }
        }
        return;
    }
    unsigned acc = 0;
    long long it = 0;
    for (int h = 0; h < hops; h++) {
        unsigned* x = h % 2 ? b : a;
        unsigned* y = h % 2 ? a : b;
        unsigned sum = boundary == 2   ? block_sum(x, d)
                       : boundary == 4 ? tagged_sum((unsigned long long*)x, d, tag0 + h)
                                       : 0;
        for (int c = 0; c < chunks; c++, it++) {
            int slot = (int)(it % stages);
            mbar_wait(shared_address(&full[slot]), (u32)((it / stages) & 1));
            int n = (int)min((long long)stage, bytes - (long long)c * stage) / 16;
            const uint4* v = (const uint4*)(ring + slot * stage);
            for (int i = threadIdx.x; i < n; i += THREADS) {
                uint4 q = v[i];
                acc += q.x ^ q.y ^ q.z ^ q.w;
            }
            __syncwarp();
            if (threadIdx.x % 32 == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(
                                 shared_address(&empty[slot]))
                             : "memory");
        }
        if (acc == 0xdeadbeefu) y[0] = acc;
        if (boundary == 2) write_slice(y, d, sum);
        if (boundary == 4) write_tagged_slice((unsigned long long*)y, d, sum, tag0 + h + 1);
        if (boundary == 3) {  // no barrier: thread 0 spins SPIN_CYCLES, the others wait for it
            if (threadIdx.x == 0) {
                long long t0 = clock64();
                while (clock64() - t0 < SPIN_CYCLES) {
                }
            }
            workers_sync();
        } else if (boundary) {
            grid_barrier(count, (unsigned)(h + 1) * gridDim.x, barrier_kind);
        }
    }
}

static std::vector<unsigned> first_vector(int d) {
    std::vector<unsigned> v(d);
    for (int i = 0; i < d; i++) v[i] = i * 7u + 1u;
    return v;
}

static std::vector<unsigned> replay(int d, int hops) {
    std::vector<unsigned> v = first_vector(d), w(d);
    for (int h = 0; h < hops; h++) {
        unsigned s = 0;
        for (unsigned x : v) s += x;
        for (int i = 0; i < d; i++) w[i] = next_word(s, i);
        std::swap(v, w);
    }
    return v;
}

// Median of REPEATS timings (µs a boundary) of `run`, after one untimed run; checks the last
// vector (at `last`) after every run when `d` > 0.
template <class F>
static double time_it(F run, cudaStream_t s, int d, unsigned* a, const unsigned* last) {
    std::vector<unsigned> want = d ? replay(d, HOPS) : std::vector<unsigned>(), got(d);
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    std::vector<double> us;
    for (int r = 0; r <= REPEATS; r++) {
        std::vector<unsigned> v = first_vector(d);
        if (d) CHECK(cudaMemcpy(a, v.data(), d * 4, cudaMemcpyHostToDevice));
        CHECK(cudaEventRecord(t0, s));
        run();
        CHECK(cudaEventRecord(t1, s));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (r > 0) us.push_back(ms * 1000.0 / HOPS);
        if (d) {
            CHECK(cudaMemcpy(got.data(), last, d * 4, cudaMemcpyDeviceToHost));
            if (got != want) {
                fprintf(stderr, "wrong vector after %d hops (d = %d)\n", HOPS, d);
                exit(1);
            }
        }
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

// A graph of HOPS boundaries (`pdl`: with programmatic dependent launch), hop h streaming
// the `per_block` · sms words of `w` at h's place in a buffer of `w_len` words (so no hop finds
// its weights in L2).
template <int AHEAD>
static cudaGraphExec_t chain_graph(cudaStream_t s, int sms, unsigned* a, unsigned* b, int d,
                                   int pdl, const uint4* w, long long per_block,
                                   long long w_len, int late) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    long long span = per_block * sms, places = span ? w_len / span : 1;
    for (int h = 0; h < HOPS; h++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(sms);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = s;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = pdl;
        const unsigned* x = h % 2 ? b : a;
        unsigned* y = h % 2 ? a : b;
        const uint4* wh = w + (h % places) * span;
        CHECK(cudaLaunchKernelEx(&cfg, hop<AHEAD>, x, y, d, pdl, wh, per_block, late));
    }
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaGraphDestroy(g));
    return ge;
}

// A producer warp's ring: slots, bytes a slot, copies in flight at most (0: the ring's).
struct Ring {
    int stages, stage, inflight;
};

// What the tables of `streamed` hops share: the buffers, the stream, the grid, the read rate.
struct Probe {
    unsigned *a, *b, *count;
    const uint4* w;
    long long w_len;
    cudaStream_t s;
    int sms, d;
    double rate_gbs;
    unsigned tag0 = 1;

    // µs a hop of `mb` MB at the read rate.
    double bytes_us(double mb) const {
        return per_block(mb) * sms * 16.0 / (rate_gbs * 1e3);
    }
    long long per_block(double mb) const { return (long long)(mb * 1e6 / 16 / sms); }

    // µs a hop of `streamed` with `mb` MB a hop through ring `r`, boundary `mode` and barrier
    // form `kind`; the last vector checked after every run (hand-overs) or once after the
    // timed runs (tagged hand-overs, their tags too).
    double streamed_hop(double mb, Ring r, int mode, int kind) {
        long long pb = per_block(mb), span = pb * sms, places = span ? w_len / span : 1;
        CHECK(cudaFuncSetAttribute(streamed, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   r.stages * r.stage));
        // Tagged runs: no tag left in the buffers by the other hops, a fresh tag a run.
        if (mode == 4) {
            CHECK(cudaMemset(a, 0, 10240 * 8));
            CHECK(cudaMemset(b, 0, 10240 * 8));
        }
        auto run = [&] {
            CHECK(cudaMemsetAsync(count, 0, 4, s));
            if (mode == 4) tagged_first<<<8, THREADS, 0, s>>>((unsigned long long*)a, d, tag0);
            int hops = HOPS;
            void* args[] = {&a,      &b,       &d,       &hops,       &count, &tag0, &w, &pb,
                            &places, &r.stages, &r.stage, &r.inflight, &mode,  &kind};
            CHECK(cudaLaunchCooperativeKernel((void*)streamed, dim3(sms), dim3(THREADS + 32),
                                              args, r.stages * r.stage, s));
            tag0 += HOPS + 1;
        };
        double us = time_it(run, s, mode == 2 ? d : 0, a, a);
        if (mode == 4) {
            run();
            CHECK(cudaStreamSynchronize(s));
            std::vector<unsigned long long> got(d);
            CHECK(cudaMemcpy(got.data(), a, d * 8, cudaMemcpyDeviceToHost));
            std::vector<unsigned> want = replay(d, HOPS);
            for (int i = 0; i < d; i++)
                if ((unsigned)(got[i] >> 32) != want[i] || (unsigned)got[i] != tag0 - 1) {
                    fprintf(stderr, "tagged hops: wrong vector at %d\n", i);
                    exit(1);
                }
        }
        return us;
    }
};

int main() {
    int dev = 0, sms = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d multiprocessors; %d boundaries a run, median of %d runs, µs a boundary\n",
           prop.name, sms, HOPS, REPEATS);
    unsigned *a, *b, *count;
    CHECK(cudaMalloc(&a, 10240 * 8));
    CHECK(cudaMalloc(&b, 10240 * 8));
    CHECK(cudaMalloc(&count, 4));
    const long long w_len = (4ll << 30) / 16;
    uint4* w;
    CHECK(cudaMalloc(&w, w_len * 16));
    CHECK(cudaMemset(w, 1, w_len * 16));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // HOPS is even, so the last vector is back in `a`.
    for (int d : {2560, 10240}) {
        double graph_us[2];
        for (int pdl = 1; pdl >= 0; pdl--) {
            cudaGraphExec_t ge = chain_graph<8>(s, sms, a, b, d, pdl, w, 0, w_len, 0);
            graph_us[pdl] = time_it([&] { CHECK(cudaGraphLaunch(ge, s)); }, s, d, a, a);
            CHECK(cudaGraphExecDestroy(ge));
        }
        auto persistent_run = [&](int exchange) {
            return [&, exchange] {
                CHECK(cudaMemsetAsync(count, 0, 4, s));
                int hops = HOPS, ex = exchange;
                void* args[] = {&a, &b, &d, &hops, &count, &ex};
                CHECK(cudaLaunchCooperativeKernel((void*)persistent, dim3(sms), dim3(THREADS),
                                                  args, 0, s));
            };
        };
        double pers = time_it(persistent_run(1), s, d, a, a);
        double bare = time_it(persistent_run(0), s, 0, a, a);
        printf("D = %5d words: graph+PDL %.2f, graph %.2f, persistent %.2f, barrier %.2f\n", d,
               graph_us[1], graph_us[0], pers, bare);
    }
    // Does a boundary hide behind the bytes a hop streams? The copy rate first (one launch
    // over the whole buffer), then graph+PDL hops of a product's bytes each (E4B bf16: the
    // per-layer-input projection, q or o, down), against the boundary alone plus the bytes at
    // that rate (no overlap) and the larger of the two (full overlap).
    unsigned* sink = count;
    double rate_gbs;
    {
        cudaEvent_t t0, t1;
        CHECK(cudaEventCreate(&t0));
        CHECK(cudaEventCreate(&t1));
        std::vector<float> ms(REPEATS);
        for (int r = 0; r <= REPEATS; r++) {
            CHECK(cudaEventRecord(t0, s));
            stream<<<sms * 8, THREADS, 0, s>>>(w, w_len, sink);
            CHECK(cudaEventRecord(t1, s));
            CHECK(cudaEventSynchronize(t1));
            if (r > 0) CHECK(cudaEventElapsedTime(&ms[r - 1], t0, t1));
        }
        std::sort(ms.begin(), ms.end());
        rate_gbs = w_len * 16.0 / (ms[REPEATS / 2] * 1e6);
    }
    printf("read rate, one launch over %.1f GB: %.0f GB/s\n", w_len * 16 / 1e9, rate_gbs);
    const int d = 2560;
    Probe probe{a, b, count, w, w_len, s, sms, d, rate_gbs};
    double alone = 0;
    printf("graph+PDL hops, µs a hop: the next kernel launched right after the wait (early) or "
           "once the blocks have streamed (late), 8 or 16 loads a thread before the wait\n");
    for (double mb : {0.0, 1.31, 10.49, 52.43}) {
        long long per_block = probe.per_block(mb);
        double us[4];
        for (int v = 0; v < 4; v++) {
            int late = v & 1;
            cudaGraphExec_t ge =
                v < 2 ? chain_graph<8>(s, sms, a, b, d, 1, w, per_block, w_len, late)
                      : chain_graph<16>(s, sms, a, b, d, 1, w, per_block, w_len, late);
            us[v] = time_it([&] { CHECK(cudaGraphLaunch(ge, s)); }, s, d, a, a);
            CHECK(cudaGraphExecDestroy(ge));
        }
        if (per_block == 0) alone = us[0];
        double bytes_us = probe.bytes_us(mb);
        printf("%6.2f MB a hop: early/8 %6.2f, late/8 %6.2f, early/16 %6.2f, late/16 %6.2f; "
               "bytes at the rate %6.2f, no overlap %6.2f, full overlap %6.2f\n",
               mb, us[0], us[1], us[2], us[3], bytes_us, alone + bytes_us,
               std::max(alone, bytes_us));
    }
    // The same hops in one persistent launch, the weights by the producer warp's ring of 8
    // slots of 16 KB: the whole hand-over (barrier forms 0, 2, 3), the barrier alone (forms
    // 0–3), a spin of SPIN_CYCLES instead, no boundary, the tagged hand-over.
    printf("persistent hops, weights by a producer warp's ring of 8 slots of 16 KB (µs a hop); "
           "barriers: 0 fences, 1 none, 2 release/acquire, 3 fences and polls 64 ns apart\n");
    for (double mb : {0.0, 1.31, 10.49, 52.43}) {
        const int variants[10][2] = {{2, 0}, {2, 2}, {2, 3}, {1, 0}, {1, 1},
                                     {1, 2}, {1, 3}, {3, 0}, {0, 0}, {4, 0}};
        double us[10];
        for (int v = 0; v < 10; v++)
            us[v] = probe.streamed_hop(mb, {8, 16384, 0}, variants[v][0], variants[v][1]);
        printf("%6.2f MB a hop: hand-over with barrier 0 %6.2f, 2 %6.2f, 3 %6.2f; barrier alone "
               "0 %6.2f, 1 %6.2f, 2 %6.2f, 3 %6.2f; a spin instead %6.2f; no boundary %6.2f; "
               "tagged hand-over %6.2f; bytes at the rate %6.2f\n",
               mb, us[0], us[1], us[2], us[3], us[4], us[5], us[6], us[7], us[8], us[9],
               probe.bytes_us(mb));
    }
    // A paced ring: no more than `inflight` copies in flight, the rest of the ring free to copy
    // into while the consumers hand over (if a hand-over's round trips are served behind the
    // copies in flight, an unpaced ring has drained by the time they return).
    printf("paced rings (slots × 16 KB / copies in flight at most), µs a hop: no boundary, "
           "hand-over with barrier 0, tagged hand-over\n");
    const Ring paced[6] = {{8, 16384, 0}, {8, 16384, 2}, {8, 16384, 3},
                           {8, 16384, 4}, {12, 16384, 3}, {12, 16384, 4}};
    for (double mb : {10.49, 52.43}) {
        printf("%6.2f MB a hop (bytes at the rate %6.2f):", mb, probe.bytes_us(mb));
        for (const Ring& r : paced)
            printf(" %d/%d %.2f %.2f %.2f;", r.stages, r.inflight ? r.inflight : r.stages,
                   probe.streamed_hop(mb, r, 0, 0), probe.streamed_hop(mb, r, 2, 0),
                   probe.streamed_hop(mb, r, 4, 0));
        printf("\n");
    }
    return 0;
}
