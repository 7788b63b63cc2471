// WaitLedger: the cross-stream waits a device's streams already made, so
// that a wait an earlier one covers can be skipped (one driver call fewer,
// on paths that make a few hundred a clock).
//
// Work on one stream completes in queue order. Once stream W waited for
// record n of stream R, W has waited for every earlier record of R as well.
// The ledger numbers each stream's records in the order they are queued and
// keeps, for each pair (W, R), the latest record number W waited for.
// Streams are "slots", small integers the device assigns; a record or wait
// outside the slots (another process's event, a stream the application may
// destroy and whose handle may come back) is simply not tracked. Each
// ledger has an id unique in the process: a record's number means something
// only to the ledger that gave it (two devices of one process both have a
// slot for their server stream, and both see the legacy default stream).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace mltuner {

class WaitLedger {
 public:
  explicit WaitLedger(int slots);
  WaitLedger(const WaitLedger&) = delete;
  WaitLedger& operator=(const WaitLedger&) = delete;

  int slots() const { return slots_; }
  uint64_t id() const { return id_; }

  // Queues a record on `slot` through `record` (a callable returning true
  // once it is queued) and returns its number, counted from 1; 0 if
  // `record` failed. Records of one slot are queued one at a time, so their
  // numbers follow the stream's order. A slot outside the ledger: `record`
  // runs unnumbered and 0 is returned.
  template <typename Record>
  uint64_t Numbered(int slot, Record&& record) {
    if (!Tracked(slot)) {
      std::forward<Record>(record)();
      return 0;
    }
    Slot& s = recorders_[slot];
    MutexLock lock(&s.mu);
    if (!std::forward<Record>(record)()) return 0;
    return ++s.recorded;
  }

  // Whether `waiter` already waited for record `number` of `recorder` (or a
  // later one). Call before queuing the work that needs the wait: a Covers
  // that sees a Note comes after that wait was queued, so the work queued
  // next on `waiter` is ordered behind it.
  bool Covers(int waiter, int recorder, uint64_t number) const;

  // Records that `waiter` waited for record `number` of `recorder`. Call
  // after the wait is queued.
  void Note(int waiter, int recorder, uint64_t number);

 private:
  struct Slot {
    Mutex mu;
    uint64_t recorded GUARDED_BY(mu) = 0;
  };

  bool Tracked(int slot) const { return slot >= 0 && slot < slots_; }
  std::atomic<uint64_t>& Waited(int waiter, int recorder) const { return waited_[waiter * slots_ + recorder]; }

  const uint64_t id_;
  const int slots_;
  const std::unique_ptr<Slot[]> recorders_;
  // waited_[w * slots_ + r]: the latest record of r that w waited for.
  const std::unique_ptr<std::atomic<uint64_t>[]> waited_;
};

}  // namespace mltuner
