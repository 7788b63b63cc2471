// VectorClock: per-worker finished clocks and their minimum.
#include "server/vector_clock.h"

#include <algorithm>
#include <string>

namespace mltuner {

VectorClock::VectorClock(int num_workers)
    : clocks_(static_cast<size_t>(std::max(num_workers, 0)), kNoClock) {}

Status VectorClock::Advance(WorkerId worker, Clock clock, bool* global_advanced) {
  if (global_advanced != nullptr) *global_advanced = false;
  if (worker < 0 || worker >= num_workers()) {
    return Status::InvalidArgument("vector clock: worker " + std::to_string(worker) +
                                   " is not in [0, " + std::to_string(num_workers()) + ")");
  }
  const Clock expected = clocks_[worker] + 1;
  if (clock != expected) {
    return Status::OutOfOrder("vector clock: worker " + std::to_string(worker) + " expected clock " +
                              std::to_string(expected) + ", received " + std::to_string(clock));
  }
  // Only a worker sitting at the minimum can move the minimum, so the O(N)
  // rescan runs at most once per worker per clock.
  const bool was_at_minimum = clocks_[worker] == global_;
  clocks_[worker] = clock;
  if (!was_at_minimum) return Status::Ok();
  const Clock new_global = *std::min_element(clocks_.begin(), clocks_.end());
  if (global_advanced != nullptr) *global_advanced = new_global > global_;
  global_ = new_global;
  return Status::Ok();
}

}  // namespace mltuner
