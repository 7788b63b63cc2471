// The reclaimer thread (geeps.md §2): runs behind the application along the
// op list. For each op the application has finished it frees the buffer,
// scatter-adds an update into the table's update log, writes kept local data
// back, and — at the table's last update of the clock — ships the log to the
// shards at once, so a top layer's updates travel while lower layers are
// still computing (Poseidon's wait-free backprop). Tables without updates
// send a bare clock at the iteration's clock op. A table with a single update
// per clock skips the log: its buffer is copied straight into the messages.
#include "common/thread_name.h"
#include "memory/reclaimer.h"

#include "plan/device_budget.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "memory/swap.h"

namespace mltuner {
namespace {

// Rows of a table's update that go to piece `piece` in a clock: the single
// update's runs, or the update log's segments.
int64_t PieceUpdateRows(const TableIndex& index, int piece) {
  if (index.direct.handle >= 0) return index.direct.runs[piece].total_rows;
  int64_t rows = 0;
  for (const WireSegment& segment : index.send[piece]) rows += segment.count;
  return rows;
}

// The same for all of `shard`'s pieces.
int64_t UpdateRows(const TableIndex& index, int shard) {
  int64_t rows = 0;
  for (int piece = index.first_piece[shard]; piece < index.first_piece[shard + 1]; ++piece) {
    rows += PieceUpdateRows(index, piece);
  }
  return rows;
}

}  // namespace

Reclaimer::Reclaimer(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
                     Transport* transport, const PipelinePlan* plan, SharedState* state)
    : config_(config),
      rank_(rank),
      num_workers_(num_workers),
      device_(device),
      transport_(transport),
      plan_(plan),
      state_(state),
      // Idle payload buffers: a few clocks of a large model's updates in flight.
      payloads_(device, size_t{2} << 30),
      // Bounded in Start, from the plan.
      frames_(std::move(device), 0, /*host=*/true) {}

int64_t Reclaimer::RemotePayloadBytesInFlight() const {
  // One clock's updates for shards in other processes, times the clocks
  // whose updates may be alive at once: with the largest recorded slack s, a
  // worker runs up to s clocks ahead, plus the clock being sent (as
  // plan/host_memory.cc counts them).
  int max_slack = 0;
  for (const AccessRecord& access : plan_->recording.accesses) {
    if (access.kind == OpKind::kRead) max_slack = std::max(max_slack, access.slack);
  }
  int64_t per_clock = 0;
  for (const TableInfo& table : plan_->tables) {
    if (table.local) continue;
    const TableIndex& index = plan_->index.tables[table.id];
    if (!index.has_updates) continue;
    for (int shard = 0; shard < num_workers_; ++shard) {
      if (!transport_->SharesDevice(rank_, shard)) per_clock += UpdateRows(index, shard) * table.row_bytes();
    }
  }
  return per_clock * (max_slack + 2);
}

size_t Reclaimer::LargestRemotePayloadValues() const {
  size_t largest = 0;
  for (const TableInfo& table : plan_->tables) {
    if (table.local) continue;
    const TableIndex& index = plan_->index.tables[table.id];
    for (int piece = 0; piece < static_cast<int>(index.pieces.size()) && index.has_updates; ++piece) {
      if (transport_->SharesDevice(rank_, index.pieces[piece].shard)) continue;
      largest = std::max(largest, static_cast<size_t>(PieceUpdateRows(index, piece) * table.row_width));
    }
  }
  return largest;
}

// The most bytes one table's update of a clock sends to the shards of this
// device at once: its payloads for all of them are taken before any leaves.
int64_t Reclaimer::LargestLocalUpdateBytes() const {
  int64_t largest = 0;
  for (const TableInfo& table : plan_->tables) {
    if (table.local) continue;
    const TableIndex& index = plan_->index.tables[table.id];
    if (!index.has_updates) continue;
    int64_t rows = 0;
    for (int shard = 0; shard < num_workers_; ++shard) {
      if (transport_->SharesDevice(rank_, shard)) rows += UpdateRows(index, shard);
    }
    largest = std::max(largest, rows * table.row_bytes());
  }
  return largest;
}

// Payloads to this device's shards are device memory outside the plan's
// budget: a share of Config.device_memory_reserve (half, at most the pool's
// 2 GiB of idle buffers), so that a shard slower than the backward pass
// (its state in host memory) cannot exhaust the device. At least one
// table's update to all of them, though: a worker whose shards wait for the
// others' parts of a table while it waits for room for its own next part
// would never go on (several workers of one process, a small reserve). No
// bound on a device of unknown capacity.
int64_t Reclaimer::LocalPayloadLimit() const {
  int64_t free_bytes = -1, total_bytes = -1;
  if (!device_->MemoryInfo(&free_bytes, &total_bytes).ok() || total_bytes < 0) return 0;
  const int64_t share = std::min<int64_t>(int64_t{2} << 30, DeviceReserve(config_, total_bytes) / 2);
  return std::max<int64_t>({1, share, LargestLocalUpdateBytes()});
}

void Reclaimer::Start() {
  local_payloads_ = std::make_unique<PayloadBound>(LocalPayloadLimit());
  frames_.set_max_idle_bytes(static_cast<size_t>(RemotePayloadBytesInFlight()));
  staging_values_ = LargestRemotePayloadValues();
  thread_ = std::thread([this] {
    NameThisThread("mlt-reclaimer");
    Loop();
  });
}

void Reclaimer::Join() {
  if (thread_.joinable()) thread_.join();
}

void Reclaimer::Loop() {
  for (int64_t seq = 0;; ++seq) {
    {
      MutexLock lock(&state_->mu);
      while (!state_->stopping && state_->app_seq <= seq) state_->cv.Wait();
      if (state_->stopping) return;
    }
    Status status = ReclaimOp(seq);
    if (status.ok()) {
      bool caught_up;
      {
        MutexLock lock(&state_->mu);
        caught_up = state_->app_seq <= seq + 1;
      }
      // Before the op counts as reclaimed: Engine::Flush's callers find
      // every message of the ops it waited for handed on.
      if (caught_up) status = Flush();
    }
    if (!status.ok()) {
      if (status.code() != StatusCode::kShutdown) state_->Fail(status.WithContext(ThreadContext(rank_, "reclaimer")));
      return;
    }
    {
      MutexLock lock(&state_->mu);
      state_->reclaimed_seq = seq + 1;
    }
    state_->cv.NotifyAll();
  }
}

Status Reclaimer::ReclaimOp(int64_t seq) {
  const int64_t num_ops = plan_->num_ops();
  const mltuner::Clock clock = seq / num_ops;
  const RecordedOp& op = plan_->recording.ops[seq % num_ops];
  const IterationIndex& index = plan_->index;
  if (op.kind == OpKind::kClock || op.kind == OpKind::kUpdate) {
    MLT_RETURN_IF_ERROR(ResolveSkip(clock));  // before the clock's first message and own step
  }
  if (op.kind == OpKind::kClock) {
    for (const TableInfo& table : plan_->tables) {
      if (!table.local && !index.tables[table.id].has_updates) {
        std::vector<Message> messages;
        MLT_RETURN_IF_ERROR(BuildTableClock(table.id, clock, &messages));
        MLT_RETURN_IF_ERROR(MarkReady(nullptr, &messages));
        MLT_RETURN_IF_ERROR(Ship(std::move(messages)));
      }
    }
    return Flush();
  }
  if (op.kind != OpKind::kPostRead && op.kind != OpKind::kUpdate && op.kind != OpKind::kPostLocalAccess) {
    return Status::Ok();  // open ops belong to the allocator
  }
  const AccessRecord& access = plan_->recording.accesses[op.handle];
  Slot* slot = &state_->slots[op.handle][clock % plan_->depth];
  // A read buffer is done with once the application's kernels are: its
  // addresses are released with the application's ticket, and the next
  // user's fill waits for it on the device. Nothing here waits.
  if (op.kind == OpKind::kPostRead) {
    DeviceEvent released = std::move(slot->app_done);
    ReleaseSlot(slot, std::move(released));
    return device_->TakeError();
  }
  // Everything below runs on the writeback stream after the application's
  // own work on the buffer. Updates are sent as soon as their copies are
  // queued (the shard's stream waits for them on the device); one ticket
  // taken after them marks both the payloads ready and the buffer released.
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kWriteback, slot->app_done));
  slot->app_done.reset();
  std::vector<Message> messages;
  if (op.kind == OpKind::kUpdate && index.tables[access.table].direct.handle == op.handle) {
    MLT_RETURN_IF_ERROR(ApplyOwnStep(access, slot->data, clock));
    MLT_RETURN_IF_ERROR(BuildDirectUpdate(access, slot->data, clock, &messages));
  } else if (op.kind == OpKind::kUpdate) {
    MLT_RETURN_IF_ERROR(ScatterAddUpdate(access, slot->data));
    if (index.accesses[op.handle].closes_table_clock) {
      MLT_RETURN_IF_ERROR(FinishHostLog(access.table));
      MLT_RETURN_IF_ERROR(ApplyOwnStep(access, nullptr, clock));
      MLT_RETURN_IF_ERROR(BuildTableClock(access.table, clock, &messages));
    }
  } else if (op.kind == OpKind::kPostLocalAccess && access.keep) {
    // Kept local data is fetched again after the allocator sees this op
    // reclaimed (WaitForWriteBack); its fetch waits on the device for this
    // slot's release ticket, taken below after these copies.
    MLT_RETURN_IF_ERROR(WriteBackLocal(access, slot->data));
  }
  if (config_.debug_buffers) {  // after its copies
    device_->Fill(slot->data, std::numeric_limits<float>::quiet_NaN(), plan_->BufferValues(access), Stream::kWriteback);
  }
  DeviceEvent released;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kWriteback, &released));
  MLT_RETURN_IF_ERROR(MarkReady(released, &messages));
  ReleaseSlot(slot, std::move(released));
  MLT_RETURN_IF_ERROR(Ship(std::move(messages)));
  return device_->TakeError();
}

