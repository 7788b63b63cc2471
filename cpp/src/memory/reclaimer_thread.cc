// The reclaimer thread (geeps.md §2): runs behind the application along the
// op list. For each op the application has finished it frees the buffer,
// scatter-adds an update into the table's update log, writes kept local data
// back, and — at the table's last update of the clock — ships the log to the
// shards at once, so a top layer's updates travel while lower layers are
// still computing (Poseidon's wait-free backprop). Tables without updates
// send a bare clock at the iteration's clock op. A table with a single update
// per clock skips the log: its buffer is copied straight into the messages.
#include <algorithm>
#include <cstring>

#include "engine/engine_impl.h"

namespace mltuner {

void Engine::Impl::ReclaimerLoop() {
  for (int64_t seq = 0;; ++seq) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || app_seq_ > seq; });
      if (stopping_) return;
    }
    const Status status = ReclaimOp(seq);
    if (!status.ok()) {
      Fail(status);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      reclaimed_seq_ = seq + 1;
    }
    cv_.notify_all();
  }
}

Status Engine::Impl::ReclaimOp(int64_t seq) {
  const int64_t num_ops = static_cast<int64_t>(recording_.ops.size());
  const mltuner::Clock clock = seq / num_ops;
  const RecordedOp& op = recording_.ops[seq % num_ops];
  if (op.kind == OpKind::kClock) {
    for (const TableInfo& table : tables_) {
      if (!table.local && !index_.tables[table.id].has_updates) {
        MLT_RETURN_IF_ERROR(SendTableClock(table.id, clock));
      }
    }
    return Status::Ok();
  }
  if (op.kind != OpKind::kPostRead && op.kind != OpKind::kUpdate && op.kind != OpKind::kPostLocalAccess) {
    return Status::Ok();  // open ops belong to the allocator
  }
  const AccessRecord& access = recording_.accesses[op.handle];
  Slot* slot = &slots_[op.handle][clock % depth_];
  // Everything below runs on the writeback stream after the application's
  // own work on the buffer; the Synchronize before ReleaseSlot then also
  // guarantees that work is done before the buffer is reused.
  MLT_RETURN_IF_ERROR(device_->WaitAppWork(Stream::kWriteback, slot->app_done));
  slot->app_done.reset();
  if (op.kind == OpKind::kUpdate && index_.tables[access.table].direct.handle == op.handle) {
    std::vector<Message> messages;
    MLT_RETURN_IF_ERROR(BuildDirectUpdate(access, slot->data, clock, &messages));
    ReleaseSlot(slot);
    return SendAll(std::move(messages));
  }
  if (op.kind == OpKind::kUpdate) {
    ScatterAddUpdate(access, slot->data);
  } else if (op.kind == OpKind::kPostLocalAccess && access.keep) {
    WriteBackLocal(access, slot->data);
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kWriteback));
  ReleaseSlot(slot);
  if (op.kind == OpKind::kUpdate && index_.accesses[op.handle].closes_table_clock) {
    MLT_RETURN_IF_ERROR(SendTableClock(access.table, clock));
  }
  return Status::Ok();
}

void Engine::Impl::ReleaseSlot(Slot* slot) {
  // The buffer's addresses are static; the next user waits for reclaimed_seq_.
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot->state = SlotState::kEmpty;
    slot->data = nullptr;
  }
  cv_.notify_all();
}

