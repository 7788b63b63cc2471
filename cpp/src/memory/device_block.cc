#include "memory/device_block.h"

#include <algorithm>
#include <iterator>
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

Status WaitReady(const DeviceBuffer* buffer) {
  if (buffer == nullptr || !buffer->ready) return Status::Ok();
  if (buffer->block == nullptr) {
    return Status::Internal("a payload with a ticket to wait for names no device (DeviceBuffer::block is null)");
  }
  return buffer->block->device()->WaitEventDone(buffer->ready);
}

std::shared_ptr<DeviceBuffer> ShareView(const std::shared_ptr<DeviceBuffer>& buffer) {
  if (!buffer->shared_uses) buffer->shared_uses = std::make_shared<SharedUses>();
  auto view = std::make_unique<DeviceBuffer>();
  view->data = buffer->data;
  view->count = buffer->count;
  view->ready = buffer->ready;
  view->block = buffer->block;
  view->borrowed = true;  // the memory is `buffer`'s
  return std::shared_ptr<DeviceBuffer>(view.release(), [buffer](DeviceBuffer* returned) {
    std::unique_ptr<DeviceBuffer> owned(returned);
    if (!owned->last_use) return;
    SharedUses& uses = *buffer->shared_uses;
    std::lock_guard<std::mutex> lock(uses.mu);
    uses.tickets.push_back(std::move(owned->last_use));
  });
}

// Every ticket the previous users of a recycled buffer left: its last use,
// and each view's where it was shared. No view is alive: each held the buffer.
static std::vector<DeviceEvent> LastUses(DeviceBuffer& buffer) {
  std::vector<DeviceEvent> uses;
  if (buffer.last_use) uses.push_back(buffer.last_use);
  if (buffer.shared_uses) {
    for (DeviceEvent& ticket : buffer.shared_uses->tickets) uses.push_back(std::move(ticket));
  }
  return uses;
}

struct DeviceBufferPool::Idle {
  std::mutex mu;
  bool open = true;
  size_t bytes = 0;
  size_t max_bytes = 0;
  int64_t allocations = 0;
  size_t in_use = 0;       // bytes handed out
  size_t peak_in_use = 0;
  bool bound_to_peak = false;
  // By exact float count: a model's tables repeat the same sizes every clock.
  std::multimap<size_t, std::unique_ptr<DeviceBuffer>> buffers;
};

DeviceBufferPool::DeviceBufferPool(std::shared_ptr<Device> device, size_t max_idle_bytes, bool host)
    : device_(std::move(device)), host_(host), idle_(std::make_shared<Idle>()) {
  idle_->max_bytes = max_idle_bytes;
}

DeviceBufferPool::~DeviceBufferPool() {
  std::lock_guard<std::mutex> lock(idle_->mu);
  idle_->open = false;
  idle_->buffers.clear();
}

void DeviceBufferPool::set_max_idle_bytes(size_t bytes) {
  std::multimap<size_t, std::unique_ptr<DeviceBuffer>> freed;  // freed outside the lock
  std::lock_guard<std::mutex> lock(idle_->mu);
  idle_->max_bytes = bytes;
  while (idle_->bytes > idle_->max_bytes && !idle_->buffers.empty()) {
    auto largest = std::prev(idle_->buffers.end());
    idle_->bytes -= largest->second->block->bytes();
    freed.insert(std::move(*largest));
    idle_->buffers.erase(largest);
  }
}

void DeviceBufferPool::set_idle_bound_to_peak(bool on) {
  std::lock_guard<std::mutex> lock(idle_->mu);
  idle_->bound_to_peak = on;
}

int64_t DeviceBufferPool::allocations() const {
  std::lock_guard<std::mutex> lock(idle_->mu);
  return idle_->allocations;
}

size_t DeviceBufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(idle_->mu);
  return idle_->bytes;
}

Status DeviceBufferPool::Take(size_t count, std::unique_ptr<DeviceBuffer>* buffer, bool* recycled) {
  {
    std::lock_guard<std::mutex> lock(idle_->mu);
    auto found = idle_->buffers.find(count);
    if (found != idle_->buffers.end()) {
      *buffer = std::move(found->second);
      idle_->buffers.erase(found);
      idle_->bytes -= (*buffer)->block->bytes();
      *recycled = true;
      return Status::Ok();
    }
    ++idle_->allocations;
  }
  *recycled = false;
  *buffer = std::make_unique<DeviceBuffer>();
  MLT_RETURN_IF_ERROR(
      DeviceBlock::Make(device_, (count > 0 ? count : 1) * sizeof(float), host_, &(*buffer)->block));
  (*buffer)->data = (*buffer)->block->floats();
  return Status::Ok();
}

Status DeviceBufferPool::Acquire(size_t count, Stream s, std::shared_ptr<DeviceBuffer>* out) {
  std::unique_ptr<DeviceBuffer> buffer;
  bool recycled = false;
  MLT_RETURN_IF_ERROR(Take(count, &buffer, &recycled));
  if (recycled) {
    for (const DeviceEvent& use : LastUses(*buffer)) MLT_RETURN_IF_ERROR(device_->WaitEvent(s, use));
  }
  *out = Hand(std::move(buffer), count);
  return Status::Ok();
}

Status DeviceBufferPool::AcquireForHost(size_t count, std::shared_ptr<DeviceBuffer>* out) {
  std::unique_ptr<DeviceBuffer> buffer;
  bool recycled = false;
  MLT_RETURN_IF_ERROR(Take(count, &buffer, &recycled));
  if (recycled) {
    for (const DeviceEvent& use : LastUses(*buffer)) MLT_RETURN_IF_ERROR(device_->WaitEventDone(use));
  }
  *out = Hand(std::move(buffer), count);
  return Status::Ok();
}

std::shared_ptr<DeviceBuffer> DeviceBufferPool::Hand(std::unique_ptr<DeviceBuffer> buffer, size_t count) {
  buffer->count = count;
  buffer->ready.reset();
  buffer->last_use.reset();
  buffer->shared_uses.reset();
  {
    std::lock_guard<std::mutex> lock(idle_->mu);
    idle_->in_use += buffer->block->bytes();
    idle_->peak_in_use = std::max(idle_->peak_in_use, idle_->in_use);
    // Twice the peak: frames of one size left idle by a clock that needed
    // others must not push out the ones the next clock needs.
    if (idle_->bound_to_peak) idle_->max_bytes = std::max(idle_->max_bytes, 2 * idle_->peak_in_use);
  }
  std::shared_ptr<Idle> idle = idle_;
  return std::shared_ptr<DeviceBuffer>(buffer.release(), [idle](DeviceBuffer* returned) {
    std::unique_ptr<DeviceBuffer> owned(returned);
    // A consumer that queued no reads still leaves the producer's writes to
    // wait for.
    if (!owned->last_use) owned->last_use = std::move(owned->ready);
    std::lock_guard<std::mutex> lock(idle->mu);
    const size_t bytes = owned->block->bytes();
    idle->in_use -= bytes;
    if (!idle->open || idle->bytes + bytes > idle->max_bytes) return;  // freed here
    idle->bytes += bytes;
    idle->buffers.emplace(owned->count, std::move(owned));
  });
}

}  // namespace mltuner
