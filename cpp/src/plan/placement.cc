#include "plan/placement.h"

#include <algorithm>
#include <sstream>

#include "plan/placement_value.h"

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

const char* Regions(int regions) { return regions == 1 ? " region" : " regions"; }

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
  out << budget.Describe() << "\n";
  out << "prefetch_clocks " << prefetch_clocks << " (" << prefetch_choice << ")\n";
  out << "pool " << pool_bytes << " B (" << buffers.regions << Regions(buffers.regions) << " of "
      << buffers.region_bytes << " B, lookahead " << buffers.lookahead_ops
      << (buffers.widest_lookahead_ops > buffers.lookahead_ops
              ? " to " + std::to_string(buffers.widest_lookahead_ops) + " (by buffer)"
              : std::string())
      << " ops; least " << pool_min_bytes
      << " B; peak " << peak_bytes << " B at op " << peak_op << "), device stores " << device_store_bytes
      << " B, host stores " << host_store_bytes << " B; host memory " << host.Describe();
  for (const auto& [name, count] : {std::pair<const char*, const EntryCount&>{"parameters", parameters},
                                    std::pair<const char*, const EntryCount&>{"local data", local_data}}) {
    out << "\n" << name << ": " << count.device_entries << " entries on the device (" << count.device_bytes
        << " B), " << count.host_entries << " in host memory (" << count.host_bytes << " B)";
  }
  out << "\npredicted per clock: " << traffic.Describe();
  if (host.shard_link_to_device > 0 || host.shard_link_to_host > 0) {
    out << "; the server shard's state in host memory about " << host.shard_link_to_device
        << " B host->device and " << host.shard_link_to_host
        << " B device->host more (its update rule reads and writes the state in place, and this worker "
           "installs its fresh rows from it)";
  }
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

int64_t LeastPool(const std::vector<TableInfo>& tables, const Recording& recording, int regions,
                  BufferSchedule* schedule) {
  BufferSchedule least = ScheduleBuffers(recording, BufferBytes(tables, recording), regions, 0);
  const int64_t bytes = PoolBytes(least);
  if (schedule != nullptr) *schedule = std::move(least);
  return bytes;
}

// The host link carries both directions at once: a clock moves at least the
// busier one's bytes.
int64_t BusierLinkBytes(const Placement& plan) {
  return std::max(plan.traffic.host_to_device(), plan.traffic.device_to_host());
}

// Raises `schedule` (which fits `budget`) to the largest lookahead up to
// `most_ops` whose pool fits `budget`. The packing need not grow
// monotonically with the lookahead: the search keeps what it checked.
void LargestLookahead(const Recording& recording, const std::vector<int64_t>& buffer_bytes, int regions,
                      int64_t budget, int most_ops, BufferSchedule* schedule) {
  int fits = schedule->lookahead_ops, too_big = most_ops + 1;
  while (too_big - fits > 1) {
    const int mid = fits + (too_big - fits) / 2;
    BufferSchedule trial = ScheduleBuffers(recording, buffer_bytes, regions, mid);
    if (PoolBytes(trial) <= budget) {
      fits = mid;
      *schedule = std::move(trial);
    } else {
      too_big = mid;
    }
  }
}