void Reclaimer::ReleaseSlot(Slot* slot, DeviceEvent released) {
  // The buffer's addresses are static; the next user waits for reclaimed_seq
  // on the host and for `released` on the device.
  {
    MutexLock lock(&state_->mu);
    slot->state = SlotState::kEmpty;
    slot->data = nullptr;
    slot->ready.reset();
    slot->released = std::move(released);
  }
  state_->cv.NotifyAll();
}

Status Reclaimer::ScatterAddUpdate(const AccessRecord& access, const float* buffer) {
  const AccessIndex& index = plan_->index.accesses[access.handle];
  const TableStore& store = *plan_->stores[access.table];
  const int64_t width = store.info.row_width;
  if (index.device_scatter.total_rows > 0) {
    device_->ScatterAdd(store.log(Residence::kDevice), buffer, index.device_scatter, width,
                        Stream::kWriteback);
  }
  if (index.host_scatter.total_rows > 0) {
    float* log = store.log(Residence::kHost);
    if (device_->swaps_by_kernel()) {
      // Host-resident rows: one scatter-add kernel into the host log where
      // it lies (pinned, mapped), on the swap-out stream. Nothing waits here;
      // FinishHostLog waits before the log is read on the host.
      MLT_RETURN_IF_ERROR(OnSwapStream(*device_, Stream::kWriteback, Stream::kSwapOut, [&](Stream swap) {
        device_->ScatterAdd(log, buffer, index.host_scatter, width, swap);
      }));
      if (host_log_pending_.size() <= static_cast<size_t>(access.table)) {
        host_log_pending_.resize(static_cast<size_t>(access.table) + 1, false);
      }
      host_log_pending_[static_cast<size_t>(access.table)] = true;
    } else {
      // A device that does not write host memory by kernel: bring the
      // buffer's rows to host staging at their places in the buffer, in one
      // swap, then add them into the host log on this thread.
      float* staging = plan_->staging->floats();
      to_staging_.runs.clear();
      for (const RowRun& run : index.host_scatter.runs) to_staging_.runs.push_back({run.src, run.src, run.count});
      device_->SwapRuns(staging, buffer, to_staging_, width, SwapDirection::kOut, Stream::kWriteback);
      MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kWriteback));
      for (const RowRun& run : index.host_scatter.runs) {
        float* __restrict dst = log + run.dst * width;
        const float* __restrict src = staging + run.src * width;
        const int64_t n = run.count * width;
        for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
      }
    }
  }
  MutexLock lock(&state_->mu);
  state_->stats.bytes_scattered += static_cast<int64_t>(access.rows.size()) * store.info.row_bytes();
  state_->stats.bytes_swapped_out += index.host_scatter.total_rows * store.info.row_bytes();
  return Status::Ok();
}

