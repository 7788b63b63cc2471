// The receive side of a worker: installs fresh rows pushed by the shards into
// the parameter cache under the partition locks, advances data age, and
// completes synchronous requests. Runs on the engine inbox thread.
#include "cache/row_installer.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "memory/device_block.h"
#include "memory/partition_locks.h"
#include "sharding/shard_range.h"

namespace mltuner {

RowInstaller::RowInstaller(int rank, int num_workers, std::shared_ptr<Device> device, const PipelinePlan* plan,
                           SharedState* state)
    : rank_(rank), num_workers_(num_workers), device_(device), plan_(plan), state_(state), landing_(std::move(device), 0) {
  landing_.set_idle_bound_to_peak(true);
}

Status RowInstaller::Handle(Message&& message) {
  ++state_->messages_received;
  switch (message.type()) {
    case MessageType::kRows: {
      // Rows that cannot be installed leave this worker waiting for a data
      // age that never comes: fail now, with the cause, rather than time out.
      const Status status = InstallRows(message);
      if (!status.ok() && status.code() != StatusCode::kShutdown) state_->Fail(status.WithContext(ThreadContext(rank_, "receive")));
      return status;
    }
    case MessageType::kFetchReply:
    case MessageType::kAck:
    case MessageType::kError:
      return CompleteRequest(std::move(message));
    default:
      return Status::InvalidArgument(std::string("worker ") + std::to_string(rank_) +
                                     " received a server-bound message: " + message.DebugString());
  }
}

Status RowInstaller::InstallRows(const Message& message) {
  // One read of the phase: the initial rows reach the last worker to start
  // while its StartIterations moves kRecorded -> kRunning, and two reads
  // (`!= kRunning && != kRecorded`) could see kRecorded and then kRunning,
  // refusing rows that are legal in both phases (they were lost for good).
  const Phase phase = state_->phase.load();
  if (phase == Phase::kShutdown) {
    return Status::Shutdown("rows arrived after shutdown: " + message.DebugString());
  }
  if (phase != Phase::kRunning && phase != Phase::kRecorded) {
    return Status::OutOfOrder("rows arrived before the virtual iteration was finished: " + message.DebugString());
  }
  const TableId table = message.header.table;
  const int shard = message.header.sender;
  const std::vector<TableInfo>& tables = plan_->tables;
  if (table < 0 || table >= static_cast<TableId>(tables.size()) || tables[table].local) {
    return Status::NotFound("rows for unknown table id " + std::to_string(table));
  }
  if (shard < 0 || shard >= num_workers_) {
    return Status::InvalidArgument("rows from unknown shard " + std::to_string(shard));
  }
  const TableInfo& info = tables[table];
  // A shard pushes its rows whole or, for a table whose clock moves in
  // parts, part by part in row order (sharding/shard_range.h, ShardParts).
  const TableIndex& index = plan_->index.tables[table];
  int piece = -1;
  if (!message.spans.empty()) {
    piece = FindPiece(index, shard, message.spans[0].begin);
  } else if (index.pieces[index.first_piece[shard]].range.count == 0) {
    piece = index.first_piece[shard];  // a shard that owns no rows: its one empty piece
  }
  const RowSpan range = piece >= 0 ? index.pieces[piece].range : RowSpan{};
  const bool whole_piece = piece >= 0 && (range.count == 0 ? message.spans.empty()
                                                           : message.spans.size() == 1 &&
                                                                 message.spans[0].count == range.count);
  if (!whole_piece || message.header.row_width != info.row_width ||
      message.num_values() != static_cast<size_t>(range.count * info.row_width)) {
    const RowSpan rows = ShardRange(info.num_rows, shard, num_workers_);
    return Status::InvalidArgument("rows for table '" + info.name + "' from shard " + std::to_string(shard) +
                                   " do not match its rows " + std::to_string(rows.begin) + "+" +
                                   std::to_string(rows.count) + " or one of their " +
                                   std::to_string(index.first_piece[shard + 1] - index.first_piece[shard]) +
                                   " parts: " + message.DebugString());
  }
  {
    MutexLock lock(&state_->age_mu);
    if (message.header.branch != state_->cache_branch) return Status::Ok();  // the cache moved to another branch
    if (message.header.clock <= state_->piece_age[table][piece]) return Status::Ok();  // not newer
  }
  // Installs are queued on the install stream (CacheTickets, table_store.h,
  // orders them against the gathers), so neither this thread nor the
  // allocator waits for the copies. Device payloads wait for their producer
  // there too.
  if (message.host_frame) {
    MLT_RETURN_IF_ERROR(InstallFrame(message, piece, range));
  } else {
    MLT_RETURN_IF_ERROR(InstallValues(message, piece, range));
  }
  MLT_RETURN_IF_ERROR(device_->TakeError());
  {
    MutexLock lock(&state_->age_mu);
    // Rows of a branch the cache left while they were copied are overwritten
    // by the new branch's rows, which this thread installs next; their age
    // must not count.
    if (message.header.branch != state_->cache_branch) return Status::Ok();
    std::vector<mltuner::Clock>& pieces = state_->piece_age[table];
    pieces[piece] = std::max(pieces[piece], message.header.clock);
    // The shard's age: its least piece's (a push moves it at its last part).
    const mltuner::Clock age = *std::min_element(pieces.begin() + index.first_piece[shard],
                                                 pieces.begin() + index.first_piece[shard + 1]);
    std::vector<mltuner::Clock>& ages = state_->shard_age[table];
    if (age <= ages[shard]) return Status::Ok();
    ages[shard] = age;
    state_->data_age[table] = *std::min_element(ages.begin(), ages.end());
    if (plan_->own_updates[table]) plan_->own_updates[table]->Forget(message.header.branch, state_->data_age[table]);
  }
  state_->age_cv.NotifyAll();
  return Status::Ok();
}

namespace {

// The held lock span of one install: from the first to the last layout
// position of its segments, so that the install's ticket is set before any
// of its rows can be gathered again.
PartitionLocks::Guard LockInstall(const TableStore& store, const std::vector<WireSegment>& segments) {
  int64_t first = segments.front().first_position;
  int64_t last = segments.front().last_position;
  for (const WireSegment& segment : segments) {
    first = std::min(first, segment.first_position);
    last = std::max(last, segment.last_position);
  }
  return store.locks->LockExclusive(first, last - first + 1);
}

}  // namespace

// Rows in a host vector (this process's shard on the CPU backend) or in a
// device payload (this process's shard, or CUDA IPC): a copy per segment.
Status RowInstaller::InstallValues(const Message& message, int piece, const RowSpan& range) {
  const TableStore& store = *plan_->stores[message.header.table];
  const std::vector<WireSegment>& segments = plan_->index.tables[message.header.table].receive[piece];
  if (segments.empty()) return Status::Ok();
  const int64_t width = store.info.row_width;
  const DeviceBuffer* on_device = message.device_values.get();
  const float* payload = on_device != nullptr ? on_device->data : message.values.data();
  auto guard = LockInstall(store, segments);
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, store.tickets.last_gather()));
  if (on_device != nullptr) MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, on_device->ready));
  bool host_writes = false;
  for (const WireSegment& segment : segments) {
    const float* src = payload + (segment.begin - range.begin) * width;
    float* dst = store.values(segment.residence) + segment.slot * width;
    const size_t bytes = static_cast<size_t>(segment.count * store.info.row_bytes());
    if (segment.residence == Residence::kDevice) {
      if (on_device != nullptr) {
        device_->CopyDeviceToDevice(dst, src, bytes, Stream::kInstall);
      } else {
        device_->CopyHostToDevice(dst, src, bytes, Stream::kInstall);  // reads the pageable source at once
      }
    } else if (on_device != nullptr) {
      device_->CopyDeviceToHost(dst, src, bytes, Stream::kInstall);  // into the pinned host store
    } else {
      host_writes = true;
    }
  }
  if (host_writes) MLT_RETURN_IF_ERROR(WriteHostRows(store, segments, range, payload));
  MLT_RETURN_IF_ERROR(ReapplyOwnSteps(message, piece, segments));
  DeviceEvent installed;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kInstall, &installed));
  if (on_device != nullptr) message.device_values->last_use = installed;
  store.tickets.set_last_install(std::move(installed));
  return Status::Ok();
}

