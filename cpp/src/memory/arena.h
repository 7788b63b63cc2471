// Arena: a next-fit sub-allocator over one region of `capacity` bytes — the
// access-buffer pool of geeps.md §3.
//
// The search for space starts just after the last allocation and wraps, so
// the engine's repeating access order uses the region like a ring and
// fragments little. When no free block is large enough, Allocate blocks until
// Free makes room, the timeout passes, or Close is called.
//
// The arena hands out offsets, not pointers: the caller adds the base of the
// device allocation it manages, so one class serves CPU and CUDA backends.
// Thread safety: all methods are safe to call concurrently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>

#include "mltuner/status.h"

namespace mltuner {

class Arena {
 public:
  // REQUIRES: alignment is a power of two.
  explicit Arena(size_t capacity, size_t alignment = 256);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves `bytes` (rounded up to the alignment; 0 is refused with
  // InvalidArgument). ResourceExhausted if it could never fit, Timeout after
  // `timeout` without room, Shutdown once Close() was called.
  Status Allocate(size_t bytes, std::chrono::milliseconds timeout, size_t* offset);
  // Non-blocking variant: false when there is no room now.
  bool TryAllocate(size_t bytes, size_t* offset);
  // REQUIRES: offset came from Allocate and was not freed since.
  void Free(size_t offset);
  // Wakes every waiter with Shutdown; later Allocate calls fail at once.
  void Close();

  size_t capacity() const { return capacity_; }
  size_t used() const;
  size_t num_allocations() const;

 private:
  bool FindLocked(size_t bytes, size_t* offset);

  const size_t capacity_;
  const size_t alignment_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::map<size_t, size_t> blocks_;  // offset -> size, guarded by mu_
  size_t next_ = 0;                  // where the next search starts, guarded by mu_
  size_t used_ = 0;                  // guarded by mu_
  bool closed_ = false;              // guarded by mu_
};

}  // namespace mltuner
