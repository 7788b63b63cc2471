// CudaIpc: see cuda_ipc.h. Plain C++ against the CUDA runtime.
#include "cuda_ipc.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "stream_ticket.h"

namespace mltuner {
namespace {

using cuda_detail::ErrorText;
using cuda_detail::EventPool;
using cuda_detail::StreamTicket;
using cuda_detail::TicketOf;

constexpr size_t kMemHandleBytes = sizeof(cudaIpcMemHandle_t);
constexpr size_t kEventHandleBytes = sizeof(cudaIpcEventHandle_t);
constexpr size_t kUuidBytes = sizeof(cudaUUID_t);
// The region, the copy events, and the exporting device's UUID: the one
// device identity two processes agree on (their ordinals may differ, and
// cudaPointerGetAttributes names the importing device for an IPC mapping).
constexpr size_t kEventsAt = kMemHandleBytes;
constexpr size_t kUuidAt = kEventsAt + DeviceIpc::kCopyEvents * kEventHandleBytes;
constexpr size_t kHandleBytes = kUuidAt + kUuidBytes;

Status Fail(const std::string& what, cudaError_t err) {
  cudaGetLastError();
  return Status::Internal("CUDA IPC: " + what + " failed: " + ErrorText(err));
}

// Threads: any method from any thread; mu_ orders the peers' table and each
// stream's record with the work before it.
class CudaIpc final : public DeviceIpc {
 public:
  CudaIpc(int ordinal, size_t region_bytes)
      : ordinal_(ordinal), region_bytes_(region_bytes),
        events_(std::make_shared<EventPool>(ordinal, cudaEventDisableTiming)) {}

  ~CudaIpc() override {
    // Errors are ignored: at exit the runtime or a peer may be gone.
    cudaSetDevice(ordinal_);
    for (cudaStream_t stream : send_) {
      if (stream) cudaStreamSynchronize(stream);
    }
    for (Peer& peer : peers_) {
      for (cudaStream_t stream : peer.receive) {
        if (!stream) continue;
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
      if (peer.region) cudaIpcCloseMemHandle(peer.region);
      for (cudaEvent_t event : peer.events) {
        if (event) cudaEventDestroy(event);
      }
    }
    for (cudaEvent_t event : events_out_) {
      if (event) cudaEventDestroy(event);
    }
    for (cudaStream_t stream : send_) {
      if (stream) cudaStreamDestroy(stream);
    }
    if (region_) cudaFree(region_);
    cudaGetLastError();
  }

  Status Init() {
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err != cudaSuccess) return Fail("cudaSetDevice", err);
    // cudaMalloc, not a pool: memory from cudaMallocAsync pools cannot be
    // exported with cudaIpcGetMemHandle.
    err = cudaMalloc(&region_, region_bytes_);
    if (err != cudaSuccess) return Fail("cudaMalloc of the " + std::to_string(region_bytes_) + "-byte landing region", err);
    cudaIpcMemHandle_t memory{};
    err = cudaIpcGetMemHandle(&memory, region_);
    if (err != cudaSuccess) return Fail("cudaIpcGetMemHandle", err);
    handle_.assign(kHandleBytes, '\0');
    std::memcpy(&handle_[0], &memory, kMemHandleBytes);
    for (int i = 0; i < kCopyEvents; ++i) {
      err = cudaEventCreateWithFlags(&events_out_[i], cudaEventDisableTiming | cudaEventInterprocess);
      if (err != cudaSuccess) return Fail("cudaEventCreateWithFlags(cudaEventInterprocess)", err);
      cudaIpcEventHandle_t event{};
      err = cudaIpcGetEventHandle(&event, events_out_[i]);
      if (err != cudaSuccess) return Fail("cudaIpcGetEventHandle", err);
      std::memcpy(&handle_[kEventsAt + i * kEventHandleBytes], &event, kEventHandleBytes);
    }
    cudaDeviceProp properties{};
    err = cudaGetDeviceProperties(&properties, ordinal_);
    if (err != cudaSuccess) return Fail("cudaGetDeviceProperties", err);
    std::memcpy(&handle_[kUuidAt], &properties.uuid, kUuidBytes);
    for (cudaStream_t& stream : send_) {
      err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      if (err != cudaSuccess) return Fail("cudaStreamCreateWithFlags", err);
    }
    return Status::Ok();
  }

