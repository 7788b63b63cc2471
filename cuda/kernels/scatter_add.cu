// Scatter-add: add runs of rows from a source (an update buffer) into a
// destination (the outgoing update log or the cache). See kernels.h for the
// contract and row_runs.cuh for the launch scheme.
//
// Precondition, relied on for plain (non-atomic) read-modify-write: within
// one call no two runs touch the same destination row. The engine's indexes
// map each buffer row to a distinct log row, so this always holds; a caller
// that needs to merge duplicates must split them over separate calls on one
// stream, which run in order.
#include "kernels/kernels.h"
#include "kernels/row_runs.cuh"

namespace mltuner::kernels {

void LaunchScatterAddRuns(float* dst, const float* src, const RowRun* runs_on_device,
                          int64_t num_runs, int64_t total_rows, int64_t row_width,
                          cudaStream_t stream) {
  internal::LaunchRowRuns<internal::AddOp>(dst, src, runs_on_device, num_runs, total_rows,
                                           row_width, stream);
}

}  // namespace mltuner::kernels
