// The CPU backend seen as an accelerator, so that the paths the engine, the
// shard and the transport take on a GPU run in CPU-only CI: its memory is
// not host-addressable (staging copies, host frames for other processes,
// device payloads within one, swaps by copies rather than a gather kernel,
// as the CUDA backend does), every event is a real ticket that readers
// on the host wait for through the buffer's device, and its free memory is
// what the test says (a shard's state in host memory, automatic budgets).
// The work itself stays the CPU backend's: synchronous, so every ticket is
// complete when made. A lent host view without a device once crashed only
// on a GPU; this device is how such a path is tested here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "forwarding_device.h"

namespace mltuner {

class GpuLikeDevice final : public ForwardingDevice {
 public:
  // Host waits on tickets, counted over every GpuLikeDevice that shares it.
  using WaitCount = std::shared_ptr<std::atomic<int64_t>>;

  // `free_bytes`: what MemoryInfo reports free (-1: no fixed capacity).
  // `ordinal`: devices of different ordinals do not share memory (the
  // GPUs of one process: rows between them go through host frames).
  explicit GpuLikeDevice(int64_t free_bytes = -1, WaitCount waits = nullptr, int ordinal = 0)
      : free_bytes_(free_bytes),
        waits_(waits ? std::move(waits) : std::make_shared<std::atomic<int64_t>>(0)),
        ordinal_(ordinal) {}

  std::string name() const override { return "gpu-like " + ForwardingDevice::name(); }
  bool host_addressable() const override { return false; }
  int ordinal() const override { return ordinal_; }
  bool maps_host_memory() const override { return true; }
  bool swaps_by_kernel() const override { return false; }  // as the CUDA backend: copies, not a gather kernel
  Status MemoryInfo(int64_t* free_bytes, int64_t* total_bytes) override {
    *free_bytes = free_bytes_;
    *total_bytes = free_bytes_ < 0 ? -1 : free_bytes_ + (int64_t{1} << 30);
    return Status::Ok();
  }
  Status RecordEvent(Stream s, DeviceEvent* out) override {
    MLT_RETURN_IF_ERROR(ForwardingDevice::RecordEvent(s, out));
    *out = std::make_shared<int>(0);
    return Status::Ok();
  }
  Status RecordAppWork(uintptr_t app_stream, DeviceEvent* out) override {
    MLT_RETURN_IF_ERROR(ForwardingDevice::RecordAppWork(app_stream, out));
    *out = std::make_shared<int>(0);
    return Status::Ok();
  }
  Status WaitEventDone(const DeviceEvent& e) override {
    ++*waits_;
    return ForwardingDevice::WaitEventDone(e);
  }

 private:
  const int64_t free_bytes_;
  WaitCount waits_;
  const int ordinal_;
};

}  // namespace mltuner
