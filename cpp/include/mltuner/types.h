// Plain value types shared by every layer of the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mltuner/config.h"

namespace mltuner {

using TableId = int32_t;
using RowId = int64_t;
// One clock is one mini-batch iteration. Clock -1 is the initialisation
// phase (before start_iterations); training clocks count up from 0.
using Clock = int64_t;
using Handle = int32_t;
using WorkerId = int32_t;
using BranchId = int32_t;

constexpr Clock kNoClock = -2;   // a vector-clock entry before start_iterations
constexpr Clock kInitClock = -1; // the clock that holds the initial values

// A contiguous block of rows to move: rows [src, src+count) of a source go to
// rows [dst, dst+count) of a destination. Indexes are prebuilt as lists of
// runs; because rows are laid out in first-use order a read is usually a
// single run, so gather and scatter-add run at copy speed.
struct RowRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t count = 0;
};

// Where a block of rows lives.
enum class Residence : int8_t { kDevice = 0, kHost = 1 };

struct TableInfo {
  TableId id = -1;
  std::string name;
  int64_t num_rows = 0;
  int64_t row_width = 0;  // float32 values per row
  bool local = false;     // local data: per worker, never communicated
  // The table's own update rule; none: Config::update_rule.
  std::optional<UpdateRuleConfig> update_rule;
  // A communicated table's clock (updates, the rule, fresh rows) moves each
  // shard's rows in parts of about this many bytes (Config::clock_part_bytes,
  // sharding/shard_range.h's ShardParts); 0: each shard's rows whole.
  int64_t part_bytes = 0;

  int64_t row_bytes() const { return row_width * static_cast<int64_t>(sizeof(float)); }
  int64_t bytes() const { return num_rows * row_bytes(); }
};

// The kinds of op a virtual iteration records.
enum class OpKind : int8_t {
  kRead = 0,
  kPostRead = 1,
  kPreUpdate = 2,
  kUpdate = 3,
  kLocalAccess = 4,
  kPostLocalAccess = 5,
  kClock = 6,
};

const char* OpKindName(OpKind kind);

// One table's slice of a server shard, for checkpoints: the values of rows
// [first_row, first_row + num_rows) in order, and the update rule's optimizer
// state laid out as `state_arrays` arrays of values.size() floats followed by
// scalars (Adam's step count), so it can be re-split over other shards.
struct ShardSlice {
  int64_t first_row = 0;
  int64_t num_rows = 0;
  std::vector<float> values;
  std::vector<float> state;
  int state_arrays = 0;
  Clock global_clock = kNoClock;
};

// The host memory a worker's plan needs (plan/host_memory.h), in bytes. On
// the CPU backend the device's memory is host memory too, so the pool and
// the device-resident stores count; on an accelerator they do not.
struct HostMemoryNeed {
  int64_t parameter_stores = 0;  // host-resident parameter rows and their update logs
  int64_t local_data = 0;        // host-resident local data
  int64_t device_memory = 0;     // the pool and device-resident stores, when the device's memory is host memory
  int64_t staging = 0;           // the staging buffer for host-resident updates (pinned on CUDA)
  int64_t payloads = 0;          // update payloads of the clocks in flight that live in host memory (an upper estimate)
  // This rank's server shard: its rows of every communicated table with the
  // rule's optimizer state, for one branch. In host memory when the
  // device's memory is, or when the device cannot hold it after the plan
  // (plan/device_budget.h; the shard allocates it once every worker's plan
  // is made). In total() then, for the first branch; each live branch
  // beyond the first adds this much (forks are not counted; the shard checks
  // each one's copy against HostMemoryHeadroom).
  int64_t shard_per_branch = 0;
  bool shard_in_host_memory = false;
  // What that state moves over an accelerator's host link a clock when it
  // lives in host memory (0 otherwise): the update rule reads and writes it
  // in place, and this process's worker installs its fresh rows from it.
  // An estimate that takes every table as updated and pushed once a clock.
  int64_t shard_link_to_device = 0;
  int64_t shard_link_to_host = 0;

  // What FinishVirtualIteration allocates or will hold, the shard's state of
  // branch 0 when it lives in host memory.
  int64_t total() const {
    return parameter_stores + local_data + device_memory + staging + payloads +
           (shard_in_host_memory ? shard_per_branch : 0);
  }
  // "12345 B (parameter stores 1000 B, local data 0 B, ...)"
  std::string Describe() const;
};

// What the plan of a recorded virtual iteration needs, from a dry run
// (Engine::PreviewPlan) made before FinishVirtualIteration commits to it.
struct PlanPreview {
  // The least access-buffer pool (lookahead 0): the smallest budget
  // accepted. Of 1 + prefetch_clocks regions; with prefetch_clocks left to
  // the plan, of one region under a budget (set or automatic), of two
  // without one (LeastPoolBytes, plan/placement.h).
  int64_t pool_min_bytes = 0;
  // The plan's prefetch_clocks (Config's, or its choice) when the budget
  // holds the least pool; when it does not, that of the least pool.
  int prefetch_clocks = 0;
  bool fits = false;           // the budget holds the least pool; the rest only then
  // The budget the plan is made under: Config's, or the automatic one when
  // none is set and the device cannot hold the plan (0: none).
  int64_t budget_bytes = 0;
  bool automatic_budget = false;
  int64_t pool_bytes = 0;
  int64_t device_store_bytes = 0;
  int64_t host_store_bytes = 0;
  // The bytes the plan predicts it moves over the host link per
  // steady-state clock, each way (plan/swap_traffic.h).
  int64_t host_to_device_bytes = 0;
  int64_t device_to_host_bytes = 0;
  // The handles of local accesses whose rows all stay on the device.
  std::vector<Handle> device_local_accesses;
  HostMemoryNeed host;
  std::string description;     // as Engine::DescribePlan will give it
};

}  // namespace mltuner
