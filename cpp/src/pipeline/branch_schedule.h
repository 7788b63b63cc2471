// BranchSchedule: which branch each application clock runs on, and the live
// branches' settings (mltuner.md §3). The application fills it
// (engine/branches.cc); the allocator and reclaimer read it to stamp a
// clock's reads and updates with its branch and the branch's own clock.
//
// Threading: none of its own; SharedState::mu guards it.
#pragma once

#include <map>
#include <vector>

#include "common/rate_ratios.h"
#include "mltuner/config.h"
#include "mltuner/types.h"

namespace mltuner {

// Where an application clock runs: its branch, the branch's own clock
// number, and the slack the branch imposes (-1: each read's own).
struct ClockBranch {
  BranchId branch = 0;
  mltuner::Clock internal = 0;
  int32_t slack = -1;
  bool training = true;  // the branch applies updates

  // The slack of a read recorded with `recorded` on this clock.
  int SlackOf(int recorded) const { return slack >= 0 ? slack : recorded; }
};

// A run of consecutive application clocks scheduled on one branch.
struct ScheduledBlock {
  mltuner::Clock first = 0;
  int64_t count = 0;
  BranchId branch = 0;
  mltuner::Clock first_internal = 0;
};

struct BranchSchedule {
  // Config::branches. Without it every clock is scheduled on branch 0 and
  // `blocks` stays empty.
  bool enabled = false;
  std::vector<ScheduledBlock> blocks;
  mltuner::Clock scheduled_until = 0;         // clocks [0, this) have a branch
  std::map<BranchId, BranchSettings> live;    // live branches
  // What each live branch's rules take from it and its ancestors: the
  // momentum the nearest of them set (kKeepParent: none did, each table
  // keeps its own). Branch 0 sets none.
  std::map<BranchId, BranchSettings> rule_overrides;
  // Each live branch's rated tables' learning rates, as its shards apply
  // them: the rules' own on branch 0 (from start_iterations), each fork's
  // (ForkRates), and the rates the application set, from the clock whose
  // update carried them (the reclaimer's). Read-my-writes steps follow them.
  std::map<BranchId, std::map<TableId, TableRate>> rates;
  std::map<BranchId, mltuner::Clock> clocks;  // clocks scheduled per branch
  // Where an application clock nobody scheduled runs (-1: nowhere, refused):
  // the branch that holds the trained model after a tuning session, so the
  // loop trains on once the session ends.
  BranchId continue_on = -1;

  // Runs the next `count` clocks after the scheduled ones on `branch`.
  // REQUIRES: `branch` is live, count >= 1.
  void Append(BranchId branch, int64_t count);

  // The branch of an application clock. REQUIRES: the clock is scheduled
  // (always true when not enabled).
  ClockBranch At(mltuner::Clock clock) const;
  // Whether the allocator may prepare `clock`: it has a branch.
  bool Scheduled(mltuner::Clock clock) const { return !enabled || clock < scheduled_until; }
  // A table's rule on a live branch: `base` with the branch's momentum and
  // the table's rate there.
  UpdateRuleConfig RuleOn(BranchId branch, TableId table, const UpdateRuleConfig& base) const;
};

}  // namespace mltuner
