// ServerShard: validates server-bound messages, keeps each worker's updates
// of a clock apart until the clock is finished by everyone, applies the
// update rule once per finished clock, and pushes fresh rows to every client.
//
// Every handler validates the whole message before it changes anything, so a
// rejected message leaves the shard exactly as it was.
#include "server/shard.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include "mltuner/host_headroom.h"
#include "mltuner/update_step.h"
#include "plan/device_budget.h"

namespace mltuner {
namespace {

std::string SpanText(const RowSpan& span) {
  return "[" + std::to_string(span.begin) + ", " + std::to_string(span.begin + span.count) + ")";
}

std::string TableText(TableId table) { return "table " + std::to_string(table); }

Status CheckSender(const Message& in, int num_workers) {
  const WorkerId sender = in.header.sender;
  if (sender < 0 || sender >= num_workers) {
    return Status::InvalidArgument("message type " + std::to_string(in.header.type) + " from sender " +
                                   std::to_string(sender) + ", not in [0, " +
                                   std::to_string(num_workers) + ")");
  }
  return Status::Ok();
}

// `branch_freed`: branch 0 was freed (every other branch names itself).
Status UnknownTable(TableId table, BranchId branch = 0, bool branch_freed = false) {
  if (branch != 0 || branch_freed) {
    return Status::NotFound(TableText(table) + " on branch " + std::to_string(branch) +
                            " is not on this shard (unknown or freed branch)");
  }
  return Status::NotFound(TableText(table) + " is not registered with this shard");
}

// Rows covered by spans that CheckSpans accepted (each lies inside the shard,
// so the sum cannot overflow for any message that fits in memory).
int64_t CountRows(const std::vector<RowSpan>& spans) {
  int64_t rows = 0;
  for (const RowSpan& span : spans) rows += span.count;
  return rows;
}

// A message that carries values must carry exactly the rows its spans name,
// in the table's row width.
Status CheckPayload(const Message& in, const TableInfo& info) {
  if (in.num_values() > 0 && in.header.row_width != info.row_width) {
    return Status::InvalidArgument(TableText(info.id) + ": message row_width " +
                                   std::to_string(in.header.row_width) + ", table row_width " +
                                   std::to_string(info.row_width));
  }
  const int64_t expected = CountRows(in.spans) * info.row_width;
  if (static_cast<int64_t>(in.num_values()) != expected) {
    return Status::InvalidArgument(TableText(info.id) + ": message has " +
                                   std::to_string(in.num_values()) + " values, its spans need " +
                                   std::to_string(expected));
  }
  return Status::Ok();
}

Message Reply(MessageType type, int rank, const Message& request) {
  Message reply = NewMessage(type, rank, request.header.sender, request.header.table);
  reply.header.branch = request.header.branch;
  reply.header.request_id = request.header.request_id;
  return reply;
}

// The reply to a request every worker makes (ready, fork, free): an ack, or
// the refusal with its code.
Message AckOrRefusal(int rank, int worker, int32_t branch, int64_t request_id, const Status& status) {
  Message reply = status.ok() ? NewMessage(MessageType::kAck, rank, worker, -1)
                              : RefusalMessage(rank, worker, -1, status);
  reply.header.branch = branch;
  reply.header.request_id = request_id;
  return reply;
}

Message ErrorReply(int rank, const Message& request, const Status& error) {
  Message reply = RefusalMessage(rank, request.header.sender, request.header.table, error);
  reply.header.branch = request.header.branch;
  reply.header.request_id = request.header.request_id;
  return reply;
}


// Idle shard buffers kept for reuse: enough for the pending updates and pushed
// rows of a large model's clocks in flight.
constexpr size_t kMaxIdleShardBufferBytes = size_t{4} << 30;

bool KnownRuleKind(UpdateRuleKind kind) {
  switch (kind) {
    case UpdateRuleKind::kAdd:
    case UpdateRuleKind::kSgd:
    case UpdateRuleKind::kDampedMomentum:
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW:
      return true;
  }
  return false;
}

std::shared_ptr<Device> OrCpu(std::shared_ptr<Device> device) {
  return device ? std::move(device) : std::shared_ptr<Device>(NewCpuDevice());
}
}  // namespace

ServerShard::ServerShard(int rank, int num_workers, const UpdateRuleConfig& rule, int max_branches,
                         std::shared_ptr<Device> device)
    : rank_(rank),
      num_workers_(num_workers),
      rule_config_(rule),
      max_branches_(max_branches),
      device_(OrCpu(std::move(device))),
      buffers_(device_, kMaxIdleShardBufferBytes),
      // Rows pushed to other processes: what one round of pushes held stays
      // for the next (a frame returns once ZeroMQ has sent it).
      frames_(device_, 0, /*host=*/true) {
  frames_.set_idle_bound_to_peak(true);
}

Status ServerShard::NewTableState(const TableInfo& info, bool allocate, std::unique_ptr<TableState>* out) {
  // Every process hosts one shard, so shards are numbered like the workers.
  std::vector<RowSpan> parts = ShardParts(info, rank_, num_workers_);
  auto table = std::make_unique<TableState>(num_workers_, static_cast<int>(parts.size()));
  table->info = info;
  table->range = ShardRange(info.num_rows, rank_, num_workers_);
  table->parts = std::move(parts);
  table->num_values = table->range.count * info.row_width;
  table->rule_config = info.update_rule ? *info.update_rule : rule_config_;
  if (allocate && table->num_values > 0) {
    MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, static_cast<size_t>(table->num_values) * sizeof(float),
                                          state_in_host_, &table->values));
  }
  *out = std::move(table);
  return Status::Ok();
}

Status ServerShard::AllocateState(TableState* table) {
  if (table->num_values > 0 && !table->values) {
    // Zero pages: on the CPU backend they take memory only once written.
    MLT_RETURN_IF_ERROR(DeviceBlock::MakeZeroed(device_, static_cast<size_t>(table->num_values) * sizeof(float),
                                                state_in_host_, &table->values));
  } else if (table->values) {
    device_->Fill(table->data(), 0.0f, static_cast<size_t>(table->num_values), Stream::kServer);
  }
  table->rule = NewUpdateRule(table->rule_config, table->num_values, device_, state_in_host_);
  if (table->rule == nullptr) {  // the kind was checked by AddTable
    return Status::ResourceExhausted(
        TableText(table->info.id) + " (" + table->info.name + "): no " + (state_in_host_ ? "host" : "device") +
        " memory for the " + UpdateRuleName(table->rule_config.kind) + " rule's state (" +
        std::to_string(table->num_values * StateArraysPerValue(table->rule_config) * int64_t{sizeof(float)}) + " B)");
  }
  return device_->Synchronize(Stream::kServer);
}

