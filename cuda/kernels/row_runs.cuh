// Internal to cuda/kernels: the one kernel behind gather and scatter-add.
//
// A run list moves whole blocks of rows, and a read is usually a single long
// run, so the grid is two-dimensional: blockIdx.y walks the runs (striding by
// gridDim.y past 65535 runs) and the x-blocks of each run stride over its
// count * row_width values. No per-row map is built. When every row starts
// on a 16-byte boundary the kernel moves float4s, otherwise floats.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "mltuner/types.h"

namespace mltuner::kernels::internal {

constexpr int kThreadsPerBlock = 256;
// Enough blocks per run to fill an H100 (132 SMs x 8 resident blocks) for a
// single long run; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocksPerRun = 4096;
constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y

struct CopyOp {
  __device__ static void Apply(float& d, float s) { d = s; }
  __device__ static void Apply(float4& d, const float4& s) { d = s; }
};

struct AddOp {
  __device__ static void Apply(float& d, float s) { d += s; }
  __device__ static void Apply(float4& d, const float4& s) {
    float4 v = d;
    v.x += s.x;
    v.y += s.y;
    v.z += s.z;
    v.w += s.w;
    d = v;
  }
};

// `width` is the row width in units of T (floats or float4s).
template <typename Op, typename T>
__global__ void RowRunsKernel(T* __restrict__ dst, const T* __restrict__ src,
                              const RowRun* __restrict__ runs, int64_t num_runs, int64_t width) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < num_runs; r += gridDim.y) {
    const RowRun run = runs[r];
    T* d = dst + run.dst * width;
    const T* s = src + run.src * width;
    const int64_t n = run.count * width;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
      Op::Apply(d[i], s[i]);
    }
  }
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename Op>
void LaunchRowRuns(float* dst, const float* src, const RowRun* runs, int64_t num_runs,
                   int64_t total_rows, int64_t row_width, cudaStream_t stream) {
  if (num_runs <= 0 || total_rows <= 0 || row_width <= 0) return;
  const bool vec = row_width % 4 == 0 && Aligned16(dst) && Aligned16(src);
  const int64_t width = vec ? row_width / 4 : row_width;
  // Size the x dimension for an average run; longer runs loop.
  const int64_t rows_per_run = (total_rows + num_runs - 1) / num_runs;
  const int64_t units_per_run = rows_per_run * width;
  const int64_t blocks_x = std::clamp<int64_t>(
      (units_per_run + kThreadsPerBlock - 1) / kThreadsPerBlock, 1, kMaxBlocksPerRun);
  const dim3 grid(static_cast<unsigned>(blocks_x),
                  static_cast<unsigned>(std::min(num_runs, kMaxGridY)));
  if (vec) {
    RowRunsKernel<Op, float4><<<grid, kThreadsPerBlock, 0, stream>>>(
        reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), runs, num_runs,
        width);
  } else {
    RowRunsKernel<Op, float><<<grid, kThreadsPerBlock, 0, stream>>>(dst, src, runs, num_runs,
                                                                     width);
  }
}

}  // namespace mltuner::kernels::internal