// Read-my-writes (cache/own_updates.h): the table's update of `clock`, from
// the single update's `buffer` (access layout) or, when null, from the
// update log (the cache's layout), before the log is shipped and zeroed.
Status Reclaimer::ApplyOwnStep(const AccessRecord& access, const float* buffer, mltuner::Clock clock) {
  OwnUpdates* own = plan_->own_updates[access.table].get();
  if (own == nullptr) return Status::Ok();
  const TableStore& store = *plan_->stores[access.table];
  ClockBranch at;
  OwnUpdates::Rule rule;
  {
    MutexLock lock(&state_->mu);
    at = state_->branches.At(clock);
    rule.config = state_->branches.RuleOn(at.branch, access.table, own->base_rule());
    rule.training = at.training && !SkipsStep(clock);  // a skipped step takes none
    // A rate set for this clock holds from its own step on, as on the shards.
    if (std::optional<float> rate = RateSetFor(access.table, clock)) rule.config.learning_rate = *rate;
  }
  const bool stale = ServesSlack(at.SlackOf(own->read_slack()));
  const float* update = store.log(Residence::kDevice);
  const RunIndex& scatter = plan_->index.accesses[access.handle].device_scatter;
  const int64_t rows = own->values() / store.info.row_width;
  const bool in_cache_layout = scatter.runs.size() == 1 && scatter.runs[0].src == 0 && scatter.runs[0].dst == 0 &&
                               scatter.runs[0].count == rows;
  if (buffer != nullptr && in_cache_layout) {
    update = buffer;  // a whole layer's update, in the cache's row order (the common case)
  } else if (buffer != nullptr && stale && rule.training) {
    float* scratch = nullptr;
    MLT_RETURN_IF_ERROR(own->Scratch(&scratch));
    device_->Fill(scratch, 0.0f, static_cast<size_t>(own->values()), Stream::kWriteback);
    device_->ScatterAdd(scratch, buffer, scatter, store.info.row_width, Stream::kWriteback);
    update = scratch;
  }
  // Exclusive: no gather reads the rows half stepped, no install lands
  // between the step and its record (partition locks come before age_mu).
  auto guard = store.locks->LockExclusive(0, store.info.num_rows);
  BranchId cached;
  {
    MutexLock lock(&state_->age_mu);
    cached = state_->cache_branch;
  }
  return own->Apply(at.branch, at.internal, rule, stale, cached, update);
}

