// Whether a 64-token bf16 product can stream its weights near the copy rate with a small fixed
// cost — what E4B's batch-64 goal needs (docs/perf.md: cuBLASLt takes 5–7 µs for each small
// product whatever its bytes, and runs gate + up and down at 2.1–2.8 TB/s).
//
// The kernel here, `skinny`, is one wave with no reduction pass: a block takes 32 × WARPS
// weight rows over one k-range; a cluster of S blocks along k splits the rows' k, and its
// blocks add their partial sums through distributed shared memory (each block the same slice,
// in rank order) before one store — no atomics, no second launch. Weights go from global
// memory straight into registers, 16 bytes a lane (a quad reads 64 contiguous bytes of a row),
// a few k-steps of 32 ahead; `mma.sync.m16n8k16` takes them as A fragments with k permuted
// within each 32 (lane c's 8 values are logical k 2c, 2c+1, 2c+8, 2c+9 of two k16 steps), and
// the 64 tokens' activations are read with the same permutation (one 16-byte load a lane a
// token tile), so the sums are the plain products: staged once in shared memory before the
// first product, or loaded from global memory beside the weights (`skinny`'s two forms).
// Timed against cuBLASLt (bf16 in, f32 out, its heuristic's first algorithm), both as a CUDA
// graph of back-to-back products over copies of the weights that do not fit in L2; the outputs
// compared (a difference over 10⁻³ of the largest output fails the run). Build and run on the
// GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/skinny scripts/skinny_probe.cu -lcublasLt && /tmp/skinny
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cublasLt.h>
#include "cuda_check.cuh"

namespace cg = cooperative_groups;

constexpr int T = 64;        // token rows
constexpr int NT = T / 8;    // n8 tiles of tokens
constexpr int MT = 2;        // m16 tiles of weight rows a warp
constexpr int LAUNCHES = 40, REPEATS = 7;

#define CHECK_LT(x)                                                                  \
    do {                                                                             \
        cublasStatus_t s = (x);                                                      \
        if (s != CUBLAS_STATUS_SUCCESS) {                                            \
            fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

// Activations' row pitch in shared memory (bf16 values): a multiple of 64 plus 32, so the
// eight token rows a quarter-warp reads fall on distinct banks.
__host__ __device__ int x_pitch(int kc) { return (kc + 63) / 64 * 64 + 32; }

__host__ int smem_bytes(bool staged, int kc, int warps) {
    int xs = staged ? T * x_pitch(kc) * 2 : 0;
    int parts = 32 * warps * T * 4;
    return std::max(xs, parts);
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// out[t · rows + r] = Σ_k x[t · K + k] · w[r · K + k] for T tokens; grid (rows / (32 · warps),
// S) in clusters of (1, S, 1), kc = K / S a multiple of 32. STAGED: the block's activations
// copied to shared memory before the first product (ST k-steps of weights in flight); else each
// lane loads its activations from global memory (L1 shared by the block's warps) beside the
// weights, ST k-steps of both in flight.
template <bool STAGED, int ST>
__global__ void __launch_bounds__(128) skinny(const __nv_bfloat16* __restrict__ w,
                                              const __nv_bfloat16* __restrict__ x,
                                              float* __restrict__ out, int rows, int K, int kc) {
    extern __shared__ uint4 smem[];
    cg::cluster_group cluster = cg::this_cluster();
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int k0 = blockIdx.y * kc, pitch = x_pitch(kc), steps = kc / 32;
    const int brows = 32 * warps, block_row0 = blockIdx.x * brows;

    // The weights first: their loads are the long ones.
    const uint4* wp[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = block_row0 + warp * 32 + m * 16 + g + 8 * h;
            wp[m][h] = reinterpret_cast<const uint4*>(w + (size_t)r * K + k0 + c * 8);
        }
    // Lane (g, c)'s activations of token tile n: token 8n + g, 16 bytes at k0 + 32 · step + 8c.
    const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)g * K + k0 + c * 8);
    const size_t tile = K;  // uint4s from one token tile to the next (8 rows of K / 8)
    uint4 ring[ST][MT][2], xring[STAGED ? 1 : ST][NT];
#pragma unroll
    for (int s = 0; s < ST; ++s)
        if (s < steps) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) ring[s][m][h] = load_stream(wp[m][h] + s * 4);
            if constexpr (!STAGED)
#pragma unroll
                for (int n = 0; n < NT; ++n) xring[s][n] = xp[n * tile + s * 4];
        }

    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
    if constexpr (STAGED) {  // the tokens' activations for this k-range, 16 bytes a copy
        const int pieces = kc / 8;
        for (int i = threadIdx.x; i < T * pieces; i += blockDim.x) {
            int t = i / pieces, j = i % pieces;
            unsigned dst = (unsigned)__cvta_generic_to_shared(xs + t * pitch + j * 8);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst),
                         "l"(x + (size_t)t * K + k0 + j * 8));
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
        __syncthreads();
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.f;

    for (int base = 0; base < steps; base += ST) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            const int step = base + s;
            if (step < steps) {
                const bool more = step + ST < steps;
                uint4 a[MT][2], bx[NT];
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        a[m][h] = ring[s][m][h];
                        if (more) ring[s][m][h] = load_stream(wp[m][h] + (step + ST) * 4);
                    }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    if constexpr (STAGED) {
                        bx[n] = *reinterpret_cast<const uint4*>(xs + (n * 8 + g) * pitch +
                                                                step * 32 + c * 8);
                    } else {
                        bx[n] = xring[s][n];
                        if (more) xring[s][n] = xp[n * tile + (step + ST) * 4];
                    }
                }
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        mma(acc[m][n], a[m][0].x, a[m][1].x, a[m][0].y, a[m][1].y, bx[n].x,
                            bx[n].y);
                        mma(acc[m][n], a[m][0].z, a[m][1].z, a[m][0].w, a[m][1].w, bx[n].z,
                            bx[n].w);
                    }
            }
        }
    }

    // Partial sums to shared memory as [token][block row], then the cluster adds them.
    __syncthreads();
    float* part = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int t = n * 8 + 2 * c + (i & 1);
                int r = warp * 32 + m * 16 + g + 8 * (i >> 1);
                part[t * brows + r] = acc[m][n][i];
            }
    cluster.sync();
    const int S = cluster.num_blocks(), rank = cluster.block_rank();
    const int share = brows * T / S;
    for (int e = rank * share + threadIdx.x; e < (rank + 1) * share; e += blockDim.x) {
        float sum = 0.f;
        for (int q = 0; q < S; ++q) sum += cluster.map_shared_rank(part, q)[e];
        out[(size_t)(e / brows) * rows + block_row0 + e % brows] = sum;
    }
    cluster.sync();
}

