// The server-side update rules and the worker-order sum as elementwise
// kernels, one grid-stride loop each. The arithmetic is UpdateValue
// (mltuner/update_step.h), shared with the CPU backend; this file is built
// with -fmad=false (cuda/CMakeLists.txt) so that no multiply-add is fused and
// the results equal the CPU's bit for bit.
#include <algorithm>

#include "kernels/kernels.h"
#include "mltuner/own_step.h"
#include "mltuner/update_step.h"

namespace mltuner::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // several waves on an H100; the loop covers the rest

dim3 GridFor(int64_t count) {
  return dim3(static_cast<unsigned>(std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMaxBlocks)));
}

__device__ inline int64_t FirstIndex() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void UpdateKernel(UpdateStep step, float* __restrict__ params, float* __restrict__ state,
                             const float* __restrict__ update_sum, int64_t count, int64_t stride) {
  for (int64_t i = FirstIndex(); i < count; i += GridStride()) UpdateValue(step, params, state, update_sum, stride, i);
}

__global__ void AddIntoKernel(float* __restrict__ dst, const float* __restrict__ src, int64_t count) {
  for (int64_t i = FirstIndex(); i < count; i += GridStride()) dst[i] = dst[i] + src[i];
}

__global__ void OwnStepKernel(UpdateStep step, float momentum, float* __restrict__ own_step,
                              float* __restrict__ state, const float* __restrict__ update, float* __restrict__ cache,
                              float* __restrict__ drift, int64_t count, int64_t stride) {
  for (int64_t i = FirstIndex(); i < count; i += GridStride()) {
    OwnStepValue(step, momentum, own_step, state, update, cache, drift, stride, i);
  }
}

__global__ void CarryKernel(float ahead, float next, float* __restrict__ cache, float* __restrict__ raw,
                            float* __restrict__ drift, const float* __restrict__ own_step_d, int64_t count) {
  for (int64_t i = FirstIndex(); i < count; i += GridStride()) CarryValue(ahead, next, cache, raw, drift, own_step_d, i);
}

}  // namespace

void LaunchOwnStep(const UpdateStep& step, float momentum, float* own_step, float* state, const float* update,
                   float* cache, float* drift, int64_t count, int64_t state_stride, cudaStream_t stream) {
  if (count <= 0) return;
  OwnStepKernel<<<GridFor(count), kThreads, 0, stream>>>(step, momentum, own_step, state, update, cache, drift, count,
                                                         state_stride);
}

void LaunchCarry(float ahead, float next, float* cache, float* raw, float* drift, const float* own_step_d,
                 int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  CarryKernel<<<GridFor(count), kThreads, 0, stream>>>(ahead, next, cache, raw, drift, own_step_d, count);
}

void LaunchApplyUpdate(const UpdateStep& step, float* params, float* state, const float* update_sum, int64_t count,
                       int64_t state_stride, cudaStream_t stream) {
  if (count <= 0) return;
  UpdateKernel<<<GridFor(count), kThreads, 0, stream>>>(step, params, state, update_sum, count, state_stride);
}

void LaunchAddInto(float* dst, const float* src, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  AddIntoKernel<<<GridFor(count), kThreads, 0, stream>>>(dst, src, count);
}

}  // namespace mltuner::kernels
