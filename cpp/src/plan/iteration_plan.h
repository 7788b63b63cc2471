// IterationPlan: the plan of a recorded virtual iteration (architecture.md,
// "The plan"), made in one place for FinishVirtualIteration and for its dry
// run, Engine::PreviewPlan: row layouts, placement under the device budget,
// and the host memory the plan needs (plan/host_memory.h).
//
// The dry run tells a caller whether a recording fits the budget before
// committing to it: the PyTorch adapter records the layers' reads held
// through the backward pass, asks, and records the GeePS pattern instead
// when they do not fit (docs/torch.md). A preview that fits keeps its plan,
// and FinishVirtualIteration uses it rather than planning again.
#pragma once

#include <memory>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/host_memory.h"
#include "plan/placement.h"
#include "plan/row_layout.h"
#include "record/recorder.h"

namespace mltuner {

struct IterationPlan {
  std::vector<RowLayout> layouts;  // by table id
  Placement placement;             // with placement.host filled

  // Whether this plan was made for `tables` (a table created since, which
  // the defining phase allows, makes it stale; tables are only added).
  bool Covers(const std::vector<TableInfo>& tables) const { return placement.tables.size() == tables.size(); }
};

// Lays out, places and counts the host memory of `recording`.
// ResourceExhausted (PlanPlacement's) when the budget cannot hold the least
// pool; the host memory is counted, not checked (CheckHostMemory).
Status PlanIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                     const PlanSite& site, IterationPlan* out);

// The dry run: `preview` gets the least pool of `recording` and, when the
// budget holds it, the plan's sizes and description; that plan goes to
// `*kept`. A plan already in `*kept` must be `recording`'s (the caller drops
// it when the recording changes): it is described, not made again, unless a
// table was created since.
// Nothing is allocated.
Status PreviewIteration(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                        const PlanSite& site, std::unique_ptr<IterationPlan>* kept, PlanPreview* preview);

}  // namespace mltuner