Status Reclaimer::FinishHostLog(TableId table) {
  const size_t t = static_cast<size_t>(table);
  if (t >= host_log_pending_.size() || !host_log_pending_[t]) return Status::Ok();
  host_log_pending_[t] = false;
  return device_->Synchronize(Stream::kWriteback);
}

Status Reclaimer::WriteBackLocal(const AccessRecord& access, const float* buffer) {
  const AccessIndex& index = plan_->index.accesses[access.handle];
  const TableStore& store = *plan_->stores[access.table];
  const int64_t width = store.info.row_width;
  // Nobody else writes local rows, and the allocator waits for this write-back
  // before any fetch of them, so no partition lock is needed.
  if (index.device_scatter.total_rows > 0) {
    device_->Gather(store.values(Residence::kDevice), buffer, index.device_scatter, width, Stream::kWriteback);
  }
  if (index.host_scatter.total_rows > 0) {
    float* host = store.values(Residence::kHost);
    MLT_RETURN_IF_ERROR(OnSwapStream(*device_, Stream::kWriteback, Stream::kSwapOut, [&](Stream swap) {
      device_->SwapRuns(host, buffer, index.host_scatter, width, SwapDirection::kOut, swap);
    }));
  }
  MutexLock lock(&state_->mu);
  state_->stats.bytes_swapped_out += index.host_scatter.total_rows * store.info.row_bytes();
  return Status::Ok();
}

