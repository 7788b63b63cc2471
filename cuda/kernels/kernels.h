// CUDA kernels of the engine: row gather, row scatter-add and the server-side
// update rules. Each is a host launcher that enqueues one kernel on `stream`
// and returns at once; it never synchronizes. Launch errors (a bad grid, no
// device) are left for the caller to read with cudaGetLastError() or the next
// cudaStreamSynchronize(), where the CUDA backend turns them into a Status.
//
// Every pointer is device memory. A launcher with nothing to do (zero runs,
// zero rows or zero values) enqueues nothing. Launchers are thread-safe: they
// hold no state, so any thread may call them on any stream.
//
// The update-rule kernels mirror cpp/src/server/update_rules.h exactly: they
// receive the SUM of `num_workers` workers' updates and average it
// (g = sum / num_workers) for sgd, momentum and adam; `add` applies the sum.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mltuner/types.h"

namespace mltuner::kernels {

// For each run r in runs[0, num_runs): rows [r.dst, r.dst + r.count) of `dst`
// = rows [r.src, r.src + r.count) of `src`; a row is `row_width` floats.
// `runs_on_device` is the run list uploaded to the device (RunIndex's
// device_copy); `total_rows` is the sum of the runs' counts and only sizes
// the grid. Uses float4 loads and stores when row_width % 4 == 0 and both
// pointers are 16-byte aligned.
// REQUIRES: src and dst do not overlap; no two runs write the same dst row.
void LaunchGatherRuns(float* dst, const float* src, const RowRun* runs_on_device,
                      int64_t num_runs, int64_t total_rows, int64_t row_width,
                      cudaStream_t stream);

// As LaunchGatherRuns, but dst rows += src rows.
// REQUIRES: no two runs of one call touch the same dst row (the engine's
// indexes never do: each row of an update log has one source). With this
// precondition no atomics are needed and the result is deterministic.
void LaunchScatterAddRuns(float* dst, const float* src, const RowRun* runs_on_device,
                          int64_t num_runs, int64_t total_rows, int64_t row_width,
                          cudaStream_t stream);

// The update rules, one thread per value, over `count` values.
// REQUIRES: num_workers >= 1; params, update_sum and the state arrays are
// `count` floats each and do not overlap.

// kAdd: w += sum_i u_i.
void LaunchAddUpdate(float* params, const float* update_sum, int64_t count,
                     cudaStream_t stream);

// kSgd: g = sum / N; w -= lr * g.
void LaunchSgdUpdate(float* params, const float* update_sum, int64_t count, int num_workers,
                     float learning_rate, cudaStream_t stream);

// kMomentum: g = sum / N; h = (1 - m) g + m h; w -= lr * h.
void LaunchMomentumUpdate(float* params, float* history, const float* update_sum, int64_t count,
                          int num_workers, float learning_rate, float momentum,
                          cudaStream_t stream);

// kAdam: g = sum / N; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
// `step` is t, the 1-based number of this update (1 for the first), so the
// bias corrections (computed on the host in double) are never zero.
// REQUIRES: step >= 1.
void LaunchAdamUpdate(float* params, float* first_moment, float* second_moment,
                      const float* update_sum, int64_t count, int num_workers,
                      float learning_rate, float beta1, float beta2, float epsilon, int64_t step,
                      cudaStream_t stream);

}  // namespace mltuner::kernels
