// ProcessNode: one worker process of a distributed job — its engine, its
// server shard, and the queues between them and a socket transport
// (python/mltuner/transport moves the bytes with ZeroMQ).
//
// Messages between this process's engine and shard never leave memory.
// Messages for other ranks wait in an outbox until the transport's send
// thread takes them (NextOutgoing), already encoded: a header frame and the
// float payload, which the transport sends without copying. Bytes received
// from other processes come in through Deliver, which validates them before
// anything else sees them; on a device whose memory is host memory a
// payload is then used where it lies (memory/borrowed_frames.h), so the
// transport keeps it until its token comes back (TakeReleasedPayloads).
//
// The outbox is bounded in payload bytes (SetOutboxLimit): Send waits while
// it is full (back-pressure on the engine's threads) for at most the
// config's wait timeout, then fails the node with kTimeout naming the bytes
// that did not leave. A single message larger than the limit goes alone.
//
// Threading: NextOutgoing / NextOutgoingBatch from one send thread, Deliver
// from one receive thread, the rest from the application thread; Abort and
// SetOutboxLimit from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "mltuner/status.h"
#include "mltuner/transport.h"

namespace mltuner {

class BorrowedFrames;
class DeviceBufferPool;
class IpcLinks;
struct DeviceBuffer;

// CUDA IPC traffic of one process (cluster/ipc_links.h), in payloads.
struct IpcStats {
  int64_t sent_messages = 0;      // payloads copied device -> device into a peer's region
  int64_t sent_bytes = 0;
  int64_t sent_from_views = 0;    // of those, copied from a view of memory it does not
                                  //   own (the shard's rows from its state): no copy first
  int64_t fallbacks = 0;          // payloads for an IPC peer that found its slice full
                                  //   and went through a host frame instead
  int64_t room_waits = 0;         // payloads that found the slice full and waited for
  int64_t room_wait_us = 0;       //   a release (the sending thread waits with them)
  int64_t received_messages = 0;  // payloads that landed in this process's region
  int64_t received_bytes = 0;
  int64_t copied_out_messages = 0;  // of those, copied out of a slice more than half held
  int64_t copied_out_bytes = 0;
  int64_t releases_sent = 0;      // landed payloads handed back to their senders
  int64_t releases_received = 0;
};

// A message on its way to another process.
struct OutgoingMessage {
  int receiver = -1;
  std::string header;                   // frame 0: header, spans and text
  std::vector<float> payload;           // frame 1: the values, as raw float32,
  std::shared_ptr<DeviceBuffer> frame;  //   or in a host frame (complete once
                                        //   NextOutgoing returns it)
  DeviceEvent after;                    // leaves only once this ticket is complete
                                        //   (a CUDA IPC release: the reads it allows
                                        //   to be overwritten)
  // The receiver's inbox it is for: each keeps its own order; none for a
  // CUDA IPC release, which keeps none.
  enum class Lane : uint8_t { kNone, kToShard, kToEngine };
  Lane lane = Lane::kNone;
  size_t payload_bytes() const;
  const float* payload_values() const;  // the frame's or the vector's
};

class ProcessNode final : public Transport {
 public:
  static Status Create(const Config& config, int rank, int num_workers, std::unique_ptr<Device> device,
                       std::unique_ptr<ProcessNode>* out);
  ~ProcessNode() override;
  ProcessNode(const ProcessNode&) = delete;
  ProcessNode& operator=(const ProcessNode&) = delete;

  Engine* engine() { return engine_.get(); }
  int rank() const { return rank_; }
  int num_workers() const { return num_workers_; }

  // Transport (called by the engine and the shard).
  Status Send(Message&& message) override;
  // Messages for other processes enter the outbox together, with one
  // wake-up of the send thread, which then joins them as NextOutgoingBatch
  // says.
  Status SendAll(std::vector<Message>&& messages) override;
  Status AddTableToShard(int rank, const TableInfo& info) override;
  Status DropTableFromShard(int rank, TableId table) override;
  // This process's engine and shard, and (sender = this rank) a peer
  // reached by CUDA IPC: its payloads leave as device buffers.
  bool SharesDevice(int sender, int receiver) const override;