std::optional<float> Reclaimer::RateSetFor(TableId table, mltuner::Clock clock) const {
  auto rates = state_->new_rates.find(table);
  if (rates == state_->new_rates.end()) return std::nullopt;
  auto rate = rates->second.find(clock);
  if (rate == rates->second.end()) return std::nullopt;
  return rate->second;
}

Status Reclaimer::ResolveSkip(mltuner::Clock clock) {
  SkipMark mark;
  {
    MutexLock lock(&state_->mu);
    auto found = state_->skipped_steps.find(clock);
    if (found == state_->skipped_steps.end() || found->second.word == nullptr) return Status::Ok();
    mark = found->second;
  }
  MLT_RETURN_IF_ERROR(device_->WaitEventDone(mark.ready));  // the application's copy into the word
  const bool skip = *mark.word != 0.0f;
  MutexLock lock(&state_->mu);
  if (skip) {
    state_->skipped_steps[clock] = SkipMark{};
  } else {
    state_->skipped_steps.erase(clock);
  }
  return Status::Ok();
}

bool Reclaimer::SkipsStep(mltuner::Clock clock) const {
  auto found = state_->skipped_steps.find(clock);
  return found != state_->skipped_steps.end() && found->second.word == nullptr;  // resolved by ResolveSkip
}

Status Reclaimer::NewUpdateMessage(TableId table, int shard, mltuner::Clock clock, size_t values, Message* out,
                                      float** data, bool* on_device) {
  ClockBranch at;
  Message message = NewMessage(MessageType::kClockUpdate, rank_, shard, table);
  {
    MutexLock lock(&state_->mu);
    at = state_->branches.At(clock);
    if (std::optional<float> rate = RateSetFor(table, clock)) {
      message.header.flags |= kNewLearningRate;
      message.header.learning_rate = *rate;
      auto branch_rates = state_->branches.rates.find(at.branch);
      if (branch_rates != state_->branches.rates.end() && branch_rates->second.count(table) != 0) {
        branch_rates->second[table].rate = *rate;  // what the branch's next forks start from
      }
    }
    if (SkipsStep(clock)) message.header.flags |= kSkipStep;
  }
  message.header.branch = at.branch;
  message.header.clock = at.internal;
  message.header.row_width = plan_->tables[table].row_width;
  *on_device = values > 0 && transport_->SharesDevice(rank_, shard);
  if (*on_device) {
    // Take may wait for the shards to give payloads back: never while some
    // wait here unsent.
    if (!local_payloads_->HasRoom(values)) MLT_RETURN_IF_ERROR(Flush());
    MLT_RETURN_IF_ERROR(local_payloads_->Take(
        values, config_.wait_timeout_ms,
        [this] {
          MutexLock lock(&state_->mu);
          return state_->stopping;
        },
        [this, values](std::shared_ptr<DeviceBuffer>* buffer) {
          return payloads_.Acquire(values, Stream::kWriteback, buffer);
        },
        &message.device_values));
    *data = message.device_values->data;
  } else if (values > 0) {
    // Another process's shard: a recycled host frame (pinned on CUDA) that
    // the transport sends as it is, once its ticket (MarkReady) is done.
    MLT_RETURN_IF_ERROR(frames_.Acquire(values, Stream::kWriteback, &message.host_frame));
    *data = message.host_frame->data;
  }
  *out = std::move(message);
  return Status::Ok();
}

