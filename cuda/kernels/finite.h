// A count of non-finite floats for the CUDA backend's CountNonFinite (the
// shards' Config::check_finite).
//
// Like the launchers in kernels.h it enqueues work on `stream` and returns at
// once; launch errors are left for cudaGetLastError(). It holds no state, so
// any thread may call it on any stream. Both pointers are device memory.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mltuner::kernels {

// *counter += how many of data[0, count) are NaN or infinite. The caller
// zeroes *counter first and reads it after the stream reaches this point.
// Enqueues nothing when count <= 0.
void LaunchCountNonFinite(const float* data, int64_t count, unsigned long long* counter, cudaStream_t stream);

}  // namespace mltuner::kernels
