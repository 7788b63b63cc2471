#include "cache/table_store.h"

#include <algorithm>
#include <cstring>

namespace mltuner {

namespace {

// Zeroed without writing it on the CPU backend: a store takes RAM as its rows
// are first installed or updated, not all at once when the plan is made.
Status MakeZeroed(const std::shared_ptr<Device>& device, int64_t rows, const TableInfo& info,
                  bool host, std::shared_ptr<DeviceBlock>* out) {
  if (rows == 0) return Status::Ok();
  return DeviceBlock::MakeZeroed(device, static_cast<size_t>(rows * info.row_bytes()), host, out);
}

}  // namespace

Status MakeTableStore(const std::shared_ptr<Device>& device, const TableInfo& info,
                      const TablePlacement& placement, int partitions, bool keeps_log,
                      std::unique_ptr<TableStore>* out) {
  auto store = std::make_unique<TableStore>();
  store->info = info;
  MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.device_rows, info, false, &store->device_values));
  MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.host_rows, info, true, &store->host_values));
  if (keeps_log) {
    MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.device_rows, info, false, &store->device_log));
    MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.host_rows, info, true, &store->host_log));
  }
  store->locks = std::make_unique<PartitionLocks>(info.num_rows, std::max(1, partitions));
  *out = std::move(store);
  return Status::Ok();
}

}  // namespace mltuner
