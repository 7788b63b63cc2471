#include "memory/buffer_pool.h"

namespace mltuner {

BufferPool::BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}

std::vector<float> BufferPool::Acquire(size_t count) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = free_.find(count);
    if (found != free_.end()) {
      std::vector<float> buffer = std::move(found->second);
      free_.erase(found);
      cached_bytes_ -= count * sizeof(float);
      return buffer;
    }
  }
  return std::vector<float>(count);
}

void BufferPool::Release(std::vector<float>&& buffer) {
  if (buffer.empty()) return;
  const size_t bytes = buffer.size() * sizeof(float);
  std::lock_guard<std::mutex> lock(mu_);
  if (cached_bytes_ + bytes > max_cached_bytes_) return;  // let it go
  cached_bytes_ += bytes;
  free_.emplace(buffer.size(), std::move(buffer));
}

size_t BufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

}  // namespace mltuner
