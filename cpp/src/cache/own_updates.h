// OwnUpdates: read-my-writes for one parameter table under bounded
// staleness. A read at slack s may see the other workers' updates up to s
// clocks late; with this, it sees this worker's own updates through the
// clock before it at once, as Bösen's SSP promises. Without it a worker's
// own last steps are missing for the round trip through the shards, and at
// a high rate with momentum that is what stops slack from training
// (docs/results.md, "Read-my-writes").
//
// How: the reclaimer turns the worker's update of each clock into the step
// the shards' rule takes for it, adds that step to the cache's rows at once
// and keeps it. For the rules where the step is linear in the update (add,
// sgd and damped momentum without weight decay) the shards' step is the sum
// of the workers' own steps, each with its own share of the momentum, so the
// mirror here is exact for this worker's part. An install of rows of data
// age d adds back the kept steps of the clocks after d, which the shard's
// rows do not hold yet; steps at or below the table's data age are dropped.
// With momentum the other workers' share is carried forward too (see
// carried_momentum_): between installs their momentum alone moves the
// shard's rows on, and that part can be predicted.
//
// The state follows one training branch: a step of another branch, or a
// clock whose reads are not stale, starts it afresh (kept steps dropped, the
// momentum share zero). After a fork the mirror's momentum starts at zero
// while the shard's carries on: it then predicts less of its own step until
// the momentum builds up again, an error that the next install corrects.
//
// Threading: Apply runs on the reclaimer thread while it holds the table's
// partition locks exclusively; Reinstall and Forget on the receive thread,
// Reinstall under the install's partition locks. mu_ guards the rest; it is
// a leaf (nothing is taken while it is held). Device work: all on the
// install stream (after the update's ticket from the writeback stream), in
// the cache's order of installs (table_store.h, CacheTickets), one pass a
// clock (Device::OwnStep) and one per install (Device::Carry).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "cache/table_store.h"
#include "common/mutex.h"
#include "memory/device_block.h"
#include "mltuner/config.h"
#include "mltuner/device.h"
#include "record/index_builder.h"

namespace mltuner {

// Whether the mirror is exact for `rule`: a step linear in the update,
// independent of the parameters.
bool OwnStepIsLinear(const UpdateRuleConfig& rule);

// The largest slack read-my-writes serves: it keeps a table-sized step per
// clock the rows may lag, up to slack + 1 of them. Reads at a larger slack
// go without it.
constexpr int kOwnUpdatesMaxSlack = 8;
inline bool ServesSlack(int slack) { return slack >= 1 && slack <= kOwnUpdatesMaxSlack; }

class OwnUpdates {
 public:
  // For a table whose rows all live on the device (`store` has no host
  // rows), read with `read_slack` at most as recorded. Null when the rule's
  // step is not linear (OwnStepIsLinear) or some rows are in host memory.
  static std::unique_ptr<OwnUpdates> ForTable(std::shared_ptr<Device> device, const TableStore& store,
                                              const UpdateRuleConfig& rule, int read_slack, int num_workers,
                                              int num_pieces);
  OwnUpdates(const OwnUpdates&) = delete;
  OwnUpdates& operator=(const OwnUpdates&) = delete;

  // What the shards apply to this table on a branch: its rule, with the
  // table's rate there and the branch's momentum where it set one
  // (BranchSchedule::RuleOn), and whether the branch trains at all.
  struct Rule {
    UpdateRuleConfig config;
    bool training = true;
  };

  // The table's base rule.
  const UpdateRuleConfig& base_rule() const { return base_rule_; }
  // The largest slack recorded for the table's reads (a branch may set
  // another, ClockBranch::SlackOf).
  int read_slack() const { return read_slack_; }

