// Fill: one grid-stride loop of plain stores. See fill.h.
#include <algorithm>

#include "kernels/fill.h"

namespace mltuner::kernels {
namespace {

constexpr int kThreads = 256;
// A few waves on an H100 (132 SMs); the stride loop covers larger fills, so a
// multi-GB fill never needs a grid wider than this.
constexpr int64_t kMaxBlocks = 4096;

__global__ void FillKernel(float* __restrict__ dst, float value, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] = value;
  }
}

}  // namespace

void LaunchFill(float* dst, float value, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  const int64_t blocks = std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMaxBlocks);
  FillKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dst, value, count);
}

}  // namespace mltuner::kernels
