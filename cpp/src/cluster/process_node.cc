#include "mltuner/process_node.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <utility>

#include "cluster/hop_log.h"
#include "cluster/ipc_links.h"
#include "cluster/shard_host.h"
#include "common/byte_bound.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "memory/borrowed_frames.h"
#include "memory/device_block.h"
#include "wire/batch.h"
#include "wire/ipc_envelope.h"
#include "wire/message.h"

namespace mltuner {

// The shard host and the outbox of messages for other processes.
class ProcessNode::Queues {
 public:
  // The shard sends rows as device buffers to its own engine, and to the
  // processes it reaches by CUDA IPC (or shared memory) as views of its
  // state, copied as they leave (`ipc` outlives the host's threads).
  Queues(int rank, int num_workers, const Config& config, std::shared_ptr<Device> device, const IpcLinks* ipc)
      : host(rank, num_workers, config, device,
             [rank, ipc](int worker) {
               return worker == rank          ? RowsRoute::kDeviceBuffer
                      : ipc->enabled(worker) ? RowsRoute::kCopiedAtSend
                                             : RowsRoute::kHostFrame;
             }),
        device(std::move(device)) {}

  // Waits while the outbox is over its limit (none when it is empty), up to
  // timeout_ms, then kTimeout; a negative timeout_ms queues without waiting.
  // Once the node is aborted the message is dropped (every call of the job
  // already fails with the abort's reason); once closed it is queued without
  // waiting, as the send thread drains.
  Status PushOutgoing(OutgoingMessage&& message, int64_t timeout_ms) {
    std::vector<OutgoingMessage> one;
    one.push_back(std::move(message));
    return PushOutgoing(std::move(one), timeout_ms);
  }

  // The same for several messages in order, with one wake-up of the send
  // thread (or one before each wait for room, so that it makes the room).
  Status PushOutgoing(std::vector<OutgoingMessage>&& messages, int64_t timeout_ms) {
    {
      MutexLock lock(&mu);
      bool unannounced = false;
      for (OutgoingMessage& message : messages) {
        const auto bytes = static_cast<int64_t>(message.payload_bytes());
        if (timeout_ms >= 0 && !outbox_bytes.HasRoom(bytes)) {
          if (unannounced) ready.NotifyAll();
          unannounced = false;
          MLT_RETURN_IF_ERROR(WaitForRoom(bytes, timeout_ms));
        }
        if (aborted) return Status::Ok();
        outbox_bytes.Add(bytes);
        outbox.push_back(std::move(message));
        unannounced = true;
      }
    }
    ready.NotifyAll();
    return Status::Ok();
  }

  // Waits while the outbox is over its limit, as PushOutgoing does for a
  // message of no bytes.
  Status WaitForOutboxRoom(int64_t timeout_ms) {
    MutexLock lock(&mu);
    return WaitForRoom(0, timeout_ms);
  }

  // Waits up to `timeout` for a message, then takes the queued ones in
  // order: at most max_messages, past the first only while their payloads
  // total at most max_bytes.
  std::vector<OutgoingMessage> PopOutgoing(std::chrono::microseconds timeout, size_t max_messages, size_t max_bytes) {
    std::vector<OutgoingMessage> taken;
    {
      MutexLock lock(&mu);
      const auto deadline = std::chrono::steady_clock::now() + std::max(timeout, std::chrono::microseconds(0));
      while (!closed && outbox.empty()) {
        if (!ready.WaitUntil(deadline)) break;
      }
      size_t bytes = 0;
      while (!outbox.empty() && taken.size() < std::max<size_t>(max_messages, 1)) {
        const size_t next = outbox.front().payload_bytes();
        if (!taken.empty() && bytes + next > max_bytes) break;
        bytes += next;
        taken.push_back(std::move(outbox.front()));
        outbox.pop_front();
        outbox_bytes.Remove(static_cast<int64_t>(next));
      }
    }
    if (!taken.empty()) room.NotifyAll();
    return taken;
  }