// Rows from another process, in a host frame (complete: the transport waited
// for its ticket). The device-resident rows take one host -> device copy of
// the whole frame into a landing buffer and one scatter kernel (the prepared
// `unpack` index) into the cache, queued on the install stream under the
// partition locks of the rows' positions; on the CPU backend the kernel
// reads the frame directly. Host-resident rows are copied on this thread
// once the table's queued copies are done. The frame and the landing buffer
// go back to their pools with the install's ticket; data age advances at
// once, since every gather that reads the rows waits for the install.
Status RowInstaller::InstallFrame(const Message& message, int piece, const RowSpan& range) {
  const TableId table = message.header.table;
  const TableStore& store = *plan_->stores[table];
  const TableIndex& index = plan_->index.tables[table];
  const std::vector<WireSegment>& segments = index.receive[piece];
  const int64_t width = store.info.row_width;
  DeviceBuffer& frame = *message.host_frame;
  if (segments.empty()) return Status::Ok();
  // One lock span for the one kernel: held only while the work is queued.
  auto guard = LockInstall(store, segments);
  const RunIndex& unpack = index.unpack[piece];
  if (unpack.total_rows > 0) {
    MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, store.tickets.last_gather()));
    const float* source = frame.data;
    std::shared_ptr<DeviceBuffer> landing;
    if (!device_->host_addressable()) {
      MLT_RETURN_IF_ERROR(landing_.Acquire(frame.count, Stream::kInstall, &landing));
      device_->CopyHostToDevice(landing->data, frame.data, frame.count * sizeof(float), Stream::kInstall);
      source = landing->data;
    }
    device_->Gather(store.values(Residence::kDevice), source, unpack, width, Stream::kInstall);
    MLT_RETURN_IF_ERROR(ReapplyOwnSteps(message, piece, segments));
    DeviceEvent installed;
    MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kInstall, &installed));
    if (landing) landing->last_use = installed;
    frame.last_use = installed;
    store.tickets.set_last_install(std::move(installed));
  }
  if (!index.receive_on_device[piece]) MLT_RETURN_IF_ERROR(WriteHostRows(store, segments, range, frame.data));
  return Status::Ok();
}

