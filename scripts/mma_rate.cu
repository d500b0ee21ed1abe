// The tensor cores' rate through mma.sync on this GPU, per instruction shape: how many
// m16n8k16 f16 (f32 sums) and m16n8k32 s8 (s32 sums) instructions a multiprocessor completes a
// cycle, with enough independent chains per warp and warps per multiprocessor that neither the
// instruction's latency nor its issue is the bound. The mmq kernels' floor at 64 tokens comes
// from it (docs/perf.md, session 45).
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/mma_rate scripts/mma_rate.cu && /tmp/mma_rate
#include <cstdio>
#include <cuda_runtime.h>

constexpr int CHAINS = 8, ITERS = 4096;

template <bool INT8>
__global__ void rate(unsigned* out, long long* cycles) {
    unsigned a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x ^ 7u, threadIdx.x + 11u};
    unsigned b0 = threadIdx.x * 5u, b1 = threadIdx.x + 1u;
    float cf[CHAINS][4] = {};
    int ci[CHAINS][4] = {};
    long long t0 = clock64();
    for (int i = 0; i < ITERS; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
            if (INT8) {
                asm volatile(
                    "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+r"(ci[c][0]), "+r"(ci[c][1]), "+r"(ci[c][2]), "+r"(ci[c][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                    : "+f"(cf[c][0]), "+f"(cf[c][1]), "+f"(cf[c][2]), "+f"(cf[c][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            }
        }
    }
    long long t1 = clock64();
    unsigned s = 0;
    for (int c = 0; c < CHAINS; c++)
        for (int v = 0; v < 4; v++) s += ci[c][v] + __float_as_uint(cf[c][v]);
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <bool INT8>
void measure(int sms, int warps) {
    const int blocks = sms, threads = 32 * warps;
    unsigned* out;
    long long* cycles;
    cudaMalloc(&out, (size_t)blocks * threads * 4);
    cudaMalloc(&cycles, blocks * 8);
    rate<INT8><<<blocks, threads>>>(out, cycles);  // warm-up
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    rate<INT8><<<blocks, threads>>>(out, cycles);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    long long c0;
    cudaMemcpy(&c0, cycles, 8, cudaMemcpyDeviceToHost);
    const double instr = (double)blocks * warps * CHAINS * ITERS;
    const double flop = instr * (INT8 ? 16 * 8 * 32 * 2 : 16 * 8 * 16 * 2);
    printf("%s, %2d warps/SM: %.3f instructions/cycle/SM (block 0: %lld cycles), %.1f T%s/s\n",
           INT8 ? "m16n8k32 s8 " : "m16n8k16 f16", warps,
           (double)warps * CHAINS * ITERS / (double)c0, c0, flop / (ms * 1e-3) / 1e12,
           INT8 ? "OP" : "FLOP");
    cudaFree(out);
    cudaFree(cycles);
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    for (int warps : {4, 8, 16}) {
        measure<false>(sms, warps);
        measure<true>(sms, warps);
    }
    return 0;
}
