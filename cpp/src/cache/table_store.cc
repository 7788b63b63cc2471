#include "cache/table_store.h"

#include <algorithm>
#include <cstring>

namespace mltuner {

namespace {

Status MakeZeroed(const std::shared_ptr<Device>& device, int64_t rows, const TableInfo& info,
                  bool host, std::shared_ptr<DeviceBlock>* out) {
  if (rows == 0) return Status::Ok();
  const size_t bytes = static_cast<size_t>(rows * info.row_bytes());
  MLT_RETURN_IF_ERROR(DeviceBlock::Make(device, bytes, host, out));
  const size_t count = static_cast<size_t>(rows * info.row_width);
  if (host) {
    std::fill_n((*out)->floats(), count, 0.0f);
  } else {
    device->Fill((*out)->floats(), 0.0f, count, Stream::kApp);
  }
  return Status::Ok();
}

}  // namespace

Status MakeTableStore(const std::shared_ptr<Device>& device, const TableInfo& info,
                      const TablePlacement& placement, int partitions,
                      std::unique_ptr<TableStore>* out) {
  auto store = std::make_unique<TableStore>();
  store->info = info;
  MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.device_rows, info, false, &store->device_values));
  MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.host_rows, info, true, &store->host_values));
  if (!info.local) {
    MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.device_rows, info, false, &store->device_log));
    MLT_RETURN_IF_ERROR(MakeZeroed(device, placement.host_rows, info, true, &store->host_log));
  }
  MLT_RETURN_IF_ERROR(device->Synchronize(Stream::kApp));
  store->locks = std::make_unique<PartitionLocks>(info.num_rows, std::max(1, partitions));
  *out = std::move(store);
  return Status::Ok();
}

}  // namespace mltuner