void ServerShard::PlaceStateWhenReady(const Config& config) {
  defer_state_ = true;
  state_placed_ = tables_.empty() ? false : state_placed_;
  int64_t free_bytes = -1, total_bytes = -1;
  if (!device_->MemoryInfo(&free_bytes, &total_bytes).ok()) total_bytes = -1;
  device_memory_reserve_ = DeviceReserve(config, total_bytes);
  wait_timeout_ms_ = config.wait_timeout_ms;
}

Status ServerShard::PlaceState() {
  if (state_placed_) return Status::Ok();
  state_placed_ = true;
  int64_t state_bytes = 0;
  for (const auto& entry : tables_) {
    const TableState& table = *entry.second;
    state_bytes += table.state_bytes();
  }
  int64_t free_bytes = -1, total_bytes = -1;
  MLT_RETURN_IF_ERROR(device_->MemoryInfo(&free_bytes, &total_bytes));
  state_in_host_ = ShardStateInHostMemory(state_bytes, free_bytes, device_memory_reserve_, device_->maps_host_memory());
  // In host memory each table's state is allocated when a message first
  // needs it (EnsureState): worker 0's initial values arrive table by table,
  // and its process frees its copy of each as it is written, so the state
  // and those copies never take the host's memory twice over.
  if (state_in_host_) return Status::Ok();
  for (auto& entry : tables_) MLT_RETURN_IF_ERROR(AllocateState(entry.second.get()));
  return Status::Ok();
}

Status ServerShard::EnsureState(TableState* table) {
  return table->rule == nullptr ? AllocateState(table) : Status::Ok();
}

Status ServerShard::EnsureStateFor(const Message& in) {
  if (!state_in_host_) return Status::Ok();  // on the device: all allocated when placed
  if (in.header.table >= 0) {
    TableState* table = Find(in.header.branch, in.header.table);
    return table == nullptr ? Status::Ok() : EnsureState(table);  // an unknown table: its handler says so
  }
  for (auto& entry : tables_) MLT_RETURN_IF_ERROR(EnsureState(entry.second.get()));
  return Status::Ok();
}

int64_t ServerShard::state_bytes_allocated() const {
  int64_t bytes = 0;
  for (const auto& entry : tables_) {
    const TableState& table = *entry.second;
    if (table.rule != nullptr) {
      bytes += table.state_bytes();
    }
  }
  return bytes;
}

Status ServerShard::NotHere(TableId table, BranchId branch) const {
  return UnknownTable(table, branch, branches_.count(0) == 0);
}

ServerShard::TableState* ServerShard::Find(BranchId branch, TableId table) const {
  auto found = tables_.find({branch, table});
  return found == tables_.end() ? nullptr : found->second.get();
}

Status ServerShard::AddTable(const TableInfo& info) {
  if (info.local) {
    return Status::InvalidArgument(TableText(info.id) + " (" + info.name +
                                   ") is local data; local tables never reach a shard");
  }
  if (tables_.count({0, info.id}) != 0) {
    return Status::InvalidArgument(TableText(info.id) + " (" + info.name + ") is already registered");
  }
  if (info.num_rows < 1 || info.row_width < 1) {
    return Status::InvalidArgument(TableText(info.id) + " (" + info.name + ") has " +
                                   std::to_string(info.num_rows) + " rows of width " +
                                   std::to_string(info.row_width) + "; both must be >= 1");
  }
  std::unique_ptr<TableState> table;
  MLT_RETURN_IF_ERROR(NewTableState(info, /*allocate=*/false, &table));
  if (!KnownRuleKind(table->rule_config.kind)) {
    // Checked here, not when the state is placed (after every worker's
    // kReady), so that CreateTable names the mistake.
    return Status::InvalidArgument(TableText(info.id) + " (" + info.name + "): unknown update rule kind " +
                                   std::to_string(static_cast<int>(table->rule_config.kind)));
  }
  if (state_placed_) MLT_RETURN_IF_ERROR(AllocateState(table.get()));
  tables_.emplace(std::make_pair(BranchId{0}, info.id), std::move(table));
  return Status::Ok();
}

Status ServerShard::DropTable(TableId table) {
  if (static_cast<int>(ready_requests_.size()) == num_workers_) {
    return Status::OutOfOrder(TableText(table) + " cannot be dropped: every worker is ready");
  }
  if (tables_.erase({0, table}) == 0) return Status::NotFound(TableText(table) + " is not registered");
  return Status::Ok();
}

Status ServerShard::Handle(const Message& in, std::vector<Message>* out) {
  if (out == nullptr) return Status::InvalidArgument("ServerShard::Handle: out is null");
  // The state is placed once every worker is ready (HandleReady); anything
  // else that arrives first needs it now.
  if (in.type() != MessageType::kReady) {
    Status placed = PlaceState();
    if (placed.ok()) placed = EnsureStateFor(in);
    if (!placed.ok()) {
      // No room for the state (pinned host memory, say): a request's sender
      // waits for a reply, so it gets the reason rather than a timeout.
      if (in.header.request_id != 0) out->push_back(ErrorReply(rank_, in, placed));
      return placed;
    }
  }
  switch (in.type()) {
    case MessageType::kStart: return HandleStart(in, out);
    case MessageType::kClockUpdate: return HandleClockUpdate(in, out);
    case MessageType::kFetch: return HandleFetch(in, out);
    case MessageType::kInitAdd: return HandleInitAdd(in, out);
    case MessageType::kReady: return HandleReady(in, out);
    case MessageType::kFork: return HandleFork(in, out);
    case MessageType::kFreeBranch: return HandleFreeBranch(in, out);
    case MessageType::kBranchRows: return HandleBranchRows(in, out);
    case MessageType::kEmptyClock: return HandleEmptyClock(in, out);
    case MessageType::kRows:
    case MessageType::kFetchReply:
    case MessageType::kAck:
    case MessageType::kError:
      return Status::InvalidArgument("client-bound message (type " +
                                     std::to_string(in.header.type) + ") sent to a shard");
    case MessageType::kBatch:  // opened by the receiving ProcessNode: never reaches a shard
    case MessageType::kIpcNotice:
    case MessageType::kIpcRelease:
      return Status::InvalidArgument("a transport envelope (type " + std::to_string(in.header.type) +
                                     ") sent to a shard");
  }
  return Status::InvalidArgument("unknown message type " + std::to_string(in.header.type));
}

