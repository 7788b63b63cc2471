// Pieces the CUDA backend's files share (cuda_device.cc, cuda_ipc.cc): the
// wording of CUDA errors, recycled events, and the ticket (DeviceEvent)
// every ticket of a CUDA device is: an event and the stream it was
// recorded on.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "mltuner/device.h"

namespace mltuner {
namespace cuda_detail {

inline std::string ErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Recycled CUDA events for RecordAppWork tickets. The engine takes a ticket
// on every post, so creating and destroying an event each time would put a
// driver call pair on that path; a handful of reusable events covers the
// tickets in flight at once.
//
// Threads: Take and Return may be called from any thread. Ownership: shared
// by the CudaDevice and every outstanding ticket's deleter, so a ticket that
// outlives its device still returns (and then destroys) its event safely.
class EventPool {
 public:
  EventPool(int ordinal, unsigned flags) : ordinal_(ordinal), flags_(flags) {}
  ~EventPool() {
    // Errors are ignored: at process exit the runtime may already be gone.
    cudaSetDevice(ordinal_);
    for (cudaEvent_t event : free_) cudaEventDestroy(event);
    cudaGetLastError();
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // The error of creating one, if the pool had none; the caller words it.
  // REQUIRES: the pool's device is current on the calling thread (an event
  // belongs to the device current when it is created).
  cudaError_t Take(cudaEvent_t* out) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        *out = free_.back();
        free_.pop_back();
        return cudaSuccess;
      }
    }
    return cudaEventCreateWithFlags(out, flags_);
  }

  // Re-recording a returned event is safe even while a stream still waits on
  // it: cudaStreamWaitEvent captures the event's state when it is called.
  void Return(cudaEvent_t event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_.size() < kMaxPooled) {
        free_.push_back(event);
        return;
      }
    }
    cudaEventDestroy(event);
  }

 private:
  // Enough for every ticket alive at once (slots, payloads in flight, idle
  // payload buffers' last uses): beyond it events are created and destroyed
  // per ticket, a driver call pair on the engine's hot path.
  static constexpr size_t kMaxPooled = 4096;
  const int ordinal_;
  const unsigned flags_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// A ticket: a pooled event and the stream it was recorded on. A wait on
// the same stream is skipped: the stream's own order already gives it.
class StreamTicket {
 public:
  StreamTicket(cudaEvent_t event, cudaStream_t stream, std::shared_ptr<EventPool> pool)
      : event_(event), stream_(stream), pool_(std::move(pool)) {}
  ~StreamTicket() { pool_->Return(event_); }
  StreamTicket(const StreamTicket&) = delete;
  StreamTicket& operator=(const StreamTicket&) = delete;

  cudaEvent_t event() const { return event_; }
  cudaStream_t stream() const { return stream_; }

 private:
  const cudaEvent_t event_;
  const cudaStream_t stream_;
  const std::shared_ptr<EventPool> pool_;
};

inline const StreamTicket& TicketOf(const DeviceEvent& event) { return *static_cast<const StreamTicket*>(event.get()); }

}  // namespace cuda_detail
}  // namespace mltuner
