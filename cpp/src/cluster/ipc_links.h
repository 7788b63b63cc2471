// IpcLinks: a process's CUDA IPC with the processes of its host (issue 19,
// item 3), or on the CPU backend its shared memory with them
// (device/cpu/shared_memory_ipc.h): the protocol is the same over any
// DeviceIpc. Payloads of messages between their engines and shards go device
// -> device; the socket carries only a small notice (wire/ipc_envelope.h).
//
// Layout: each process exports one landing region (Device::ExportIpc) made
// of one slice of `slice_bytes` per peer, in rank order (this rank has
// none). A sender owns its slice of each receiver's region: it places each
// payload in a free range of it (cluster/byte_ranges.h), queues the copy
// after the payload's producer, records one of its interprocess events (one
// no payload still out uses, where there is one: a receiver's wait then
// covers its own copy and no later one), and sends the notice naming range
// and event. The receiver checks the notice's range against the sender's
// slice (outside it, or over bytes still in use: refused as corrupt, never
// read), makes its stream wait on the sender's event (updates for shards
// and rows for workers each have a lane of streams and events of their
// own: DeviceIpc::kLanes), and hands the bytes
// on as a read-only device buffer, or, when the sender's slice is more
// than half held, as a copy in pooled device memory, the range released
// once the copy is done (a shard may hold an update for most of a clock).
// When that buffer's last reader lets go,
// a release goes back (once the reads' ticket completes: the send thread
// holds it until then, up to the wait timeout, and sends what queued behind
// it meanwhile, except to a peer on its own device, SharesDeviceWith) and
// the sender may use the range again.
// A payload that finds no room in its slice waits for the peer's releases
// at most as long as the host-frame path would take it (a large payload's
// fallback costs tens of milliseconds; a release comes within a clock's
// kernels), then goes through pinned host frames, as one for a peer
// without IPC does: a wait here is bounded, so the shard's replies still
// never wait on a peer for long.
//
// A pair of processes uses IPC only when both opened each other's export
// (Enable, decided by the job from an exchange at the rendezvous), so a
// notice never reaches a process that cannot read it.
//
// Thread safety: every method from any thread; Export, OpenPeer and Enable
// before traffic starts. Landing buffers may die on any thread, also after
// this object is gone (then nothing is posted).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cluster/byte_ranges.h"
#include "common/mutex.h"
#include "memory/device_block.h"
#include "mltuner/device.h"
#include "mltuner/device_ipc.h"
#include "mltuner/process_node.h"
#include "mltuner/status.h"
#include "wire/ipc_envelope.h"

namespace mltuner {

class IpcLinks {
 public:
  // Alignment of every payload placed in a slice (a float4 and a cache
  // line of the GPU; the copies stay aligned).
  static constexpr uint64_t kAlignment = 256;
  // About how fast a payload crosses by the host-frame path (device -> host,
  // socket, host -> device; measured 1.5-3.8 GB/s on H100 and H200 hosts):
  // a payload that finds its slice full waits for a release at most as long
  // as that path would take it.
  static constexpr double kHostPathBytesPerSecond = 2e9;
  // Queues a release for the transport: frame 0 for `receiver`, to leave
  // once ticket `after` is complete.
  using PostRelease = std::function<void(int receiver, std::string frame0, DeviceEvent after)>;

  IpcLinks(int rank, int num_workers, std::shared_ptr<Device> device);
  ~IpcLinks();
  IpcLinks(const IpcLinks&) = delete;
  IpcLinks& operator=(const IpcLinks&) = delete;

  // Exports this process's landing region: one slice of `slice_bytes` (a
  // multiple of kAlignment, > 0) per peer. *handle: what peers open.
  Status Export(size_t slice_bytes, std::string* handle);
  // Opens peer `peer`'s export, whose slices are `slice_bytes` each.
  Status OpenPeer(int peer, const std::string& handle, size_t slice_bytes);
  // Uses IPC with `peer` both ways. REQUIRES: exported, and peer opened.
  Status Enable(int peer);
  bool enabled(int peer) const;
  std::vector<int> peers() const;
  // Where releases go (the node's outbox); StopPosting ends it for good.
  void SetPost(PostRelease post);
  void StopPosting();