  // A message the send thread took but holds (its frame still being filled)
  // keeps its bytes counted against the limit until it leaves.
  void CountHeld(int64_t bytes) {
    {
      MutexLock lock(&mu);
      if (bytes >= 0) {
        outbox_bytes.Add(bytes);
      } else {
        outbox_bytes.Remove(-bytes);
      }
    }
    if (bytes < 0) room.NotifyAll();
  }

  Status WaitForRoom(int64_t bytes, int64_t timeout_ms) REQUIRES(mu) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    bool has_room = closed || aborted || outbox_bytes.HasRoom(bytes);
    while (!has_room) {
      const bool woken = room.WaitUntil(deadline);
      has_room = closed || aborted || outbox_bytes.HasRoom(bytes);
      if (!woken) break;
    }
    if (has_room) return Status::Ok();
    // The send thread takes messages in order: the oldest one's receiver is
    // the peer that stopped taking them.
    const int stuck = outbox.empty() ? -1 : outbox.front().receiver;
    return Status::Timeout("the outbox to other processes has held " + std::to_string(outbox_bytes.held) +
                           " bytes (its limit is " + std::to_string(outbox_bytes.limit) + ") for " + std::to_string(timeout_ms) +
                           " ms: worker rank " + std::to_string(stuck) + " is not taking its messages");
  }

  void Close() {
    {
      MutexLock lock(&mu);
      closed = true;
    }
    ready.NotifyAll();
    room.NotifyAll();
  }

  ShardHost host;
  std::shared_ptr<Device> device;  // shared with the engine and the shard
  mutable Mutex mu;
  CondVar ready{&mu};  // a message arrived, or closed
  CondVar room{&mu};   // bytes left, or closed or aborted
  std::deque<OutgoingMessage> outbox GUARDED_BY(mu);
  ByteBound outbox_bytes GUARDED_BY(mu);  // payload bytes in outbox
  bool closed GUARDED_BY(mu) = false;
  bool aborted GUARDED_BY(mu) = false;
};

size_t OutgoingMessage::payload_bytes() const {
  return frame ? frame->count * sizeof(float) : payload.size() * sizeof(float);
}

const float* OutgoingMessage::payload_values() const { return frame ? frame->data : payload.data(); }

ProcessNode::ProcessNode(int rank, int num_workers, int64_t wait_timeout_ms)
    : rank_(rank), num_workers_(num_workers), wait_timeout_ms_(wait_timeout_ms) {}

Status ProcessNode::Create(const Config& config, int rank, int num_workers, std::unique_ptr<Device> device,
                           std::unique_ptr<ProcessNode>* out) {
  if (num_workers < 1) return Status::InvalidArgument("a job needs at least one worker");
  if (rank < 0 || rank >= num_workers) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is outside 0.." +
                                   std::to_string(num_workers - 1));
  }
  std::shared_ptr<Device> shared_device = device ? std::move(device) : NewCpuDevice();
  std::unique_ptr<ProcessNode> node(new ProcessNode(rank, num_workers, config.wait_timeout_ms));
  // Received payloads land in host frames (pinned on CUDA). The bytes one
  // clock brings are not known here: idle frames are kept up to the most
  // bytes ever held at once, so the steady state allocates none.
  node->frames_ = std::make_shared<DeviceBufferPool>(shared_device, 0, /*host=*/true);
  node->frames_->set_idle_bound_to_peak(true);
  node->borrowed_ = std::make_unique<BorrowedFrames>(shared_device);
  node->ipc_ = std::make_unique<IpcLinks>(rank, num_workers, shared_device);
  node->queues_ = std::make_unique<Queues>(rank, num_workers, config, shared_device, node->ipc_.get());
  // A landed payload's release leaves through the outbox, after the reads.
  Queues* queues = node->queues_.get();
  node->ipc_->SetPost([queues](int receiver, std::string frame0, DeviceEvent after) {
    OutgoingMessage release;
    release.receiver = receiver;
    release.header = std::move(frame0);
    release.after = std::move(after);
    (void)queues->PushOutgoing(std::move(release), -1);  // never waits; dropped once aborted
  });
  MLT_RETURN_IF_ERROR(Engine::Create(config, rank, num_workers, shared_device, node.get(), &node->engine_));
  node->queues_->host.Start(node->engine_.get(), node.get());
  *out = std::move(node);
  return Status::Ok();
}

