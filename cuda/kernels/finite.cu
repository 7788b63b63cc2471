// CountNonFinite: a grid-stride loop, a block-wide sum, one atomic per block.
// See finite.h.
#include <algorithm>

#include "kernels/finite.h"

namespace mltuner::kernels {
namespace {

constexpr int kThreads = 256;
// A few waves on an H100 (132 SMs); the stride loop covers the rest, so the
// atomics stay at most one per block whatever the count.
constexpr int64_t kMaxBlocks = 1024;

__global__ void CountNonFiniteKernel(const float* __restrict__ data, int64_t count,
                                     unsigned long long* __restrict__ counter) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned int mine = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    // All exponent bits set: NaN or an infinity (independent of fast-math).
    mine += (__float_as_uint(data[i]) & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
  }
  __shared__ unsigned int block_sum;
  if (threadIdx.x == 0) block_sum = 0;
  __syncthreads();
  if (mine != 0) atomicAdd(&block_sum, mine);
  __syncthreads();
  if (threadIdx.x == 0 && block_sum != 0) atomicAdd(counter, static_cast<unsigned long long>(block_sum));
}

}  // namespace

void LaunchCountNonFinite(const float* data, int64_t count, unsigned long long* counter, cudaStream_t stream) {
  if (count <= 0) return;
  const int64_t blocks = std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMaxBlocks);
  CountNonFiniteKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(data, count, counter);
}

}  // namespace mltuner::kernels
