// Large memory passes of the CPU backend (copies, fills, sums and update
// rules over megabytes) split over a few helper threads on hosts with many
// cores. One core's copy reaches a fraction of a server's memory bandwidth,
// and a clock's passes lie on its critical path (a 10-MiB table took 6 ms
// a clock on a 16-core host against raw pyzmq's 4). On small hosts, and for
// small passes, the calling thread does the work alone, as before.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace mltuner {

class PassSplit {
 public:
  using Range = std::function<void(int64_t begin, int64_t end)>;

  // The process's splitter: MLTUNER_CPU_PASS_THREADS threads when set to
  // 1-64 (1: never split), else a quarter of the cores, at most 4 (1 below
  // 8 cores).
  static PassSplit& Shared();

  // `threads` counts the caller: threads - 1 helpers wait for work.
  explicit PassSplit(int threads);
  ~PassSplit();
  PassSplit(const PassSplit&) = delete;
  PassSplit& operator=(const PassSplit&) = delete;

  int threads() const { return threads_; }

  // Calls fn(begin, end) over [0, n) in chunks of at least `min_chunk`
  // (each a multiple of `align`), at most threads() of them: the helpers
  // and the caller take chunks until none is left, and this returns once
  // every chunk is done. One chunk (a small pass, one thread, or a process
  // forked after the helpers started) is a plain call on this thread.
  // Several callers may split at once; a caller never waits for another's
  // chunks.
  void For(int64_t n, int64_t min_chunk, int64_t align, const Range& fn);

 private:
  struct Job;
  static void RunChunks(Job* job);
  void HelperLoop();

  const int threads_;
  Mutex mu_;
  CondVar work_{&mu_};
  std::deque<std::shared_ptr<Job>> jobs_ GUARDED_BY(mu_);  // with chunks not yet taken
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> helpers_;
};

// A pass smaller than two of these stays on its thread: waking a helper
// costs tens of microseconds, a megabyte's copy about a hundred.
constexpr int64_t kSplitChunkBytes = int64_t{1} << 20;

// memcpy, split by PassSplit::Shared() when large (null pointers allowed
// with 0 bytes).
void CopyBytes(void* dst, const void* src, size_t bytes);

}  // namespace mltuner