  float* region() const override { return static_cast<float*>(region_); }
  size_t region_bytes() const override { return region_bytes_; }
  const std::string& handle() const override { return handle_; }

  Status OpenPeer(int peer, const std::string& handle, size_t region_bytes) override {
    if (peer < 0) return Status::InvalidArgument("CUDA IPC: no peer rank " + std::to_string(peer));
    if (handle.size() != kHandleBytes) {
      return Status::InvalidArgument("CUDA IPC: peer " + std::to_string(peer) + "'s handle is " +
                                     std::to_string(handle.size()) + " bytes, not " + std::to_string(kHandleBytes));
    }
    cudaIpcMemHandle_t memory{};
    std::memcpy(&memory, handle.data(), kMemHandleBytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<size_t>(peer) >= peers_.size()) peers_.resize(static_cast<size_t>(peer) + 1);
    Peer& slot = peers_[peer];
    if (slot.region) return Status::InvalidArgument("CUDA IPC: peer " + std::to_string(peer) + " is open already");
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err != cudaSuccess) return Fail("cudaSetDevice", err);
    void* region = nullptr;
    // Lazy peer access: a region on another GPU of the host is reached over
    // NVLink or PCIe where the two can; on the same GPU it is plain memory.
    err = cudaIpcOpenMemHandle(&region, memory, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) return Fail("cudaIpcOpenMemHandle of peer " + std::to_string(peer) + "'s region", err);
    std::array<cudaEvent_t, kCopyEvents> opened{};
    for (int i = 0; i < kCopyEvents; ++i) {
      cudaIpcEventHandle_t event{};
      std::memcpy(&event, handle.data() + kEventsAt + i * kEventHandleBytes, kEventHandleBytes);
      err = cudaIpcOpenEventHandle(&opened[i], event);
      if (err != cudaSuccess) {
        for (int j = 0; j < i; ++j) cudaEventDestroy(opened[j]);
        cudaIpcCloseMemHandle(region);
        return Fail("cudaIpcOpenEventHandle of peer " + std::to_string(peer) + "'s event " + std::to_string(i), err);
      }
    }
    std::array<cudaStream_t, kLanes> receive{};
    for (cudaStream_t& stream : receive) {
      err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      if (err != cudaSuccess) {
        for (cudaStream_t made : receive) {
          if (made) cudaStreamDestroy(made);
        }
        for (cudaEvent_t event : opened) cudaEventDestroy(event);
        cudaIpcCloseMemHandle(region);
        return Fail("cudaStreamCreateWithFlags (peer " + std::to_string(peer) + "'s landings)", err);
      }
    }
    slot.region = region;
    slot.region_bytes = region_bytes;
    slot.events = opened;
    slot.receive = receive;
    slot.same_device = handle.compare(kUuidAt, kUuidBytes, handle_, kUuidAt, kUuidBytes) == 0;
    return Status::Ok();
  }

