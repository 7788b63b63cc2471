// BorrowedFrames: payloads received from another process, used where they
// lie instead of being copied into a frame of our own.
//
// The transport receives a payload into memory it owns (a ZeroMQ frame) and
// hands it to the node with a token. On a device whose memory is host memory
// (Device::host_addressable), a payload at a float-aligned address (ZeroMQ
// puts large messages in memory of their own; small ones share its receive
// buffer at any byte offset and are copied) becomes the message's host frame
// as it is: a DeviceBuffer that views the bytes, marked `borrowed` (consumers
// read it and never write it). When the buffer's last owner lets go (the
// shard once it applied the clock, the installer once the rows are in), its
// token is queued with the buffer's `last_use` ticket; TakeReleased waits for
// those tickets and hands the tokens back, and only then may the transport
// free the memory. Tokens of payloads that were not borrowed (copied, or
// refused) are handed back the same way, so the transport has one rule: keep
// a payload until its token comes back.
//
// Thread safety: Borrow and Release from any thread; a buffer may die on any
// thread, also after this object is gone (then its token is dropped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "memory/device_block.h"
#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner {

class BorrowedFrames {
 public:
  explicit BorrowedFrames(std::shared_ptr<Device> device);
  ~BorrowedFrames();
  BorrowedFrames(const BorrowedFrames&) = delete;
  BorrowedFrames& operator=(const BorrowedFrames&) = delete;

  // Whether this device reads received payloads where they lie at all, and
  // whether the one at `data` can be (its floats are aligned).
  bool device_reads_host_memory() const;
  bool CanBorrow(const void* data) const;
  // A read-only buffer over `count` floats at `data`; its death queues `token`.
  std::shared_ptr<DeviceBuffer> Borrow(const float* data, size_t count, int64_t token);
  // Queues the token of a payload that was not borrowed.
  void Release(int64_t token);
  // The tokens whose buffers are gone, once their tickets are complete
  // (blocks for those that are not; on the CPU backend none is).
  Status TakeReleased(std::vector<int64_t>* out);
  // Payloads handed to this object and not yet handed back.
  int64_t outstanding() const;
  // Payloads used in place so far.
  int64_t borrowed_total() const;

 private:
  struct Queue;  // shared with the buffers' deleters
  std::shared_ptr<Device> device_;
  std::shared_ptr<Queue> queue_;
};

}  // namespace mltuner
