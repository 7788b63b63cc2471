// CUDA kernels of the engine: row gather, row scatter-add and the server-side
// update rules. Each is a host launcher that enqueues one kernel on `stream`
// and returns at once; it never synchronizes. Launch errors (a bad grid, no
// device) are left for the caller to read with cudaGetLastError() or the next
// cudaStreamSynchronize(), where the CUDA backend turns them into a Status.
//
// Every pointer is device memory, except that the row-run launchers (gather,
// scatter-add) also take pinned host memory mapped at its host address
// (cudaHostAllocMapped with unified addressing): the kernel then reads or
// writes it over PCIe, which is how host-resident rows are swapped. A launcher with nothing to do (zero runs,
// zero rows or zero values) enqueues nothing. Launchers are thread-safe: they
// hold no state, so any thread may call them on any stream.
//
// The update-rule kernels mirror cpp/src/server/update_rules.h exactly: they
// receive the SUM of `num_workers` workers' updates and average it
// (g = sum / num_workers) for every rule but `add`, which applies the sum.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "mltuner/device.h"
#include "mltuner/types.h"
#include "mltuner/update_step.h"

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

// One step of an update rule (see mltuner/update_step.h) over `count`
// values; the state holds StateArraysPerValue(step.kind) arrays,
// `state_stride` (>= count) floats apart.
// REQUIRES: params, state and update_sum do not overlap.
void LaunchApplyUpdate(const UpdateStep& step, float* params, float* state, const float* update_sum,
                       int64_t count, int64_t state_stride, cudaStream_t stream);

// For each piece: buffer[offset, offset + count) = memory[0, count)
// (`into_buffer`), or the other way. The pieces go to the kernel by value,
// up to kMaxPiecesPerLaunch per launch.
constexpr int kMaxPiecesPerLaunch = 128;
// `zero_if` (device memory, may be null): read by the kernel; nonzero, the
// copy into the buffer writes zeros instead (Device::CopyPiecesOnAppStream).
void LaunchCopyPieces(float* buffer, const CopyPiece* pieces, int num_pieces, bool into_buffer, const float* zero_if,
                      cudaStream_t stream);

// dst[i] += src[i]: the shard's sum of the workers' updates, in worker order.
void LaunchAddInto(float* dst, const float* src, int64_t count, cudaStream_t stream);

// Read-my-writes (mltuner/own_step.h): OwnStepValue and CarryValue over
// `count` values. REQUIRES: the arrays do not overlap.
void LaunchOwnStep(const UpdateStep& step, float momentum, float* own_step, float* state, const float* update,
                   float* cache, float* drift, int64_t count, int64_t state_stride, cudaStream_t stream);
void LaunchCarry(float ahead, float next, float* cache, float* raw, float* drift, const float* own_step_d,
                 int64_t count, cudaStream_t stream);

}  // namespace mltuner::kernels