void Engine::Impl::ScatterAddUpdate(const AccessRecord& access, const float* buffer) {
  const AccessIndex& index = index_.accesses[access.handle];
  const TableStore& store = *stores_[access.table];
  const int64_t width = store.info.row_width;
  if (index.device_scatter.total_rows > 0) {
    device_->ScatterAdd(store.log(Residence::kDevice), buffer, index.device_scatter, width,
                        Stream::kWriteback);
  }
  if (index.host_scatter.total_rows > 0) {
    // Host-resident rows: bring the buffer's rows to host staging, then add
    // them into the host log on this thread.
    float* staging = staging_->floats();
    for (const RowRun& run : index.host_scatter.runs) {
      device_->CopyDeviceToHost(staging + run.src * width, buffer + run.src * width,
                                static_cast<size_t>(run.count * store.info.row_bytes()), Stream::kWriteback);
    }
    device_->Synchronize(Stream::kWriteback);
    float* log = store.log(Residence::kHost);
    for (const RowRun& run : index.host_scatter.runs) {
      float* __restrict dst = log + run.dst * width;
      const float* __restrict src = staging + run.src * width;
      const int64_t n = run.count * width;
      for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_scattered += static_cast<int64_t>(access.rows.size()) * store.info.row_bytes();
  stats_.bytes_swapped_out += index.host_scatter.total_rows * store.info.row_bytes();
}

void Engine::Impl::WriteBackLocal(const AccessRecord& access, const float* buffer) {
  const AccessIndex& index = index_.accesses[access.handle];
  const TableStore& store = *stores_[access.table];
  const int64_t width = store.info.row_width;
  // Nobody else writes local rows, and the allocator waits for this write-back
  // before any fetch of them, so no partition lock is needed.
  if (index.device_scatter.total_rows > 0) {
    device_->Gather(store.values(Residence::kDevice), buffer, index.device_scatter, width, Stream::kWriteback);
  }
  float* host = store.values(Residence::kHost);
  for (const RowRun& run : index.host_scatter.runs) {
    device_->CopyDeviceToHost(host + run.dst * width, buffer + run.src * width,
                              static_cast<size_t>(run.count * store.info.row_bytes()), Stream::kWriteback);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_swapped_out += index.host_scatter.total_rows * store.info.row_bytes();
}

Status Engine::Impl::SendTableClock(TableId table, mltuner::Clock clock) {
  const TableStore& store = *stores_[table];
  const int64_t width = store.info.row_width;
  const TableIndex& table_index = index_.tables[table];
  std::vector<Message> messages;
  const ClockBranch at = BranchOf(clock);
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message message = NewMessage(MessageType::kClockUpdate, rank_, shard, table);
    message.header.branch = at.branch;
    message.header.clock = at.internal;
    message.header.row_width = width;
    const std::vector<WireSegment>& segments = table_index.send[shard];
    int64_t rows = 0;
    for (const WireSegment& segment : segments) rows += segment.count;
    message.values = transport_->NewPayload(static_cast<size_t>(rows * width));
    float* out = message.values.data();
    for (const WireSegment& segment : segments) {
      message.spans.push_back({segment.begin, segment.count});
      const size_t count = static_cast<size_t>(segment.count * width);
      float* log = store.log(segment.residence) + segment.slot * width;
      if (segment.residence == Residence::kDevice) {
        device_->CopyDeviceToHost(out, log, count * sizeof(float), Stream::kWriteback);
        device_->Fill(log, 0.0f, count, Stream::kWriteback);
      } else {
        std::memcpy(out, log, count * sizeof(float));
        std::fill_n(log, count, 0.0f);
      }
      out += count;
    }
    message.header.num_spans = static_cast<uint32_t>(message.spans.size());
    messages.push_back(std::move(message));
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kWriteback));
  return SendAll(std::move(messages));
}

Status Engine::Impl::BuildDirectUpdate(const AccessRecord& access, const float* buffer, mltuner::Clock clock,
                                       std::vector<Message>* messages) {
  const TableInfo& info = tables_[access.table];
  const DirectSend& direct = index_.tables[access.table].direct;
  const int64_t width = info.row_width;
  const ClockBranch at = BranchOf(clock);
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message message = NewMessage(MessageType::kClockUpdate, rank_, shard, access.table);
    message.header.branch = at.branch;
    message.header.clock = at.internal;
    message.header.row_width = width;
    message.spans = direct.spans[shard];
    message.header.num_spans = static_cast<uint32_t>(message.spans.size());
    const RunIndex& runs = direct.runs[shard];
    message.values = transport_->NewPayload(static_cast<size_t>(runs.total_rows * width));
    for (const RowRun& run : runs.runs) {
      device_->CopyDeviceToHost(message.values.data() + run.dst * width, buffer + run.src * width,
                                static_cast<size_t>(run.count * info.row_bytes()), Stream::kWriteback);
    }
    messages->push_back(std::move(message));
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kWriteback));
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_scattered += static_cast<int64_t>(access.rows.size()) * info.row_bytes();
  return Status::Ok();
}

Status Engine::Impl::SendAll(std::vector<Message> messages) {
  for (Message& message : messages) {
    MLT_RETURN_IF_ERROR(transport_->Send(std::move(message)));
    ++messages_sent_;
  }
  return Status::Ok();
}

}  // namespace mltuner
