// main() for the CUDA tests: runs every TEST, or exits 77 (CTest's skip code,
// SKIP_RETURN_CODE) on a machine without a CUDA device, so the gpu label can
// run anywhere.
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

#include "test_util.h"

#define MLT_GPU_TEST_MAIN                                                                    \
  int main() {                                                                               \
    int devices = 0;                                                                         \
    const cudaError_t err = cudaGetDeviceCount(&devices);                                    \
    if (err != cudaSuccess || devices == 0) {                                                \
      std::printf("SKIPPED: no CUDA device (%s)\n",                                          \
                  err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");               \
      return 77;                                                                             \
    }                                                                                        \
    return ::mltuner::testing::RunAll();                                                     \
  }