ProcessNode::~ProcessNode() {
  Shutdown();
  ipc_->StopPosting();  // landing buffers that die later must not reach the outbox, which dies first
}

Status ProcessNode::Send(Message&& message) {
  std::vector<Message> one;
  one.push_back(std::move(message));
  return SendAll(std::move(one));
}

Status ProcessNode::SendAll(std::vector<Message>&& messages) {
  // Every receiver is checked before anything leaves (a CUDA IPC copy is
  // issued as a message is made outgoing).
  for (const Message& message : messages) {
    const int receiver = message.header.receiver;
    if (receiver < 0 || receiver >= num_workers_) {
      return Status::InvalidArgument("message to unknown process " + std::to_string(receiver) + ": " +
                                     message.DebugString());
    }
  }
  std::vector<OutgoingMessage> outgoing;
  bool waits = false;
  Status status;
  for (Message& message : messages) {
    HopLog::Record(rank_, "queued", message);
    if (message.header.receiver == rank_) {
      status = SendToSelf(std::move(message));
    } else {
      // Only the engine's messages wait for room (see SendToSelf).
      waits = waits || IsServerBound(message.type());
      outgoing.emplace_back();
      status = ToOutgoing(std::move(message), &outgoing.back());
      if (!status.ok()) outgoing.pop_back();
    }
    if (!status.ok()) break;  // what was made outgoing still leaves, in order
  }
  if (outgoing.empty()) return status;
  const Status queued = queues_->PushOutgoing(std::move(outgoing), waits ? wait_timeout_ms_ : -1);
  if (queued.code() == StatusCode::kTimeout) Abort(queued);  // every wait of the job ends with it
  return status.ok() ? queued : status;
}

Status ProcessNode::SendToSelf(Message&& message) {
  // Only the engine's messages wait for room (it makes all the traffic, so
  // waiting there bounds every queue). The shard's replies never wait: its
  // thread must keep draining its inbox, or two processes whose outboxes and
  // inboxes were all full would wait on each other; they answer messages
  // that waited on their way in.
  if (!IsServerBound(message.type())) {
    queues_->host.Push(std::move(message));
    return Status::Ok();
  }
  // The engine's update for its own shard also makes that shard's replies
  // to every peer: it waits while they are not taken (the outbox is full)
  // and while the shard is behind.
  Status room = queues_->WaitForOutboxRoom(wait_timeout_ms_);
  if (room.ok()) room = queues_->host.PushBounded(std::move(message), wait_timeout_ms_);
  if (room.code() == StatusCode::kTimeout) Abort(room);
  return room;
}

Status ProcessNode::ToOutgoing(Message&& message, OutgoingMessage* outgoing) {
  const int receiver = message.header.receiver;
  outgoing->receiver = receiver;
  outgoing->lane = IsServerBound(message.type()) ? OutgoingMessage::Lane::kToShard : OutgoingMessage::Lane::kToEngine;
  bool by_ipc = false;
  if (message.device_values) {
    // A process of this host reached by CUDA IPC: the values go device ->
    // device into its landing region, and only a notice takes the socket.
    MLT_RETURN_IF_ERROR(ipc_->TrySend(receiver, outgoing->lane, message.device_values.get(),
                                      EncodeHeaderFrame(message), &outgoing->header, &by_ipc));
    if (by_ipc) {
      message.device_values.reset();
    } else {
      MLT_RETURN_IF_ERROR(MoveToHostFrame(&message));
      device_payload_bytes_by_host_ += static_cast<int64_t>(message.num_values() * sizeof(float));
    }
  }
  if (!by_ipc) {
    outgoing->header = EncodeHeaderFrame(message);
    outgoing->payload = std::move(message.values);
    outgoing->frame = std::move(message.host_frame);
    socket_payload_bytes_ += static_cast<int64_t>(outgoing->payload_bytes());
  }
  return Status::Ok();
}

