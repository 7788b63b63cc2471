// SpinningCondVar: a CondVar whose waiters spin for a short while before they
// sleep.
//
// The engine's training thread, allocator and reclaimer hand each op of a
// clock on to one another. When the device memory budget leaves the pool no
// room to prepare ahead, every buffer waits for the one before it to be
// reclaimed, so a clock of ResNet-18 makes about three hand-offs per op and
// 160 ops. A sleeping thread takes a futex wake-up to run again, tens of
// microseconds on a virtual machine; a thread that spins on a counter of
// notifications sees the next one in well under a microsecond. Past the spin
// time it sleeps as a plain CondVar does.
//
// Spinning costs a core per spinning thread, so it pays only where the
// machine has cores to spare: `spin` is zero unless the caller chose a
// duration (DefaultSpin picks one from the number of cores).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace mltuner {

class SpinningCondVar {
 public:
  SpinningCondVar(Mutex* mu, std::chrono::nanoseconds spin) : mu_(mu), spin_(spin) {}
  SpinningCondVar(const SpinningCondVar&) = delete;
  SpinningCondVar& operator=(const SpinningCondVar&) = delete;

  // REQUIRES: the mutex held. Releases it while waiting (spinning included)
  // and holds it again on return, also without a notification: callers loop
  // on their predicate, as with CondVar.
  void Wait() { Block(nullptr); }
  // As Wait; false once `deadline` has passed.
  bool WaitUntil(std::chrono::steady_clock::time_point deadline) { return Block(&deadline); }

  // REQUIRES: the mutex not held (it is taken briefly when a waiter sleeps).
  void NotifyAll();
  // REQUIRES: the mutex held by the caller.
  void NotifyAllHeld();

  // The spin for this machine: none with fewer than 8 hardware threads (a
  // spinning waiter there takes the core the thread it waits for needs),
  // else 50 us; MLTUNER_SPIN_WAIT_US overrides (0 turns it off).
  static std::chrono::nanoseconds DefaultSpin();

 private:
  // Wait and WaitUntil (no deadline when null). Unlocks and locks the
  // caller's mutex, which the analysis cannot tie to this object.
  bool Block(const std::chrono::steady_clock::time_point* deadline) NO_THREAD_SAFETY_ANALYSIS;

  Mutex* const mu_;
  const std::chrono::nanoseconds spin_;
  std::condition_variable cv_;
  // Bumped by every notification: what spinning waiters watch.
  std::atomic<uint64_t> notifications_{0};
  // Waiters about to sleep or asleep: a notifier takes the mutex before it
  // wakes them, so that none is between its check and its sleep.
  std::atomic<int> sleepers_{0};
};

}  // namespace mltuner