// kStart ends initialisation for the sender in every table at once: its
// entries move from kNoClock to kInitClock. A table whose last worker starts
// has its initial values final, so they are pushed with data age -1.
Status ServerShard::HandleStart(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  const WorkerId sender = in.header.sender;
  for (const auto& entry : tables_) {
    if (entry.second->clock.Get(sender) != kNoClock) {
      return Status::OutOfOrder("worker " + std::to_string(sender) +
                                " sent kStart twice (already started " + TableText(entry.first.second) + ")");
    }
  }
  // Before the first kStart only branch 0 exists: forks need every worker started.
  for (auto& entry : tables_) {
    TableState& table = *entry.second;
    bool global_advanced = false;
    MLT_RETURN_IF_ERROR(table.clock.Advance(sender, kInitClock, &global_advanced));
    if (global_advanced) MLT_RETURN_IF_ERROR(PushAllRows(table, out));
  }
  return Status::Ok();
}

Status ServerShard::Handle(Message&& in, std::vector<Message>* out) {
  return Handle(static_cast<const Message&>(in), out);
}

Status ServerShard::PayloadOnDevice(const Message& in, std::shared_ptr<DeviceBuffer>* out) {
  out->reset();
  if (in.device_values) {
    MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kServer, in.device_values->ready));
    *out = in.device_values;
    return Status::Ok();
  }
  const size_t count = in.num_values();
  if (count == 0) return Status::Ok();
  if (in.host_frame && device_->host_addressable()) {
    *out = in.host_frame;  // the device reads it where it lies: no copy
    return Status::Ok();
  }
  MLT_RETURN_IF_ERROR(buffers_.Acquire(count, Stream::kServer, out));
  device_->CopyHostToDevice((*out)->data, in.host_values(), count * sizeof(float), Stream::kServer);
  // A pageable source is read before the copy call returns; a CPU device
  // copies at once; a host frame (pinned) is read by the queued copy, so it
  // goes back to its pool with that copy's ticket.
  if (in.host_frame) MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &in.host_frame->last_use));
  return Status::Ok();
}

void ServerShard::AddSpansOnDevice(const Message& in, const RowSpan& range, int64_t row_width,
                                   const float* source, float* dense) {
  for (const RowSpan& span : in.spans) {
    const int64_t count = span.count * row_width;
    device_->AddInto(dense + (span.begin - range.begin) * row_width, source, count, Stream::kServer);
    source += count;
  }
}

Status ServerShard::HandleClockUpdate(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  TableState* found = Find(in.header.branch, in.header.table);
  if (found == nullptr) return NotHere(in.header.table, in.header.branch);
  TableState& table = *found;
  MLT_RETURN_IF_ERROR(CheckPayload(in, table.info));

  const WorkerId sender = in.header.sender;
  const Clock clock = in.header.clock;
  const Clock last = table.clock.Sent(sender);
  // Training clocks start at 0; clock -1 is entered only through kStart.
  if (last == kNoClock) {
    return Status::OutOfOrder(TableText(table.info.id) + ": worker " + std::to_string(sender) +
                              " sent clock " + std::to_string(clock) + " before kStart");
  }
  // Which part this is follows from the order: every worker sends the
  // parts of a clock one after the other.
  int part = 0;
  if (!table.clock.NextPart(sender, clock, &part).ok()) {
    return Status::OutOfOrder(TableText(table.info.id) + ": worker " + std::to_string(sender) +
                              " sent clock " + std::to_string(clock) + ", expected " + std::to_string(last + 1) +
                              (table.clock.parts() > 1 ? " (a clock of " + std::to_string(table.clock.parts()) +
                                                             " parts, each sent once, in order)"
                                                       : ""));
  }
  const RowSpan& rows = table.parts[static_cast<size_t>(part)];
  MLT_RETURN_IF_ERROR(CheckSpans(table, rows, in));

  // Every part carries the clock's rate; the first one records it, also of
  // a clock declared empty that is still to finish (its rate must agree).
  if ((in.header.flags & kNewLearningRate) != 0 && part == 0 && clock > table.clock.global()) {
    table.new_rates[clock][sender] = in.header.learning_rate;
  }
  if (table.clock.DeclaredEmpty(sender, clock)) return DropDeclaredEmpty(&table, in);
  // Every part carries the mark; part 0, which every worker's must reach
  // before the clock's first part is applied, decides for all of them.
  if ((in.header.flags & kSkipStep) != 0 && part == 0 && clock > table.clock.global()) {
    table.skipped_steps.insert(clock);
  }
  if (check_finite_ && table.training && in.num_values() > 0) MLT_RETURN_IF_ERROR(CheckFinite(table, in));
  if (in.num_values() > 0) {
    std::shared_ptr<DeviceBuffer> payload;
    MLT_RETURN_IF_ERROR(PayloadOnDevice(in, &payload));
    std::vector<std::shared_ptr<DeviceBuffer>>& per_worker = table.pending[{clock, part}];
    per_worker.resize(static_cast<size_t>(num_workers_));
    std::shared_ptr<DeviceBuffer>& dense = per_worker[static_cast<size_t>(sender)];
    const bool whole_part = in.spans.size() == 1 && in.spans[0].begin == rows.begin && in.spans[0].count == rows.count;
    if (!dense && whole_part) {
      dense = std::move(payload);  // already dense in the part's row order
    } else {
      if (!dense) {
        MLT_RETURN_IF_ERROR(buffers_.Acquire(static_cast<size_t>(table.values_of(part)), Stream::kServer, &dense));
        device_->Fill(dense->data, 0.0f, dense->count, Stream::kServer);
      }
      AddSpansOnDevice(in, rows, table.info.row_width, payload->data, dense->data);
      MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &payload->last_use));
    }
  }

  const int64_t before = table.clock.global_position();
  MLT_RETURN_IF_ERROR(table.clock.Advance(sender, clock, nullptr));
  return FinishParts(&table, before, out);
}

