// The server-side update rules as elementwise kernels, one grid-stride loop
// each. Semantics follow cpp/src/server/update_rules.h and config.h: the
// kernels receive the sum of num_workers workers' updates and average it
// before sgd, momentum and adam, so N workers behave like one worker with an
// N-times larger batch.
#include <algorithm>
#include <cmath>

#include "kernels/kernels.h"

namespace mltuner::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // several waves on an H100; the loop covers the rest

dim3 GridFor(int64_t count) {
  return dim3(static_cast<unsigned>(
      std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMaxBlocks)));
}

__device__ inline int64_t FirstIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t GridStride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void AddKernel(float* __restrict__ w, const float* __restrict__ sum, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) w[i] += sum[i];
}

__global__ void SgdKernel(float* __restrict__ w, const float* __restrict__ sum, int64_t n,
                          float num_workers, float lr) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = sum[i] / num_workers;
    w[i] -= lr * g;
  }
}

__global__ void MomentumKernel(float* __restrict__ w, float* __restrict__ h,
                               const float* __restrict__ sum, int64_t n, float num_workers,
                               float lr, float m) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = sum[i] / num_workers;
    const float hi = (1.0f - m) * g + m * h[i];
    h[i] = hi;
    w[i] -= lr * hi;
  }
}

__global__ void AdamKernel(float* __restrict__ w, float* __restrict__ m1, float* __restrict__ m2,
                           const float* __restrict__ sum, int64_t n, float num_workers, float lr,
                           float beta1, float beta2, float eps, float bias1, float bias2) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    const float g = sum[i] / num_workers;
    const float m = beta1 * m1[i] + (1.0f - beta1) * g;
    const float v = beta2 * m2[i] + (1.0f - beta2) * g * g;
    m1[i] = m;
    m2[i] = v;
    w[i] -= lr * (m / bias1) / (sqrtf(v / bias2) + eps);
  }
}

}  // namespace

void LaunchAddUpdate(float* params, const float* update_sum, int64_t count,
                     cudaStream_t stream) {
  if (count <= 0) return;
  AddKernel<<<GridFor(count), kThreads, 0, stream>>>(params, update_sum, count);
}

void LaunchSgdUpdate(float* params, const float* update_sum, int64_t count, int num_workers,
                     float learning_rate, cudaStream_t stream) {
  if (count <= 0) return;
  SgdKernel<<<GridFor(count), kThreads, 0, stream>>>(
      params, update_sum, count, static_cast<float>(num_workers), learning_rate);
}

void LaunchMomentumUpdate(float* params, float* history, const float* update_sum, int64_t count,
                          int num_workers, float learning_rate, float momentum,
                          cudaStream_t stream) {
  if (count <= 0) return;
  MomentumKernel<<<GridFor(count), kThreads, 0, stream>>>(
      params, history, update_sum, count, static_cast<float>(num_workers), learning_rate,
      momentum);
}

void LaunchAdamUpdate(float* params, float* first_moment, float* second_moment,
                      const float* update_sum, int64_t count, int num_workers,
                      float learning_rate, float beta1, float beta2, float epsilon, int64_t step,
                      cudaStream_t stream) {
  if (count <= 0) return;
  // 1 - beta^t in double: in float, beta2 = 0.999 loses digits for small t.
  const double t = static_cast<double>(step);
  const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), t));
  const float bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), t));
  AdamKernel<<<GridFor(count), kThreads, 0, stream>>>(
      params, first_moment, second_moment, update_sum, count, static_cast<float>(num_workers),
      learning_rate, beta1, beta2, epsilon, bias1, bias2);
}

}  // namespace mltuner::kernels