// Read-my-writes: the rows just queued for install are the shard's of the
// message's clock; this worker's own steps of later clocks go back on top.
Status RowInstaller::ReapplyOwnSteps(const Message& message, int piece, const std::vector<WireSegment>& segments) {
  OwnUpdates* own = plan_->own_updates[message.header.table].get();
  if (own == nullptr) return Status::Ok();
  return own->Reinstall(message.header.branch, piece, message.header.clock, segments);
}

// The host-resident rows of `segments`, copied on the host from `source`
// (whose first row is range.begin): once the queued gathers, which may still
// read them, and the queued installs, which may still write them, are done.
Status RowInstaller::WriteHostRows(const TableStore& store, const std::vector<WireSegment>& segments,
                                   const RowSpan& range, const float* source) {
  MLT_RETURN_IF_ERROR(device_->WaitEventDone(store.tickets.last_gather()));
  MLT_RETURN_IF_ERROR(device_->WaitEventDone(store.tickets.last_install()));
  const int64_t width = store.info.row_width;
  for (const WireSegment& segment : segments) {
    if (segment.residence != Residence::kHost) continue;
    std::memcpy(store.values(Residence::kHost) + segment.slot * width, source + (segment.begin - range.begin) * width,
                static_cast<size_t>(segment.count * store.info.row_bytes()));
  }
  return Status::Ok();
}

Status RowInstaller::CompleteRequest(Message&& message) {
  if (message.type() == MessageType::kError && message.header.request_id == 0) {
    // A shard refused a message that has no reply (a clock's updates, ours
    // or another worker's): that clock never finishes, the job cannot go on.
    // The text names the shard, the sender and why; the code travels too.
    state_->Fail(ErrorOf(message));
    return Status::Ok();
  }
  std::shared_ptr<PendingRequest> request;
  {
    MutexLock lock(&state_->age_mu);
    auto it = state_->requests.find(message.header.request_id);
    if (it == state_->requests.end()) {
      return Status::InvalidArgument("reply to unknown request " + std::to_string(message.header.request_id));
    }
    request = it->second;
    if (message.type() == MessageType::kError && request->error.ok()) {
      // The refusal's code travels with it (a freed branch is NotFound, as
      // the branch calls say); peers of before it sent none.
      const Status why = ErrorOf(message);
      request->error = Status::FromCode(
          message.header.clock == 0 ? StatusCode::kInvalidArgument : why.code(),
          "shard " + std::to_string(message.header.sender) + " refused the request: " + message.text);
    }
    request->replies.push_back(std::move(message));
    --request->replies_missing;
  }
  state_->age_cv.NotifyAll();
  return Status::Ok();
}

}  // namespace mltuner
