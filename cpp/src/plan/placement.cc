#include "plan/placement.h"

#include <algorithm>
#include <sstream>

namespace mltuner {

int64_t AlignedBufferBytes(const TableInfo& table, int64_t rows) {
  const int64_t bytes = rows * table.row_bytes();
  return (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
}

namespace {

// Bytes of access buffers open at each op, and the largest of them.
void FindPeak(const std::vector<TableInfo>& tables, const Recording& recording,
              int64_t* peak_bytes, int* peak_op) {
  int64_t open_bytes = 0;
  *peak_bytes = 0;
  *peak_op = -1;
  for (int i = 0; i < static_cast<int>(recording.ops.size()); ++i) {
    const RecordedOp& op = recording.ops[i];
    if (op.kind == OpKind::kClock) continue;
    const AccessRecord& access = recording.accesses[op.handle];
    const int64_t bytes =
        AlignedBufferBytes(tables[access.table], static_cast<int64_t>(access.rows.size()));
    const bool opens = op.kind == OpKind::kRead || op.kind == OpKind::kPreUpdate ||
                       op.kind == OpKind::kLocalAccess;
    open_bytes += opens ? bytes : -bytes;
    if (open_bytes > *peak_bytes) {
      *peak_bytes = open_bytes;
      *peak_op = i;
    }
  }
}

// Device bytes of a schedule's pool (never 0: an empty pool is still one block).
int64_t PoolBytes(const BufferSchedule& schedule) {
  return std::max<int64_t>(schedule.pool_bytes(), kBufferAlignment);
}

// The rows of `access` not placed yet: they are the positions right after
// those already placed (the layout is first-use order over the same ops), so
// counting them is all placement needs. Internal when the layout breaks that.
Status CountNewRows(const AccessRecord& access, const RowLayout& layout, const TablePlacement& placement,
                    int64_t* out) {
  const int64_t placed = placement.placed();
  int64_t count = 0, last = -1;
  for (RowId row : access.rows) {
    const int64_t position = layout.PositionOf(row);
    if (position < placed) continue;
    ++count;
    last = std::max(last, position);
  }
  if (count > 0 && last != placed + count - 1) {
    return Status::Internal("placement: the new rows of handle " + std::to_string(access.handle) +
                            " are not the next layout positions");
  }
  *out = count;
  return Status::Ok();
}

}  // namespace

void TablePlacement::Append(int64_t count, Residence where) {
  if (count <= 0) return;
  int64_t& rows = where == Residence::kDevice ? device_rows : host_rows;
  const int64_t position = placed();
  if (!runs.empty() && runs.back().residence == where) {
    runs.back().count += count;  // its slots continue too: nothing else took one of this store
  } else {
    runs.push_back({position, count, where, rows});
  }
  rows += count;
}

const TablePlacement::Run& TablePlacement::RunOf(int64_t position) const {
  auto after = std::upper_bound(runs.begin(), runs.end(), position,
                                [](int64_t p, const Run& run) { return p < run.first_position; });
  return *(after - 1);
}

std::string Placement::Describe() const {
  std::ostringstream out;
  out << "pool " << pool_bytes << " B (" << buffers.regions << " regions of " << buffers.region_bytes
      << " B, lookahead " << buffers.lookahead_ops << " ops; least " << pool_min_bytes << " B; peak "
      << peak_bytes << " B at op " << peak_op << "), device stores " << device_store_bytes
      << " B, host stores " << host_store_bytes << " B; host memory " << host.Describe();
  return out.str();
}

namespace {

std::vector<int64_t> BufferBytes(const std::vector<TableInfo>& tables, const Recording& recording) {
  std::vector<int64_t> bytes;
  bytes.reserve(recording.accesses.size());
  for (const AccessRecord& access : recording.accesses) {
    bytes.push_back(AlignedBufferBytes(tables[access.table], static_cast<int64_t>(access.rows.size())));
  }
  return bytes;
}

}  // namespace

int64_t LeastPoolBytes(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                       BufferSchedule* schedule) {
  const int regions = 1 + std::max(0, config.prefetch_clocks);
  BufferSchedule least = ScheduleBuffers(recording, BufferBytes(tables, recording), regions, 0);
  const int64_t bytes = PoolBytes(least);
  if (schedule != nullptr) *schedule = std::move(least);
  return bytes;
}

Status PlanPlacement(const Config& config, const std::vector<TableInfo>& tables,
                     const std::vector<RowLayout>& layouts, const Recording& recording,
                     Placement* out) {
  Placement plan;
  FindPeak(tables, recording, &plan.peak_bytes, &plan.peak_op);
  const bool unlimited = config.device_memory_budget <= 0;
  const int regions = 1 + std::max(0, config.prefetch_clocks);
  const std::vector<int64_t> buffer_bytes = BufferBytes(tables, recording);
  const int64_t pool_min = LeastPoolBytes(config, tables, recording, &plan.buffers);
  plan.pool_min_bytes = pool_min;
  plan.staging_bytes = kBufferAlignment;
  for (int64_t bytes : buffer_bytes) plan.staging_bytes = std::max(plan.staging_bytes, bytes);
  if (!unlimited && pool_min > config.device_memory_budget) {
    std::ostringstream msg;
    msg << "device_memory_budget of " << config.device_memory_budget
        << " bytes is too small: the access-buffer pool needs " << pool_min << " bytes ("
        << regions << " regions, one per clock in flight (1 + prefetch_clocks), of "
        << plan.buffers.region_bytes << " bytes: one clock's buffers packed by lifetime; the largest set open "
        << "at once is " << plan.peak_bytes << " bytes at op " << plan.peak_op << ")";
    return Status::ResourceExhausted(msg.str());
  }
  int64_t left = unlimited ? 0 : config.device_memory_budget - pool_min;

  plan.tables.resize(tables.size());

  // Local data: all on the device or all in host memory.
  int64_t local_bytes = 0;
  for (const TableInfo& table : tables) {
    if (table.local) local_bytes += table.bytes();
  }
  const bool local_on_device = unlimited || local_bytes <= left;
  if (!unlimited && local_on_device) left -= local_bytes;
  for (const TableInfo& table : tables) {
    if (table.local) {
      plan.tables[table.id].Append(table.num_rows, local_on_device ? Residence::kDevice : Residence::kHost);
    }
  }

  // Parameter rows: access by access in op order; each row costs its cache
  // row plus its update-log row.
  for (const RecordedOp& op : recording.ops) {
    if (op.kind != OpKind::kRead && op.kind != OpKind::kPreUpdate) continue;
    const AccessRecord& access = recording.accesses[op.handle];
    const TableInfo& table = tables[access.table];
    TablePlacement& placement = plan.tables[table.id];
    int64_t new_rows = 0;
    MLT_RETURN_IF_ERROR(CountNewRows(access, layouts[table.id], placement, &new_rows));
    const int64_t cost = 2 * new_rows * table.row_bytes();
    const bool fits = unlimited || cost <= left;
    if (fits && !unlimited) left -= cost;
    placement.Append(new_rows, fits ? Residence::kDevice : Residence::kHost);
  }
  // Rows no access touches (the end of each layout): to the device while
  // there is room, row by row.
  for (const TableInfo& table : tables) {
    TablePlacement& placement = plan.tables[table.id];
    const int64_t untouched = table.num_rows - placement.placed();
    const int64_t row_cost = 2 * table.row_bytes();
    const int64_t fitting = unlimited ? untouched : std::min(untouched, std::max<int64_t>(0, left) / row_cost);
    if (!unlimited) left -= fitting * row_cost;
    placement.Append(fitting, Residence::kDevice);
    placement.Append(untouched - fitting, Residence::kHost);
  }

  for (const TableInfo& table : tables) {
    const TablePlacement& placement = plan.tables[table.id];
    const int64_t copies = table.local ? 1 : 2;  // parameters also keep an update log
    plan.device_store_bytes += copies * placement.device_rows * table.row_bytes();
    plan.host_store_bytes += copies * placement.host_rows * table.row_bytes();
  }
  // The budget left over buys lookahead: the largest that fits.
  const int num_ops = static_cast<int>(recording.ops.size());
  if (unlimited) {
    plan.buffers = ScheduleBuffers(recording, buffer_bytes, regions, num_ops);
  } else {
    int fits = 0, too_big = num_ops + 1;  // the packing need not grow monotonically: keep what was checked
    while (too_big - fits > 1) {
      const int mid = fits + (too_big - fits) / 2;
      BufferSchedule trial = ScheduleBuffers(recording, buffer_bytes, regions, mid);
      if (PoolBytes(trial) <= pool_min + left) {
        fits = mid;
        plan.buffers = std::move(trial);
      } else {
        too_big = mid;
      }
    }
  }
  plan.pool_bytes = PoolBytes(plan.buffers);
  *out = std::move(plan);
  return Status::Ok();
}

}  // namespace mltuner