// The table's update log for `clock`: one message per piece (a shard's rows,
// or a part of them), its payload filled on the writeback stream. A shard
// of this process on this device gets
// a device buffer; another process's shard a host frame, filled by one pack
// kernel (the prepared `pack` index: log slots -> a contiguous device
// staging payload) and one device -> host copy when its rows are all
// device-resident (on the CPU backend the kernel packs into the frame
// directly). MarkReady gives both their ticket; nothing here waits, except
// for host-resident log rows copied to a device payload (zeroed after).
Status Reclaimer::BuildTableClock(TableId table, mltuner::Clock clock, std::vector<Message>* messages) {
  const TableStore& store = *plan_->stores[table];
  const int64_t width = store.info.row_width;
  const TableIndex& table_index = plan_->index.tables[table];
  std::vector<std::pair<float*, size_t>> zero_after_copy;  // host log rows read by queued copies
  for (int piece = 0; piece < static_cast<int>(table_index.pieces.size()); ++piece) {
    const int shard = table_index.pieces[piece].shard;
    const std::vector<WireSegment>& segments = table_index.send[piece];
    int64_t rows = 0;
    for (const WireSegment& segment : segments) rows += segment.count;
    Message message;
    float* out = nullptr;
    bool on_device = false;
    const size_t total = static_cast<size_t>(rows * width);
    MLT_RETURN_IF_ERROR(NewUpdateMessage(table, shard, clock, total, &message, &out, &on_device));
    const bool remote = !on_device && rows > 0;
    const bool host_device = device_->host_addressable();
    const bool packed = remote && (host_device || table_index.send_on_device[piece]);
    if (packed && table_index.pack[piece].total_rows > 0) {
      float* target = out;
      std::shared_ptr<DeviceBuffer> staging;
      if (!host_device) {
        MLT_RETURN_IF_ERROR(payloads_.Acquire(std::max(staging_values_, total), Stream::kWriteback, &staging));
        target = staging->data;
      }
      device_->Gather(target, store.log(Residence::kDevice), table_index.pack[piece], width, Stream::kWriteback);
      if (staging) device_->CopyDeviceToHost(out, staging->data, total * sizeof(float), Stream::kWriteback);
      // `staging` (one size for every table: the largest remote payload, so
      // one buffer serves them all) goes back to the pool at once: its next
      // writer queues behind this copy, on this stream or after last_use.
    }
    for (const WireSegment& segment : segments) {
      message.spans.push_back({segment.begin, segment.count});
      const size_t count = static_cast<size_t>(segment.count * width);
      float* log = store.log(segment.residence) + segment.slot * width;
      const size_t bytes = count * sizeof(float);
      if (segment.residence == Residence::kDevice) {
        if (on_device) {
          device_->CopyDeviceToDevice(out, log, bytes, Stream::kWriteback);
        } else if (!packed) {
          device_->CopyDeviceToHost(out, log, bytes, Stream::kWriteback);  // into the frame
        }
        device_->Fill(log, 0.0f, count, Stream::kWriteback);
      } else if (on_device) {
        device_->CopyHostToDevice(out, log, bytes, Stream::kWriteback);
        zero_after_copy.push_back({log, count});
      } else {
        std::memcpy(out, log, bytes);
        std::fill_n(log, count, 0.0f);
      }
      out += count;
    }
    message.header.num_spans = static_cast<uint32_t>(message.spans.size());
    messages->push_back(std::move(message));
    if (InParts(table_index)) MLT_RETURN_IF_ERROR(SendPart(messages));
  }
  if (!zero_after_copy.empty()) MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kWriteback));
  for (const auto& [log, count] : zero_after_copy) std::fill_n(log, count, 0.0f);
  return Status::Ok();
}