Status ProcessNode::MoveToHostFrame(Message* message) {
  // The values leave the device here, after the work that produced them,
  // into a host frame the send thread waits for.
  DeviceBuffer& buffer = *message->device_values;
  Device& device = *queues_->device;
  std::shared_ptr<DeviceBuffer> frame;
  MLT_RETURN_IF_ERROR(frames_->Acquire(buffer.count, Stream::kReceive, &frame));
  MLT_RETURN_IF_ERROR(device.WaitEvent(Stream::kReceive, buffer.ready));
  device.CopyDeviceToHost(frame->data, buffer.data, buffer.count * sizeof(float), Stream::kReceive);
  MLT_RETURN_IF_ERROR(device.RecordEvent(Stream::kReceive, &frame->ready));
  buffer.last_use = frame->ready;
  message->host_frame = std::move(frame);
  message->device_values.reset();
  return Status::Ok();
}

bool ProcessNode::SharesDevice(int sender, int receiver) const {
  return sender == rank_ && (receiver == rank_ || ipc_->enabled(receiver));
}

Status ProcessNode::AddTableToShard(int rank, const TableInfo& info) {
  if (rank != rank_) {
    return Status::Internal("process " + std::to_string(rank_) + " asked to register a table with shard " +
                            std::to_string(rank) + ", which lives in another process");
  }
  return queues_->host.AddTable(info);
}

Status ProcessNode::DropTableFromShard(int rank, TableId table) {
  if (rank != rank_) {
    return Status::Internal("process " + std::to_string(rank_) + " asked to drop a table of shard " +
                            std::to_string(rank) + ", which lives in another process");
  }
  return queues_->host.DropTable(table);
}

bool ProcessNode::NextOutgoing(int timeout_ms, OutgoingMessage* out) {
  std::vector<OutgoingMessage> batch = NextOutgoingBatch(timeout_ms, 1, 0);
  if (batch.empty()) return false;
  *out = std::move(batch.front());
  return true;
}

