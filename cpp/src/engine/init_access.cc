// Synchronous accesses: the initialisation phase (between the end of the
// virtual iteration and start_iterations, in any order) and Fetch (any time).
// Reads ask the shards for their current values; updates add to them
// directly, bypassing the update rule, so worker 0 can write initial weights.
#include <algorithm>
#include <cstring>

#include "common/interruptible_wait.h"
#include "engine/engine_impl.h"
#include "memory/device_block.h"
#include "sharding/shard_range.h"

namespace mltuner {

namespace {

Message RequestTo(MessageType type, int sender, int shard, const TableInfo& table) {
  Message message = NewMessage(type, sender, shard, table.id);
  message.header.row_width = table.row_width;
  return message;
}

}  // namespace

Status Engine::Impl::SendRequests(std::vector<Message> requests, std::vector<Message>* replies) {
  if (requests.empty()) return Status::Ok();
  auto request = std::make_shared<PendingRequest>();
  request->replies_missing = static_cast<int>(requests.size());
  int64_t id;
  {
    MutexLock lock(&state_.age_mu);
    ForgetAnsweredAbandonedRequests();
    id = state_.next_request_id++;
    state_.requests[id] = request;
  }
  Status sent;
  for (Message& message : requests) {
    message.header.request_id = id;
    message.header.num_spans = static_cast<uint32_t>(message.spans.size());
    sent = transport_->Send(std::move(message));
    if (!sent.ok()) break;
    ++state_.messages_sent;
  }
  MutexLock lock(&state_.age_mu);
  bool done = false;
  bool interrupted = false;
  if (sent.ok()) {
    InterruptibleWait wait(Deadline());
    done = request->replies_missing == 0 || state_.phase.load() == Phase::kShutdown || !state_.abort_error.ok();
    while (!done) {
      const bool more = wait.Step(&state_.age_cv, &state_.age_mu);
      done = request->replies_missing == 0 || state_.phase.load() == Phase::kShutdown || !state_.abort_error.ok();
      if (!more) break;
    }
    interrupted = !done && wait.interrupted();
  }
  if (interrupted) {
    // The shards still answer: the request stays known until they have, so
    // their replies are not refused as replies to an unknown request.
    abandoned_requests_.push_back(id);
    return Status::Cancelled("interrupted while waiting for the shards' replies");
  }
  state_.requests.erase(id);
  if (!sent.ok()) return sent;
  if (!state_.abort_error.ok()) return state_.abort_error;
  if (!request->error.ok()) return request->error;
  if (!done) return Status::Timeout("no reply from the shards after " + std::to_string(config_.wait_timeout_ms) + " ms");
  if (request->replies_missing > 0) return Status::Shutdown("the engine is shut down");
  *replies = std::move(request->replies);
  return Status::Ok();
}

void Engine::Impl::ForgetAnsweredAbandonedRequests() {
  size_t kept = 0;
  for (const int64_t id : abandoned_requests_) {
    auto it = state_.requests.find(id);
    if (it != state_.requests.end() && it->second->replies_missing > 0) {
      abandoned_requests_[kept++] = id;
    } else if (it != state_.requests.end()) {
      state_.requests.erase(it);
    }
  }
  abandoned_requests_.resize(kept);
}

Status Engine::Impl::Fetch(TableId table, const std::vector<RowId>& rows, std::optional<int64_t> row_width,
                           float* out, BranchId branch) {
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(LookupTable(table, &info));
  if (row_width && *row_width != info->row_width) {
    // The caller sized `out` from its own idea of the table (a Table object
    // kept across drop_tables, say): copying the real rows would overrun it.
    return Status::InvalidArgument("fetch of table '" + info->name + "' (id " + std::to_string(table) +
                                   ") with row width " + std::to_string(*row_width) + "; the table's rows are " +
                                   std::to_string(info->row_width) + " wide (" + std::to_string(info->num_rows) +
                                   " rows): was the table dropped and created again?");
  }
  if (info->local) {
    return Status::InvalidArgument("table '" + info->name + "' is local: its rows live on this worker only");
  }
  MLT_RETURN_IF_ERROR(CheckRowIds(*info, rows, "a request to"));
  if (branch < 0) {
    MutexLock lock(&state_.mu);
    branch = state_.stats.branch;
  }
  const ShardedRows sharded = ShardRows(*info, rows, num_workers_);
  std::vector<Message> requests;
  for (int shard = 0; shard < num_workers_; ++shard) {
    if (sharded.spans[shard].empty()) continue;
    Message request = RequestTo(MessageType::kFetch, rank_, shard, *info);
    request.header.branch = branch;
    request.spans = sharded.spans[shard];
    requests.push_back(std::move(request));
  }
  std::vector<Message> replies;
  MLT_RETURN_IF_ERROR(SendRequests(std::move(requests), &replies));
  const int64_t width = info->row_width;
  for (const Message& reply : replies) {
    const int shard = reply.header.sender;
    const std::vector<int64_t>& order = sharded.order[shard];
    if (reply.num_values() != order.size() * static_cast<size_t>(width)) {
      return Status::CorruptMessage("fetch reply of the wrong size: " + reply.DebugString());
    }
    for (size_t k = 0; k < order.size(); ++k) {
      std::memcpy(out + order[k] * width, reply.host_values() + k * width, static_cast<size_t>(width) * sizeof(float));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::InitAdd(const AccessRecord& access, const float* host_values) {
  const TableInfo& info = plan_.tables[access.table];
  const ShardedRows sharded = ShardRows(info, access.rows, num_workers_);
  const int64_t width = info.row_width;
  std::vector<Message> requests;
  for (int shard = 0; shard < num_workers_; ++shard) {
    if (sharded.spans[shard].empty()) continue;
    Message request = RequestTo(MessageType::kInitAdd, rank_, shard, info);
    request.spans = sharded.spans[shard];
    const std::vector<int64_t>& order = sharded.order[shard];
    const bool one_run =
        std::adjacent_find(order.begin(), order.end(), [](int64_t a, int64_t b) { return b != a + 1; }) == order.end();
    if (one_run && device_->host_addressable() && transport_->SharesDevice(rank_, shard)) {
      // A shard of this process on host memory reads the rows where they
      // lie: the request waits for its reply, so they outlive its use.
      auto lent = std::make_shared<DeviceBuffer>();
      lent->data = const_cast<float*>(host_values + order.front() * width);
      lent->count = order.size() * static_cast<size_t>(width);
      lent->borrowed = true;
      request.device_values = std::move(lent);
      requests.push_back(std::move(request));
      continue;
    }
    // Appended run by run (consecutive rows of the access at once), never
    // zero-filled first: worker 0 writes the whole model this way, and a
    // pass over a fresh layer-sized vector costs as much as the copy.
    request.values.reserve(order.size() * static_cast<size_t>(width));
    for (size_t k = 0; k < order.size();) {
      size_t end = k + 1;
      while (end < order.size() && order[end] == order[end - 1] + 1) ++end;
      const float* first = host_values + order[k] * width;
      request.values.insert(request.values.end(), first, first + (end - k) * width);
      k = end;
    }
    requests.push_back(std::move(request));
  }
  std::vector<Message> replies;
  return SendRequests(std::move(requests), &replies);
}

Status Engine::Impl::WriteInitial(Handle handle, const float* values, int64_t count) {
  const Phase phase = state_.phase.load();
  if (phase == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (phase != Phase::kRecorded) {
    return Status::OutOfOrder("write_initial outside the initialisation phase: call it after "
                              "finish_virtual_iteration and before start_iterations");
  }
  MLT_RETURN_IF_ERROR(CheckExpected(handle, OpKind::kPreUpdate));
  const AccessRecord& access = plan_.recording.accesses[handle];
  const TableInfo& info = plan_.tables[access.table];
  if (access.kind != OpKind::kPreUpdate) {
    return Status::InvalidArgument("write_initial of handle " + std::to_string(handle) + ", which was recorded as a " +
                                   access.Describe(info.name) + "; it takes an update's handle");
  }
  if (init_slots_[handle].state != SlotState::kEmpty) {
    return Status::OutOfOrder("handle " + std::to_string(handle) + " (" + access.Describe(info.name) +
                              ") is open: post it before writing through it");
  }
  const int64_t expected = static_cast<int64_t>(access.rows.size()) * info.row_width;
  if (count != expected) {
    return Status::InvalidArgument("write_initial of " + access.Describe(info.name) + " got " +
                                   std::to_string(count) + " values; its rows hold " + std::to_string(expected));
  }
  return InitAdd(access, values);
}

Status Engine::Impl::OpenInit(Handle handle, AccessBuffer* out) {
  const AccessRecord& access = plan_.recording.accesses[handle];
  const TableInfo& info = plan_.tables[access.table];
  Slot& slot = init_slots_[handle];
  if (slot.state != SlotState::kEmpty) {
    return Status::OutOfOrder("handle " + std::to_string(handle) + " (" + access.Describe(info.name) +
                              ") is already open: post it before opening it again");
  }
  const size_t values = access.rows.size() * static_cast<size_t>(info.row_width);
  std::shared_ptr<DeviceBlock> block;
  MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, values * sizeof(float), false, &block));
  if (access.kind == OpKind::kRead) {
    std::vector<float> host(values);
    MLT_RETURN_IF_ERROR(Fetch(access.table, access.rows, std::nullopt, host.data(), 0));
    device_->CopyHostToDevice(block->floats(), host.data(), values * sizeof(float), Stream::kApp);
  } else if (access.kind == OpKind::kLocalAccess && access.fetch) {
    MLT_RETURN_IF_ERROR(allocator_.GatherInto(access, block->floats(), Stream::kApp));
  } else {
    device_->Fill(block->floats(), 0.0f, values, Stream::kApp);
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kApp));
  slot.state = SlotState::kInUse;
  slot.data = block->floats();
  init_blocks_[handle] = block;
  *out = BufferFor(access, block->floats(), kInitClock, block);
  return Status::Ok();
}

Status Engine::Impl::PostInit(Handle handle, uintptr_t app_stream) {
  const AccessRecord& access = plan_.recording.accesses[handle];
  Slot& slot = init_slots_[handle];
  if (slot.state != SlotState::kInUse) {
    return Status::OutOfOrder("handle " + std::to_string(handle) + " (" +
                              access.Describe(plan_.tables[access.table].name) + ") is not open");
  }
  const size_t values = access.rows.size() * static_cast<size_t>(plan_.tables[access.table].row_width);
  // The application's writes must land before we copy the buffer out.
  DeviceEvent app_done;
  Status status = device_->RecordAppWork(app_stream, &app_done);
  if (status.ok()) status = device_->WaitEvent(Stream::kApp, app_done);
  if (status.ok()) status = device_->WaitEvent(Stream::kWriteback, app_done);
  if (!status.ok()) return status;
  if (access.kind == OpKind::kPreUpdate) {
    // Through the plan's staging buffer (host memory, as large as the
    // largest access, idle until start_iterations starts the reclaimer), not
    // a buffer of its own: worker 0 writes the whole model this way, so a
    // layer's worth of host memory more would come on top of everything the
    // plan holds (the host-memory guard counts the staging buffer).
    if (static_cast<int64_t>(values * sizeof(float)) > plan_.placement.staging_bytes) {
      return Status::Internal("initialisation write of " + std::to_string(values * sizeof(float)) +
                              " bytes is larger than the staging buffer's " +
                              std::to_string(plan_.placement.staging_bytes));
    }
    // Device memory that is host memory (the CPU backend) is read in place.
    float* host = slot.data;
    if (!device_->host_addressable()) {
      host = plan_.staging->floats();
      device_->CopyDeviceToHost(host, slot.data, values * sizeof(float), Stream::kApp);
    }
    status = device_->Synchronize(Stream::kApp);
    if (status.ok()) status = InitAdd(access, host);
  } else if (access.kind == OpKind::kLocalAccess && access.keep) {
    status = reclaimer_.WriteBackLocal(access, slot.data);
    if (status.ok()) status = device_->Synchronize(Stream::kWriteback);
  }
  if (status.ok() && config_.debug_buffers) {
    // The buffer was read (synchronously) above: poison it for the
    // application's stream, as a post of the real phase does.
    status = PoisonPostedRead(access, slot.data, app_stream, &app_done);
    if (status.ok()) status = device_->Synchronize(Stream::kApp);
  }
  slot.state = SlotState::kEmpty;
  slot.data = nullptr;
  init_blocks_[handle].reset();
  return status;
}

}  // namespace mltuner