  // This worker's update of `clock` (the branch's own clock numbering, as
  // data ages are), in the cache's device layout (`update`, ready on the
  // writeback stream, which waits for this pass before it writes `update`
  // again): its step is made, added to the cache and kept.
  // `stale`: the clock's reads of the table may be stale (slack >= 1); when
  // not, nothing is added and the state starts afresh. `cache_branch`: the
  // branch whose rows the cache holds now. REQUIRES: the caller holds the
  // table's partition locks exclusively.
  Status Apply(BranchId branch, mltuner::Clock clock, const Rule& rule, bool stale, BranchId cache_branch,
               const float* update) EXCLUDES(mu_);
  // After the device rows of `segments` were installed from a shard's rows
  // of data age `age` on `branch` (queued on the install stream): adds the
  // kept steps of later clocks to them. REQUIRES: the caller holds the
  // install's partition locks.
  Status Reinstall(BranchId branch, int piece, mltuner::Clock age, const std::vector<WireSegment>& segments)
      EXCLUDES(mu_);
  // No install older than `age` (the table's data age) can come any more.
  void Forget(BranchId branch, mltuner::Clock age) EXCLUDES(mu_);

  // A device buffer of the cache's device layout for the reclaimer to
  // gather an update into (one whose buffer is not in that layout), made at
  // the first call. Only the reclaimer thread uses it.
  Status Scratch(float** out) EXCLUDES(mu_);
  // Floats of the cache's device rows (of the scratch and of each step).
  int64_t values() const;
  int64_t steps_applied() const EXCLUDES(mu_);

 private:
  OwnUpdates(std::shared_ptr<Device> device, const TableStore& store, const UpdateRuleConfig& rule, int read_slack,
             int num_workers, int num_pieces)
      : device_(std::move(device)),
        store_(store),
        base_rule_(rule),
        read_slack_(read_slack),
        num_workers_(num_workers),
        raw_age_(static_cast<size_t>(num_pieces), kNoClock) {}
  // Drops the kept steps and the state; they follow `branch` (-1: none) now.
  void Restart(BranchId branch) REQUIRES(mu_);
  // The other workers' momentum (see the class comment): carried with
  // `momentum` from now on (0: not), every piece's rows unknown again.
  Status StartCarrying(float momentum) REQUIRES(mu_);
  void StopCarrying() REQUIRES(mu_);
  // Adds `step` (cache layout) to `count` values of the cache from `offset`
  // on the install stream.
  void AddToCache(const float* step, int64_t offset, int64_t count);

  const std::shared_ptr<Device> device_;
  const TableStore& store_;
  const UpdateRuleConfig base_rule_;
  const int read_slack_;
  const int num_workers_;

  mutable Mutex mu_;
  BranchId branch_ GUARDED_BY(mu_) = -1;  // the branch the state follows; -1: none yet
  int state_arrays_ GUARDED_BY(mu_) = 0;
  std::shared_ptr<DeviceBlock> state_ GUARDED_BY(mu_);  // the rule's state for this worker's share
  std::map<mltuner::Clock, std::shared_ptr<DeviceBlock>> steps_ GUARDED_BY(mu_);  // kept steps by clock
  std::vector<std::shared_ptr<DeviceBlock>> spare_ GUARDED_BY(mu_);              // blocks of dropped steps
  std::shared_ptr<DeviceBlock> scratch_ GUARDED_BY(mu_);  // made at the first Scratch
  int64_t steps_applied_ GUARDED_BY(mu_) = 0;
  mltuner::Clock latest_ GUARDED_BY(mu_) = kNoClock;  // the clock of the last step kept
  // The other workers' momentum: with momentum m, a row the shard last sent
  // at clock d, when this worker is at clock L, also gets m + ... + m^(L-d)
  // times the others' step at d. `raw_` holds the shard's rows as last
  // installed, `raw_age_` their clock by piece, `drift_` the share of each
  // row for the next clock.
  float carried_momentum_ GUARDED_BY(mu_) = 0.0f;
  std::vector<mltuner::Clock> raw_age_ GUARDED_BY(mu_);
  std::shared_ptr<DeviceBlock> raw_ GUARDED_BY(mu_);
  std::shared_ptr<DeviceBlock> drift_ GUARDED_BY(mu_);
};

}  // namespace mltuner