  // The DeviceIpc lane of a message's lane (-1 for none): an update for a
  // shard waits for the application's work, rows for an engine for the shard's.
  static int EventLane(OutgoingMessage::Lane lane) {
    return lane == OutgoingMessage::Lane::kToShard ? 0 : lane == OutgoingMessage::Lane::kToEngine ? 1 : -1;
  }

  // Sender: tries to move `buffer`'s values (device memory, ready with its
  // ticket) into peer's landing slice, in the event lane of the message's
  // `lane` (kNone: InvalidArgument). *sent: whether it did; then *notice
  // is frame 0 to send in place of the message's (whose frame 0 is
  // `message_frame0`), and buffer->last_use the copy's ticket. Not sent:
  // IPC is not enabled for `peer`, or the slice has no room (counted as a
  // fallback). Fails only when the device does.
  Status TrySend(int peer, OutgoingMessage::Lane lane, DeviceBuffer* buffer, const std::string& message_frame0,
                 std::string* notice, bool* sent);
  // Sender: a release from the peer that received a payload.
  Status OnRelease(const IpcEnvelope& release);
  // Receiver: checks a notice's span against its sender's slice and claims
  // it; *out: a read-only buffer over the landed bytes, ready once the
  // sender's copy is, or, when more than half of the sender's slice is
  // held, a copy of them in pooled device memory (the range goes back once
  // the copy is done). kCorruptMessage naming the problem otherwise.
  Status Land(const IpcEnvelope& notice, std::shared_ptr<DeviceBuffer>* out);
  // Whether ticket `event` is complete (no wait).
  Status IsDone(const DeviceEvent& event, bool* done);
  // Blocks until ticket `event` completes, up to timeout_ms (kTimeout).
  Status WaitDone(const DeviceEvent& event, int64_t timeout_ms);
  // Whether peer's landing region lives on this process's device: the two
  // processes time-share one GPU, which finishes a release's reads late, so
  // releases to that peer leave in order (a release held aside would let the
  // notices behind it overtake, and the peer's next payload wait for room).
  bool SharesDeviceWith(int peer) const { return ipc_ != nullptr && ipc_->SameDevice(peer); }

  IpcStats stats() const;

 private:
  struct Receiving;  // shared with the landing buffers' deleters
  // This process's slot in a region of `peer` (rank order, skipping peer).
  int SlotIn(int owner, int peer) const { return peer < owner ? peer : peer - 1; }
  bool ValidPeer(int peer) const { return peer >= 0 && peer < num_workers_ && peer != rank_; }
  // The copy event of `lane` for the next payload: the lane's first unused
  // one from its next_event_ on, or next_event_ itself when all are in use.
  int TakeEvent(int lane) REQUIRES(send_mu_);
  // Replaces a landed buffer by a copy in copies_ (see Land); false, and
  // nothing changed, when the copy cannot be queued.
  bool CopyOut(std::shared_ptr<DeviceBuffer>* landed);

  const int rank_;
  const int num_workers_;
  const std::shared_ptr<Device> device_;
  std::unique_ptr<DeviceIpc> ipc_;       // set by Export
  size_t slice_bytes_ = 0;               // of this process's region
  std::shared_ptr<DeviceBufferPool> copies_;  // set by Export: payloads copied out of a crowded slice
  std::vector<size_t> peer_slice_bytes_;  // of each opened peer's region; 0: not open
  std::unique_ptr<std::atomic<bool>[]> enabled_;
  mutable Mutex send_mu_;  // the copy and its event record, in one order
  CondVar released_{&send_mu_};  // a release freed a range of some peer's slice
  std::vector<std::unique_ptr<ByteRanges>> sending_ GUARDED_BY(send_mu_);  // per peer: my slice of its region
  IpcStats send_stats_ GUARDED_BY(send_mu_);
  // Per copy event: how many payloads recorded with it are not released yet.
  std::vector<int> event_uses_ GUARDED_BY(send_mu_);
  // Per lane: where the search for a free event starts.
  std::array<int, DeviceIpc::kLanes> next_event_ GUARDED_BY(send_mu_){};
  std::shared_ptr<Receiving> receiving_;
};

}  // namespace mltuner
