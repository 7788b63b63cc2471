#include "common/spinning_cond_var.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace mltuner {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

}  // namespace

std::chrono::nanoseconds SpinningCondVar::DefaultSpin() {
  if (const char* text = std::getenv("MLTUNER_SPIN_WAIT_US")) {
    char* end = nullptr;
    const long us = std::strtol(text, &end, 10);
    if (end != text && us >= 0 && us <= 10'000) return std::chrono::microseconds(us);
  }
  return std::thread::hardware_concurrency() >= 8 ? std::chrono::microseconds(50) : std::chrono::nanoseconds(0);
}

bool SpinningCondVar::Block(const std::chrono::steady_clock::time_point* deadline) {
  using Clock = std::chrono::steady_clock;
  // Read with the mutex held: a notifier changes the state under it and
  // counts after, so a change this waiter has not seen is counted after
  // this read.
  const uint64_t seen = notifications_.load();
  if (spin_.count() > 0) {
    const Clock::time_point spin_from = Clock::now();
    const Clock::time_point spin_end = deadline ? std::min(*deadline, spin_from + spin_) : spin_from + spin_;
    mu_->Unlock();
    bool notified = false;
    while (!notified && Clock::now() < spin_end) {
      for (int i = 0; i < 64 && !notified; ++i) {
        CpuRelax();
        notified = notifications_.load(std::memory_order_relaxed) != seen;
      }
    }
    mu_->Lock();
    if (notified || notifications_.load() != seen) return true;
    if (deadline && Clock::now() >= *deadline) return false;
  }
  // Announce the sleep, then look once more: a notifier counts first and
  // reads sleepers_ after, so either it sees this waiter (and takes the
  // mutex, which this thread holds until it sleeps) or this read sees it.
  sleepers_.fetch_add(1);
  bool woken = true;
  if (notifications_.load() == seen) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    if (deadline) {
      woken = cv_.wait_until(lock, *deadline) == std::cv_status::no_timeout;
    } else {
      cv_.wait(lock);
    }
    lock.release();
  }
  sleepers_.fetch_sub(1);
  return woken;
}

void SpinningCondVar::NotifyAll() {
  notifications_.fetch_add(1);
  if (sleepers_.load() == 0) return;
  { MutexLock lock(mu_); }
  cv_.notify_all();
}

void SpinningCondVar::NotifyAllHeld() {
  notifications_.fetch_add(1);
  cv_.notify_all();
}

}  // namespace mltuner