struct Config {
    bool staged;
    int warps, splits;
};

// Launches `skinny` for one product; false when the shape does not take the config.
bool launch_skinny(cudaStream_t st, Config cfg, const __nv_bfloat16* w, const __nv_bfloat16* x,
                   float* out, int rows, int K) {
    int kc = K / cfg.splits;
    if (K % cfg.splits || kc % 32 || rows % (32 * cfg.warps)) return false;
    int smem = smem_bytes(cfg.staged, kc, cfg.warps);
    if (smem > 227 * 1024) return false;
    void (*kernel)(const __nv_bfloat16*, const __nv_bfloat16*, float*, int, int, int) =
        cfg.staged ? skinny<true, 4> : skinny<false, 2>;
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(rows / (32 * cfg.warps), cfg.splits);
    lc.blockDim = dim3(32 * cfg.warps);
    lc.dynamicSmemBytes = smem;
    lc.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 1;
    at[0].val.clusterDim.y = cfg.splits;
    at[0].val.clusterDim.z = 1;
    lc.attrs = at;
    lc.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &lc) != cudaSuccess || clusters < 1) {
        cudaGetLastError();
        return false;
    }
    return cudaLaunchKernelEx(&lc, kernel, w, x, out, rows, K, kc) == cudaSuccess;
}

struct Lt {
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    void* ws;
    size_t ws_bytes = 32 << 20;
    Lt(int rows, int K) {
        CHECK_LT(cublasLtCreate(&h));
        CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t tr = CUBLAS_OP_T, n = CUBLAS_OP_N;
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n));
        CHECK_LT(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, K, rows, K));
        CHECK_LT(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, T, K));
        CHECK_LT(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, rows, T, rows));
        CHECK(cudaMalloc(&ws, ws_bytes));
        cublasLtMatmulPreference_t pref;
        CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
        CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        CHECK_LT(cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, c, c, pref, 1, &res, &found));
        if (!found) {
            fprintf(stderr, "cuBLASLt: no algorithm for %d x %d\n", rows, K);
            exit(1);
        }
        algo = res.algo;
        cublasLtMatmulPreferenceDestroy(pref);
    }
    void run(cudaStream_t st, const void* w, const void* x, float* out) {
        float one = 1.f, zero = 0.f;
        CHECK_LT(cublasLtMatmul(h, desc, &one, w, a, x, b, &zero, out, c, out, c, &algo, ws,
                                ws_bytes, st));
    }
};

