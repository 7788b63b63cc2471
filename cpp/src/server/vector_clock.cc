// VectorClock: per-worker positions (clock x parts + part) and their minimum.
#include "server/vector_clock.h"

#include <algorithm>
#include <string>

namespace mltuner {

VectorClock::VectorClock(int num_workers, int parts)
    : parts_(std::max(parts, 1)),
      // The last part of clock kNoClock: not started.
      positions_(static_cast<size_t>(std::max(num_workers, 0)), int64_t{kNoClock} * parts_ + parts_ - 1),
      sent_(positions_),
      empty_(positions_.size()),
      global_(int64_t{kNoClock} * parts_ + parts_ - 1) {}

Clock VectorClock::ClockBefore(int64_t next) const {
  // Floor division: positions before clock 0 are negative.
  const int64_t quotient = next / parts_ - (next % parts_ < 0 ? 1 : 0);
  return quotient - 1;
}

static Status CheckWorker(WorkerId worker, int num_workers) {
  if (worker >= 0 && worker < num_workers) return Status::Ok();
  return Status::InvalidArgument("vector clock: worker " + std::to_string(worker) + " is not in [0, " +
                                 std::to_string(num_workers) + ")");
}

Status VectorClock::NextPart(WorkerId worker, Clock clock, int* part) const {
  MLT_RETURN_IF_ERROR(CheckWorker(worker, num_workers()));
  const Clock last = Sent(worker);
  const Clock expected = last == kNoClock ? kInitClock : ClockBefore(sent_[worker] + 1 + parts_);
  if (clock != expected) {
    return Status::OutOfOrder("vector clock: worker " + std::to_string(worker) + " expected clock " +
                              std::to_string(expected) + ", received " + std::to_string(clock));
  }
  *part = last == kNoClock ? 0 : static_cast<int>(sent_[worker] + 1 - clock * parts_);
  return Status::Ok();
}

Status VectorClock::Advance(WorkerId worker, Clock clock, bool* global_advanced) {
  if (global_advanced != nullptr) *global_advanced = false;
  int part = 0;
  MLT_RETURN_IF_ERROR(NextPart(worker, clock, &part));
  sent_[worker] = clock == kInitClock ? -1 : clock * parts_ + part;
  std::set<Clock>& empty = empty_[worker];
  if (empty.count(clock) != 0) {
    // Counted when it was declared: only the order is checked.
    if (part == parts_ - 1) empty.erase(clock);
    return Status::Ok();
  }
  const int64_t before = positions_[worker];
  positions_[worker] = sent_[worker];
  CountOnward(worker, before, global_advanced);
  return Status::Ok();
}

Status VectorClock::DeclareEmpty(WorkerId worker, Clock clock, bool* global_advanced) {
  if (global_advanced != nullptr) *global_advanced = false;
  MLT_RETURN_IF_ERROR(CheckWorker(worker, num_workers()));
  if (clock < 0) {
    return Status::InvalidArgument("vector clock: only training clocks (>= 0) may be declared empty, got " +
                                   std::to_string(clock));
  }
  // Once the worker sent part of the clock, its own update counts.
  if (sent_[worker] >= clock * parts_) return Status::Ok();
  if (!empty_[worker].insert(clock).second) return Status::Ok();
  CountOnward(worker, positions_[worker], global_advanced);
  return Status::Ok();
}

bool VectorClock::DeclaredEmpty(WorkerId worker, Clock clock) const {
  return worker >= 0 && worker < num_workers() && empty_[worker].count(clock) != 0;
}

void VectorClock::CountOnward(WorkerId worker, int64_t before, bool* global_advanced) {
  // A worker that has not started (kNoClock) counts nothing before kStart.
  int64_t& position = positions_[worker];
  const std::set<Clock>& empty = empty_[worker];
  while (Get(worker) != kNoClock && (position + 1) % parts_ == 0 && empty.count(Get(worker) + 1) != 0) {
    position += parts_;
  }
  // Only a worker that was at the minimum can move the minimum, so the O(N)
  // rescan runs at most once per worker per part.
  if (before != global_) return;
  const int64_t new_global = *std::min_element(positions_.begin(), positions_.end());
  if (new_global == global_) return;
  if (global_advanced != nullptr) *global_advanced = true;
  global_ = new_global;
}

}  // namespace mltuner
