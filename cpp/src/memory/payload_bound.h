// PayloadBound: the bytes of update payloads in device memory that are on
// their way to a shard of this device, against a limit. These buffers lie
// outside the plan's budget (the reserve must hold them), and a worker's
// backward pass can make a whole model's updates far faster than a shard
// whose state lives in host memory applies them: without a bound they
// would exhaust the device. Take blocks the reclaimer until the shard gives
// buffers back; one payload larger than the limit still goes alone.
//
// Threading: Take from one thread; the handed-out buffers may be released
// from any thread (the shard's), also after the bound is gone.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "common/byte_bound.h"
#include "common/mutex.h"
#include "memory/device_block.h"
#include "mltuner/status.h"

namespace mltuner {

class PayloadBound {
 public:
  // `limit_bytes` 0: no bound.
  explicit PayloadBound(int64_t limit_bytes);

  // Waits (up to `timeout_ms`, or until `stopping` says so, checked every
  // few ms) for room for `count` floats, then takes a buffer with
  // `acquire` and returns in *out a handle on it that gives the bytes back
  // when its last owner lets go.
  Status Take(size_t count, int64_t timeout_ms, const std::function<bool()>& stopping,
              const std::function<Status(std::shared_ptr<DeviceBuffer>*)>& acquire,
              std::shared_ptr<DeviceBuffer>* out);
  // Whether Take of `count` floats would go ahead without waiting (Take's
  // caller is the only taker, and room only grows meanwhile).
  bool HasRoom(size_t count) const;
  int64_t held_bytes() const;
  int64_t peak_bytes() const;
  int64_t limit_bytes() const;

 private:
  struct Shared {
    mutable Mutex mu;
    CondVar room{&mu};
    ByteBound bytes GUARDED_BY(mu);
  };
  std::shared_ptr<Shared> shared_;
};

}  // namespace mltuner
