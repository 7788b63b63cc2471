// A fill kernel for the CUDA backend: CudaDevice::Fill uses cudaMemsetAsync
// for +0.0f (all-zero bits) and this kernel for every other value, since a
// byte memset cannot write an arbitrary float pattern.
//
// Like the launchers in kernels.h it enqueues one kernel on `stream` and
// returns at once; launch errors are left for cudaGetLastError(). It holds no
// state, so any thread may call it on any stream. `dst` is device memory.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mltuner::kernels {

// dst[0, count) = value. Enqueues nothing when count <= 0.
void LaunchFill(float* dst, float value, int64_t count, cudaStream_t stream);

}  // namespace mltuner::kernels
