// Placement: what lives in device memory under the budget, and how big the
// access-buffer pool is (geeps.md §3).
//
// 1. The pool: one region per clock in flight (1 + prefetch_clocks), each
//    holding a clock's buffers at the static offsets of a BufferSchedule
//    (plan/buffer_schedule.h). Its least size packs the recorded lifetimes
//    tightly (lookahead 0); a budget below that is refused with the exact
//    bytes needed.
// 2. Local data goes to the device if all of it fits in what is left.
// 3. Parameter rows go to the device access by access, in op order (first
//    layers first), each with its update log, while they fit; the rest stay
//    in host memory and are swapped in by the allocator thread.
// 4. Whatever budget is left buys lookahead: buffers of a clock reuse each
//    other's addresses less, so the allocator prepares them further ahead of
//    the application. (More regions would not help: the allocator never runs
//    more than prefetch_clocks ahead, so they would sit idle.)
// A budget of 0 means unlimited: everything on the device, and the largest
// lookahead (no buffer of a clock shares addresses with another).
#pragma once

#include <string>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/buffer_schedule.h"
#include "plan/row_layout.h"
#include "record/recorder.h"

namespace mltuner {

struct TablePlacement {
  std::vector<Residence> residence;  // by layout position
  std::vector<int64_t> slot;         // by layout position: row index in its store
  int64_t device_rows = 0;
  int64_t host_rows = 0;
};

struct Placement {
  std::vector<TablePlacement> tables;  // by table id
  int64_t peak_bytes = 0;              // largest set of open buffers
  int peak_op = -1;                    // op index where it is reached
  BufferSchedule buffers;              // static addresses and waits of the pool
  int64_t pool_bytes = 0;              // access-buffer pool: buffers.pool_bytes(), at least kBufferAlignment
  int64_t pool_min_bytes = 0;          // the pool at lookahead 0: the least budget accepted
  int64_t device_store_bytes = 0;      // resident parameters, logs, local data
  int64_t host_store_bytes = 0;
  // A few lines for logs and the Python `plan` property.
  std::string Describe() const;
};

int64_t AlignedBufferBytes(const TableInfo& table, int64_t rows);

Status PlanPlacement(const Config& config, const std::vector<TableInfo>& tables,
                     const std::vector<RowLayout>& layouts, const Recording& recording,
                     Placement* out);

}  // namespace mltuner