  // The next message for another process, waiting up to timeout_ms. False
  // when none came in time, or the node is closed and its outbox drained.
  // A host frame's producer may still be copying into it when it is queued:
  // such a message waits aside, with the later ones for the same receiver's
  // shard (or engine), while the others go on; the engine's threads never
  // wait for a frame.
  bool NextOutgoing(int timeout_ms, OutgoingMessage* out);
  // The socket messages to send next: every message waiting in the outbox
  // (at most max_messages, and past the first only while their payloads
  // total at most max_bytes), where each run of consecutive messages for one
  // receiver whose payloads are under kBatchBelowBytes is joined into one
  // batch (wire/batch.h; Deliver opens it). Per receiver the order is the
  // outbox's. Waits up to timeout_ms for the first message; empty when none
  // came in time, or the node is closed and its outbox drained. One wake-up
  // of the send thread so takes what a clock queued together (the updates
  // of a step(), a shard's pushes of a clock) as one socket message per
  // peer, instead of one per table.
  std::vector<OutgoingMessage> NextOutgoingBatch(int timeout_ms, size_t max_messages, size_t max_bytes);
  // Payloads under this size join batches: copied into the batch here and
  // out of it on arrival, which costs less than a socket message of their
  // own (ZeroMQ's I/O thread, the send and receive threads, on both sides).
  // Measured on 2 cores, 16 tables of 64 KiB between 2 processes: 2.7 ms a
  // clock with 8 KiB here, 1.55 with 256 KiB. Larger payloads go alone, to
  // be used in place on arrival.
  static constexpr size_t kBatchBelowBytes = size_t{256} << 10;
  // Host frames that received payloads land in (pinned on CUDA, recycled).
  const DeviceBufferPool& receive_frames() const { return *frames_; }
  // Messages and payload bytes waiting in the outbox, and the most bytes it
  // has held.
  int64_t outbox_messages() const;
  int64_t outbox_bytes() const;
  int64_t peak_outbox_bytes() const;
  // Payload bytes the outbox may hold before Send waits; 0: no bound (the
  // default until the transport knows the plan).
  void SetOutboxLimit(int64_t bytes);

  // Payload bytes each of this process's two inboxes (the shard's, the
  // engine's) may hold before Deliver, or an update of this process's engine
  // for its own shard, waits for room, up to the wait timeout (then
  // kTimeout, and the node is aborted); the shard's replies never wait. 0:
  // no bound (the default until the transport knows the plan).
  void SetInboxLimit(int64_t bytes);
  // Payload bytes waiting in both inboxes, and the most one has held.
  int64_t inbox_bytes() const;
  int64_t peak_inbox_bytes() const;

  // Frames received from another process: one message, or a batch of them
  // (each part delivered as if it came alone; the first refusal is
  // returned, every one counted). A message that fails validation
  // (malformed, foreign, not addressed to this rank, or from this rank or an
  // unknown one) is counted as rejected and returns why; nothing else sees it.
  // With a token (>= 0) the payload may be used in place: the caller keeps
  // its bytes alive and unchanged until TakeReleasedPayloads returns the
  // token, which it does for every token, used in place or not, rejected or
  // not. Without one (-1) the payload is copied before Deliver returns.
  Status Deliver(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                 int64_t token = -1);
  // Tokens of delivered payloads that nothing reads any more (waits for the
  // device's last reads of them, which on the CPU backend are done).
  Status TakeReleasedPayloads(std::vector<int64_t>* tokens);
  // Whether Deliver uses payloads in place on this node's device at all (a
  // transport may skip tokens where it does not).
  bool lends_payloads() const;
  // Payloads delivered with a token and not yet handed back, and those used
  // in place so far.
  int64_t borrowed_payloads() const;
  int64_t payloads_used_in_place() const;

  // A peer is gone: the engine's waits and later calls fail with `why`.
  void Abort(const Status& why);
  bool aborted() const;

  // Checkpoints (see ServerShard::ExportTable / ImportTable): a branch's
  // slice out (a tuning session's final branch too), branch 0's in.
  Status ExportShardTable(TableId table, ShardSlice* out, BranchId branch = 0);
  Status ImportShardTable(TableId table, const float* values, size_t num_values, const float* state,
                          size_t num_state);

  int64_t rejected_messages() const;

