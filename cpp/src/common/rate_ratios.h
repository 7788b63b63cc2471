// The learning rate a branch fork gives each table (BranchSettings), in one
// function for the shards, which apply it, and the engines, whose
// read-my-writes steps follow it: both compute the same floats.
#pragma once

#include <map>

#include "mltuner/types.h"

namespace mltuner {

// A table's rate on one branch.
struct TableRate {
  float rate = 0;        // what the table's rule applies now
  double ratio = -1;     // set by a fork that kept ratios: the rate over the fastest's
  float ratio_rate = 0;  // the rate that fork gave; a rate set since ends the ratio
};

// The rates of the rated tables (every rule but add, which has none) on a
// branch forked from one where they are `parent`. A learning rate < 0 keeps
// the parent's; without `keep_ratios` every table takes `learning_rate`.
// Keeping them, each table takes its ratio times it: the ratios the
// parent's fork kept, where every table still has the rate that fork gave
// (so a chain of forks rounds once), else its rate over the fastest's (in
// double: the fastest's is exactly 1); where every rate is 0 each takes it.
std::map<TableId, TableRate> ForkRates(const std::map<TableId, TableRate>& parent, float learning_rate,
                                       bool keep_ratios);

}  // namespace mltuner
