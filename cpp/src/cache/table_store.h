// TableStore: one table's rows inside a worker — the parameter cache (or the
// local data) split into a device-resident part and a host-resident part as
// the placement decided, each indexed by slot; for parameter tables updated
// more than once a clock also the update log of the same shape, where the
// reclaimer scatter-adds updates until the table's clock is shipped.
//
// The values are guarded by `locks`, partitioned over layout positions:
// gathers take shared locks, installs of fresh rows exclusive ones. The log
// is touched only by the reclaimer thread.
#pragma once

#include <memory>

#include "memory/device_block.h"
#include "memory/partition_locks.h"
#include "mltuner/device.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/placement.h"

namespace mltuner {

struct TableStore {
  TableInfo info;
  std::shared_ptr<DeviceBlock> device_values;  // device_rows rows, or null
  std::shared_ptr<DeviceBlock> host_values;    // host_rows rows (host memory), or null
  std::shared_ptr<DeviceBlock> device_log;     // parameter tables only
  std::shared_ptr<DeviceBlock> host_log;
  std::unique_ptr<PartitionLocks> locks;       // over layout positions

  float* values(Residence where) const {
    const auto& block = where == Residence::kDevice ? device_values : host_values;
    return block ? block->floats() : nullptr;
  }
  float* log(Residence where) const {
    const auto& block = where == Residence::kDevice ? device_log : host_log;
    return block ? block->floats() : nullptr;
  }
};

// Allocates and zeroes the stores of one table; the update log only where
// `keeps_log` (KeepsUpdateLog, record/recorder.h).
Status MakeTableStore(const std::shared_ptr<Device>& device, const TableInfo& info,
                      const TablePlacement& placement, int partitions, bool keeps_log,
                      std::unique_ptr<TableStore>* out);

}  // namespace mltuner
