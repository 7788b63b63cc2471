#include "cluster/ipc_links.h"

#include <chrono>
#include <utility>

namespace mltuner {

// The receiving side's state, shared with the landing buffers' deleters
// (which run on the shard's or the installer's thread, or later).
struct IpcLinks::Receiving {
  Mutex mu;
  std::vector<std::unique_ptr<ByteRanges>> ranges GUARDED_BY(mu);  // per sender: its slice of my region
  PostRelease post GUARDED_BY(mu);                                 // null once stopped
  IpcStats stats GUARDED_BY(mu);  // received_*, copied_out_* and releases_sent
};

IpcLinks::IpcLinks(int rank, int num_workers, std::shared_ptr<Device> device)
    : rank_(rank),
      num_workers_(num_workers),
      device_(std::move(device)),
      peer_slice_bytes_(static_cast<size_t>(num_workers), 0),
      enabled_(new std::atomic<bool>[static_cast<size_t>(num_workers)]),
      sending_(static_cast<size_t>(num_workers)),
      event_uses_(DeviceIpc::kCopyEvents, 0),
      receiving_(std::make_shared<Receiving>()) {
  for (int peer = 0; peer < num_workers; ++peer) enabled_[peer].store(false);
  MutexLock lock(&receiving_->mu);
  receiving_->ranges.resize(static_cast<size_t>(num_workers));
}

IpcLinks::~IpcLinks() { StopPosting(); }

Status IpcLinks::Export(size_t slice_bytes, std::string* handle) {
  if (ipc_) return Status::InvalidArgument("worker " + std::to_string(rank_) + " exported its CUDA IPC region already");
  if (num_workers_ < 2) return Status::InvalidArgument("CUDA IPC needs a peer; this job has one worker");
  if (slice_bytes == 0 || slice_bytes % kAlignment != 0) {
    return Status::InvalidArgument("a CUDA IPC landing slice must be a positive multiple of " +
                                   std::to_string(kAlignment) + " bytes, not " + std::to_string(slice_bytes));
  }
  const size_t peers = static_cast<size_t>(num_workers_ - 1);
  if (slice_bytes > SIZE_MAX / peers) return Status::InvalidArgument("the CUDA IPC landing region would overflow");
  std::unique_ptr<DeviceIpc> ipc;
  MLT_RETURN_IF_ERROR(device_->ExportIpc(slice_bytes * peers, &ipc));
  {
    MutexLock lock(&receiving_->mu);
    for (int peer = 0; peer < num_workers_; ++peer) {
      if (peer != rank_) receiving_->ranges[peer] = std::make_unique<ByteRanges>(slice_bytes);
    }
  }
  slice_bytes_ = slice_bytes;
  copies_ = std::make_shared<DeviceBufferPool>(device_, 0);
  copies_->set_idle_bound_to_peak(true);  // a clock's copies stay for the next: no allocation in the steady state
  *handle = ipc->handle();
  ipc_ = std::move(ipc);
  return Status::Ok();
}

Status IpcLinks::OpenPeer(int peer, const std::string& handle, size_t slice_bytes) {
  if (!ValidPeer(peer)) return Status::InvalidArgument("no peer rank " + std::to_string(peer) + " to open by CUDA IPC");
  if (!ipc_) return Status::InvalidArgument("export this process's CUDA IPC region before opening peers'");
  if (slice_bytes == 0 || slice_bytes % kAlignment != 0) {
    return Status::InvalidArgument("peer " + std::to_string(peer) + "'s CUDA IPC slice of " +
                                   std::to_string(slice_bytes) + " bytes is not a positive multiple of " +
                                   std::to_string(kAlignment));
  }
  const size_t peers = static_cast<size_t>(num_workers_ - 1);
  if (slice_bytes > SIZE_MAX / peers) return Status::InvalidArgument("peer's CUDA IPC region would overflow");
  MLT_RETURN_IF_ERROR(ipc_->OpenPeer(peer, handle, slice_bytes * peers));
  MutexLock lock(&send_mu_);
  peer_slice_bytes_[peer] = slice_bytes;
  sending_[peer] = std::make_unique<ByteRanges>(slice_bytes);
  return Status::Ok();
}

Status IpcLinks::Enable(int peer) {
  if (!ValidPeer(peer)) return Status::InvalidArgument("no peer rank " + std::to_string(peer) + " for CUDA IPC");
  {
    MutexLock lock(&send_mu_);
    if (!ipc_ || peer_slice_bytes_[peer] == 0) {
      return Status::InvalidArgument("CUDA IPC with rank " + std::to_string(peer) +
                                     " needs this process's export and the peer's opened first");
    }
  }
  enabled_[peer].store(true);
  return Status::Ok();
}

bool IpcLinks::enabled(int peer) const { return ValidPeer(peer) && enabled_[peer].load(std::memory_order_acquire); }

std::vector<int> IpcLinks::peers() const {
  std::vector<int> out;
  for (int peer = 0; peer < num_workers_; ++peer) {
    if (enabled(peer)) out.push_back(peer);
  }
  return out;
}

void IpcLinks::SetPost(PostRelease post) {
  MutexLock lock(&receiving_->mu);
  receiving_->post = std::move(post);
}

void IpcLinks::StopPosting() {
  MutexLock lock(&receiving_->mu);
  receiving_->post = nullptr;
}

Status IpcLinks::TrySend(int peer, OutgoingMessage::Lane message_lane, DeviceBuffer* buffer,
                         const std::string& message_frame0, std::string* notice, bool* sent) {
  *sent = false;
  const int lane = EventLane(message_lane);
  if (lane < 0) return Status::InvalidArgument("CUDA IPC: a payload for no inbox (OutgoingMessage::Lane::kNone)");
  if (!enabled(peer) || buffer->count == 0) return Status::Ok();
  const uint64_t bytes = buffer->count * sizeof(float);
  IpcSpan span;
  {
    MutexLock lock(&send_mu_);
    ByteRanges& ranges = *sending_[peer];
    // A full slice gets back what the peer reads as soon as its releases
    // come, typically within a clock's kernels: wait for that as long as
    // the host-frame path would take (about kHostPathBytesPerSecond), never
    // longer, and never when nothing is out to come back.
    const auto start = std::chrono::steady_clock::now();
    const auto deadline =
        start + std::chrono::microseconds(static_cast<int64_t>(bytes * 1e6 / kHostPathBytesPerSecond));
    bool waited = false;
    while (!ranges.FindFree(bytes, kAlignment, &span.offset)) {
      if (bytes > ranges.capacity() || ranges.used_bytes() == 0 || !released_.WaitUntil(deadline)) {
        ++send_stats_.fallbacks;
        return Status::Ok();
      }
      waited = true;
    }
    if (waited) {
      ++send_stats_.room_waits;
      send_stats_.room_wait_us +=
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
    }
    MLT_RETURN_IF_ERROR(ranges.Claim(span.offset, bytes));
    span.bytes = bytes;
    const int event = TakeEvent(lane);
    span.event = static_cast<uint64_t>(event);
    const size_t at = static_cast<size_t>(SlotIn(peer, rank_)) * peer_slice_bytes_[peer] + span.offset;
    DeviceEvent done;
    const Status copied = ipc_->CopyToPeer(peer, at, buffer->data, bytes, buffer->ready, event, &done);
    if (!copied.ok()) {
      (void)ranges.Free(span.offset, bytes);
      --event_uses_[event];
      return copied.WithContext("worker " + std::to_string(rank_) + "'s CUDA IPC copy to worker " + std::to_string(peer));
    }
    buffer->last_use = std::move(done);
    ++send_stats_.sent_messages;
    send_stats_.sent_bytes += static_cast<int64_t>(bytes);
    if (buffer->borrowed) ++send_stats_.sent_from_views;
  }
  *notice = EncodeIpcNotice(rank_, peer, span, message_frame0);
  *sent = true;
  return Status::Ok();
}

int IpcLinks::TakeEvent(int lane) {
  const int first = lane * DeviceIpc::kEventsPerLane;
  int& next = next_event_[lane];
  int event = first + next;
  for (int i = 0; i < DeviceIpc::kEventsPerLane; ++i) {
    const int candidate = first + (next + i) % DeviceIpc::kEventsPerLane;
    if (event_uses_[candidate] == 0) {
      event = candidate;
      break;
    }
  }
  ++event_uses_[event];
  next = (event - first + 1) % DeviceIpc::kEventsPerLane;
  return event;
}

Status IpcLinks::OnRelease(const IpcEnvelope& release) {
  const int peer = release.sender;  // the process that read the payload
  if (!enabled(peer)) {
    return Status::CorruptMessage("a CUDA IPC release from worker " + std::to_string(peer) +
                                  ", with which this process uses no CUDA IPC");
  }
  MutexLock lock(&send_mu_);
  const uint64_t event = release.span.event;
  if (event >= event_uses_.size() || event_uses_[event] == 0) {
    return Status::CorruptMessage("a CUDA IPC release from worker " + std::to_string(peer) + " names copy event " +
                                  std::to_string(event) + ", which no payload out uses");
  }
  MLT_RETURN_IF_ERROR(sending_[peer]->Free(release.span.offset, release.span.bytes)
                          .WithContext("a CUDA IPC release from worker " + std::to_string(peer)));
  --event_uses_[event];
  ++send_stats_.releases_received;
  released_.NotifyAll();
  return Status::Ok();
}

Status IpcLinks::Land(const IpcEnvelope& notice, std::shared_ptr<DeviceBuffer>* out) {
  const int sender = notice.sender;
  const std::string from = "a CUDA IPC notice from worker " + std::to_string(sender);
  if (!ipc_ || !enabled(sender)) return Status::CorruptMessage(from + ", with which this process uses no CUDA IPC");
  const IpcSpan span = notice.span;
  if (span.offset % sizeof(float) != 0 || span.bytes % sizeof(float) != 0) {
    return Status::CorruptMessage(from + ": bytes [" + std::to_string(span.offset) + ", +" +
                                  std::to_string(span.bytes) + ") are not whole floats");
  }
  if (span.event >= static_cast<uint64_t>(DeviceIpc::kCopyEvents)) {
    return Status::CorruptMessage(from + " names copy event " + std::to_string(span.event) + " of " +
                                  std::to_string(DeviceIpc::kCopyEvents));
  }
  bool crowded = false;
  {
    MutexLock lock(&receiving_->mu);
    ByteRanges& ranges = *receiving_->ranges[sender];
    MLT_RETURN_IF_ERROR(ranges.Claim(span.offset, span.bytes).WithContext(from));
    crowded = ranges.used_bytes() > ranges.capacity() / 2;
  }
  DeviceEvent ready;
  const Status waited = ipc_->PeerWrites(sender, static_cast<int>(span.event), &ready);
  if (!waited.ok()) {
    MutexLock lock(&receiving_->mu);
    (void)receiving_->ranges[sender]->Free(span.offset, span.bytes);
    return waited;
  }
  auto* buffer = new DeviceBuffer();
  char* base = reinterpret_cast<char*>(ipc_->region()) + static_cast<size_t>(SlotIn(rank_, sender)) * slice_bytes_;
  buffer->data = reinterpret_cast<float*>(base + span.offset);
  buffer->count = static_cast<size_t>(span.bytes / sizeof(float));
  buffer->ready = std::move(ready);
  buffer->borrowed = true;  // read-only: the sender's bytes
  const int rank = rank_;
  std::weak_ptr<Receiving> receiving = receiving_;
  *out = std::shared_ptr<DeviceBuffer>(buffer, [receiving, rank, sender, span](DeviceBuffer* done) {
    std::unique_ptr<DeviceBuffer> owned(done);
    auto alive = receiving.lock();
    if (!alive) return;
    MutexLock lock(&alive->mu);
    (void)alive->ranges[sender]->Free(span.offset, span.bytes);
    if (!alive->post) return;  // the node is shutting down: the sender is done too
    ++alive->stats.releases_sent;
    alive->post(sender, EncodeIpcRelease(rank, sender, span), std::move(owned->last_use));
  });
  const bool copied = crowded && CopyOut(out);
  MutexLock lock(&receiving_->mu);
  ++receiving_->stats.received_messages;
  receiving_->stats.received_bytes += static_cast<int64_t>(span.bytes);
  if (copied) {
    ++receiving_->stats.copied_out_messages;
    receiving_->stats.copied_out_bytes += static_cast<int64_t>(span.bytes);
  }
  return Status::Ok();
}

// A payload's consumer may hold it for most of a clock (a shard waits for
// every worker's part, an installer for the reads of the rows it replaces).
// Held in place, the payloads of a model larger than the slice fill it, and
// the sender's next ones wait and then take the host path, tens of
// milliseconds each. A copy into pooled device memory (one pass at the
// device's bandwidth) lets the range go back as soon as it is done. A copy
// that cannot be made leaves the payload where it landed.
bool IpcLinks::CopyOut(std::shared_ptr<DeviceBuffer>* landed) {
  DeviceBuffer& source = **landed;
  std::shared_ptr<DeviceBuffer> copy;
  if (!copies_->Acquire(source.count, Stream::kReceive, &copy).ok() ||
      !device_->WaitEvent(Stream::kReceive, source.ready).ok()) {
    return false;
  }
  device_->CopyDeviceToDevice(copy->data, source.data, source.count * sizeof(float), Stream::kReceive);
  if (!device_->RecordEvent(Stream::kReceive, &copy->ready).ok()) {
    // No ticket for the copy: wait for it here, so that the range goes
    // back only once it has been read.
    if (!device_->Synchronize(Stream::kReceive).ok()) return false;
  }
  source.last_use = copy->ready;  // the release leaves once the copy has read the range
  *landed = std::move(copy);
  return true;
}

Status IpcLinks::WaitDone(const DeviceEvent& event, int64_t timeout_ms) {
  if (!event) return Status::Ok();
  return ipc_ ? ipc_->WaitDone(event, timeout_ms) : device_->WaitEventDone(event);
}

Status IpcLinks::IsDone(const DeviceEvent& event, bool* done) {
  *done = true;
  const Status waited = WaitDone(event, 0);
  if (waited.code() == StatusCode::kTimeout) {
    *done = false;
    return Status::Ok();
  }
  return waited;
}

IpcStats IpcLinks::stats() const {
  IpcStats out;
  {
    MutexLock lock(&send_mu_);
    out = send_stats_;
  }
  MutexLock lock(&receiving_->mu);
  out.received_messages = receiving_->stats.received_messages;
  out.received_bytes = receiving_->stats.received_bytes;
  out.copied_out_messages = receiving_->stats.copied_out_messages;
  out.copied_out_bytes = receiving_->stats.copied_out_bytes;
  out.releases_sent = receiving_->stats.releases_sent;
  return out;
}

}  // namespace mltuner
