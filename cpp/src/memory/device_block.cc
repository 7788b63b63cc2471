#include "memory/device_block.h"

#include <utility>

namespace mltuner {

Status DeviceBlock::Make(std::shared_ptr<Device> device, size_t bytes, bool host,
                         std::shared_ptr<DeviceBlock>* out) {
  void* data = nullptr;
  MLT_RETURN_IF_ERROR(host ? device->AllocateHost(bytes, &data) : device->Allocate(bytes, &data));
  out->reset(new DeviceBlock(std::move(device), data, bytes, host));
  return Status::Ok();
}

Status DeviceBlock::MakeZeroed(std::shared_ptr<Device> device, size_t bytes, bool host,
                               std::shared_ptr<DeviceBlock>* out) {
  void* data = nullptr;
  MLT_RETURN_IF_ERROR(device->AllocateZeroed(bytes, host, &data));
  out->reset(new DeviceBlock(std::move(device), data, bytes, host));
  return Status::Ok();
}

DeviceBlock::~DeviceBlock() {
  if (host_) {
    device_->FreeHost(data_);
  } else {
    device_->Free(data_);
  }
}

struct DeviceBufferPool::Idle {
  std::mutex mu;
  bool open = true;
  size_t bytes = 0;
  size_t max_bytes = 0;
  // By exact float count: a model's tables repeat the same sizes every clock.
  std::multimap<size_t, std::unique_ptr<DeviceBuffer>> buffers;
};

DeviceBufferPool::DeviceBufferPool(std::shared_ptr<Device> device, size_t max_idle_bytes)
    : device_(std::move(device)), idle_(std::make_shared<Idle>()) {
  idle_->max_bytes = max_idle_bytes;
}

DeviceBufferPool::~DeviceBufferPool() {
  std::lock_guard<std::mutex> lock(idle_->mu);
  idle_->open = false;
  idle_->buffers.clear();
}

Status DeviceBufferPool::Acquire(size_t count, Stream s, std::shared_ptr<DeviceBuffer>* out) {
  std::unique_ptr<DeviceBuffer> buffer;
  {
    std::lock_guard<std::mutex> lock(idle_->mu);
    auto found = idle_->buffers.find(count);
    if (found != idle_->buffers.end()) {
      buffer = std::move(found->second);
      idle_->buffers.erase(found);
      idle_->bytes -= buffer->block->bytes();
    }
  }
  if (buffer) {
    MLT_RETURN_IF_ERROR(device_->WaitEvent(s, buffer->last_use));
  } else {
    buffer = std::make_unique<DeviceBuffer>();
    MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, (count > 0 ? count : 1) * sizeof(float), false, &buffer->block));
    buffer->data = buffer->block->floats();
  }
  buffer->count = count;
  buffer->ready.reset();
  buffer->last_use.reset();
  std::shared_ptr<Idle> idle = idle_;
  *out = std::shared_ptr<DeviceBuffer>(buffer.release(), [idle](DeviceBuffer* returned) {
    std::unique_ptr<DeviceBuffer> owned(returned);
    // A consumer that queued no reads still leaves the producer's writes to
    // wait for.
    if (!owned->last_use) owned->last_use = std::move(owned->ready);
    std::lock_guard<std::mutex> lock(idle->mu);
    const size_t bytes = owned->block->bytes();
    if (!idle->open || idle->bytes + bytes > idle->max_bytes) return;  // freed here
    idle->bytes += bytes;
    idle->buffers.emplace(owned->count, std::move(owned));
  });
  return Status::Ok();
}

}  // namespace mltuner