// A worker's own update of a clock another worker declared empty: its
// samples were computed by others, so it must be zero; it is dropped (the
// clock was counted when declared), only its order checked.
Status ServerShard::DropDeclaredEmpty(TableState* table, const Message& in) {
  const size_t count = in.num_values();
  std::vector<float> copied;
  const float* values = in.host_values();
  if (count > 0 && values == nullptr) {
    // In device memory: a rare message (a late worker's), read back to check.
    MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kServer, in.device_values->ready));
    copied.resize(count);
    device_->CopyDeviceToHost(copied.data(), in.device_values->data, count * sizeof(float), Stream::kServer);
    MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kServer));
    values = copied.data();
  }
  const size_t nonzero = static_cast<size_t>(std::count_if(values, values + count, [](float v) { return v != 0.0f; }));
  if (nonzero != 0) {
    return Status::InvalidArgument(TableText(table->info.id) + " on branch " + std::to_string(table->branch) +
                                   ": worker " + std::to_string(in.header.sender) + " sent " +
                                   std::to_string(nonzero) + " nonzero values for clock " +
                                   std::to_string(in.header.clock) +
                                   ", which another worker declared empty (its samples went to the others); "
                                   "an empty step must update by zero");
  }
  return table->clock.Advance(in.header.sender, in.header.clock, nullptr);
}

// kEmptyClock: every table of the branch counts the worker's clock at once.
// Everything is checked before any table changes.
Status ServerShard::HandleEmptyClock(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  const int64_t late = in.header.request_id;
  const std::string what = "an empty clock " + std::to_string(in.header.clock) + " of worker " + std::to_string(late) +
                           " on branch " + std::to_string(in.header.branch);
  if (late < 0 || late >= num_workers_) {
    return Status::InvalidArgument(what + ": no such worker (the job has " + std::to_string(num_workers_) + ")");
  }
  if (in.header.clock < 0) return Status::InvalidArgument(what + ": only training clocks (>= 0) can be empty");
  if (branches_.count(in.header.branch) == 0) return Status::InvalidArgument(what + ": no such branch");
  if (in.num_values() != 0 || !in.spans.empty()) return Status::InvalidArgument(what + ": it carries rows");
  std::vector<TableState*> tables;
  for (auto& entry : tables_) {
    if (entry.first.first != in.header.branch) continue;
    if (entry.second->clock.Sent(static_cast<WorkerId>(late)) == kNoClock) {
      return Status::OutOfOrder(what + ": that worker has not started");
    }
    tables.push_back(entry.second.get());
  }
  for (TableState* table : tables) {
    const int64_t before = table->clock.global_position();
    MLT_RETURN_IF_ERROR(table->clock.DeclareEmpty(static_cast<WorkerId>(late), in.header.clock, nullptr));
    MLT_RETURN_IF_ERROR(FinishParts(table, before, out));
  }
  return Status::Ok();
}

// Applies every part the global position passed since `before`, in order,
// then pushes each part once, at the last clock of it that finished.
Status ServerShard::FinishParts(TableState* table, int64_t before, std::vector<Message>* out) {
  const int64_t now = table->clock.global_position();
  for (int64_t position = before + 1; position <= now; ++position) {
    MLT_RETURN_IF_ERROR(ApplyPart(table, table->clock.ClockOf(position), table->clock.PartOf(position)));
  }
  for (int64_t position = std::max(before + 1, now - table->clock.parts() + 1); position <= now; ++position) {
    MLT_RETURN_IF_ERROR(PushRows(*table, table->clock.PartOf(position), table->clock.ClockOf(position), out));
  }
  return Status::Ok();
}

// Host payloads are counted here; a device payload on the server stream once
// its producer is done, which blocks this thread for the count.
Status ServerShard::CheckFinite(const TableState& table, const Message& in) {
  const int64_t count = static_cast<int64_t>(in.num_values());
  int64_t bad = 0;
  if (in.device_values) {
    MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kServer, in.device_values->ready));
    MLT_RETURN_IF_ERROR(device_->CountNonFinite(in.device_values->data, count, Stream::kServer, &bad));
  } else {
    bad = CountNonFiniteHost(in.host_values(), count);
  }
  if (bad == 0) return Status::Ok();
  return Status::NonFinite("table '" + table.info.name + "' (id " + std::to_string(table.info.id) + ") on branch " +
                           std::to_string(table.branch) + ", clock " + std::to_string(in.header.clock) + ": worker " +
                           std::to_string(in.header.sender) + "'s update holds " + std::to_string(bad) + " of " +
                           std::to_string(count) + " values that are NaN or infinite (refused: Config.check_finite)");
}

Status ServerShard::HandleFetch(const Message& in, std::vector<Message>* out) {
  // A sender out of range has no client to tell, so it only gets the Status.
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  const TableState* found = Find(in.header.branch, in.header.table);
  Status status = found == nullptr ? NotHere(in.header.table, in.header.branch) : CheckSpans(*found, found->range, in);
  if (!status.ok()) {
    out->push_back(ErrorReply(rank_, in, status));
    return status;
  }
  const TableState& table = *found;
  const int64_t row_width = table.info.row_width;
  Message reply = Reply(MessageType::kFetchReply, rank_, in);
  reply.header.clock = table.clock.global();  // the data age of the values
  reply.header.row_width = row_width;
  reply.header.num_spans = static_cast<uint32_t>(in.spans.size());
  reply.spans = in.spans;
  reply.values.resize(static_cast<size_t>(CountRows(in.spans) * row_width));
  float* target = reply.values.data();
  for (const RowSpan& span : in.spans) {
    const int64_t count = span.count * row_width;
    device_->CopyDeviceToHost(target, table.data() + (span.begin - table.range.begin) * row_width,
                              static_cast<size_t>(count) * sizeof(float), Stream::kServer);
    target += count;
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kServer));
  out->push_back(std::move(reply));
  return Status::Ok();
}

// kInitAdd writes initial values straight into the master copy, so it is only
// legal while the sender is still initialising (before its kStart).
Status ServerShard::HandleInitAdd(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  TableState* found = Find(in.header.branch, in.header.table);
  Status status = found == nullptr ? NotHere(in.header.table, in.header.branch) : CheckSpans(*found, found->range, in);
  if (status.ok()) status = CheckPayload(in, found->info);
  // Initial values are checked as training updates are: a NaN model would train on NaN.
  if (status.ok() && check_finite_ && in.num_values() > 0) status = CheckFinite(*found, in);
  if (status.ok() && found->clock.Get(in.header.sender) != kNoClock) {
    status = Status::OutOfOrder(TableText(in.header.table) + ": worker " +
                                std::to_string(in.header.sender) + " sent kInitAdd after kStart");
  }
  if (!status.ok()) {
    out->push_back(ErrorReply(rank_, in, status));
    return status;
  }
  TableState& table = *found;
  if (device_->host_addressable() && !in.device_values && !in.host_frame && in.num_values() > 0) {
    // Worker 0's initial values, added from the message where they lie
    // rather than through a payload buffer: a pass less over the model.
    // Waited for before the message goes away.
    AddSpansOnDevice(in, table.range, table.info.row_width, in.host_values(), table.data());
    MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kServer));
  } else {
    std::shared_ptr<DeviceBuffer> payload;
    MLT_RETURN_IF_ERROR(PayloadOnDevice(in, &payload));
    if (payload) {
      AddSpansOnDevice(in, table.range, table.info.row_width, payload->data, table.data());
      MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &payload->last_use));
    }
  }
  out->push_back(Reply(MessageType::kAck, rank_, in));
  return Status::Ok();
}