// Median µs a product of a graph of `launches` products (`product(i)` queues the i-th).
template <typename F>
float time_graph(cudaStream_t st, int launches, F&& product) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    bool ok = true;
    for (int i = 0; i < launches; ++i) ok &= product(i);
    CHECK(cudaStreamEndCapture(st, &graph));
    if (!ok) {
        cudaGraphDestroy(graph);
        cudaGetLastError();
        return -1.f;
    }
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> ts;
    for (int r = 0; r < REPEATS + 1; ++r) {
        CHECK(cudaEventRecord(e0, st));
        CHECK(cudaGraphLaunch(exec, st));
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r) ts.push_back(ms * 1000.f / launches);
    }
    std::sort(ts.begin(), ts.end());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ts[ts.size() / 2];
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 0.25f);
    }
}

int main() {
    for (auto kernel : {skinny<true, 4>, skinny<false, 2>}) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   227 * 1024));
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaFuncAttributes fa, fd;
    CHECK(cudaFuncGetAttributes(&fa, skinny<true, 4>));
    CHECK(cudaFuncGetAttributes(&fd, skinny<false, 2>));
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // The copy rate: bytes read plus written over a device-to-device copy's time.
    size_t cbytes = 1ull << 30;
    void *ca, *cb;
    CHECK(cudaMalloc(&ca, cbytes));
    CHECK(cudaMalloc(&cb, cbytes));
    float copy_us = time_graph(st, LAUNCHES, [&](int) {
        return cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice, st) == cudaSuccess;
    });
    double rate = 2.0 * cbytes / (copy_us * 1e-6);  // bytes a second
    CHECK(cudaFree(ca));
    CHECK(cudaFree(cb));
    printf("%s, %d multiprocessors, L2 %d MB; copy rate %.0f GB/s; %d tokens, µs a product "
           "(median of %d graphs of %d); staged: %d registers, %zu bytes of local memory, direct: "
           "%d, %zu; ours as s(taged)/d(irect) warps/splits µs\n",
           prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, rate / 1e9, T, REPEATS,
           LAUNCHES, fa.numRegs, fa.localSizeBytes, fd.numRegs, fd.localSizeBytes);

    struct Shape {
        const char* name;
        int rows, K;
    };
    const Shape shapes[] = {{"q", 2048, 2560},        {"k+v", 1024, 2560},
                            {"o", 2560, 2048},        {"gate+up", 20480, 2560},
                            {"down", 2560, 10240},    {"ple gate", 256, 2560},
                            {"ple proj", 2560, 256}};
    std::vector<Config> configs;
    for (bool staged : {true, false})
        for (int warps : {1, 2, 4})
            for (int splits : {1, 2, 4, 8, 16}) configs.push_back({staged, warps, splits});
    std::vector<Config> bests;
    bool mismatch = false;
    for (const Shape& sh : shapes) {
        size_t wn = (size_t)sh.rows * sh.K, wbytes = wn * 2;
        int copies = std::max(2, (int)((256ull << 20) / wbytes) + 1);
        copies = std::min(copies, LAUNCHES);
        __nv_bfloat16 *w, *x;
        float *o_ours, *o_lt;
        CHECK(cudaMalloc(&w, wbytes * copies));
        CHECK(cudaMalloc(&x, (size_t)T * sh.K * 2));
        CHECK(cudaMalloc(&o_ours, (size_t)T * sh.rows * 4));
        CHECK(cudaMalloc(&o_lt, (size_t)T * sh.rows * 4));
        fill<<<1024, 256, 0, st>>>(w, wn * copies, 17);
        fill<<<64, 256, 0, st>>>(x, (size_t)T * sh.K, 91);
        CHECK(cudaStreamSynchronize(st));
        Lt lt(sh.rows, sh.K);
        float lt_us = time_graph(st, LAUNCHES, [&](int i) {
            lt.run(st, w + i % copies * wn, x, o_lt);
            return true;
        });
        float best = 1e9f;
        Config best_cfg = {true, 0, 0};
        printf("%-8s %5d x %5d (%5.2f MB, bytes at the rate %5.2f): cuBLASLt %6.2f; ours",
               sh.name, sh.rows, sh.K, wbytes / 1e6, wbytes / rate * 1e6, lt_us);
        for (Config cfg : configs) {
            float us = time_graph(st, LAUNCHES, [&](int i) {
                return launch_skinny(st, cfg, w + i % copies * wn, x, o_ours, sh.rows, sh.K);
            });
            if (us < 0) continue;
            printf(" %c%d/%d %.2f", cfg.staged ? 's' : 'd', cfg.warps, cfg.splits, us);
            if (us < best) best = us, best_cfg = cfg;
        }
        // Check the best config's sums (over copy 0) against cuBLASLt's.
        lt.run(st, w, x, o_lt);
        if (!launch_skinny(st, best_cfg, w, x, o_ours, sh.rows, sh.K)) {
            fprintf(stderr, "no config ran for %s\n", sh.name);
            exit(1);
        }
        CHECK(cudaStreamSynchronize(st));
        std::vector<float> a((size_t)T * sh.rows), b(a.size());
        CHECK(cudaMemcpy(a.data(), o_ours, a.size() * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b.data(), o_lt, b.size() * 4, cudaMemcpyDeviceToHost));
        double diff = 0, peak = 0;
        for (size_t i = 0; i < a.size(); ++i) {
            diff = std::max(diff, (double)std::fabs(a[i] - b[i]));
            peak = std::max(peak, (double)std::fabs(b[i]));
        }
        bool wrong = diff > 1e-3 * peak;
        mismatch |= wrong;
        printf("\n    best %s %d warps / %d splits %.2f µs (%.0f GB/s); max |ours - cuBLASLt| "
               "%.3g of max |out| %.3g%s\n",
               best_cfg.staged ? "staged" : "direct", best_cfg.warps, best_cfg.splits, best,
               wbytes / (best * 1e-6) / 1e9, diff, peak, wrong ? "  MISMATCH" : "");
        CHECK(cudaFree(w));
        CHECK(cudaFree(x));
        CHECK(cudaFree(o_ours));
        CHECK(cudaFree(o_lt));
        bests.push_back(best_cfg);
    }

    // A layer's seven products in order over LAYERS sets of weights of their own (none found in
    // L2), cuBLASLt's against ours (each shape at its best split above), 2 · LAYERS layers a
    // graph: µs a layer.
    constexpr int LAYERS = 8, SHAPES = sizeof shapes / sizeof shapes[0];
    size_t offset[SHAPES + 1] = {0};
    for (int i = 0; i < SHAPES; ++i)
        offset[i + 1] = offset[i] + (size_t)shapes[i].rows * shapes[i].K;
    __nv_bfloat16 *lw, *lx;
    float* lo;
    CHECK(cudaMalloc(&lw, offset[SHAPES] * 2 * LAYERS));
    CHECK(cudaMalloc(&lx, (size_t)T * 10240 * 2));
    CHECK(cudaMalloc(&lo, (size_t)T * 20480 * 4));
    fill<<<1024, 256, 0, st>>>(lw, offset[SHAPES] * LAYERS, 5);
    fill<<<64, 256, 0, st>>>(lx, (size_t)T * 10240, 7);
    CHECK(cudaStreamSynchronize(st));
    std::vector<Lt> lts;
    for (const Shape& sh : shapes) lts.emplace_back(sh.rows, sh.K);
    auto weights = [&](int i) {
        return lw + (i / SHAPES % LAYERS) * offset[SHAPES] + offset[i % SHAPES];
    };
    float lt_layer = time_graph(st, 2 * LAYERS * SHAPES, [&](int i) {
        lts[i % SHAPES].run(st, weights(i), lx, lo);
        return true;
    }) * SHAPES;
    float our_layer = time_graph(st, 2 * LAYERS * SHAPES, [&](int i) {
        const Shape& sh = shapes[i % SHAPES];
        return launch_skinny(st, bests[i % SHAPES], weights(i), lx, lo, sh.rows, sh.K);
    }) * SHAPES;
    printf("a layer's seven products (%.2f MB, bytes at the rate %.2f µs): cuBLASLt %.2f µs, "
           "ours %.2f µs\n",
           offset[SHAPES] * 2 / 1e6, offset[SHAPES] * 2 / rate * 1e6, lt_layer, our_layer);
    return mismatch ? 1 : 0;  // a shape whose sums differ from cuBLASLt's fails the run
}
