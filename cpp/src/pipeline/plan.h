// PipelinePlan: what the end of the virtual iteration decided, read by every
// stage of the pipeline (the allocator and reclaimer of memory/, the row
// installer of cache/, the application's calls in engine/).
//
// Threading: written by the application thread (tables while they are
// defined, the rest in FinishVirtualIteration) before any pipeline thread
// starts; constant after, so read without locks.
#pragma once

#include <memory>
#include <vector>

#include "cache/own_updates.h"
#include "cache/table_store.h"
#include "memory/device_block.h"
#include "mltuner/types.h"
#include "plan/placement.h"
#include "plan/row_layout.h"
#include "record/index_builder.h"
#include "record/recorder.h"

namespace mltuner {

struct PipelinePlan {
  std::vector<TableInfo> tables;  // by id
  Recording recording;
  std::vector<RowLayout> layouts;
  Placement placement;
  IterationIndex index;
  std::vector<std::unique_ptr<TableStore>> stores;  // by table id
  // By table id: read-my-writes (Config::read_my_writes), null where off.
  std::vector<std::unique_ptr<OwnUpdates>> own_updates;
  int depth = 2;                                    // slots per handle = pool regions
  std::shared_ptr<DeviceBlock> pool_memory;
  std::shared_ptr<DeviceBlock> staging;  // reclaimer: device -> host for host-resident updates

  int64_t num_ops() const { return static_cast<int64_t>(recording.ops.size()); }
  // Floats in the buffer of `access`.
  size_t BufferValues(const AccessRecord& access) const {
    return access.rows.size() * static_cast<size_t>(tables[access.table].row_width);
  }
};

}  // namespace mltuner
