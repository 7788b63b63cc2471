// VectorClock: the last clock each worker has finished, for one table.
//
// The global clock is the minimum over workers: every update of every worker
// through the global clock has arrived. Entries start at kNoClock (-2);
// kStart moves a worker to kInitClock (-1); each kClockUpdate moves it by
// exactly one. Not thread-safe: owned by a shard's handler thread.
#pragma once

#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

class VectorClock {
 public:
  explicit VectorClock(int num_workers);

  // Moves `worker` to `clock`. REQUIRES clock == Get(worker) + 1, else
  // OutOfOrder naming the worker, the expected and the received clock.
  // *global_advanced is set to whether the minimum moved.
  Status Advance(WorkerId worker, Clock clock, bool* global_advanced);

  Clock Get(WorkerId worker) const { return clocks_[worker]; }
  Clock global() const { return global_; }
  int num_workers() const { return static_cast<int>(clocks_.size()); }

 private:
  std::vector<Clock> clocks_;
  Clock global_ = kNoClock;
};

}  // namespace mltuner