// kReady is a barrier: it is acknowledged once every worker has sent it, so
// no worker sends initial values or clocks before every shard knows every
// table. The check waits for the last kReady because this shard's own worker
// registers its tables before sending its kReady, and only then are the
// shard's tables complete. Any mismatch fails every worker, so none of them
// goes on to wait for clocks that will never come.
Status ServerShard::HandleReady(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  if (ready_requests_.count(in.header.sender) != 0) {
    const Status status = Status::OutOfOrder("worker " + std::to_string(in.header.sender) + " sent kReady twice");
    out->push_back(ErrorReply(rank_, in, status));
    return status;
  }
  ready_requests_[in.header.sender] = {in.header.request_id, in.text};
  if (static_cast<int>(ready_requests_.size()) < num_workers_) return Status::Ok();

  std::vector<TableInfo> mine;
  for (const auto& entry : tables_) {
    if (entry.first.first == 0) mine.push_back(entry.second->info);
  }
  // Equal tables encode to equal bytes (wire/table_schema.h); a worker's
  // schema is decoded only to say how it differs.
  const std::string expected = EncodeTableSchema(mine);
  std::string mismatches;
  for (const auto& [worker, request] : ready_requests_) {
    if (request.second == expected) continue;
    std::vector<TableInfo> theirs;
    const Status decoded = DecodeTableSchema(request.second, &theirs);
    mismatches += " worker " + std::to_string(worker) +
                  (decoded.ok() ? " created [" + DescribeTables(theirs) + "];" : " sent " + decoded.ToString() + ";");
  }
  // Every worker's plan is made and its memory taken: the state goes where
  // there is room for it now (PlaceStateWhenReady).
  const Status status = mismatches.empty()
                            ? PlaceState()
                            : Status::InvalidArgument("shard " + std::to_string(rank_) + " has tables [" +
                                                      DescribeTables(mine) + "] but" + mismatches +
                                                      " every worker must create the same tables in the same order");
  for (const auto& [worker, request] : ready_requests_) {
    out->push_back(AckOrRefusal(rank_, worker, /*branch=*/0, request.first, status));
  }
  return status;
}

Status ServerShard::CheckSpans(const TableState& table, const RowSpan& range, const Message& in) const {
  const int64_t range_end = range.begin + range.count;
  for (const RowSpan& span : in.spans) {
    // Written as begin <= end - count so a huge count cannot overflow.
    const bool inside = span.count >= 0 && span.begin >= range.begin && span.begin <= range_end - span.count;
    if (!inside) {
      return Status::InvalidArgument(TableText(table.info.id) + ": span " + SpanText(span) +
                                     " (count " + std::to_string(span.count) +
                                     ") is outside this shard's rows " + SpanText(range) +
                                     (range.count != table.range.count ? " (a part of its rows " + SpanText(table.range) +
                                                                             ", the one this message is in order for)"
                                                                       : ""));
    }
  }
  return Status::Ok();
}

// Sends every client a part of this shard's rows of the table (all of them
// when the table is not split). The message goes out even when the shard
// owns no rows (a table with fewer rows than shards): the client's data age
// moves with each shard's last part. Workers outside the shard's memory
// (other processes, other GPUs of a LocalCluster) share one host frame: one
// device -> host copy, one view of it sent to each.
Status ServerShard::PushRows(const TableState& table, int part, Clock age, std::vector<Message>* out) {
  std::shared_ptr<DeviceBuffer> shared_frame;
  for (int worker = 0; worker < num_workers_; ++worker) {
    Message rows;
    MLT_RETURN_IF_ERROR(RowsMessage(table, part, age, worker, &rows, &shared_frame));
    out->push_back(std::move(rows));
  }
  return Status::Ok();
}

Status ServerShard::PushAllRows(const TableState& table, std::vector<Message>* out) {
  for (int part = 0; part < static_cast<int>(table.parts.size()); ++part) {
    MLT_RETURN_IF_ERROR(PushRows(table, part, table.clock.global(), out));
  }
  return Status::Ok();
}

// Views of the state itself (LendValues) go to a worker of another process
// reached by CUDA IPC or shared memory, whose copy into that process is made
// as the message leaves, on this thread, which ends the loan at once; and to
// the workers of this process on the CPU, or with the state in host memory,
// which hold them until their installers have copied the rows (the next rule
// waits: WaitForLoans). On a GPU a worker of this process gets a copy in
// device memory instead, queued on the server stream after the rule (its
// install waits for `ready`), so the rule never waits for its installer.
// Any other worker gets a host copy, which waits for the device.
Status ServerShard::RowsMessage(const TableState& table, int part, Clock age, int worker, Message* out,
                                std::shared_ptr<DeviceBuffer>* shared_frame) {
  Message rows = NewMessage(MessageType::kRows, rank_, worker, table.info.id);
  rows.header.branch = table.branch;
  rows.header.clock = age;
  rows.header.row_width = table.info.row_width;
  const RowSpan& range = table.parts[static_cast<size_t>(part)];
  if (range.count > 0) {
    rows.spans.push_back(range);
    const size_t count = static_cast<size_t>(table.values_of(part));
    const float* values = table.data() + table.offset_of(part);
    const RowsRoute route = rows_route_ ? rows_route_(worker) : RowsRoute::kHostFrame;
    const bool direct = route != RowsRoute::kHostFrame;
    const bool host = device_->host_addressable();
    if (direct && state_in_host_ && (worker == rank_ || !host)) {
      MLT_RETURN_IF_ERROR(LendValues(table, part, &rows.host_frame));
    } else if ((direct && host) || route == RowsRoute::kCopiedAtSend) {
      MLT_RETURN_IF_ERROR(LendValues(table, part, &rows.device_values));
    } else if (direct) {
      MLT_RETURN_IF_ERROR(buffers_.Acquire(count, Stream::kServer, &rows.device_values));
      device_->CopyDeviceToDevice(rows.device_values->data, values, count * sizeof(float), Stream::kServer);
      MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &rows.device_values->ready));
    } else {
      // Into a host frame, ready with the copy's ticket: the transport's
      // send thread waits for it, this thread does not. One copy per push:
      // each receiver gets a view of it, since the workers of a LocalCluster
      // on other GPUs install it at once and each leaves its own last use.
      std::shared_ptr<DeviceBuffer> frame = shared_frame != nullptr ? *shared_frame : nullptr;
      if (!frame) {
        MLT_RETURN_IF_ERROR(frames_.Acquire(count, Stream::kServer, &frame));
        device_->CopyDeviceToHost(frame->data, values, count * sizeof(float), Stream::kServer);
        MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &frame->ready));
        if (shared_frame != nullptr) *shared_frame = frame;
      }
      rows.host_frame = shared_frame != nullptr ? ShareView(frame) : std::move(frame);
    }
  }
  rows.header.num_spans = static_cast<uint32_t>(rows.spans.size());
  *out = std::move(rows);
  return Status::Ok();
}

