#include "memory/payload_bound.h"

#include <chrono>
#include <string>
#include <utility>

namespace mltuner {

PayloadBound::PayloadBound(int64_t limit_bytes) : shared_(std::make_shared<Shared>()) {
  shared_->bytes.SetLimit(limit_bytes);
}

Status PayloadBound::Take(size_t count, int64_t timeout_ms, const std::function<bool()>& stopping,
                          const std::function<Status(std::shared_ptr<DeviceBuffer>*)>& acquire,
                          std::shared_ptr<DeviceBuffer>* out) {
  const int64_t bytes = static_cast<int64_t>(count * sizeof(float));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::shared_ptr<Shared> shared = shared_;
  {
    MutexLock lock(&shared->mu);
    while (!shared->bytes.HasRoom(bytes)) {
      if (stopping()) return Status::Shutdown("the engine is shut down");
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::Timeout("update payloads to this device's shard: " + std::to_string(shared->bytes.held) +
                               " B of them not yet applied after " + std::to_string(timeout_ms) +
                               " ms (Config.wait_timeout_ms), the bound is " + std::to_string(shared->bytes.limit) +
                               " B");
      }
      // Short slices: `stopping` has no condition variable of ours to wake.
      shared->room.WaitFor(std::chrono::milliseconds(20));
    }
    shared->bytes.Add(bytes);
  }
  std::shared_ptr<DeviceBuffer> buffer;
  const Status acquired = acquire(&buffer);
  if (!acquired.ok()) {
    {
      MutexLock lock(&shared->mu);
      shared->bytes.Remove(bytes);
    }
    shared->room.NotifyAll();
    return acquired;
  }
  DeviceBuffer* raw = buffer.get();
  *out = std::shared_ptr<DeviceBuffer>(raw, [shared, buffer = std::move(buffer), bytes](DeviceBuffer*) mutable {
    buffer.reset();  // back to its pool, with the last_use its users set
    {
      MutexLock lock(&shared->mu);
      shared->bytes.Remove(bytes);
    }
    shared->room.NotifyAll();
  });
  return Status::Ok();
}

bool PayloadBound::HasRoom(size_t count) const {
  MutexLock lock(&shared_->mu);
  return shared_->bytes.HasRoom(static_cast<int64_t>(count * sizeof(float)));
}

int64_t PayloadBound::held_bytes() const {
  MutexLock lock(&shared_->mu);
  return shared_->bytes.held;
}

int64_t PayloadBound::peak_bytes() const {
  MutexLock lock(&shared_->mu);
  return shared_->bytes.peak;
}

int64_t PayloadBound::limit_bytes() const {
  MutexLock lock(&shared_->mu);
  return shared_->bytes.limit;
}

}  // namespace mltuner