  Status CopyToPeer(int peer, size_t offset, const void* src, size_t bytes, const DeviceEvent& after, int event,
                    DeviceEvent* done) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Peer* target = Find(peer);
    if (target == nullptr || target->region == nullptr) {
      return Status::InvalidArgument("CUDA IPC: peer " + std::to_string(peer) + " is not open");
    }
    if (event < 0 || event >= kCopyEvents) {
      return Status::InvalidArgument("CUDA IPC: no copy event " + std::to_string(event));
    }
    if (offset > target->region_bytes || bytes > target->region_bytes - offset) {
      return Status::InvalidArgument("CUDA IPC: bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                                     ") are outside peer " + std::to_string(peer) + "'s region of " +
                                     std::to_string(target->region_bytes));
    }
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err != cudaSuccess) return Fail("cudaSetDevice", err);
    const cudaStream_t send = send_[LaneOf(event)];
    if (after) {
      err = cudaStreamWaitEvent(send, TicketOf(after).event(), 0);
      if (err != cudaSuccess) return Fail("cudaStreamWaitEvent (the payload's producer)", err);
    }
    err = cudaMemcpyAsync(static_cast<char*>(target->region) + offset, src, bytes, cudaMemcpyDeviceToDevice, send);
    if (err != cudaSuccess) return Fail("cudaMemcpyAsync to peer " + std::to_string(peer), err);
    // Recorded after the copy, under mu_: whatever record of this event a
    // receiver waits on is at or after the copy its notice announces (a
    // later one, when the caller reused the event meanwhile: the wait is
    // longer, never too short, since every copy of the event's lane goes on
    // that lane's stream).
    err = cudaEventRecord(events_out_[event], send);
    if (err != cudaSuccess) return Fail("cudaEventRecord (the interprocess event)", err);
    return Ticket(send, done, "the copy's ticket");
  }

  Status PeerWrites(int peer, int event, DeviceEvent* ready) override {
    std::lock_guard<std::mutex> lock(mu_);
    const Peer* source = Find(peer);
    if (source == nullptr || source->region == nullptr) {
      return Status::InvalidArgument("CUDA IPC: peer " + std::to_string(peer) + " is not open");
    }
    if (event < 0 || event >= kCopyEvents) {
      return Status::InvalidArgument("CUDA IPC: peer " + std::to_string(peer) + " has no copy event " +
                                     std::to_string(event));
    }
    cudaError_t err = cudaSetDevice(ordinal_);
    if (err != cudaSuccess) return Fail("cudaSetDevice", err);
    const cudaStream_t receive = source->receive[LaneOf(event)];
    err = cudaStreamWaitEvent(receive, source->events[event], 0);
    if (err != cudaSuccess) return Fail("cudaStreamWaitEvent on peer " + std::to_string(peer) + "'s event", err);
    return Ticket(receive, ready, "a landing ticket");
  }

  Status WaitDone(const DeviceEvent& event, int64_t timeout_ms) override {
    if (!event) return Status::Ok();
    const cudaEvent_t handle = TicketOf(event).event();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    auto pause = std::chrono::microseconds(20);
    while (true) {
      const cudaError_t err = cudaEventQuery(handle);
      if (err == cudaSuccess) return Status::Ok();
      if (err != cudaErrorNotReady) return Fail("cudaEventQuery", err);
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::Timeout("CUDA IPC: the device work a release waits for did not finish within " +
                               std::to_string(timeout_ms) + " ms (a peer's copy never completed?)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  bool SameDevice(int peer) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const Peer* found = Find(peer);
    return found != nullptr && found->same_device;
  }

 private:
  struct Peer {
    void* region = nullptr;
    size_t region_bytes = 0;
    std::array<cudaEvent_t, kCopyEvents> events{};
    std::array<cudaStream_t, kLanes> receive{};  // a lane's waits for this peer's events alone
    bool same_device = false;
  };

  const Peer* Find(int peer) const {
    return peer >= 0 && static_cast<size_t>(peer) < peers_.size() ? &peers_[peer] : nullptr;
  }

  // REQUIRES: mu_ held, the device current.
  Status Ticket(cudaStream_t stream, DeviceEvent* out, const char* what) {
    cudaEvent_t event = nullptr;
    cudaError_t err = events_->Take(&event);
    if (err != cudaSuccess) return Fail(std::string("cudaEventCreate (") + what + ")", err);
    err = cudaEventRecord(event, stream);
    if (err != cudaSuccess) {
      events_->Return(event);
      return Fail(std::string("cudaEventRecord (") + what + ")", err);
    }
    *out = std::make_shared<StreamTicket>(event, stream, events_);
    return Status::Ok();
  }

  const int ordinal_;
  const size_t region_bytes_;
  std::shared_ptr<EventPool> events_;
  void* region_ = nullptr;
  std::array<cudaEvent_t, kCopyEvents> events_out_{};  // interprocess: peers wait on them
  std::array<cudaStream_t, kLanes> send_{};  // a lane's copies and its events' records
  std::string handle_;
  mutable std::mutex mu_;
  std::vector<Peer> peers_;  // by rank; guarded by mu_
};

}  // namespace

Status NewCudaIpc(int ordinal, size_t region_bytes, std::unique_ptr<DeviceIpc>* out) {
  if (region_bytes == 0) return Status::InvalidArgument("CUDA IPC: a landing region of 0 bytes");
  auto ipc = std::make_unique<CudaIpc>(ordinal, region_bytes);
  MLT_RETURN_IF_ERROR(ipc->Init());
  *out = std::move(ipc);
  return Status::Ok();
}

}  // namespace mltuner