Status ServerShard::LendValues(const TableState& table, int part, std::shared_ptr<DeviceBuffer>* out) {
  auto view = std::make_unique<DeviceBuffer>();
  view->data = table.data() + table.offset_of(part);
  view->count = static_cast<size_t>(table.values_of(part));
  view->borrowed = true;  // read only: the installer never writes a frame
  view->block = table.values;  // names the device whose ticket `ready` is (WaitReady)
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &view->ready));
  std::shared_ptr<Loans> loans = table.loans;
  {
    MutexLock lock(&loans->mu);
    ++loans->out;
  }
  // The deleter keeps the values alive (a freed branch's view may still be
  // out) and hands the last read's ticket back.
  std::shared_ptr<DeviceBlock> values = table.values;
  *out = std::shared_ptr<DeviceBuffer>(view.release(), [loans, values](DeviceBuffer* returned) {
    {
      MutexLock lock(&loans->mu);
      if (returned->last_use) loans->last_uses.push_back(returned->last_use);
      --loans->out;
    }
    loans->returned.NotifyAll();
    delete returned;
  });
  return Status::Ok();
}

Status ServerShard::WaitForLoans(const TableState& table) {
  Loans& loans = *table.loans;
  std::vector<DeviceEvent> last_uses;
  {
    MutexLock lock(&loans.mu);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_timeout_ms_);
    while (loans.out > 0 && loans.returned.WaitUntil(deadline)) {
    }
    if (loans.out > 0) {
      return Status::Timeout(TableText(table.info.id) + " (" + table.info.name + ") on branch " +
                             std::to_string(table.branch) + ": " + std::to_string(loans.out) +
                             " worker(s) of this process did not install the shard's last rows within " +
                             std::to_string(wait_timeout_ms_) + " ms (Config.wait_timeout_ms), so the update "
                             "rule cannot change them");
    }
    last_uses.swap(loans.last_uses);
  }
  for (const DeviceEvent& last_use : last_uses) MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kServer, last_use));
  return Status::Ok();
}

// Called for each part the table's global position passes, in order (parts
// finish clock by clock). The rule runs once per finished part, also when
// no worker sent values: for a stateful rule (momentum, Adam) a clock
// without updates is a zero-gradient step that still decays its history.
// For the stateless rules (add, SGD) a zero update changes nothing, so the
// step is skipped. A clock's first part takes its new learning rate and
// starts the rule's step.
Status ServerShard::ApplyPart(TableState* table, Clock finished, int part) {
  auto pending = table->pending.find({finished, part});
  std::vector<std::shared_ptr<DeviceBuffer>> updates;
  if (pending != table->pending.end()) {
    updates = std::move(pending->second);
    table->pending.erase(pending);
  }
  if (part == 0) MLT_RETURN_IF_ERROR(TakeNewLearningRate(table, finished));
  const bool skipped = table->skipped_steps.count(finished) != 0;
  if (skipped && part + 1 == table->clock.parts()) table->skipped_steps.erase(finished);
  if (!table->training) return Status::Ok();  // evaluation and testing branches never change
  if (skipped) return ReleaseUpdates(updates);  // a skipped step: nothing changes
  // Sum in worker order 0..N-1, whatever order the updates arrived in, so
  // the float result is the same on every run. Workers that sent nothing
  // have no buffer and add nothing.
  const int64_t count = table->values_of(part);
  std::shared_ptr<DeviceBuffer> sum;
  MLT_RETURN_IF_ERROR(SumInWorkerOrder(updates, count, &sum));
  if (!sum) {
    if (!table->rule->stateful() || count == 0) return Status::Ok();
    MLT_RETURN_IF_ERROR(buffers_.Acquire(static_cast<size_t>(count), Stream::kServer, &sum));
    device_->Fill(sum->data, 0.0f, sum->count, Stream::kServer);
    updates.push_back(sum);
  }
  MLT_RETURN_IF_ERROR(WaitForLoans(*table));  // workers of this process still reading the last rows
  const int64_t offset = table->offset_of(part);
  table->rule->ApplyPart(table->data() + offset, sum->data, offset, count, num_workers_, part == 0, Stream::kServer);
  return ReleaseUpdates(updates);
}

Status ServerShard::ReleaseUpdates(std::vector<std::shared_ptr<DeviceBuffer>>& updates) {
  DeviceEvent done;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kServer, &done));
  for (std::shared_ptr<DeviceBuffer>& update : updates) {
    if (update) update->last_use = done;
  }
  return Status::Ok();
}

// The first update becomes the sum, unless it is borrowed (a received frame,
// read only): then the second, if it may be written, takes the first in
// (a + b and b + a are the same float, bit for bit), else a pooled buffer
// starts as a copy of the first. The rest are added in order.
Status ServerShard::SumInWorkerOrder(std::vector<std::shared_ptr<DeviceBuffer>>& updates, int64_t count,
                                     std::shared_ptr<DeviceBuffer>* sum) {
  std::vector<std::shared_ptr<DeviceBuffer>> present;
  for (const std::shared_ptr<DeviceBuffer>& update : updates) {
    if (update) present.push_back(update);
  }
  sum->reset();
  if (present.empty()) return Status::Ok();
  size_t next = 1;
  if (present.size() == 1 || !present[0]->borrowed) {
    *sum = present[0];
  } else if (!present[1]->borrowed) {
    *sum = present[1];
    device_->AddInto((*sum)->data, present[0]->data, count, Stream::kServer);
    next = 2;
  } else {
    MLT_RETURN_IF_ERROR(buffers_.Acquire(static_cast<size_t>(count), Stream::kServer, sum));
    device_->CopyDeviceToDevice((*sum)->data, present[0]->data, static_cast<size_t>(count) * sizeof(float),
                                Stream::kServer);
    updates.push_back(*sum);  // returns to its pool with the others' ticket
  }
  for (size_t i = next; i < present.size(); ++i) {
    device_->AddInto((*sum)->data, present[i]->data, count, Stream::kServer);
  }
  return Status::Ok();
}

