// CHECK(call): the probes' exit with a message (file, line, the call, CUDA's words) when a
// CUDA runtime call fails.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x)                                                                     \
    do {                                                                             \
        cudaError_t e = (x);                                                         \
        if (e != cudaSuccess) {                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
                    cudaGetErrorString(e));                                          \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