Status Reclaimer::BuildDirectUpdate(const AccessRecord& access, const float* buffer, mltuner::Clock clock,
                                       std::vector<Message>* messages) {
  const TableInfo& info = plan_->tables[access.table];
  const TableIndex& table_index = plan_->index.tables[access.table];
  const DirectSend& direct = table_index.direct;
  const int64_t width = info.row_width;
  for (int piece = 0; piece < static_cast<int>(table_index.pieces.size()); ++piece) {
    const RunIndex& runs = direct.runs[piece];
    Message message;
    float* out = nullptr;
    bool on_device = false;
    const size_t total = static_cast<size_t>(runs.total_rows * width);
    MLT_RETURN_IF_ERROR(
        NewUpdateMessage(access.table, table_index.pieces[piece].shard, clock, total, &message, &out, &on_device));
    message.spans = direct.spans[piece];
    message.header.num_spans = static_cast<uint32_t>(message.spans.size());
    if (runs.total_rows > 0) {
      // One kernel packs the buffer's rows (the prepared run index); another
      // process's shard then gets them by one device -> host copy.
      std::shared_ptr<DeviceBuffer> staging;
      float* target = out;
      if (!on_device && !device_->host_addressable()) {
        MLT_RETURN_IF_ERROR(payloads_.Acquire(std::max(staging_values_, total), Stream::kWriteback, &staging));
        target = staging->data;
      }
      device_->Gather(target, buffer, runs, width, Stream::kWriteback);
      if (staging) device_->CopyDeviceToHost(out, staging->data, total * sizeof(float), Stream::kWriteback);
    }
    messages->push_back(std::move(message));
    if (InParts(table_index)) MLT_RETURN_IF_ERROR(SendPart(messages));
  }
  MutexLock lock(&state_->mu);
  state_->stats.bytes_scattered += static_cast<int64_t>(access.rows.size()) * info.row_bytes();
  return Status::Ok();
}

// Gives every device payload and host frame of the batch `ready`, a ticket
// for everything queued on the writeback stream; when null, one taken now if
// needed. A frame's consumer (the transport's send thread) waits for it.
Status Reclaimer::MarkReady(DeviceEvent ready, std::vector<Message>* messages) {
  for (Message& message : *messages) {
    DeviceBuffer* payload = message.device_values ? message.device_values.get() : message.host_frame.get();
    if (payload == nullptr) continue;
    if (!ready) MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kWriteback, &ready));
    payload->ready = ready;
  }
  return Status::Ok();
}

bool Reclaimer::InParts(const TableIndex& index) const {
  return index.pieces.size() > static_cast<size_t>(num_workers_);
}

Status Reclaimer::SendPart(std::vector<Message>* messages) {
  MLT_RETURN_IF_ERROR(MarkReady(nullptr, messages));
  std::vector<Message> part = std::move(*messages);
  messages->clear();
  MLT_RETURN_IF_ERROR(Ship(std::move(part)));
  return Flush();
}

Status Reclaimer::Ship(std::vector<Message> messages) {
  bool full = false;
  for (Message& message : messages) {
    if (message.header.receiver == rank_) {
      // This process's own shard gets its part at once: with one worker, or
      // at slack 0, the next clock's first read waits for its apply.
      MLT_RETURN_IF_ERROR(transport_->Send(std::move(message)));
      ++state_->messages_sent;
      continue;
    }
    full = held_.Hold(std::move(message)) || full;
  }
  return full ? Flush() : Status::Ok();
}

Status Reclaimer::Flush() {
  int64_t sent = 0;
  const Status status = held_.Flush(transport_, &sent);
  state_->messages_sent += sent;
  return status;
}

}  // namespace mltuner
