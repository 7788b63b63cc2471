// Device memory that the engine and the server shard of a process share:
// DeviceBlock, one allocation; DeviceBuffer, a float array recycled through a
// DeviceBufferPool, which is how payloads move between a worker and its
// process's shard without leaving the device.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner {

// HostFrame: the same pool over host memory (Device::AllocateHost: pinned on
// CUDA, plain on the CPU backend) carries payloads to and from other
// processes: filled by one device -> host copy (`ready`), sent by the
// transport without a copy, read by one host -> device copy (`last_use`).
//
// One allocation from a Device (device memory, or host staging memory when
// `host`), freed when the last owner lets go. Holds the Device alive too, so
// a buffer the application still holds stays valid after the engine is gone.
class DeviceBlock {
 public:
  static Status Make(std::shared_ptr<Device> device, size_t bytes, bool host,
                     std::shared_ptr<DeviceBlock>* out);
  // The same, every byte zero (Device::AllocateZeroed: on the CPU backend,
  // pages take RAM only once written).
  static Status MakeZeroed(std::shared_ptr<Device> device, size_t bytes, bool host,
                           std::shared_ptr<DeviceBlock>* out);
  ~DeviceBlock();
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  float* floats() const { return static_cast<float*>(data_); }
  size_t bytes() const { return bytes_; }
  bool host() const { return host_; }
  Device* device() const { return device_.get(); }

 private:
  DeviceBlock(std::shared_ptr<Device> device, void* data, size_t bytes, bool host)
      : device_(std::move(device)), data_(data), bytes_(bytes), host_(host) {}
  std::shared_ptr<Device> device_;
  void* data_;
  size_t bytes_;
  bool host_;
};

// The last uses of a buffer read by several consumers at once (ShareView).
struct SharedUses {
  std::mutex mu;
  std::vector<DeviceEvent> tickets;
};

// A float array in device memory, handed from a producer to one consumer at
// a time. `ready` is the ticket of the work that filled it: a consumer's
// stream waits for it before reading. A consumer that queued reads sets
// `last_use` to a ticket taken after them before letting go, and the pool's
// next user of the memory waits for that ticket before writing. Nothing
// here blocks a thread.
struct DeviceBuffer {
  float* data = nullptr;
  size_t count = 0;     // floats in use (the block may be larger)
  DeviceEvent ready;
  DeviceEvent last_use;
  // Null when borrowed from a received frame or a peer. A shard's lent view
  // of its state (borrowed too) names the state's block: its device is the
  // one whose ticket `ready` is.
  std::shared_ptr<DeviceBlock> block;
  // Views memory owned elsewhere (a received ZeroMQ frame, see
  // memory/borrowed_frames.h): consumers read it and never write it.
  bool borrowed = false;
  // Set once the buffer is shared (ShareView): every view's last use, which
  // the pool's next user waits for as for `last_use`.
  std::shared_ptr<SharedUses> shared_uses;
};

// One more consumer of `buffer`, which several read at once (a pushed host
// frame that every worker on another GPU of a process installs): a view of
// its own, whose `last_use` the consumer sets without racing the others, and
// which hands that ticket to `buffer` as it goes. `buffer` returns to its
// pool once every view is gone. Call on the producer's thread, once `ready`
// is set, before any view leaves it.
std::shared_ptr<DeviceBuffer> ShareView(const std::shared_ptr<DeviceBuffer>& buffer);

// Blocks until a buffer's producer is done with it (`ready`), on the thread
// of a consumer that reads it on the host. A null buffer or ticket is ready.
Status WaitReady(const DeviceBuffer* buffer);

// Recycles DeviceBuffers by size. Buffers handed out return to the pool when
// their last owner lets go, whatever thread that is, also after the pool
// itself is gone (then they are freed). Idle memory is bounded by
// `max_idle_bytes`; above it, returned buffers are freed. A buffer returns
// at once with its `last_use` ticket; nothing waits for it then: the next
// user of the memory waits for the ticket (its stream, or its thread for a
// host writer). With `host`, buffers are host frames (pinned on CUDA).
class DeviceBufferPool {
 public:
  DeviceBufferPool(std::shared_ptr<Device> device, size_t max_idle_bytes, bool host = false);
  ~DeviceBufferPool();
  DeviceBufferPool(const DeviceBufferPool&) = delete;
  DeviceBufferPool& operator=(const DeviceBufferPool&) = delete;

  // A buffer of `count` floats (contents unspecified) whose memory stream `s`
  // may write: `s` waits for the previous user's last_use.
  Status Acquire(size_t count, Stream s, std::shared_ptr<DeviceBuffer>* out);
  // The same for a writer on this thread (a host frame filled by memcpy):
  // blocks until the previous user's last_use is complete.
  Status AcquireForHost(size_t count, std::shared_ptr<DeviceBuffer>* out);
  // Bounds idle memory anew (the plan knows the bytes in flight only once
  // it is made); idle buffers above the new bound are freed.
  void set_max_idle_bytes(size_t bytes);
  // Let idle memory reach twice the most bytes ever handed out at once (for a
  // pool whose clock's bytes the plan does not name: what one clock needed
  // stays for the next, so the steady state allocates nothing).
  void set_idle_bound_to_peak(bool on);
  // Allocations made so far (a steady state makes none) and idle bytes.
  int64_t allocations() const;
  size_t idle_bytes() const;
  bool host() const { return host_; }
  Device* device() const { return device_.get(); }
  const std::shared_ptr<Device>& shared_device() const { return device_; }

 private:
  struct Idle;  // shared with the buffers' deleters
  Status Take(size_t count, std::unique_ptr<DeviceBuffer>* buffer, bool* recycled);
  std::shared_ptr<DeviceBuffer> Hand(std::unique_ptr<DeviceBuffer> buffer, size_t count);
  std::shared_ptr<Device> device_;
  const bool host_;
  std::shared_ptr<Idle> idle_;
};

}  // namespace mltuner
