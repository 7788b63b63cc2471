#include "device/cpu/pass_split.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include <pthread.h>

#include "common/thread_name.h"

namespace mltuner {

struct PassSplit::Job {
  const Range* fn = nullptr;
  int64_t n = 0;
  int64_t chunk = 0;
  int chunks = 0;
  std::atomic<int> next{0};  // the next chunk to take
  std::atomic<int> left{0};  // chunks not yet done
};

namespace {

// A child forked from a process with helpers has none of them, and a helper
// may have held the lock at the fork: its passes run on its own thread.
std::atomic<bool> forked_child{false};

int DefaultThreads() {
  // As MLTUNER_SPIN_WAIT_US: a value out of range leaves the default.
  if (const char* text = std::getenv("MLTUNER_CPU_PASS_THREADS")) {
    char* end = nullptr;
    const long threads = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && threads >= 1 && threads <= 64) return static_cast<int>(threads);
  }
  const unsigned cores = std::thread::hardware_concurrency();
  // Engine threads, the training thread and the transport share the
  // cores: a quarter of them split passes, and four already reach most of
  // a socket's memory bandwidth.
  return cores < 8 ? 1 : static_cast<int>(std::min(4u, cores / 4));
}

}  // namespace

PassSplit& PassSplit::Shared() {
  // Never destroyed: helpers may be waiting when the process exits.
  static PassSplit* const shared = [] {
    pthread_atfork(nullptr, nullptr, [] { forked_child.store(true); });
    return new PassSplit(DefaultThreads());
  }();
  return *shared;
}

PassSplit::PassSplit(int threads) : threads_(std::max(threads, 1)) {
  for (int i = 1; i < threads_; ++i) helpers_.emplace_back([this] { HelperLoop(); });
}

PassSplit::~PassSplit() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  work_.NotifyAll();
  for (std::thread& helper : helpers_) helper.join();
}

void PassSplit::For(int64_t n, int64_t min_chunk, int64_t align, const Range& fn) {
  const int64_t most = std::max<int64_t>(n / std::max<int64_t>(min_chunk, 1), 1);
  const int chunks = static_cast<int>(std::min<int64_t>(threads_, most));
  if (chunks <= 1 || forked_child.load(std::memory_order_relaxed)) {
    if (n > 0) fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  align = std::max<int64_t>(align, 1);
  job->chunk = ((n + chunks - 1) / chunks + align - 1) / align * align;
  job->chunks = static_cast<int>((n + job->chunk - 1) / job->chunk);
  job->left.store(job->chunks);
  {
    MutexLock lock(&mu_);
    jobs_.push_back(job);
  }
  work_.NotifyAll();
  RunChunks(job.get());
  // The helpers' chunks take about as long as the caller's did.
  while (job->left.load(std::memory_order_acquire) > 0) std::this_thread::yield();
  MutexLock lock(&mu_);
  jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), job), jobs_.end());
}

void PassSplit::RunChunks(Job* job) {
  for (int k = job->next.fetch_add(1); k < job->chunks; k = job->next.fetch_add(1)) {
    const int64_t begin = k * job->chunk;
    (*job->fn)(begin, std::min(job->n, begin + job->chunk));
    job->left.fetch_sub(1, std::memory_order_release);
  }
}

void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;  // memcpy with a null pointer is undefined even for 0 bytes
  char* to = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
  PassSplit::Shared().For(static_cast<int64_t>(bytes), kSplitChunkBytes, 64, [to, from](int64_t begin, int64_t end) {
    std::memcpy(to + begin, from + begin, static_cast<size_t>(end - begin));
  });
}

void PassSplit::HelperLoop() {
  NameThisThread("mlt-cpu-pass");
  while (true) {
    std::shared_ptr<Job> job;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && !job) {
        for (const std::shared_ptr<Job>& waiting : jobs_) {
          if (waiting->next.load() < waiting->chunks) {
            job = waiting;
            break;
          }
        }
        if (!job && !stopping_) work_.Wait();
      }
      if (stopping_) return;
    }
    RunChunks(job.get());
  }
}

}  // namespace mltuner
