// BufferPool: recycles the float vectors that carry message payloads.
//
// Every clock moves the same sizes of payload (a table's updates to a shard,
// a shard's rows to each worker). Allocating them fresh costs a page fault
// per 4 KiB once they exceed malloc's mmap threshold, about as much as the
// copy itself; recycling them makes the steady state allocation-free.
// Buffers are matched by exact size, and at most `max_cached_bytes` are kept.
// Thread safety: all methods are safe to call concurrently.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

namespace mltuner {

class BufferPool {
 public:
  explicit BufferPool(size_t max_cached_bytes);
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A vector of `count` floats with unspecified contents.
  std::vector<float> Acquire(size_t count);
  // Takes a vector back for reuse; empty vectors are ignored.
  void Release(std::vector<float>&& buffer);

  size_t cached_bytes() const;

 private:
  const size_t max_cached_bytes_;
  mutable std::mutex mu_;
  std::multimap<size_t, std::vector<float>> free_;  // by size, guarded by mu_
  size_t cached_bytes_ = 0;                         // guarded by mu_
};

}  // namespace mltuner
