// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// the thread-safety attributes libstdc++ lacks, so clang can check which
// lock guards what (common/thread_annotations.h). They cost nothing over
// the std types they wrap.
//
// A CondVar is tied to one Mutex and waits with it held, as LevelDB's
// port::CondVar: write the predicate as a loop around Wait, so the analysis
// sees the guarded fields read under the lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace mltuner {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis the caller holds the lock (checked nowhere).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  friend class SpinningCondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class CondVar {
 public:
  explicit CondVar(Mutex* mu) : mu_(mu) {}
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // REQUIRES: the mutex held (not annotated: the analysis cannot tie a
  // CondVar to its Mutex; the caller's MutexLock is what it checks).
  // Releases the mutex while waiting, holds it again on return (also on a
  // spurious wakeup: callers loop on their predicate).
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // As Wait; false once `deadline` has passed.
  bool WaitUntil(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  template <typename Rep, typename Period>
  void WaitFor(std::chrono::duration<Rep, Period> timeout) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    cv_.wait_for(lock, timeout);
    lock.release();
  }
  void NotifyAll() { cv_.notify_all(); }

 private:
  Mutex* const mu_;
  std::condition_variable cv_;
};

}  // namespace mltuner