// The placement with `prefetch` clocks ahead (1 + prefetch regions); the
// caller names the choice. `refusal_note` ends the message of a budget below
// the least pool.
Status PlanWithPrefetch(const Config& config, int prefetch, const std::vector<TableInfo>& tables,
                        const std::vector<RowLayout>& layouts, const Recording& recording, Placement* out,
                        const PlanSite& site, const std::string& refusal_note) {
  Placement plan;
  FindPeak(tables, recording, &plan.peak_bytes, &plan.peak_op);
  const bool unlimited = config.device_memory_budget <= 0;
  const int regions = 1 + prefetch;
  plan.prefetch_clocks = prefetch;
  const std::vector<int64_t> buffer_bytes = BufferBytes(tables, recording);
  const int64_t pool_min = LeastPool(tables, recording, regions, &plan.buffers);
  plan.pool_min_bytes = pool_min;
  plan.staging_bytes = kBufferAlignment;
  for (int64_t bytes : buffer_bytes) plan.staging_bytes = std::max(plan.staging_bytes, bytes);
  if (!unlimited && pool_min > config.device_memory_budget) {
    std::ostringstream msg;
    msg << "device_memory_budget of " << config.device_memory_budget
        << " bytes is too small: the access-buffer pool needs " << pool_min << " bytes (" << regions
        << Regions(regions) << ", one per clock in flight (1 + prefetch_clocks), of " << plan.buffers.region_bytes
        << " bytes: one clock's buffers packed by lifetime; the largest set open at once is " << plan.peak_bytes
        << " bytes at op " << plan.peak_op << ")" << refusal_note;
    return Status::ResourceExhausted(msg.str());
  }
  // Lookahead up to a floor first, then stores, then more lookahead with what
  // the stores left (item 2 of placement.h).
  const int num_ops = static_cast<int>(recording.ops.size());
  const int floor_ops = std::min(num_ops, kLookaheadFloorOps);
  if (unlimited) {
    plan.buffers = ScheduleBuffers(recording, buffer_bytes, regions, num_ops);
  } else {
    LargestLookahead(recording, buffer_bytes, regions, config.device_memory_budget, floor_ops, &plan.buffers);
    plan.buffers = WidenLookahead(recording, plan.buffers, config.device_memory_budget, floor_ops);
  }
  plan.pool_bytes = PoolBytes(plan.buffers);
  int64_t left = unlimited ? 0 : config.device_memory_budget - plan.pool_bytes;

  plan.tables.resize(tables.size());

  // Stores by value (plan/placement_value.h): entries claim what the pool
  // left in order while they fit; untouched rows may be split.
  std::vector<PlacementEntry> entries;
  MLT_RETURN_IF_ERROR(ListPlacementEntries(tables, layouts, recording, site, &entries));
  std::vector<PlacementEntry*> claims;
  for (PlacementEntry& entry : entries) claims.push_back(&entry);
  std::sort(claims.begin(), claims.end(),
            [](const PlacementEntry* a, const PlacementEntry* b) { return ClaimsBudgetFirst(*a, *b); });
  for (PlacementEntry* entry : claims) {
    if (unlimited || entry->device_bytes <= left) {
      entry->device_rows = entry->rows;
    } else if (entry->divisible()) {
      entry->device_rows = std::max<int64_t>(0, left) / (entry->device_bytes / entry->rows);
    }
    if (!unlimited) left -= entry->device_bytes / entry->rows * entry->device_rows;
  }
  if (!unlimited && plan.buffers.lookahead_ops < num_ops) {
    // What the stores left may lengthen the lookahead further.
    const int64_t stores = config.device_memory_budget - plan.pool_bytes - left;
    LargestLookahead(recording, buffer_bytes, regions, config.device_memory_budget - stores, num_ops,
                     &plan.buffers);
    plan.pool_bytes = PoolBytes(plan.buffers);
  }
  // Each table's entries in position order: its device part, then its host part.
  for (const PlacementEntry& entry : entries) {
    TablePlacement& placement = plan.tables[entry.table];
    placement.Append(entry.device_rows, Residence::kDevice);
    placement.Append(entry.rows - entry.device_rows, Residence::kHost);
    if (entry.divisible()) continue;  // untouched rows are no entry of their own
    Placement::EntryCount& count = tables[entry.table].local ? plan.local_data : plan.parameters;
    const int64_t row_cost = entry.device_bytes / entry.rows;
    if (entry.device_rows > 0) {
      ++count.device_entries;
      count.device_bytes += entry.device_rows * row_cost;
    }
    if (entry.device_rows < entry.rows) {
      ++count.host_entries;
      count.host_bytes += (entry.rows - entry.device_rows) * row_cost;
    }
  }
  plan.traffic = PredictSwapTraffic(tables, layouts, recording, plan.tables, site);

  for (const TableInfo& table : tables) {
    const TablePlacement& placement = plan.tables[table.id];
    const int64_t copies = KeepsUpdateLog(table, recording) ? 2 : 1;  // values, and the update log
    plan.device_store_bytes += copies * placement.device_rows * table.row_bytes();
    plan.host_store_bytes += copies * placement.host_rows * table.row_bytes();
  }
  *out = std::move(plan);
  return Status::Ok();
}

}  // namespace