std::vector<OutgoingMessage> ProcessNode::NextOutgoingBatch(int timeout_ms, size_t max_messages, size_t max_bytes) {
  using SteadyClock = std::chrono::steady_clock;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  std::vector<OutgoingMessage> taken;
  auto pause = std::chrono::microseconds(10);
  while (true) {
    Status checked = TakeHeldMessages(&taken);
    // While messages wait for the device, wait for the outbox only briefly
    // (a new message still wakes this at once), and look at them again.
    std::chrono::microseconds wait = std::chrono::duration_cast<std::chrono::microseconds>(deadline - SteadyClock::now());
    if (!taken.empty()) {
      wait = std::chrono::microseconds(0);
    } else if (!held_releases_.empty() || !held_frames_.empty()) {
      wait = std::min(wait, pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
    std::vector<OutgoingMessage> popped = queues_->PopOutgoing(wait, max_messages, max_bytes);
    for (OutgoingMessage& message : popped) {
      if (!checked.ok()) break;
      bool wait_for_frame = false;
      checked = MustWaitForFrame(message, &wait_for_frame);
      if (wait_for_frame) {
        queues_->CountHeld(static_cast<int64_t>(message.payload_bytes()));
        held_frames_.push_back({std::move(message), SteadyClock::now()});
        continue;
      }
      if (message.frame) message.frame->ready.reset();
      if (message.after && !ipc_->SharesDeviceWith(message.receiver)) {
        held_releases_.push_back({std::move(message), SteadyClock::now()});
      } else {
        // In order: a release for a peer on this device waits here (IpcLinks::SharesDeviceWith).
        if (checked.ok() && message.after) {
          HopLog::Record(rank_, "release-wait", message.receiver, 0);
          checked = ipc_->WaitDone(message.after, wait_timeout_ms_);
          HopLog::Record(rank_, "release-waited", message.receiver, 0);
        }
        message.after.reset();
        taken.push_back(std::move(message));
      }
    }
    if (checked.ok() && !popped.empty()) checked = TakeHeldMessages(&taken);
    if (!checked.ok()) {
      // The device failed under a copy or a release's reads: the engine's
      // threads report it too.
      Abort(checked.WithContext("worker " + std::to_string(rank_) + "'s send thread"));
      return {};
    }
    if (!taken.empty() || SteadyClock::now() >= deadline) break;
    // The wait ran out with nothing held, or the outbox is closed and drained.
    if (held_releases_.empty() && held_frames_.empty() && popped.empty()) break;
  }
  if (taken.size() < 2) return taken;
  // Per receiver, in order: each run of small messages becomes one batch (a
  // run of one stays as it is); a large one goes alone, zero-copy.
  std::vector<OutgoingMessage> out;
  std::vector<bool> done(taken.size(), false);
  for (size_t first = 0; first < taken.size(); ++first) {
    if (done[first]) continue;
    const int receiver = taken[first].receiver;
    std::vector<size_t> run;
    const auto flush = [&] {
      OutgoingMessage batch;
      if (run.size() > 1 && JoinBatch(receiver, taken, run, &batch).ok()) {
        out.push_back(std::move(batch));
      } else {  // one message, or (never expected) one the batch could not hold
        for (size_t i : run) out.push_back(std::move(taken[i]));
      }
      run.clear();
    };
    for (size_t i = first; i < taken.size(); ++i) {
      if (done[i] || taken[i].receiver != receiver) continue;
      done[i] = true;
      if (taken[i].payload_bytes() < kBatchBelowBytes && run.size() < kMaxBatchParts) {
        run.push_back(i);
        continue;
      }
      flush();
      if (taken[i].payload_bytes() < kBatchBelowBytes) {
        run.push_back(i);
      } else {
        out.push_back(std::move(taken[i]));
      }
    }
    flush();
  }
  return out;
}

Status ProcessNode::TakeHeldMessages(std::vector<OutgoingMessage>* out) {
  MLT_RETURN_IF_ERROR(TakeFinishedReleases(out));
  return TakeReadyFrames(out);
}

Status ProcessNode::TakeFinishedReleases(std::vector<OutgoingMessage>* out) {
  for (auto held = held_releases_.begin(); held != held_releases_.end();) {
    bool done = false;
    MLT_RETURN_IF_ERROR(ipc_->IsDone(held->message.after, &done));
    if (!done) {
      const auto waited = std::chrono::steady_clock::now() - held->since;
      if (waited > std::chrono::milliseconds(wait_timeout_ms_)) {
        return Status::Timeout("CUDA IPC: the reads a release waits for did not finish within " +
                               std::to_string(wait_timeout_ms_) + " ms");
      }
      ++held;
      continue;
    }
    held->message.after.reset();
    out->push_back(std::move(held->message));
    held = held_releases_.erase(held);
  }
  return Status::Ok();
}

namespace {

// Whether `frame` (null: none) is filled: its ticket, if it has one, done.
Status FrameFilled(const DeviceBuffer* frame, bool* filled) {
  *filled = true;
  if (frame == nullptr || !frame->ready) return Status::Ok();
  if (frame->block == nullptr) {
    return Status::Internal("a frame with a ticket to wait for names no device (DeviceBuffer::block is null)");
  }
  return frame->block->device()->QueryEvent(frame->ready, filled);
}

}  // namespace

Status ProcessNode::MustWaitForFrame(const OutgoingMessage& message, bool* wait) const {
  *wait = false;
  if (message.lane == OutgoingMessage::Lane::kNone) return Status::Ok();
  for (const HeldMessage& held : held_frames_) {
    if (held.message.receiver == message.receiver && held.message.lane == message.lane) {
      *wait = true;
      return Status::Ok();
    }
  }
  bool filled = true;
  MLT_RETURN_IF_ERROR(FrameFilled(message.frame.get(), &filled));
  *wait = !filled;
  return Status::Ok();
}

Status ProcessNode::TakeReadyFrames(std::vector<OutgoingMessage>* out) {
  // A receiver's inbox whose first held message is not ready keeps the
  // later ones held too.
  std::vector<std::pair<int, OutgoingMessage::Lane>> blocked;
  for (auto held = held_frames_.begin(); held != held_frames_.end();) {
    OutgoingMessage& message = held->message;
    const std::pair<int, OutgoingMessage::Lane> inbox{message.receiver, message.lane};
    bool done = std::find(blocked.begin(), blocked.end(), inbox) == blocked.end();
    if (done) MLT_RETURN_IF_ERROR(FrameFilled(message.frame.get(), &done));
    if (!done) {
      if (std::chrono::steady_clock::now() - held->since > std::chrono::milliseconds(wait_timeout_ms_)) {
        return Status::Timeout("the device work filling a host frame for rank " + std::to_string(message.receiver) +
                               " did not finish within " + std::to_string(wait_timeout_ms_) + " ms");
      }
      blocked.push_back(inbox);
      ++held;
      continue;
    }
    if (message.frame) message.frame->ready.reset();
    queues_->CountHeld(-static_cast<int64_t>(message.payload_bytes()));
    out->push_back(std::move(message));
    held = held_frames_.erase(held);
  }
  return Status::Ok();
}

Status ProcessNode::JoinBatch(int receiver, const std::vector<OutgoingMessage>& messages,
                              const std::vector<size_t>& run, OutgoingMessage* batch) const {
  std::vector<FramePair> parts;
  parts.reserve(run.size());
  for (size_t i : run) {
    const OutgoingMessage& message = messages[i];
    parts.push_back({message.header.data(), message.header.size(), message.payload_values(), message.payload_bytes()});
  }
  batch->receiver = receiver;
  return EncodeBatch(rank_, receiver, parts, &batch->header, &batch->payload);
}

int64_t ProcessNode::outbox_messages() const {
  MutexLock lock(&queues_->mu);
  return static_cast<int64_t>(queues_->outbox.size());
}

int64_t ProcessNode::outbox_bytes() const {
  MutexLock lock(&queues_->mu);
  return queues_->outbox_bytes.held;
}

int64_t ProcessNode::peak_outbox_bytes() const {
  MutexLock lock(&queues_->mu);
  return queues_->outbox_bytes.peak;
}

void ProcessNode::SetOutboxLimit(int64_t bytes) {
  {
    MutexLock lock(&queues_->mu);
    queues_->outbox_bytes.SetLimit(bytes);
  }
  queues_->room.NotifyAll();
}

Status ProcessNode::Deliver(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                            int64_t token) {
  if (!IsBatch(frame0, frame0_bytes)) return DeliverOne(frame0, frame0_bytes, payload, payload_bytes, token);
  // A batch's parts are small: each is copied out, and the frames are done
  // with before this returns.
  if (token >= 0) borrowed_->Release(token);
  std::vector<FramePair> parts;
  int sender = -1;
  int receiver = -1;
  Status status = DecodeBatch(frame0, frame0_bytes, payload, payload_bytes, &parts, &sender, &receiver);
  if (status.ok() && (receiver != rank_ || sender < 0 || sender >= num_workers_ || sender == rank_)) {
    status = Status::CorruptMessage("a batch from process " + std::to_string(sender) + " for process " +
                                    std::to_string(receiver) + " reached process " + std::to_string(rank_));
  }
  if (!status.ok()) {
    queues_->host.Reject(status, Message());
    return status;
  }
  Status first_refusal;
  for (const FramePair& part : parts) {
    const Status delivered = DeliverOne(part.frame0, part.frame0_bytes, part.payload, part.payload_bytes, -1);
    if (!delivered.ok() && first_refusal.ok()) first_refusal = delivered;  // each refusal is counted
  }
  return first_refusal;
}

Status ProcessNode::DeliverOne(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                               int64_t token) {
  if (IsIpcEnvelope(frame0, frame0_bytes)) {
    if (token >= 0) borrowed_->Release(token);  // an envelope's payload frame is empty: nothing to keep
    return DeliverIpc(frame0, frame0_bytes, payload_bytes);
  }
  Message message;
  // On a device whose memory is host memory the payload is used where
  // ZeroMQ put it (no copy: the message's host frame views it). Otherwise
  // one copy out of ZeroMQ's memory, into a recycled host frame (pinned on
  // CUDA), which the receiver copies to the device once.
  DeviceBufferPool* frames = frames_.get();
  BorrowedFrames* borrowed = borrowed_.get();
  bool lent = false;
  Status status = DecodeMessage(frame0, frame0_bytes, payload, payload_bytes, &message,
                                [&](Message* decoded, size_t count, float** destination) {
                                  *destination = nullptr;
                                  if (count == 0) return Status::Ok();
                                  if (token >= 0 && borrowed->CanBorrow(payload)) {
                                    decoded->host_frame =
                                        borrowed->Borrow(static_cast<const float*>(payload), count, token);
                                    lent = true;
                                    return Status::Ok();
                                  }
                                  MLT_RETURN_IF_ERROR(frames->AcquireForHost(count, &decoded->host_frame));
                                  *destination = decoded->host_frame->data;
                                  return Status::Ok();
                                });
  // A payload not lent is done with now; a lent one comes back when its
  // buffer dies (also below, if the message is refused).
  if (token >= 0 && !lent) borrowed_->Release(token);
  return Admit(std::move(message), status);
}

Status ProcessNode::DeliverIpc(const void* frame0, size_t frame0_bytes, size_t payload_bytes) {
  IpcEnvelope envelope;
  Status status = DecodeIpcEnvelope(frame0, frame0_bytes, payload_bytes, &envelope);
  if (status.ok() && (envelope.receiver != rank_ || envelope.sender < 0 || envelope.sender >= num_workers_ ||
                      envelope.sender == rank_)) {
    status = Status::CorruptMessage("a CUDA IPC envelope from process " + std::to_string(envelope.sender) +
                                    " for process " + std::to_string(envelope.receiver) + " reached process " +
                                    std::to_string(rank_));
  }
  if (status.ok() && envelope.type == MessageType::kIpcRelease) status = ipc_->OnRelease(envelope);
  if (!status.ok() || envelope.type == MessageType::kIpcRelease) {
    if (!status.ok()) queues_->host.Reject(status, Message());
    return status;
  }
  // The payload lies in this process's landing region: DecodeMessage checks
  // the notice's size against the message's spans, and Land its place
  // against the sender's slice, before anything reads it. The payload
  // pointer only tells DecodeMessage there is one; nothing reads it here.
  IpcLinks* ipc = ipc_.get();
  Message message;
  status = DecodeMessage(envelope.inner, envelope.inner_bytes, frame0, static_cast<size_t>(envelope.span.bytes),
                         &message, [&](Message* decoded, size_t count, float** destination) {
                           *destination = nullptr;
                           if (count == 0) return Status::CorruptMessage("a CUDA IPC notice of an empty payload");
                           return ipc->Land(envelope, &decoded->device_values);
                         });
  if (status.ok() && message.header.sender != envelope.sender) {
    status = Status::CorruptMessage("a CUDA IPC notice from process " + std::to_string(envelope.sender) +
                                    " announces a message from process " + std::to_string(message.header.sender));
  }
  return Admit(std::move(message), status);
}

Status ProcessNode::Admit(Message&& message, Status status) {
  if (status.ok() && message.header.receiver != rank_) {
    status = Status::CorruptMessage("message for process " + std::to_string(message.header.receiver) +
                                    " reached process " + std::to_string(rank_));
  }
  const int sender = message.header.sender;
  if (status.ok() && (sender < 0 || sender >= num_workers_ || sender == rank_)) {
    status = Status::CorruptMessage("message from process " + std::to_string(sender) +
                                    ", not another rank of 0.." + std::to_string(num_workers_ - 1));
  }
  if (!status.ok()) {
    queues_->host.Reject(status, Message());
    return status;
  }
  HopLog::Record(rank_, "admitted", message);
  status = queues_->host.PushBounded(std::move(message), wait_timeout_ms_);
  // A full inbox for the whole wait: this process's shard or installer is
  // stuck, and every worker would wait for its clocks forever.
  if (!status.ok()) Abort(status);
  return status;
}

void ProcessNode::SetInboxLimit(int64_t bytes) { queues_->host.SetInboxLimit(bytes); }

int64_t ProcessNode::inbox_bytes() const { return queues_->host.inbox_bytes(); }

int64_t ProcessNode::peak_inbox_bytes() const { return queues_->host.peak_inbox_bytes(); }

void ProcessNode::Abort(const Status& why) {
  {
    MutexLock lock(&queues_->mu);
    if (queues_->aborted) return;
    queues_->aborted = true;
  }
  queues_->room.NotifyAll();
  queues_->host.StopWaiting();
  engine_->Abort(why);
}

bool ProcessNode::aborted() const {
  MutexLock lock(&queues_->mu);
  return queues_->aborted;
}

Status ProcessNode::ExportShardTable(TableId table, ShardSlice* out, BranchId branch) {
  return queues_->host.ExportTable(table, out, branch);
}

Status ProcessNode::ImportShardTable(TableId table, const float* values, size_t num_values, const float* state,
                                     size_t num_state) {
  return queues_->host.ImportTable(table, values, num_values, state, num_state);
}

int64_t ProcessNode::rejected_messages() const { return queues_->host.rejected(); }

Status ProcessNode::TakeReleasedPayloads(std::vector<int64_t>* tokens) { return borrowed_->TakeReleased(tokens); }

bool ProcessNode::lends_payloads() const { return borrowed_->device_reads_host_memory(); }

int64_t ProcessNode::borrowed_payloads() const { return borrowed_->outstanding(); }

int64_t ProcessNode::payloads_used_in_place() const { return borrowed_->borrowed_total(); }

Status ProcessNode::ExportCudaIpc(size_t slice_bytes, std::string* handle) { return ipc_->Export(slice_bytes, handle); }

int64_t ProcessNode::device_total_bytes() const {
  int64_t free_bytes = -1;
  int64_t total_bytes = -1;
  if (!queues_->device || !queues_->device->MemoryInfo(&free_bytes, &total_bytes).ok()) return -1;
  return total_bytes;
}

Status ProcessNode::OpenCudaIpcPeer(int peer, const std::string& handle, size_t slice_bytes) {
  return ipc_->OpenPeer(peer, handle, slice_bytes);
}

Status ProcessNode::EnableCudaIpcPeer(int peer) { return ipc_->Enable(peer); }

std::vector<int> ProcessNode::cuda_ipc_peers() const { return ipc_->peers(); }

std::vector<int> ProcessNode::cuda_ipc_same_device_peers() const {
  std::vector<int> same;
  for (int peer : ipc_->peers()) {
    if (ipc_->SharesDeviceWith(peer)) same.push_back(peer);
  }
  return same;
}

IpcStats ProcessNode::cuda_ipc_stats() const { return ipc_->stats(); }

int64_t ProcessNode::socket_payload_bytes() const { return socket_payload_bytes_.load(); }

int64_t ProcessNode::device_payload_bytes_by_host() const { return device_payload_bytes_by_host_.load(); }

Status ProcessNode::Shutdown() {
  if (!engine_) return Status::Ok();
  const Status status = engine_->Shutdown();
  queues_->host.Stop();
  queues_->Close();
  return status;
}

}  // namespace mltuner
