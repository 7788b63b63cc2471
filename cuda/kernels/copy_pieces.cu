// CopyPieces: many small copies in one launch. See kernels.h.
#include <algorithm>

#include "kernels/kernels.h"

namespace mltuner::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerPiece = 1024;

// The pieces of one launch, as a kernel parameter (3 KiB, under the 4 KiB
// that every architecture takes).
struct PieceBatch {
  float* memory[kMaxPiecesPerLaunch];
  int64_t offset[kMaxPiecesPerLaunch];
  int64_t count[kMaxPiecesPerLaunch];
};

// blockIdx.y picks the piece; the x blocks stride over it.
__global__ void CopyPiecesKernel(float* buffer, PieceBatch batch, bool into_buffer, const float* zero_if) {
  const int piece = blockIdx.y;
  const bool zeros = into_buffer && zero_if != nullptr && *zero_if != 0.0f;
  float* const span = buffer + batch.offset[piece];
  const float* __restrict__ src = into_buffer ? batch.memory[piece] : span;
  float* __restrict__ out = into_buffer ? span : batch.memory[piece];
  const int64_t count = batch.count[piece];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = zeros ? 0.0f : src[i];
  }
}

}  // namespace

void LaunchCopyPieces(float* buffer, const CopyPiece* pieces, int num_pieces, bool into_buffer, const float* zero_if,
                      cudaStream_t stream) {
  for (int first = 0; first < num_pieces; first += kMaxPiecesPerLaunch) {
    const int n = std::min(kMaxPiecesPerLaunch, num_pieces - first);
    PieceBatch batch{};
    int64_t largest = 0;
    for (int i = 0; i < n; ++i) {
      batch.memory[i] = pieces[first + i].memory;
      batch.offset[i] = pieces[first + i].offset;
      batch.count[i] = pieces[first + i].count;
      largest = std::max(largest, batch.count[i]);
    }
    if (largest == 0) continue;
    const int64_t blocks = std::clamp<int64_t>((largest + kThreads - 1) / kThreads, 1, kMaxBlocksPerPiece);
    CopyPiecesKernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(n)), kThreads, 0, stream>>>(
        buffer, batch, into_buffer, zero_if);
  }
}

}  // namespace mltuner::kernels
