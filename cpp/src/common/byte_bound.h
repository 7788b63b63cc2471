// ByteBound: the payload bytes a queue holds against its limit. A queue over
// its limit takes nothing more, except when empty: one message larger than
// the limit goes alone. The outbox and the inboxes of a ProcessNode use it,
// each under its own mutex.
#pragma once

#include <algorithm>
#include <cstdint>

namespace mltuner {

struct ByteBound {
  int64_t held = 0;
  int64_t peak = 0;   // the most held at once
  int64_t limit = 0;  // 0: no bound

  bool HasRoom(int64_t bytes) const { return limit == 0 || held == 0 || held + bytes <= limit; }
  void Add(int64_t bytes) {
    held += bytes;
    peak = std::max(peak, held);
  }
  void Remove(int64_t bytes) { held -= bytes; }
  void SetLimit(int64_t bytes) { limit = std::max<int64_t>(bytes, 0); }
};

}  // namespace mltuner
