#include "pipeline/branch_schedule.h"

#include <algorithm>

namespace mltuner {

ClockBranch BranchSchedule::At(mltuner::Clock clock) const {
  ClockBranch at;
  at.internal = clock;
  if (!enabled) return at;
  // The last block that starts at or before `clock`.
  auto block = std::upper_bound(blocks.begin(), blocks.end(), clock,
                                [](mltuner::Clock c, const ScheduledBlock& b) { return c < b.first; });
  if (block == blocks.begin()) return at;  // not scheduled: callers check first
  --block;
  at.branch = block->branch;
  at.internal = block->first_internal + (clock - block->first);
  auto settings = live.find(block->branch);
  at.slack = settings == live.end() ? -1 : settings->second.slack;
  return at;
}

}  // namespace mltuner
