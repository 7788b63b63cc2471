#include "plan/placement_value.h"

#include <algorithm>
#include <string>

#include "plan/swap_traffic.h"

namespace mltuner {

namespace {

bool Opens(OpKind kind) {
  return kind == OpKind::kRead || kind == OpKind::kPreUpdate || kind == OpKind::kLocalAccess;
}

// The rows of `access` at positions not yet in an entry: they must be the
// positions right after `placed` (the layout is first-use order over the same
// ops). Internal when the layout breaks that.
Status CountNewRows(const AccessRecord& access, const RowLayout& layout, int64_t placed, int64_t* out) {
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

struct Use {
  int open_op = 0;
  int close_op = 0;
  bool swaps_in = false;  // a read or a local fetch: a host-resident entry must come in for it
};

// The least gap, in ops, between a use that swaps the entry in and the use
// before it (the last use of the previous clock for the first one).
int IdleSpan(const std::vector<Use>& uses, int num_ops) {
  int least = num_ops;
  for (size_t i = 0; i < uses.size(); ++i) {
    if (!uses[i].swaps_in) continue;
    const Use& before = i > 0 ? uses[i - 1] : uses.back();
    const int before_close = i > 0 ? before.close_op : before.close_op - num_ops;
    least = std::min(least, std::max(0, uses[i].open_op - before_close));
  }
  return least;
}

// Fills moved_bytes and idle_ops of one table's entries (`first` .. `last`,
// ascending positions covering the table).
void CostTableEntries(const TableInfo& table, const RowLayout& layout, const Recording& recording,
                      const PlanSite& site, std::vector<PlacementEntry>::iterator first,
                      std::vector<PlacementEntry>::iterator last) {
  // The entry holding a position: a search over the entries' runs, not a
  // table of one entry per row (the plan stays per run, architecture.md).
  auto entry_of = [first, last](int64_t position) {
    auto after = std::upper_bound(first, last, position, [](int64_t p, const PlacementEntry& entry) {
      return p < entry.first_position;
    });
    return static_cast<size_t>(after - first) - 1;
  };
  const int64_t row_bytes = table.row_bytes();
  ForEachHostTransfer(table, layout, recording, site, [&](SwapCause, int64_t position) {
    (first + entry_of(position))->moved_bytes += row_bytes;
  });
  std::vector<std::vector<Use>> uses(static_cast<size_t>(last - first));
  std::vector<Handle> seen_by(uses.size(), -1);
  for (const AccessRecord& access : recording.accesses) {  // by handle: in open order
    if (access.table != table.id) continue;
    const Use use{access.open_op, access.close_op,
                  access.kind == OpKind::kRead || (access.kind == OpKind::kLocalAccess && access.fetch)};
    for (RowId row : access.rows) {
      const size_t entry = entry_of(layout.PositionOf(row));
      if (seen_by[entry] == access.handle) continue;
      seen_by[entry] = access.handle;
      uses[entry].push_back(use);
    }
  }
  const int num_ops = static_cast<int>(recording.ops.size());
  for (size_t i = 0; i < uses.size(); ++i) (first + i)->idle_ops = IdleSpan(uses[i], num_ops);
}

}  // namespace

Status ListPlacementEntries(const std::vector<TableInfo>& tables, const std::vector<RowLayout>& layouts,
                            const Recording& recording, const PlanSite& site, std::vector<PlacementEntry>* out) {
  std::vector<std::vector<PlacementEntry>> by_table(tables.size());
  std::vector<int64_t> placed(tables.size(), 0);
  for (const RecordedOp& op : recording.ops) {
    if (!Opens(op.kind)) continue;
    const AccessRecord& access = recording.accesses[op.handle];
    const size_t t = static_cast<size_t>(access.table);
    int64_t rows = 0;
    MLT_RETURN_IF_ERROR(CountNewRows(access, layouts[t], placed[t], &rows));
    if (rows == 0) continue;
    PlacementEntry entry;
    entry.table = access.table;
    entry.first_handle = access.handle;
    entry.first_position = placed[t];
    entry.rows = rows;
    by_table[t].push_back(entry);
    placed[t] += rows;
  }
  std::vector<PlacementEntry> entries;
  for (const TableInfo& table : tables) {
    const size_t t = static_cast<size_t>(table.id);
    // A local table's untouched rows are placed nowhere and take no memory:
    // local data exists only through recorded accesses, so no later call can
    // reach them (the PyTorch adapter's activation table keeps rows for
    // saved tensors that a later choice recomputes instead).
    if (placed[t] < table.num_rows && !table.local) {
      PlacementEntry untouched;
      untouched.table = table.id;
      untouched.first_position = placed[t];
      untouched.rows = table.num_rows - placed[t];
      by_table[t].push_back(untouched);
    }
    const int64_t copies = KeepsUpdateLog(table, recording) ? 2 : 1;  // values, and the update log
    for (PlacementEntry& entry : by_table[t]) entry.device_bytes = copies * entry.rows * table.row_bytes();
    CostTableEntries(table, layouts[t], recording, site, by_table[t].begin(), by_table[t].end());
    entries.insert(entries.end(), by_table[t].begin(), by_table[t].end());
  }
  *out = std::move(entries);
  return Status::Ok();
}

bool ClaimsBudgetFirst(const PlacementEntry& a, const PlacementEntry& b) {
  // moved/device compared exactly: a.moved * b.device vs b.moved * a.device.
  const __int128 left = static_cast<__int128>(a.moved_bytes) * b.device_bytes;
  const __int128 right = static_cast<__int128>(b.moved_bytes) * a.device_bytes;
  if (left != right) return left > right;
  if (a.idle_ops != b.idle_ops) return a.idle_ops < b.idle_ops;
  // Then op order (first layers first), untouched rows last.
  if (a.divisible() != b.divisible()) return !a.divisible();
  if (a.first_handle != b.first_handle) return a.first_handle < b.first_handle;
  if (a.table != b.table) return a.table < b.table;
  return a.first_position < b.first_position;
}

}  // namespace mltuner
