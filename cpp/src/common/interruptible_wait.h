// InterruptibleWait: a bounded wait on a condition variable that the calling
// thread's interrupt check (mltuner/interrupt.h) may end early. It replaces
// cv.WaitUntil(deadline) in a wait loop:
//
//   InterruptibleWait wait(Deadline());
//   bool done = <predicate>;
//   while (!done) {
//     const bool more = wait.Step(&cv, &mu);
//     done = <predicate>;
//     if (!more) break;
//   }
//   if (!done && wait.interrupted()) return Status::Cancelled(...);
//
// Without a check, Step is cv.WaitUntil(deadline). With one, Step sleeps at
// most until the next poll and, once kInterruptPollInterval has passed since
// the wait began or last asked, asks the check with `mu` released (the check
// may take other locks, such as Python's GIL, that a thread holding `mu` must
// never wait for). The first ask comes only after a poll interval, so the
// short waits of a running pipeline never ask.
#pragma once

#include <algorithm>
#include <chrono>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "mltuner/interrupt.h"

namespace mltuner {

class InterruptibleWait {
 public:
  explicit InterruptibleWait(std::chrono::steady_clock::time_point deadline)
      : deadline_(deadline), check_(ScopedInterruptCheck::Current()) {
    if (check_ != nullptr) next_poll_ = std::chrono::steady_clock::now() + kInterruptPollInterval;
  }
  InterruptibleWait(const InterruptibleWait&) = delete;
  InterruptibleWait& operator=(const InterruptibleWait&) = delete;

  // REQUIRES: `mu` held, `cv` tied to it (a CondVar or SpinningCondVar).
  // Waits for a notification, the deadline or the next poll, and holds `mu`
  // again on return (callers re-check their predicate, as with WaitUntil).
  // False once the deadline has passed or the check asked to give up.
  template <typename Cv>
  bool Step(Cv* cv, Mutex* mu) REQUIRES(mu) {
    if (check_ == nullptr) return cv->WaitUntil(deadline_);
    auto now = std::chrono::steady_clock::now();
    if (now >= next_poll_) {
      mu->Unlock();
      interrupted_ = (*check_)();
      mu->Lock();
      now = std::chrono::steady_clock::now();
      next_poll_ = now + kInterruptPollInterval;
      if (interrupted_) return false;
    } else {
      cv->WaitUntil(std::min(deadline_, next_poll_));
      now = std::chrono::steady_clock::now();
    }
    return now < deadline_;
  }

  // Whether the check asked to give up.
  bool interrupted() const { return interrupted_; }

 private:
  const std::chrono::steady_clock::time_point deadline_;
  const InterruptCheck* const check_;
  std::chrono::steady_clock::time_point next_poll_;
  bool interrupted_ = false;
};

}  // namespace mltuner
