// VectorClock: per-worker positions (clock x parts + part) and their minimum.
#include "server/vector_clock.h"

#include <algorithm>
#include <string>

namespace mltuner {

VectorClock::VectorClock(int num_workers, int parts)
    : parts_(std::max(parts, 1)),
      // The last part of clock kNoClock: not started.
      positions_(static_cast<size_t>(std::max(num_workers, 0)), int64_t{kNoClock} * parts_ + parts_ - 1),
      global_(int64_t{kNoClock} * parts_ + parts_ - 1) {}

Clock VectorClock::ClockBefore(int64_t next) const {
  // Floor division: positions before clock 0 are negative.
  const int64_t quotient = next / parts_ - (next % parts_ < 0 ? 1 : 0);
  return quotient - 1;
}

Status VectorClock::NextPart(WorkerId worker, Clock clock, int* part) const {
  if (worker < 0 || worker >= num_workers()) {
    return Status::InvalidArgument("vector clock: worker " + std::to_string(worker) + " is not in [0, " +
                                   std::to_string(num_workers()) + ")");
  }
  const Clock last = Get(worker);
  const Clock expected = last == kNoClock ? kInitClock : ClockBefore(positions_[worker] + 1 + parts_);
  if (clock != expected) {
    return Status::OutOfOrder("vector clock: worker " + std::to_string(worker) + " expected clock " +
                              std::to_string(expected) + ", received " + std::to_string(clock));
  }
  *part = last == kNoClock ? 0 : static_cast<int>(positions_[worker] + 1 - clock * parts_);
  return Status::Ok();
}

Status VectorClock::Advance(WorkerId worker, Clock clock, bool* global_advanced) {
  if (global_advanced != nullptr) *global_advanced = false;
  int part = 0;
  MLT_RETURN_IF_ERROR(NextPart(worker, clock, &part));
  // Only a worker sitting at the minimum can move the minimum, so the O(N)
  // rescan runs at most once per worker per part.
  const bool was_at_minimum = positions_[worker] == global_;
  positions_[worker] = clock == kInitClock ? -1 : clock * parts_ + part;
  if (!was_at_minimum) return Status::Ok();
  const int64_t new_global = *std::min_element(positions_.begin(), positions_.end());
  if (global_advanced != nullptr) *global_advanced = new_global > global_;
  global_ = new_global;
  return Status::Ok();
}

}  // namespace mltuner
