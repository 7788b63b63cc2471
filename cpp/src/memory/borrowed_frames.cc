#include "memory/borrowed_frames.h"

#include <mutex>
#include <utility>

namespace mltuner {

struct BorrowedFrames::Queue {
  std::mutex mu;
  std::vector<std::pair<int64_t, DeviceEvent>> released;  // token, the last reader's ticket
  int64_t outstanding = 0;
  int64_t borrowed_total = 0;
};

BorrowedFrames::BorrowedFrames(std::shared_ptr<Device> device)
    : device_(std::move(device)), queue_(std::make_shared<Queue>()) {}

BorrowedFrames::~BorrowedFrames() = default;

bool BorrowedFrames::device_reads_host_memory() const {
  // A host-addressable device's kernels take any host memory; a GPU would
  // copy from pageable memory, which synchronizes its stream, so there a
  // payload is still copied once into a pinned frame.
  return device_->host_addressable();
}

bool BorrowedFrames::CanBorrow(const void* data) const {
  return device_reads_host_memory() && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0;
}

std::shared_ptr<DeviceBuffer> BorrowedFrames::Borrow(const float* data, size_t count, int64_t token) {
  auto* buffer = new DeviceBuffer();
  buffer->data = const_cast<float*>(data);  // never written: `borrowed`
  buffer->count = count;
  buffer->borrowed = true;
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    ++queue_->outstanding;
    ++queue_->borrowed_total;
  }
  std::weak_ptr<Queue> queue = queue_;
  return std::shared_ptr<DeviceBuffer>(buffer, [queue, token](DeviceBuffer* done) {
    std::unique_ptr<DeviceBuffer> owned(done);
    // A consumer that queued no reads leaves nothing to wait for (the
    // transport's bytes were complete when they came in).
    if (auto alive = queue.lock()) {
      std::lock_guard<std::mutex> lock(alive->mu);
      alive->released.emplace_back(token, std::move(owned->last_use));
    }
  });
}

void BorrowedFrames::Release(int64_t token) {
  std::lock_guard<std::mutex> lock(queue_->mu);
  ++queue_->outstanding;  // balanced by TakeReleased
  queue_->released.emplace_back(token, DeviceEvent());
}

Status BorrowedFrames::TakeReleased(std::vector<int64_t>* out) {
  std::vector<std::pair<int64_t, DeviceEvent>> released;
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    released.swap(queue_->released);
    queue_->outstanding -= static_cast<int64_t>(released.size());
  }
  out->clear();
  Status status = Status::Ok();
  for (auto& [token, last_use] : released) {
    // A failed wait means the device failed: the memory is not read any
    // more either way, and the error reaches the engine's threads too.
    if (last_use) {
      const Status waited = device_->WaitEventDone(last_use);
      if (status.ok() && !waited.ok()) status = waited;
    }
    out->push_back(token);
  }
  return status;
}

int64_t BorrowedFrames::borrowed_total() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->borrowed_total;
}

int64_t BorrowedFrames::outstanding() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->outstanding;
}

}  // namespace mltuner
