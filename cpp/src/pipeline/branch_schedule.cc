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
  if (settings != live.end()) {
    at.slack = settings->second.slack;
    at.training = settings->second.training;
  }
  return at;
}

void BranchSchedule::Append(BranchId branch, int64_t count) {
  // A block that continues the last one on the same branch just extends it
  // (not one of a freed branch whose id a new fork took: its clocks start
  // at 0 again).
  const ScheduledBlock* last = blocks.empty() ? nullptr : &blocks.back();
  if (last != nullptr && last->branch == branch && last->first_internal + last->count == clocks[branch]) {
    blocks.back().count += count;
  } else {
    blocks.push_back({scheduled_until, count, branch, clocks[branch]});
  }
  clocks[branch] += count;
  scheduled_until += count;
}

UpdateRuleConfig BranchSchedule::RuleOn(BranchId branch, TableId table, const UpdateRuleConfig& base) const {
  UpdateRuleConfig rule = base;
  auto overrides = rule_overrides.find(branch);
  if (overrides != rule_overrides.end() && overrides->second.momentum >= 0) rule.momentum = overrides->second.momentum;
  auto branch_rates = rates.find(branch);
  if (branch_rates != rates.end()) {
    auto rate = branch_rates->second.find(table);
    if (rate != branch_rates->second.end()) rule.learning_rate = rate->second.rate;
  }
  return rule;
}

}  // namespace mltuner