int LeastPoolPrefetchClocks(const Config& config) {
  if (config.prefetch_clocks != kAutoPrefetchClocks) return std::max(0, config.prefetch_clocks);
  return config.device_memory_budget > 0 ? 0 : 1;
}

int64_t LeastPoolBytes(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                       BufferSchedule* schedule) {
  return LeastPool(tables, recording, 1 + LeastPoolPrefetchClocks(config), schedule);
}

Status PlanPlacement(const Config& config, const std::vector<TableInfo>& tables,
                     const std::vector<RowLayout>& layouts, const Recording& recording,
                     Placement* out, const PlanSite& site) {
  if (config.prefetch_clocks != kAutoPrefetchClocks) {
    MLT_RETURN_IF_ERROR(PlanWithPrefetch(config, std::max(0, config.prefetch_clocks), tables, layouts, recording,
                                         out, site, ""));
    out->prefetch_choice = "set in Config";
    return Status::Ok();
  }
  // Chosen (item 4 of placement.h): two regions unless one does better.
  const int64_t budget = config.device_memory_budget;
  const int num_ops = static_cast<int>(recording.ops.size());
  Placement two;
  const Status with_two = PlanWithPrefetch(config, 1, tables, layouts, recording, &two, site, "");
  if (!with_two.ok() && with_two.code() != StatusCode::kResourceExhausted) return with_two;
  if (with_two.ok() && (budget <= 0 || two.buffers.lookahead_ops >= num_ops)) {
    // One region cannot prepare more ops ahead than all of them.
    two.prefetch_choice = budget <= 0 ? "chosen: no device_memory_budget"
                                      : "chosen: the budget holds two regions at the full lookahead";
    *out = std::move(two);
    return Status::Ok();
  }
  const int64_t two_least = with_two.ok() ? two.pool_min_bytes : LeastPool(tables, recording, 2, nullptr);
  Placement one;
  MLT_RETURN_IF_ERROR(PlanWithPrefetch(
      config, 0, tables, layouts, recording, &one, site,
      "; prefetch_clocks was left to the plan, which takes one region when the budget cannot hold two (" +
          std::to_string(two_least) + " bytes)"));
  std::ostringstream why;
  Placement* chosen = &two;
  if (!with_two.ok()) {
    why << "chosen: the budget of " << budget << " bytes is below the least pool of two regions (" << two_least
        << " bytes), not of one (" << one.pool_min_bytes << " bytes)";
    chosen = &one;
  } else if (BusierLinkBytes(one) != BusierLinkBytes(two) &&
             std::min(one.buffers.lookahead_ops, kLookaheadFloorOps) ==
                 std::min(two.buffers.lookahead_ops, kLookaheadFloorOps)) {
    chosen = BusierLinkBytes(one) < BusierLinkBytes(two) ? &one : &two;
    why << "chosen: under the budget " << (chosen == &one ? "one region" : "two regions")
        << " moves fewer bytes over the busier direction of the host link a clock (" << BusierLinkBytes(one)
        << " B with one region, " << BusierLinkBytes(two) << " B with two)";
  } else if (one.buffers.lookahead_ops > two.buffers.lookahead_ops) {  // up to the floor, this comes first
    why << "chosen: under the budget one region prepares " << one.buffers.lookahead_ops
        << " ops ahead, two regions " << two.buffers.lookahead_ops;
    chosen = &one;
  } else {
    why << "chosen: under the budget two regions prepare " << two.buffers.lookahead_ops
        << " ops ahead, one region " << one.buffers.lookahead_ops;
  }
  chosen->prefetch_choice = why.str();
  *out = std::move(*chosen);
  return Status::Ok();
}

}  // namespace mltuner