// A rate travels with each worker's clock update of the clock it starts at,
// so the change lands at the same clock on every shard, whatever the timing.
Status ServerShard::TakeNewLearningRate(TableState* table, Clock finished) {
  auto found = table->new_rates.find(finished);
  if (found == table->new_rates.end()) return Status::Ok();
  const std::map<WorkerId, float> rates = std::move(found->second);
  table->new_rates.erase(found);
  // A worker whose clock was declared empty and never sent (a rank that
  // closed the job lends its later clocks so) sets no rate.
  bool agree = true;
  for (WorkerId worker = 0; worker < num_workers_; ++worker) {
    auto rate = rates.find(worker);
    agree = agree && (rate == rates.end() ? table->clock.DeclaredEmpty(worker, finished)
                                          : rate->second == rates.begin()->second);
  }
  if (!agree) {
    std::string asked;
    for (WorkerId worker = 0; worker < num_workers_; ++worker) {
      auto rate = rates.find(worker);
      asked += " worker " + std::to_string(worker) + ": " +
               (rate == rates.end() ? "kept " + std::to_string(table->rule->config().learning_rate)
                                    : std::to_string(rate->second)) +
               ";";
    }
    return Status::InvalidArgument(TableText(table->info.id) + " (" + table->info.name + ") on branch " +
                                   std::to_string(table->branch) + ", clock " + std::to_string(finished) +
                                   ": the workers set different learning rates (" + asked +
                                   ") every worker must set the same rate before the same clock");
  }
  table->rule->set_learning_rate(rates.begin()->second);
  return Status::Ok();
}

std::unique_ptr<std::vector<float>> ServerShard::values(TableId table, BranchId branch) const {
  const TableState* found = Find(branch, table);
  if (found == nullptr) return nullptr;
  auto out = std::make_unique<std::vector<float>>(static_cast<size_t>(found->num_values));
  if (found->values) {  // not yet placed: the values are still their initial zeros
    device_->CopyDeviceToHost(out->data(), found->data(), out->size() * sizeof(float), Stream::kServer);
    if (!device_->Synchronize(Stream::kServer).ok()) return nullptr;
  }
  return out;
}

Clock ServerShard::global_clock(TableId table, BranchId branch) const {
  const TableState* found = Find(branch, table);
  return found == nullptr ? kNoClock : found->clock.global();
}

float ServerShard::learning_rate(TableId table, BranchId branch) const {
  const TableState* found = Find(branch, table);
  return found == nullptr ? -1.0f : found->rule->config().learning_rate;
}

Status ServerShard::ExportTable(TableId table, ShardSlice* out, BranchId branch) const {
  const TableState* found = Find(branch, table);
  if (found == nullptr) return NotHere(table, branch);
  const TableState& state = *found;
  if (!state.rule) return Status::OutOfOrder(TableText(table) + ": the shard's state is placed once every worker is ready");
  out->first_row = state.range.begin;
  out->num_rows = state.range.count;
  out->values.resize(static_cast<size_t>(state.num_values));
  if (state.num_values > 0) {
    device_->CopyDeviceToHost(out->values.data(), state.data(), out->values.size() * sizeof(float), Stream::kServer);
  }
  MLT_RETURN_IF_ERROR(device_->Synchronize(Stream::kServer));
  out->state = state.rule->ExportState();
  out->state_arrays = state.rule->state_arrays_per_value();
  out->global_clock = state.clock.global();
  return Status::Ok();
}

Status ServerShard::ImportTable(TableId table, const float* values, size_t num_values, const float* state,
                                size_t num_state) {
  TableState* found = Find(0, table);
  if (found == nullptr) return UnknownTable(table);
  MLT_RETURN_IF_ERROR(PlaceState());
  MLT_RETURN_IF_ERROR(EnsureState(found));
  TableState& target = *found;
  const size_t state_size = target.rule->state_size();
  if (num_values != static_cast<size_t>(target.num_values) || num_state != state_size) {
    return Status::InvalidArgument(TableText(table) + " (" + target.info.name + "): restoring " +
                                   std::to_string(num_values) + " values and " + std::to_string(num_state) +
                                   " state floats, this shard holds " + std::to_string(target.num_values) +
                                   " and " + std::to_string(state_size));
  }
  if (!target.pending.empty()) {
    return Status::OutOfOrder(TableText(table) + " (" + target.info.name +
                              "): a restore must come before training starts");
  }
  MLT_RETURN_IF_ERROR(WaitForLoans(target));
  if (num_values > 0) {
    device_->CopyHostToDevice(target.data(), values, num_values * sizeof(float), Stream::kServer);
  }
  MLT_RETURN_IF_ERROR(target.rule->ImportState(state, num_state));
  return device_->Synchronize(Stream::kServer);
}

// --- branches ---------------------------------------------------------------

bool ServerShard::CollectRequest(std::map<BranchId, std::map<WorkerId, std::pair<int64_t, std::string>>>* pending,
                                 const Message& in, std::map<WorkerId, std::pair<int64_t, std::string>>* requests) {
  auto& arrived = (*pending)[in.header.branch];
  arrived[in.header.sender] = {in.header.request_id, in.text};
  if (static_cast<int>(arrived.size()) < num_workers_) return false;
  *requests = std::move(arrived);
  pending->erase(in.header.branch);
  return true;
}

