// Gather: copy runs of rows from a source (the parameter cache) into a
// destination (an access buffer). See kernels.h for the contract and
// row_runs.cuh for the launch scheme.
#include "kernels/kernels.h"
#include "kernels/row_runs.cuh"

namespace mltuner::kernels {

void LaunchGatherRuns(float* dst, const float* src, const RowRun* runs_on_device,
                      int64_t num_runs, int64_t total_rows, int64_t row_width,
                      cudaStream_t stream) {
  internal::LaunchRowRuns<internal::CopyOp>(dst, src, runs_on_device, num_runs, total_rows,
                                            row_width, stream);
}

}  // namespace mltuner::kernels
