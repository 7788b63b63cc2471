// VectorClock: how far each worker has sent one table's clocks to a shard.
//
// A table whose clock moves in `parts` (sharding/shard_range.h, ShardParts)
// counts a worker's progress in parts: every worker sends the parts of every
// clock in order, so part k of clock c is the worker's position c * parts + k.
// The global position is the minimum over workers: that part of that clock
// has every worker's update. The global clock is the last clock every worker
// sent every part of. Entries start at kNoClock (-2); kStart moves a worker
// to kInitClock (-1, all of its parts at once); each kClockUpdate moves it by
// exactly one part.
//
// A clock of a worker may be declared empty by another (batch stealing: its
// samples went to the others, python/mltuner/tune/session/_steal.py). The
// worker then counts as having sent all of that clock as soon as it has sent
// the clock before, so the others need not wait for it; its own update of
// that clock, which still comes, is only checked for order and dropped. A
// declaration that comes after the worker sent part of that clock changes
// nothing: its own update counts. Not thread-safe: owned by a shard's
// handler thread.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

class VectorClock {
 public:
  explicit VectorClock(int num_workers, int parts = 1);

  // Which part of `clock` the worker's next update is: OutOfOrder, naming
  // the worker, the expected and the received clock, unless `clock` is the
  // clock of the worker's next part (kInitClock for a worker at kNoClock).
  Status NextPart(WorkerId worker, Clock clock, int* part) const;
  // Moves `worker` past its next part, which must be of `clock` (NextPart's
  // check); from kNoClock, kInitClock moves it past every part of clock -1.
  // *global_advanced is set to whether the global position moved (by one
  // part, or by more when declared empty clocks follow: parts between the
  // old global_position() and the new one are finished, in order).
  Status Advance(WorkerId worker, Clock clock, bool* global_advanced);
  // Declares `worker`'s `clock` (>= 0) empty (see above); *global_advanced
  // as for Advance. Declaring a clock twice, or one the worker already sent
  // part of, changes nothing.
  Status DeclareEmpty(WorkerId worker, Clock clock, bool* global_advanced);
  // Whether the worker's own update of `clock` is to be dropped: the clock
  // was declared empty before the worker sent any of it.
  bool DeclaredEmpty(WorkerId worker, Clock clock) const;

  // The last clock `worker` counts as having sent every part of (its own or
  // declared empty).
  Clock Get(WorkerId worker) const { return ClockBefore(positions_[worker] + 1); }
  // The last clock the worker itself sent every part of.
  Clock Sent(WorkerId worker) const { return ClockBefore(sent_[worker] + 1); }
  Clock global() const { return ClockBefore(global_ + 1); }
  // The last clock whose part `part` every worker reached: global() + 1 for
  // the parts the global position has passed in the clock after it.
  Clock PartClock(int part) const { return part <= PartOf(global_) ? ClockOf(global_) : ClockOf(global_) - 1; }
  // The last part every worker reached, as a position (clock * parts + part).
  int64_t global_position() const { return global_; }
  Clock ClockOf(int64_t position) const { return ClockBefore(position + parts_); }
  int PartOf(int64_t position) const { return static_cast<int>(position - ClockOf(position) * parts_); }
  int num_workers() const { return static_cast<int>(positions_.size()); }
  int parts() const { return parts_; }

 private:
  // The last clock whose every part lies before position `next`.
  Clock ClockBefore(int64_t next) const;
  // Moves the worker's counted position over the declared empty clocks that
  // follow it, then the global position to the minimum if the worker was at
  // it (its counted position was `before`).
  void CountOnward(WorkerId worker, int64_t before, bool* global_advanced);

  const int parts_;
  std::vector<int64_t> positions_;  // per worker: the last part it counts as having sent
  std::vector<int64_t> sent_;       // per worker: the last part it sent itself
  std::vector<std::set<Clock>> empty_;  // per worker: declared clocks it has not sent yet
  int64_t global_;
};

}  // namespace mltuner
