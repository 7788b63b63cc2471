// VectorClock: how far each worker has sent one table's clocks to a shard.
//
// A table whose clock moves in `parts` (sharding/shard_range.h, ShardParts)
// counts a worker's progress in parts: every worker sends the parts of every
// clock in order, so part k of clock c is the worker's position c * parts + k.
// The global position is the minimum over workers: that part of that clock
// has every worker's update. The global clock is the last clock every worker
// sent every part of. Entries start at kNoClock (-2); kStart moves a worker
// to kInitClock (-1, all of its parts at once); each kClockUpdate moves it by
// exactly one part. Not thread-safe: owned by a shard's handler thread.
#pragma once

#include <cstdint>
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
  // *global_advanced is set to whether the global position moved (then
  // finished_clock() and finished_part() name the part it reached).
  Status Advance(WorkerId worker, Clock clock, bool* global_advanced);

  // The last clock `worker` sent every part of.
  Clock Get(WorkerId worker) const { return ClockBefore(positions_[worker] + 1); }
  Clock global() const { return ClockBefore(global_ + 1); }
  // The part every worker reached last: the one a global advance finished.
  Clock finished_clock() const { return ClockBefore(global_ + 1 + (parts_ - 1)); }
  int finished_part() const { return static_cast<int>(global_ - finished_clock() * parts_); }
  int num_workers() const { return static_cast<int>(positions_.size()); }
  int parts() const { return parts_; }

 private:
  // The last clock whose every part lies before position `next`.
  Clock ClockBefore(int64_t next) const;

  const int parts_;
  std::vector<int64_t> positions_;  // the last part each worker sent
  int64_t global_;
};

}  // namespace mltuner
