// TableStore: one table's rows inside a worker — the parameter cache (or the
// local data) split into a device-resident part and a host-resident part as
// the placement decided, each indexed by slot; for parameter tables updated
// more than once a clock also the update log of the same shape, where the
// reclaimer scatter-adds updates until the table's clock is shipped.
//
// The values are guarded by `locks`, partitioned over layout positions:
// gathers take shared locks, installs of fresh rows exclusive ones. Those
// order the two on the host; `tickets` order them on the device, where they
// run on different streams. The log is touched only by the reclaimer thread.
#pragma once

#include <memory>
#include <utility>

#include "common/mutex.h"
#include "memory/device_block.h"
#include "memory/partition_locks.h"
#include "mltuner/device.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/placement.h"

namespace mltuner {

// The device order of a table's cache writes and reads. Installs run on
// Stream::kInstall and gathers on the allocator's streams, so that an install
// never queues behind the allocator's waits for the application. An install
// waits for the last gather queued before it (a gather reads whole rows of
// one clock), a gather for the last install (its rows are the data age's).
// Both take and set their ticket while holding the partition locks of the
// rows they copy, which order them on the host.
class CacheTickets {
 public:
  DeviceEvent last_install() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return install_;
  }
  DeviceEvent last_gather() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return gather_;
  }
  void set_last_install(DeviceEvent ticket) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    install_ = std::move(ticket);
  }
  void set_last_gather(DeviceEvent ticket) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    gather_ = std::move(ticket);
  }

 private:
  mutable Mutex mu_;
  DeviceEvent install_ GUARDED_BY(mu_);
  DeviceEvent gather_ GUARDED_BY(mu_);
};

struct TableStore {
  TableInfo info;
  std::shared_ptr<DeviceBlock> device_values;  // device_rows rows, or null
  std::shared_ptr<DeviceBlock> host_values;    // host_rows rows (host memory), or null
  std::shared_ptr<DeviceBlock> device_log;     // parameter tables only
  std::shared_ptr<DeviceBlock> host_log;
  std::unique_ptr<PartitionLocks> locks;       // over layout positions
  mutable CacheTickets tickets;                 // parameter tables' values only

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
