// Placement entries and their value: what placement (plan/placement.h)
// decides on, one entry at a time, and the order in which entries claim the
// device budget.
//
// An entry is the rows of a table that one access touches first — a
// layer's parameters (the rows of its first read or update), a stored
// activation (the rows of the local access that writes it) — or a
// parameter table's rows that no access touches. Entries are runs of
// consecutive layout positions (the layout is first-use order), so deciding
// per entry keeps a table's placement a few runs.
//
// Cost model. Keeping an entry on the device costs `device_bytes` of the
// budget: its values, plus the update log for parameters. Leaving it in host
// memory costs `moved_bytes` per clock: the swap traffic its rows cause
// (plan/swap_traffic.h: reads and fetches in, updates and keeps out, the own
// shard's send and install). Entries claim the budget in order of
// moved_bytes / device_bytes, the bytes saved per clock per byte of device
// memory, while they fit (a budget knapsack, greedy by density). At equal
// value the entry with the shorter idle span goes first: its swap-in must
// follow its previous use within `idle_ops` ops, too soon to hide behind
// compute, while a long-idle entry's swap overlaps the ops in between.
//
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/plan_site.h"
#include "plan/row_layout.h"
#include "record/recorder.h"

namespace mltuner {

struct PlacementEntry {
  TableId table = -1;
  Handle first_handle = -1;    // the access that touches it first; -1: rows no access touches
  int64_t first_position = 0;  // its layout positions: [first_position, first_position + rows)
  int64_t rows = 0;
  int64_t device_bytes = 0;    // budget it takes on the device: values (+ update log for parameters)
  int64_t moved_bytes = 0;     // bytes moved per clock when it lives in host memory
  int idle_ops = 0;            // least ops between a use and the next use that swaps it in (wrapping)
  int64_t device_rows = 0;     // the decision: its first device_rows rows on the device

  // Untouched rows move nothing but installs, all alike: they may be split.
  bool divisible() const { return first_handle < 0; }
};

// The entries of `recording`, by table and ascending position, covering
// every row of every parameter table and the touched rows of local tables
// (their untouched rows, which no access can reach, are placed nowhere),
// with their costs. Internal when a layout is not
// first-use order over the same ops.
Status ListPlacementEntries(const std::vector<TableInfo>& tables, const std::vector<RowLayout>& layouts,
                            const Recording& recording, const PlanSite& site, std::vector<PlacementEntry>* out);

// Whether `a` claims the budget before `b`: higher moved_bytes per
// device byte, then shorter idle span, then op order (untouched rows last).
bool ClaimsBudgetFirst(const PlacementEntry& a, const PlacementEntry& b);

}  // namespace mltuner