  // CUDA IPC with processes of this host (cluster/ipc_links.h). The job
  // calls these at the rendezvous, before any traffic: Export makes this
  // process's landing region (one slice of `slice_bytes` per peer) and
  // returns the handle its peers open with OpenCudaIpcPeer; once both
  // processes of a pair opened each other's, EnableCudaIpcPeer on each side
  // sends their device payloads device -> device (falling back to host
  // frames where a slice is full). Fails with the reason where CUDA IPC is
  // unavailable (a CPU engine, another container, the driver refuses).
  Status ExportCudaIpc(size_t slice_bytes, std::string* handle);
  Status OpenCudaIpcPeer(int peer, const std::string& handle, size_t slice_bytes);
  Status EnableCudaIpcPeer(int peer);
  std::vector<int> cuda_ipc_peers() const;
  // Of those, the ones whose GPU is this process's (processes time-sharing
  // a GPU): releases to them leave in order (IpcLinks::SharesDeviceWith).
  std::vector<int> cuda_ipc_same_device_peers() const;
  IpcStats cuda_ipc_stats() const;
  // The memory of this process's device in bytes, -1 where unknown: what
  // the job sizes the CUDA IPC landing region by.
  int64_t device_total_bytes() const;
  // Payload bytes sent to other processes through the socket (host frames
  // and vectors), and those of them that left a device payload's memory by
  // a device -> host copy (no CUDA IPC to that peer, or its slice was full).
  int64_t socket_payload_bytes() const;
  int64_t device_payload_bytes_by_host() const;

  // Shuts the engine down, stops the shard and closes the outbox (what is
  // queued can still be taken). Idempotent.
  Status Shutdown();

  class Queues;

 private:
  ProcessNode(int rank, int num_workers, int64_t wait_timeout_ms);
  Status DeliverOne(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                    int64_t token);
  // A CUDA IPC notice or release (wire/ipc_envelope.h).
  Status DeliverIpc(const void* frame0, size_t frame0_bytes, size_t payload_bytes);
  // Checks a decoded message's routing (`status`: the decode's) and queues it.
  Status Admit(Message&& message, Status status);
  // SendAll's two halves: a message to this process's shard or engine, and
  // one for another process made into what the send thread takes.
  Status SendToSelf(Message&& message);
  Status ToOutgoing(Message&& message, OutgoingMessage* outgoing);
  // A device payload for another process into a host frame (the path
  // without CUDA IPC).
  Status MoveToHostFrame(Message* message);
  // The messages at `run` (all for `receiver`) copied into one batch.
  Status JoinBatch(int receiver, const std::vector<OutgoingMessage>& messages, const std::vector<size_t>& run,
                   OutgoingMessage* batch) const;
  const int rank_;
  const int num_workers_;
  const int64_t wait_timeout_ms_;
  // Messages taken from the outbox that wait for the device (the send
  // thread's): CUDA IPC releases whose reads are not done, which leave as
  // soon as they are; and messages whose host frame is still being filled,
  // with the later ones for the same receiver and inbox (shard or engine),
  // which leave in their order. No other message waits behind them: an
  // update still behind the application's backward pass once held back the
  // rows of the clock before.
  struct HeldMessage {
    OutgoingMessage message;
    std::chrono::steady_clock::time_point since;
  };
  std::deque<HeldMessage> held_releases_;
  std::deque<HeldMessage> held_frames_;
  // Moves the held releases whose reads are done, and the held frames that
  // are ready and first of their receiver's inbox, to *out; kTimeout once
  // one has waited longer than the wait timeout.
  Status TakeHeldMessages(std::vector<OutgoingMessage>* out);
  Status TakeFinishedReleases(std::vector<OutgoingMessage>* out);
  Status TakeReadyFrames(std::vector<OutgoingMessage>* out);
  // Whether `message` must wait in held_frames_: its frame is not ready, or
  // one for the same receiver and inbox waits there already.
  Status MustWaitForFrame(const OutgoingMessage& message, bool* wait) const;
  std::shared_ptr<DeviceBufferPool> frames_;
  std::unique_ptr<BorrowedFrames> borrowed_;
  std::unique_ptr<IpcLinks> ipc_;  // before queues_: the shard host asks it
  std::unique_ptr<Queues> queues_;
  std::atomic<int64_t> socket_payload_bytes_{0};
  std::atomic<int64_t> device_payload_bytes_by_host_{0};
  std::unique_ptr<Engine> engine_;
};

}  // namespace mltuner