// Every worker forks at the same point of its clock stream, and its fork
// request follows its updates of the parent (messages of one pair arrive in
// order). So when the last request arrives, every update the parent will get
// before the fork is here, and applied: the parent's clock cannot have
// finished without it. The child starts with every worker at clock -1.
Status ServerShard::HandleFork(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  std::map<WorkerId, std::pair<int64_t, std::string>> requests;
  if (!CollectRequest(&fork_requests_, in, &requests)) return Status::Ok();
  BranchId parent = -1;
  BranchSettings settings;
  Status status = DecodeBranchSettings(requests.begin()->second.second, &parent, &settings);
  for (const auto& [worker, request] : requests) {
    if (status.ok() && request.second != requests.begin()->second.second) {
      BranchId other_parent = -1;
      BranchSettings other;
      const Status decoded = DecodeBranchSettings(request.second, &other_parent, &other);
      status = Status::InvalidArgument(
          "workers forked branch " + std::to_string(in.header.branch) + " with different settings: '" +
          DescribeBranchSettings(parent, settings) + "' (worker " + std::to_string(requests.begin()->first) +
          ") and '" + (decoded.ok() ? DescribeBranchSettings(other_parent, other) : decoded.ToString()) +
          "' (worker " + std::to_string(worker) + ")");
    }
  }
  if (status.ok()) status = Fork(in.header.branch, parent, settings);
  for (const auto& [worker, request] : requests) {
    out->push_back(AckOrRefusal(rank_, worker, in.header.branch, request.first, status));
  }
  return status;
}

Status ServerShard::Fork(BranchId child, BranchId parent, const BranchSettings& settings) {
  if (branches_.count(child) != 0) return Status::InvalidArgument("branch " + std::to_string(child) + " already exists");
  if (branches_.count(parent) == 0) {
    return Status::NotFound("cannot fork from branch " + std::to_string(parent) + ": it does not exist");
  }
  if (static_cast<int>(branches_.size()) >= max_branches_) {
    return Status::ResourceExhausted("cannot fork branch " + std::to_string(child) + ": " +
                                     std::to_string(branches_.size()) + " branches are live, the limit is " +
                                     std::to_string(max_branches_) + " (free some, or raise Config.max_branches)");
  }
  MLT_RETURN_IF_ERROR(CheckForkFits(child, parent));
  // Every shard holds every table, so each computes the same rates (as the
  // engines do for their own steps).
  const std::map<TableId, TableRate> rates =
      ForkRates(RatesOf(parent), settings.learning_rate, settings.keep_rate_ratios);
  std::vector<std::pair<std::pair<BranchId, TableId>, std::unique_ptr<TableState>>> copies;
  for (const auto& [key, table] : tables_) {
    if (key.first != parent) continue;
    std::unique_ptr<TableState> copy;
    MLT_RETURN_IF_ERROR(NewTableState(table->info, /*allocate=*/true, &copy));
    copy->branch = child;
    copy->training = settings.training;
    if (copy->values) {
      device_->CopyDeviceToDevice(copy->data(), table->data(), copy->values->bytes(), Stream::kServer);
    }
    // Each table keeps its own rule; the branch may set its rate and momentum.
    UpdateRuleConfig rule = table->rule->config();
    const auto rate = rates.find(key.second);
    if (rate != rates.end()) {
      rule.learning_rate = rate->second.rate;
      copy->rate_ratio = rate->second.ratio;
      copy->ratio_rate = rate->second.ratio_rate;
    } else if (settings.learning_rate >= 0) {  // an add table's, unused
      rule.learning_rate = settings.learning_rate;
    }
    if (settings.momentum >= 0) rule.momentum = settings.momentum;
    // Momentum history, Adam moments and steps go with the values.
    MLT_RETURN_IF_ERROR(table->rule->Clone(rule, &copy->rule));
    for (WorkerId worker = 0; worker < num_workers_; ++worker) {
      bool advanced = false;
      MLT_RETURN_IF_ERROR(copy->clock.Advance(worker, kInitClock, &advanced));
    }
    copies.emplace_back(std::make_pair(child, key.second), std::move(copy));
  }
  for (auto& entry : copies) tables_.emplace(std::move(entry.first), std::move(entry.second));
  branches_.insert(child);
  return Status::Ok();
}

std::map<TableId, TableRate> ServerShard::RatesOf(BranchId parent) const {
  std::map<TableId, TableRate> rates;
  for (const auto& [key, table] : tables_) {
    if (key.first != parent || table->rule->config().kind == UpdateRuleKind::kAdd) continue;
    rates[key.second] = {table->rule->config().learning_rate, table->rate_ratio, table->ratio_rate};
  }
  return rates;
}

Status ServerShard::CheckForkFits(BranchId child, BranchId parent) const {
  if (!state_in_host_ && !device_->host_addressable()) return Status::Ok();  // device memory: cudaMalloc says
  int64_t need = 0;
  for (const auto& [key, table] : tables_) {
    if (key.first == parent) {
      need += table->state_bytes();
    }
  }
  const HostHeadroom available = host_available_ ? host_available_() : HostMemoryHeadroom();
  if (!available.known() || need <= available.bytes) return Status::Ok();
  return Status::ResourceExhausted(
      "cannot fork branch " + std::to_string(child) + " from branch " + std::to_string(parent) + ": shard " +
      std::to_string(rank_) + "'s copy of its values and optimizer state needs " + std::to_string(need) +
      " bytes of host memory, but only " + std::to_string(available.bytes) + " are available (" +
      available.source + "); free a branch first, or trial fewer branches at once");
}

Status ServerShard::HandleFreeBranch(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  std::map<WorkerId, std::pair<int64_t, std::string>> requests;
  if (!CollectRequest(&free_requests_, in, &requests)) return Status::Ok();
  const BranchId branch = in.header.branch;
  Status status;
  if (branches_.erase(branch) == 0) {
    status = Status::NotFound("cannot free branch " + std::to_string(branch) + ": it does not exist");
  }
  for (auto it = tables_.begin(); it != tables_.end();) {
    it = it->first.first == branch ? tables_.erase(it) : std::next(it);
  }
  for (const auto& [worker, request] : requests) {
    out->push_back(AckOrRefusal(rank_, worker, branch, request.first, status));
  }
  return status;
}

Status ServerShard::HandleBranchRows(const Message& in, std::vector<Message>* out) {
  MLT_RETURN_IF_ERROR(CheckSender(in, num_workers_));
  const BranchId branch = in.header.branch;
  if (branches_.count(branch) == 0) {
    return Status::NotFound("rows of branch " + std::to_string(branch) + " requested: it does not exist");
  }
  for (const auto& [key, table] : tables_) {
    if (key.first != branch) continue;
    for (int part = 0; part < static_cast<int>(table->parts.size()); ++part) {
      // Each part says its own clock: a part the global position passed
      // already holds the next clock's update, which the worker may have
      // dropped (its cache on another branch) and will not get again.
      Message rows;
      MLT_RETURN_IF_ERROR(RowsMessage(*table, part, table->clock.PartClock(part), in.header.sender, &rows));
      out->push_back(std::move(rows));
    }
  }
  return Status::Ok();
}

}  // namespace mltuner
