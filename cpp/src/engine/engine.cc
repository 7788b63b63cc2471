// Engine: the application-facing calls. Validation happens here, at the
// boundary, so every mistake is reported with the table, handle or op at
// fault; the background threads then trust the plan.
#include <algorithm>
#include <limits>
#include <sstream>

#include "common/interruptible_wait.h"
#include "common/update_rule_check.h"
#include "engine/engine_impl.h"
#include "wire/table_schema.h"

namespace mltuner {

namespace {

constexpr int kMaxSlack = 1000;


Status ShutdownError() { return Status::Shutdown("the engine is shut down"); }

}  // namespace

// --- Impl: construction and tables ---------------------------------------------

Engine::Impl::Impl(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
                   Transport* transport)
    : config_(config),
      rank_(rank),
      num_workers_(num_workers),
      device_(std::move(device)),
      transport_(transport),
      allocator_(rank, num_workers, device_, transport, &plan_, &state_),
      reclaimer_(config_, rank, num_workers, device_, transport, &plan_, &state_),
      installer_(rank, num_workers, device_, &plan_, &state_) {
  BranchSettings initial;
  initial.learning_rate = config.update_rule.learning_rate;
  initial.momentum = config.update_rule.momentum;
  MutexLock lock(&state_.mu);
  state_.branches.enabled = config.branches;
  state_.branches.live[0] = initial;
  state_.branches.rule_overrides[0] = BranchSettings();
  state_.branches.clocks[0] = 0;
}

Engine::Impl::~Impl() {
  Shutdown();
  // The receive thread may install rows until its transport stops, which is
  // before the engine is destroyed.
  for (TableIndex& table : plan_.index.tables) {
    for (RunIndex& runs : table.unpack) device_->ReleaseIndex(&runs);
  }
}

std::chrono::steady_clock::time_point Engine::Impl::Deadline() const {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.wait_timeout_ms);
}

void Engine::Impl::Abort(const Status& why) {
  {
    MutexLock lock(&state_.age_mu);
    if (state_.abort_error.ok()) state_.abort_error = why;
  }
  state_.Fail(why);
}

Status Engine::Impl::CreateTable(const std::string& name, int64_t num_rows, int64_t row_width,
                                 bool local, TableId* out, const std::optional<UpdateRuleConfig>& update_rule) {
  if (state_.phase.load() == Phase::kShutdown) return ShutdownError();
  if (state_.phase.load() != Phase::kDefining) {
    return Status::OutOfOrder("create_table('" + name +
                              "') after the virtual iteration was finished");
  }
  if (name.empty()) return Status::InvalidArgument("a table needs a name");
  if (num_rows <= 0 || row_width <= 0) {
    return Status::InvalidArgument("table '" + name + "' needs num_rows > 0 and row_width > 0 (got " +
                                   std::to_string(num_rows) + " x " + std::to_string(row_width) + ")");
  }
  if (num_rows > (int64_t{1} << 40) / row_width) {
    return Status::InvalidArgument("table '" + name + "' is too large");
  }
  for (const TableInfo& table : plan_.tables) {
    if (table.name == name) return Status::InvalidArgument("table '" + name + "' already exists");
  }
  if (update_rule) {
    if (local) return Status::InvalidArgument("table '" + name + "' is local data: it has no update rule");
    MLT_RETURN_IF_ERROR(CheckUpdateRule(*update_rule, "table '" + name + "'"));
  }
  TableInfo info;
  info.id = static_cast<TableId>(plan_.tables.size());
  info.name = name;
  info.num_rows = num_rows;
  info.row_width = row_width;
  info.local = local;
  info.update_rule = update_rule;
  if (!local) {
    info.part_bytes = config_.clock_part_bytes != kAutoClockPartBytes ? config_.clock_part_bytes
                      : device_->host_addressable()                  ? kHostClockPartBytes
                                                                     : kDeviceClockPartBytes;
    MLT_RETURN_IF_ERROR(transport_->AddTableToShard(rank_, info));
  }
  plan_.tables.push_back(info);
  *out = info.id;
  return Status::Ok();
}

Status Engine::Impl::LookupTable(TableId table, const TableInfo** out) const {
  if (table < 0 || table >= static_cast<TableId>(plan_.tables.size())) {
    return Status::NotFound("unknown table id " + std::to_string(table));
  }
  *out = &plan_.tables[table];
  return Status::Ok();
}

// --- Impl: the end of the virtual iteration and the start -------------------------

Status Engine::Impl::WaitUntilAllReady() {
  std::vector<Message> requests;
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message ready = NewMessage(MessageType::kReady, rank_, shard, -1);
    ready.text = EncodeTableSchema(plan_.tables);
    ready.header.text_bytes = static_cast<uint32_t>(ready.text.size());
    requests.push_back(std::move(ready));
  }
  std::vector<Message> replies;
  const Status status = SendRequests(std::move(requests), &replies);
  if (status.code() == StatusCode::kTimeout) {
    return Status::Timeout("finish_virtual_iteration waited " + std::to_string(config_.wait_timeout_ms) +
                           " ms for every worker to finish its virtual iteration");
  }
  return status;
}

Status Engine::Impl::FinishVirtualIteration() {
  if (state_.phase.load() != Phase::kDefining) {
    return Status::OutOfOrder("finish_virtual_iteration was already called");
  }
  if (!finish_error_.ok()) {
    // The recording was consumed by the failed attempt; planning again would
    // plan nothing.
    return Status::OutOfOrder("finish_virtual_iteration failed before (" + finish_error_.ToString() +
                              "); shut this engine down and start over");
  }
  const Status status = PlanAndPrepare();
  if (!status.ok() && recorder_.finished()) finish_error_ = status;
  return status;
}

Status Engine::Impl::PreviewPlan(PlanPreview* out) {
  const Recording* recording = nullptr;
  MLT_RETURN_IF_ERROR(recorder_.Peek("preview_plan", &recording));
  PlanSite site;
  MLT_RETURN_IF_ERROR(Site(&site));
  return PreviewIteration(PlanConfig(), plan_.tables, *recording, site, &previewed_, out);
}

Status Engine::Impl::ReserveDeviceMemory(int64_t bytes) {
  if (bytes < 0) return Status::InvalidArgument("reserve_device_memory needs bytes >= 0, got " + std::to_string(bytes));
  if (bytes != application_device_bytes_) previewed_.reset();  // planned under the old reservation
  application_device_bytes_ = bytes;
  return Status::Ok();
}

Status Engine::Impl::ReleaseHostMemoryDuringInit(int64_t bytes) {
  if (bytes < 0) {
    return Status::InvalidArgument("release_host_memory_during_init needs bytes >= 0, got " + std::to_string(bytes));
  }
  host_bytes_freed_during_init_ = bytes;
  return Status::Ok();
}

Config Engine::Impl::PlanConfig() const {
  Config planned = config_;
  if (planned.device_memory_budget > 0 && application_device_bytes_ > 0) {
    // At least 1 byte, so that a refusal names the least budget.
    planned.device_memory_budget = std::max<int64_t>(1, planned.device_memory_budget - application_device_bytes_);
  }
  return planned;
}

Status Engine::Impl::Site(PlanSite* out) const {
  PlanSite site;
  site.rank = rank_;
  site.num_workers = num_workers_;
  site.device_is_host = device_->host_addressable();
  site.maps_host_memory = device_->maps_host_memory();
  MLT_RETURN_IF_ERROR(device_->MemoryInfo(&site.device_free, &site.device_total));
  site.application_bytes = application_device_bytes_;
  if (site.device_free >= 0) site.device_free = std::max<int64_t>(0, site.device_free - application_device_bytes_);
  *out = site;
  return Status::Ok();
}

Status Engine::Impl::ResetVirtualIteration() {
  previewed_.reset();
  return recorder_.Reset();
}

Status Engine::Impl::DropTables(TableId first) {
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(LookupTable(first, &info));
  if (!recorder_.empty()) {
    return Status::OutOfOrder("drop_tables while the virtual iteration has recorded calls: reset it first");
  }
  for (auto table = static_cast<TableId>(plan_.tables.size()) - 1; table >= first; --table) {
    if (!plan_.tables[table].local) MLT_RETURN_IF_ERROR(transport_->DropTableFromShard(rank_, table));
    plan_.tables.pop_back();
  }
  {
    MutexLock lock(&state_.mu);
    state_.new_rates.erase(state_.new_rates.lower_bound(first), state_.new_rates.end());
  }
  previewed_.reset();
  return Status::Ok();
}

Status Engine::Impl::PlanAndPrepare() {
  // The plan (plan/iteration_plan.h), or the one PreviewPlan kept: the
  // recording cannot change after its clock but by ResetVirtualIteration.
  // A plan refused here (budget, host memory) leaves the recording in place.
  const Recording* recorded = nullptr;
  MLT_RETURN_IF_ERROR(recorder_.Peek("finish_virtual_iteration", &recorded));
  std::unique_ptr<IterationPlan> plan = std::move(previewed_);
  if (!plan || !plan->Covers(plan_.tables)) {
    plan = std::make_unique<IterationPlan>();
    PlanSite site;
    MLT_RETURN_IF_ERROR(Site(&site));
    MLT_RETURN_IF_ERROR(PlanIteration(PlanConfig(), plan_.tables, *recorded, site, plan.get()));
  }
  MLT_RETURN_IF_ERROR(CheckHostMemory(plan->placement.host, config_.host_memory_limit, host_bytes_freed_during_init_));
  Recording recording;
  MLT_RETURN_IF_ERROR(recorder_.Finish(&recording));
  std::vector<RowLayout> layouts = std::move(plan->layouts);
  Placement placement = std::move(plan->placement);
  IterationIndex index = BuildIndexes(plan_.tables, layouts, placement, recording, num_workers_);

  std::vector<std::unique_ptr<TableStore>> stores;
  for (const TableInfo& table : plan_.tables) {
    std::unique_ptr<TableStore> store;
    MLT_RETURN_IF_ERROR(MakeTableStore(device_, table, placement.tables[table.id], config_.partitions_per_table,
                                       KeepsUpdateLog(table, recording), &store));
    stores.push_back(std::move(store));
  }
  MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, static_cast<size_t>(placement.pool_bytes), false,
                                        &plan_.pool_memory));
  MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, static_cast<size_t>(placement.staging_bytes), true, &plan_.staging));
  for (AccessIndex& access : index.accesses) {
    for (RunIndex* runs : {&access.device_gather, &access.host_gather, &access.device_scatter,
                           &access.host_scatter}) {
      MLT_RETURN_IF_ERROR(device_->PrepareIndex(runs));
    }
  }
  for (TableIndex& table : index.tables) {
    for (std::vector<RunIndex>* by_shard : {&table.pack, &table.unpack, &table.direct.runs}) {
      for (RunIndex& runs : *by_shard) MLT_RETURN_IF_ERROR(device_->PrepareIndex(&runs));
    }
  }

  plan_.recording = std::move(recording);
  plan_.layouts = std::move(layouts);
  plan_.placement = std::move(placement);
  plan_.index = std::move(index);
  plan_.stores = std::move(stores);
  MakeOwnUpdates();
  plan_.depth = plan_.placement.buffers.regions;  // clock c's buffers live in region c % depth
  state_.slots.assign(plan_.recording.accesses.size(), std::vector<Slot>(plan_.depth));
  init_slots_.assign(plan_.recording.accesses.size(), Slot());
  init_blocks_.assign(plan_.recording.accesses.size(), nullptr);
  {
    MutexLock lock(&state_.age_mu);
    state_.shard_age.assign(plan_.tables.size(), std::vector<mltuner::Clock>(num_workers_, kNoClock));
    state_.piece_age.clear();
    for (const TableIndex& index : plan_.index.tables) {
      state_.piece_age.emplace_back(index.pieces.size(), kNoClock);
    }
    state_.data_age.assign(plan_.tables.size(), kNoClock);
  }
  MLT_RETURN_IF_ERROR(WaitUntilAllReady());
  {
    MutexLock lock(&state_.mu);
    state_.stats.pool_bytes = plan_.placement.pool_bytes;
    state_.stats.pool_min_bytes = plan_.placement.pool_min_bytes;
    state_.stats.prefetch_clocks = plan_.placement.prefetch_clocks;
    state_.stats.device_store_bytes = plan_.placement.device_store_bytes;
    state_.stats.host_store_bytes = plan_.placement.host_store_bytes;
    state_.stats.host_memory_bytes = plan_.placement.host.total();
    state_.stats.budget_bytes = plan_.placement.budget.budget;
    state_.stats.automatic_budget = plan_.placement.budget.automatic;
    state_.stats.device_reserve_bytes = plan_.placement.budget.reserve;
    state_.stats.device_free_at_plan_bytes = plan_.placement.budget.device_free;
    state_.stats.shard_in_host_memory = plan_.placement.host.shard_in_host_memory;
    state_.stats.predicted_bytes_to_device_per_clock = plan_.placement.traffic.host_to_device();
    state_.stats.predicted_bytes_to_host_per_clock = plan_.placement.traffic.device_to_host();
  }
  state_.phase = Phase::kRecorded;
  return Status::Ok();
}

Status Engine::Impl::StartIterations() {
  if (state_.phase.load() == Phase::kDefining) {
    return Status::OutOfOrder("start_iterations before finish_virtual_iteration");
  }
  if (state_.phase.load() != Phase::kRecorded) return Status::OutOfOrder("start_iterations was already called");
  for (Handle h = 0; h < static_cast<Handle>(init_slots_.size()); ++h) {
    if (init_slots_[h].state != SlotState::kEmpty) {
      return Status::OutOfOrder("start_iterations while initialisation access of handle " +
                                std::to_string(h) + " is still open: post it first");
    }
  }
  init_blocks_.clear();
  // kStart tells every shard our initial values are in; each answers, once
  // all workers started, with its rows at data age -1.
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message start = NewMessage(MessageType::kStart, rank_, shard, -1);
    start.header.clock = kInitClock;
    MLT_RETURN_IF_ERROR(transport_->Send(std::move(start)));
    ++state_.messages_sent;
  }
  {
    MutexLock lock(&state_.mu);
    for (const TableInfo& info : plan_.tables) {  // branch 0's rates: the rules' own
      const UpdateRuleConfig& rule = info.update_rule ? *info.update_rule : config_.update_rule;
      if (!info.local && rule.kind != UpdateRuleKind::kAdd) {
        state_.branches.rates[0][info.id].rate = rule.learning_rate;
      }
    }
  }
  state_.phase = Phase::kRunning;
  allocator_.Start();
  reclaimer_.Start();
  return Status::Ok();
}

// --- Impl: real accesses ----------------------------------------------------------

std::string Engine::Impl::DescribeOp(int op_index) const {
  const RecordedOp& op = plan_.recording.ops[op_index];
  if (op.kind == OpKind::kClock) return "clock()";
  const AccessRecord& access = plan_.recording.accesses[op.handle];
  std::ostringstream out;
  out << OpKindName(op.kind) << "(handle " << op.handle << ": "
      << access.Describe(plan_.tables[access.table].name) << ")";
  return out.str();
}

Status Engine::Impl::CheckExpected(Handle handle, OpKind kind) const {
  if (handle < 0 || handle >= static_cast<Handle>(plan_.recording.accesses.size())) {
    if (kind == OpKind::kClock) return Status::Internal("clock checked with a handle");
    return Status::NotFound("unknown handle " + std::to_string(handle) + " in " + OpKindName(kind) +
                            " (the virtual iteration recorded " +
                            std::to_string(plan_.recording.accesses.size()) + " handles)");
  }
  return Status::Ok();
}

Status Engine::Impl::CheckNextOp(OpKind kind, Handle handle) const {
  const int op_index = static_cast<int>(state_.app_seq % plan_.recording.ops.size());
  const RecordedOp& expected = plan_.recording.ops[op_index];
  if (expected.kind == kind && expected.handle == handle) return Status::Ok();
  const std::string called =
      kind == OpKind::kClock ? "clock()" : std::string(OpKindName(kind)) + "(handle " + std::to_string(handle) + ")";
  return Status::OutOfOrder("called " + called + " but the recorded iteration expects " + DescribeOp(op_index) +
                            " as op " + std::to_string(op_index) + " of clock " + std::to_string(state_.app_clock));
}

AccessBuffer Engine::Impl::BufferFor(const AccessRecord& access, float* data, mltuner::Clock data_age,
                                     std::shared_ptr<void> keepalive) const {
  AccessBuffer buffer;
  buffer.data = data;
  buffer.rows = static_cast<int64_t>(access.rows.size());
  buffer.row_width = plan_.tables[access.table].row_width;
  buffer.writable = access.kind != OpKind::kRead;
  buffer.data_age = data_age;
  buffer.keepalive = std::move(keepalive);
  buffer.device = device_;
  return buffer;
}

Status Engine::Impl::WaitForSlot(Handle handle, mltuner::Clock clock, Slot** out) {
  Slot* slot = &state_.slots[handle][clock % plan_.depth];
  MutexLock lock(&state_.mu);
  const auto start = std::chrono::steady_clock::now();
  InterruptibleWait wait(Deadline());
  // As cv.wait_until(deadline, predicate), written out for the analysis.
  bool ready = state_.stopping || (slot->state == SlotState::kReady && slot->clock == clock);
  // A batch defers its wake-ups (Run): the threads that prepare the slot
  // must hear of the ops before this one before the application blocks.
  if (!ready) state_.cv.NotifyAllHeld();
  while (!ready) {
    const bool more = wait.Step(&state_.cv, &state_.mu);
    ready = state_.stopping || (slot->state == SlotState::kReady && slot->clock == clock);
    if (!more) break;
  }
  state_.stats.stall_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!state_.background_error.ok()) return state_.background_error;
  if (state_.stopping) return ShutdownError();
  if (!ready && wait.interrupted()) {
    // The slot stays the allocator's: the same open may be made again.
    const AccessRecord& access = plan_.recording.accesses[handle];
    return Status::Cancelled("interrupted while waiting for the buffer of " +
                             access.Describe(plan_.tables[access.table].name) + " at clock " + std::to_string(clock));
  }
  if (!ready) {
    const AccessRecord& access = plan_.recording.accesses[handle];
    return Status::Timeout("waited " + std::to_string(config_.wait_timeout_ms) + " ms for the buffer of " +
                           access.Describe(plan_.tables[access.table].name) + " at clock " +
                           std::to_string(clock) + "; the allocator thread is waiting for " +
                           (state_.allocator_waiting_for.empty() ? std::string("nothing")
                                                           : state_.allocator_waiting_for));
  }
  slot->state = SlotState::kInUse;
  *out = slot;
  return Status::Ok();
}

Status Engine::Impl::Open(Handle handle, OpKind kind, AccessBuffer* out, uintptr_t app_stream) {
  MLT_RETURN_IF_ERROR(CheckAccessCall(handle, kind));
  if (state_.phase.load() == Phase::kRecorded) return OpenInit(handle, out);
  MLT_RETURN_IF_ERROR(OpenSlot(handle, kind, out));
  // The allocator queued the buffer's contents without waiting for them: the
  // application's stream waits on the GPU instead, so this thread runs ahead.
  return device_->WaitOnAppStream(app_stream, out->ready);
}

Status Engine::Impl::Post(Handle handle, OpKind kind, uintptr_t app_stream) {
  MLT_RETURN_IF_ERROR(CheckAccessCall(handle, kind));
  if (state_.phase.load() == Phase::kRecorded) return PostInit(handle, app_stream);
  DeviceEvent app_done;
  MLT_RETURN_IF_ERROR(TakeAppTicket(app_stream, &app_done));
  return PostSlot(handle, kind, std::move(app_done), app_stream);
}

Status Engine::Impl::TakeAppTicket(uintptr_t app_stream, DeviceEvent* out) {
  if (last_app_ticket_ && app_stream != last_app_stream_) {
    MLT_RETURN_IF_ERROR(device_->WaitOnAppStream(app_stream, last_app_ticket_));
  }
  MLT_RETURN_IF_ERROR(device_->RecordAppWork(app_stream, out));
  last_app_ticket_ = *out;
  last_app_stream_ = app_stream;
  return Status::Ok();
}

Status Engine::Impl::CheckAccessCall(Handle handle, OpKind kind) const {
  const Phase phase = state_.phase.load();
  if (phase == Phase::kShutdown) return ShutdownError();
  if (phase == Phase::kDefining) {
    return Status::OutOfOrder(std::string(OpKindName(kind)) +
                              " before finish_virtual_iteration: record the iteration first");
  }
  MLT_RETURN_IF_ERROR(CheckExpected(handle, kind));
  const AccessRecord& access = plan_.recording.accesses[handle];
  const bool opens = kind == OpKind::kRead || kind == OpKind::kPreUpdate || kind == OpKind::kLocalAccess;
  if ((opens ? access.kind : PostKindOf(access.kind)) != kind) {
    std::string text = std::string(OpKindName(kind)) + " of handle " + std::to_string(handle) +
                       ", which was recorded as a " + access.Describe(plan_.tables[access.table].name);
    if (!opens) text += std::string("; it is closed by ") + OpKindName(PostKindOf(access.kind));
    return Status::InvalidArgument(text);
  }
  return Status::Ok();
}

Status Engine::Impl::OpenSlot(Handle handle, OpKind kind, AccessBuffer* out, bool notify) {
  const AccessRecord& access = plan_.recording.accesses[handle];
  mltuner::Clock clock;
  bool extended = false;
  {
    MutexLock lock(&state_.mu);
    // A failed engine names the failure on every call, before any complaint
    // about the call's order (the failed call may have broken the order).
    if (!state_.background_error.ok()) return state_.background_error;
    MLT_RETURN_IF_ERROR(CheckNextOp(kind, handle));
    clock = state_.app_clock;
    if (config_.branches && clock >= state_.branches.scheduled_until) {
      if (state_.branches.continue_on < 0) {
        return Status::OutOfOrder("clock " + std::to_string(clock) + " is not scheduled on any branch: call " +
                                  "schedule_branch(branch, clocks) first");
      }
      // Only this thread extends the schedule, at the clock it reached, so
      // every worker's clocks land on the same branches.
      state_.branches.Append(state_.branches.continue_on, clock + 1 - state_.branches.scheduled_until);
      extended = true;
    }
  }
  if (extended) state_.cv.NotifyAll();  // the allocator waits for the clock's branch
  Slot* slot = nullptr;
  MLT_RETURN_IF_ERROR(WaitForSlot(handle, clock, &slot));
  *out = BufferFor(access, slot->data, slot->data_age, plan_.pool_memory);
  out->ready = slot->ready;
  {
    MutexLock lock(&state_.mu);
    ++state_.app_seq;
  }
  if (notify) state_.cv.NotifyAll();
  return Status::Ok();
}

Status Engine::Impl::PostSlot(Handle handle, OpKind kind, DeviceEvent app_done, uintptr_t app_stream, bool notify) {
  Slot* slot = nullptr;
  {
    MutexLock lock(&state_.mu);
    if (!state_.background_error.ok()) return state_.background_error;
    MLT_RETURN_IF_ERROR(CheckNextOp(kind, handle));
    slot = &state_.slots[handle][state_.app_clock % plan_.depth];
  }
  // The slot is the application's until it is marked posted: no other thread
  // touches it in between.
  if (config_.debug_buffers && kind == OpKind::kPostRead) {
    MLT_RETURN_IF_ERROR(PoisonPostedRead(plan_.recording.accesses[handle], slot->data, app_stream, &app_done));
  }
  {
    MutexLock lock(&state_.mu);
    slot->app_done = std::move(app_done);
    slot->state = SlotState::kPosted;
    ++state_.app_seq;
  }
  if (notify) state_.cv.NotifyAll();
  return Status::Ok();
}

// A batch runs its ops one by one, as separate calls would, with three
// savings while running: the posts share one ticket of the application's
// work (taken before the first post; the batch itself queues no application
// work), the application's stream waits once, at the end, for the last
// buffer opened (the allocator fills buffers in op order on one stream, so
// the ticket of the last one covers the others), and the background threads
// are woken once, at the end or before an open blocks, not per op.
Status Engine::Impl::Run(const std::vector<OpCall>& ops, std::vector<AccessBuffer>* opened, uintptr_t app_stream) {
  opened->clear();
  DeviceEvent app_done;
  bool app_done_taken = false;
  DeviceEvent last_ready;
  struct WakeOnExit {  // the background threads hear of the batch's ops however it ends
    SpinningCondVar* cv;
    bool due = false;
    ~WakeOnExit() {
      if (due) cv->NotifyAll();
    }
  } wake{&state_.cv};
  for (const OpCall& op : ops) {
    const bool opens = op.kind == OpKind::kRead || op.kind == OpKind::kPreUpdate || op.kind == OpKind::kLocalAccess;
    if (op.kind == OpKind::kClock) {
      MLT_RETURN_IF_ERROR(Clock());
      continue;
    }
    MLT_RETURN_IF_ERROR(CheckAccessCall(op.handle, op.kind));
    if (state_.phase.load() != Phase::kRunning) {  // the initialisation phase: synchronous anyway
      if (!op.fill.empty() || !op.drain.empty()) {
        return Status::OutOfOrder("pieces to copy are for the running phase's posts");
      }
      AccessBuffer buffer;
      MLT_RETURN_IF_ERROR(opens ? Open(op.handle, op.kind, &buffer, app_stream) : Post(op.handle, op.kind, app_stream));
      if (opens) opened->push_back(std::move(buffer));
    } else if (opens) {
      AccessBuffer buffer;
      MLT_RETURN_IF_ERROR(OpenSlot(op.handle, op.kind, &buffer, /*notify=*/false));
      wake.due = true;
      if (buffer.ready) last_ready = buffer.ready;
      opened->push_back(std::move(buffer));
    } else {
      if (!op.fill.empty() || !op.drain.empty()) {
        // The copies touch a buffer that may have been opened in this batch:
        // the stream waits for the buffers opened so far first.
        if (last_ready) {
          MLT_RETURN_IF_ERROR(device_->WaitOnAppStream(app_stream, last_ready));
          last_ready = DeviceEvent();
        }
        MLT_RETURN_IF_ERROR(CopyBeforePost(op, app_stream));
        app_done_taken = false;  // the post's ticket must come after the copies
      }
      if (!app_done_taken) {
        MLT_RETURN_IF_ERROR(TakeAppTicket(app_stream, &app_done));
        app_done_taken = true;
      }
      MLT_RETURN_IF_ERROR(PostSlot(op.handle, op.kind, app_done, app_stream, /*notify=*/false));
      wake.due = true;
    }
  }
  return device_->WaitOnAppStream(app_stream, last_ready);
}

Status Engine::Impl::CopyBeforePost(const OpCall& op, uintptr_t app_stream) {
  if (op.kind != OpKind::kUpdate && op.kind != OpKind::kPostLocalAccess) {
    return Status::InvalidArgument(std::string("pieces to copy in come with an update or post_local_access, not ") +
                                   OpKindName(op.kind));
  }
  if (!op.drain.empty() && op.kind != OpKind::kPostLocalAccess) {
    return Status::InvalidArgument(std::string("pieces to copy out come with a post_local_access, not ") +
                                   OpKindName(op.kind));
  }
  const AccessRecord& access = plan_.recording.accesses[op.handle];
  const int64_t capacity = static_cast<int64_t>(access.rows.size()) * plan_.tables[access.table].row_width;
  for (const std::vector<CopyPiece>* pieces : {&op.fill, &op.drain}) {
    for (const CopyPiece& piece : *pieces) {
      if (piece.memory == nullptr || piece.offset < 0 || piece.count < 0 || piece.offset > capacity - piece.count) {
        return Status::InvalidArgument("a piece of " + std::to_string(piece.count) + " floats at offset " +
                                       std::to_string(piece.offset) + " does not fit the " +
                                       std::to_string(capacity) + " floats of the " +
                                       access.Describe(plan_.tables[access.table].name));
      }
    }
  }
  float* data = nullptr;
  {
    MutexLock lock(&state_.mu);
    if (!state_.background_error.ok()) return state_.background_error;
    MLT_RETURN_IF_ERROR(CheckNextOp(op.kind, op.handle));
    data = state_.slots[op.handle][state_.app_clock % plan_.depth].data;
  }
  MLT_RETURN_IF_ERROR(
      device_->CopyPiecesOnAppStream(app_stream, data, op.drain, CopyDirection::kOutOfBuffer, /*zero_if=*/nullptr));
  return device_->CopyPiecesOnAppStream(app_stream, data, op.fill, CopyDirection::kIntoBuffer, op.fill_zero_if);
}

void Engine::Impl::Poison(const AccessRecord& access, float* data, Stream s) {
  const size_t count = access.rows.size() * static_cast<size_t>(plan_.tables[access.table].row_width);
  device_->Fill(data, std::numeric_limits<float>::quiet_NaN(), count, s);
}

// The fill runs after the application's work on the buffer (`app_done`) and
// before anything the application queues on its stream after the post, so a
// tensor still read there sees NaN; the next gather into the buffer waits for
// the fill (the new `app_done`).
Status Engine::Impl::PoisonPostedRead(const AccessRecord& access, float* data, uintptr_t app_stream,
                                      DeviceEvent* app_done) {
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kApp, *app_done));
  Poison(access, data, Stream::kApp);
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kApp, app_done));
  last_app_ticket_ = *app_done;  // the release ticket now; app_stream waits for it below
  return device_->WaitOnAppStream(app_stream, *app_done);
}

Status Engine::Impl::FinishClock(uintptr_t app_stream, int64_t* ran) {
  *ran = 0;
  if (state_.phase.load() == Phase::kShutdown) return ShutdownError();
  if (state_.phase.load() != Phase::kRunning) return Status::OutOfOrder("finish_clock before start_iterations");
  std::vector<OpCall> rest;
  {
    MutexLock lock(&state_.mu);
    if (!state_.background_error.ok()) return state_.background_error;
    const int64_t num_ops = static_cast<int64_t>(plan_.recording.ops.size());
    if (state_.app_seq % num_ops == 0) return Status::Ok();  // at a clock boundary
    for (int64_t i = state_.app_seq % num_ops; i < num_ops; ++i) {
      rest.push_back(OpCall{plan_.recording.ops[i].kind, plan_.recording.ops[i].handle, {}, {}});
    }
  }
  std::vector<AccessBuffer> opened;
  const Status status = Run(rest, &opened, app_stream);
  *ran = static_cast<int64_t>(rest.size());
  return status;
}

Status Engine::Impl::Clock() {
  const Phase phase = state_.phase.load();
  if (phase == Phase::kShutdown) return ShutdownError();
  if (phase != Phase::kRunning) {
    return Status::OutOfOrder("clock() before start_iterations (the virtual iteration records its "
                              "clock with virtual_clock)");
  }
  {
    MutexLock lock(&state_.mu);
    if (!state_.background_error.ok()) return state_.background_error;
    MLT_RETURN_IF_ERROR(CheckNextOp(OpKind::kClock, -1));
    ++state_.app_seq;
    ++state_.app_clock;
    state_.stats.clock = state_.app_clock;
    const ClockBranch at = state_.branches.At(state_.app_clock - 1);
    state_.stats.branch = at.branch;
    state_.stats.branch_clock = at.internal + 1;
  }
  state_.cv.NotifyAll();
  return Status::Ok();
}

Status Engine::Impl::SetLearningRate(TableId table, float learning_rate) {
  const Phase phase = state_.phase.load();
  if (phase == Phase::kShutdown) return ShutdownError();
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(LookupTable(table, &info));
  if (info->local) return Status::InvalidArgument("table '" + info->name + "' is local data: it has no learning rate");
  const UpdateRuleConfig& rule = info->update_rule ? *info->update_rule : config_.update_rule;
  if (rule.kind == UpdateRuleKind::kAdd) {
    return Status::InvalidArgument("table '" + info->name + "' has the add rule, which has no learning rate");
  }
  if (!(learning_rate >= 0 && learning_rate <= 1e6f)) {
    return Status::InvalidArgument("table '" + info->name + "': learning rate " + std::to_string(learning_rate) +
                                   " is not in [0, 1e6]");
  }
  const int64_t first_update = phase == Phase::kRunning ? FirstUpdateOp(table) : 0;
  MutexLock lock(&state_.mu);
  if (!state_.background_error.ok()) return state_.background_error;
  mltuner::Clock from = 0;
  if (phase == Phase::kRunning) {
    const int64_t num_ops = static_cast<int64_t>(plan_.recording.ops.size());
    // From the first clock none of whose updates of the table has been
    // posted: the current one while the application has not reached them (a
    // rate set between the backward pass and step(), as torch applies it),
    // else the next. Their message carries the rate (Reclaimer::RateSetFor).
    const mltuner::Clock current = state_.app_seq / num_ops;
    from = state_.app_seq % num_ops > first_update ? current + 1 : current;
    std::map<mltuner::Clock, float>& rates = state_.new_rates[table];
    rates.erase(rates.begin(), rates.lower_bound(state_.reclaimed_seq / num_ops));
  }
  state_.new_rates[table][from] = learning_rate;
  return Status::Ok();
}

Status Engine::Impl::SkipStep(const float* flag, uintptr_t app_stream) {
  const Phase phase = state_.phase.load();
  if (phase == Phase::kShutdown) return ShutdownError();
  if (phase != Phase::kRunning) return Status::OutOfOrder("skip_step before start_iterations: no clock is running");
  const std::vector<RecordedOp>& ops = plan_.recording.ops;
  const auto first_update = std::find_if(ops.begin(), ops.end(), [](const RecordedOp& op) {
    return op.kind == OpKind::kUpdate;
  });
  const int64_t num_ops = static_cast<int64_t>(ops.size());
  mltuner::Clock current = 0;
  {
    MutexLock lock(&state_.mu);
    if (!state_.background_error.ok()) return state_.background_error;
    current = state_.app_seq / num_ops;
    if (state_.app_seq % num_ops > first_update - ops.begin()) {
      return Status::OutOfOrder("skip_step in clock " + std::to_string(current) +
                                " after some of its updates were posted: call it before the clock's first update");
    }
    state_.skipped_steps.erase(state_.skipped_steps.begin(),
                               state_.skipped_steps.lower_bound(state_.reclaimed_seq / num_ops));
    auto marked = state_.skipped_steps.find(current);
    if (marked != state_.skipped_steps.end()) {
      if (marked->second.word == nullptr) return Status::Ok();  // skipped already, whatever a flag says
      if (flag != nullptr) {
        return Status::OutOfOrder("skip_step(if_set=...) twice in clock " + std::to_string(current) +
                                  ": one flag a clock");
      }
    }
    if (flag == nullptr) {
      state_.skipped_steps[current] = SkipMark{};
      return Status::Ok();
    }
  }
  // One pinned word per clock the pipeline may hold (the reclaimer is at
  // most `depth` clocks behind the application), written in the stream's
  // order; the ticket after the copy tells the reclaimer when to read it.
  const size_t words = static_cast<size_t>(plan_.depth) + 1;
  if (!skip_words_) MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, words * sizeof(float), true, &skip_words_));
  SkipMark mark;
  mark.word = skip_words_->floats() + current % static_cast<mltuner::Clock>(words);
  MLT_RETURN_IF_ERROR(device_->CopyToHostOnAppStream(app_stream, mark.word, flag, sizeof(float)));
  MLT_RETURN_IF_ERROR(TakeAppTicket(app_stream, &mark.ready));
  MutexLock lock(&state_.mu);
  state_.skipped_steps[current] = std::move(mark);
  return Status::Ok();
}

int64_t Engine::Impl::FirstUpdateOp(TableId table) const {
  const std::vector<RecordedOp>& ops = plan_.recording.ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == OpKind::kUpdate && plan_.recording.accesses[ops[i].handle].table == table) {
      return static_cast<int64_t>(i);
    }
  }
  return static_cast<int64_t>(ops.size());
}

bool Engine::Impl::WaitReclaimedLocked(int64_t target, bool* interrupted) {
  InterruptibleWait wait(Deadline());
  bool done = state_.stopping || state_.reclaimed_seq >= target;
  while (!done) {
    const bool more = wait.Step(&state_.cv, &state_.mu);
    done = state_.stopping || state_.reclaimed_seq >= target;
    if (!more) break;
  }
  *interrupted = !done && wait.interrupted();
  return done;
}

Status Engine::Impl::Flush() {
  if (state_.phase.load() == Phase::kShutdown) return ShutdownError();
  if (state_.phase.load() != Phase::kRunning) return Status::Ok();
  MutexLock lock(&state_.mu);
  const int64_t target = state_.app_seq;
  bool interrupted = false;
  const bool done = WaitReclaimedLocked(target, &interrupted);
  if (!state_.background_error.ok()) return state_.background_error;
  if (interrupted) return Status::Cancelled("flush: interrupted while waiting for the reclaimer thread");
  if (!done) return Status::Timeout("flush: the reclaimer thread did not catch up in time");
  return Status::Ok();
}

Status Engine::Impl::WaitForDataAge(TableId table, mltuner::Clock age) {
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(LookupTable(table, &info));
  if (info->local) return Status::InvalidArgument("table '" + info->name + "' is local: it has no data age");
  if (state_.phase.load() == Phase::kShutdown) return ShutdownError();
  if (state_.phase.load() != Phase::kRunning) return Status::OutOfOrder("wait_for_data_age before start_iterations");
  BranchId branch;
  BranchId next = -1;  // the branch the next clock is scheduled on, where it is scheduled
  {
    MutexLock lock(&state_.mu);
    branch = state_.stats.branch;
    const BranchSchedule& schedule = state_.branches;
    if (schedule.enabled && state_.app_clock > 0 && schedule.Scheduled(state_.app_clock)) {
      next = schedule.At(state_.app_clock).branch;
    }
  }
  MutexLock lock(&state_.age_mu);
  // Refused whether or not the allocator has switched the cache yet (it may
  // at any moment once the next clock is scheduled), so that the outcome
  // never depends on timing.
  if (state_.cache_branch == kNoCachedBranch) {
    return Status::OutOfOrder("branch " + std::to_string(branch) + " of the last finished clock was freed and "
                              "forked again since: there is no data age to wait for until a clock runs");
  }
  if ((next >= 0 && next != branch) || state_.cache_branch != branch) {
    const BranchId other = next >= 0 && next != branch ? next : state_.cache_branch;
    return Status::OutOfOrder("the next clock is scheduled on branch " + std::to_string(other) +
                              ", whose rows the cache holds from then on, not branch " + std::to_string(branch) +
                              " of the last finished clock: wait for its data age (sync) before scheduling "
                              "the next branch");
  }
  InterruptibleWait wait(Deadline());
  bool fresh =
      state_.data_age[table] >= age || state_.phase.load() == Phase::kShutdown || !state_.abort_error.ok();
  while (!fresh) {
    const bool more = wait.Step(&state_.age_cv, &state_.age_mu);
    fresh = state_.data_age[table] >= age || state_.phase.load() == Phase::kShutdown || !state_.abort_error.ok();
    if (!more) break;
  }
  if (!state_.abort_error.ok()) return state_.abort_error;
  if (!fresh && wait.interrupted()) {
    return Status::Cancelled("interrupted while waiting for table '" + info->name + "' to reach data age " +
                             std::to_string(age) + " (it is at " + std::to_string(state_.data_age[table]) + ")");
  }
  if (!fresh) {
    return Status::Timeout("table '" + info->name + "' did not reach data age " + std::to_string(age) +
                           " (it is at " + std::to_string(state_.data_age[table]) +
                           "): another worker is slow or gone");
  }
  if (state_.data_age[table] < age) return ShutdownError();
  return Status::Ok();
}

// Read-my-writes (Config::read_my_writes) for each communicated table that
// is read and updated, whose reads may be stale: a recorded slack >= 1, or
// branches, which may set one. Not under a device-memory budget: its steps
// are device memory the plan does not count.
void Engine::Impl::MakeOwnUpdates() {
  plan_.own_updates.clear();
  plan_.own_updates.resize(plan_.tables.size());
  if (!config_.read_my_writes || plan_.placement.budget.budget != 0) return;
  std::vector<bool> read(plan_.tables.size(), false), updated(plan_.tables.size(), false);
  std::vector<int> slack(plan_.tables.size(), 0);
  for (const AccessRecord& access : plan_.recording.accesses) {
    if (access.kind == OpKind::kRead) {
      read[access.table] = true;
      slack[access.table] = std::max(slack[access.table], access.slack);
    }
    if (access.kind == OpKind::kPreUpdate) updated[access.table] = true;
  }
  for (const TableInfo& table : plan_.tables) {
    if (table.local || !read[table.id] || !updated[table.id]) continue;
    if (!ServesSlack(slack[table.id]) && !config_.branches) continue;
    const UpdateRuleConfig& rule = table.update_rule ? *table.update_rule : config_.update_rule;
    plan_.own_updates[table.id] =
        OwnUpdates::ForTable(device_, *plan_.stores[table.id], rule, slack[table.id], num_workers_,
                             static_cast<int>(plan_.index.tables[table.id].pieces.size()));
  }
}

EngineStats Engine::Impl::Stats() const {
  MutexLock lock(&state_.mu);
  EngineStats stats = state_.stats;
  for (const std::unique_ptr<OwnUpdates>& own : plan_.own_updates) {
    if (own) stats.own_steps += own->steps_applied();
  }
  stats.messages_sent = state_.messages_sent;
  stats.messages_received = state_.messages_received;
  if (state_.branches.enabled) {
    stats.scheduled_ahead = std::max<int64_t>(0, state_.branches.scheduled_until - state_.app_clock);
    stats.next_branch = stats.scheduled_ahead > 0 ? state_.branches.At(state_.app_clock).branch
                                                  : state_.branches.continue_on;
  }
  return stats;
}

Status Engine::Impl::Shutdown() {
  // Nothing posted is lost: a running engine first lets the reclaimer ship
  // every update the application posted (bounded by the wait timeout).
  Status unsent;
  if (state_.phase.load() == Phase::kRunning) {
    MutexLock lock(&state_.mu);
    const int64_t target = state_.app_seq;
    bool interrupted = false;
    const bool done = WaitReclaimedLocked(target, &interrupted);
    if (interrupted) {
      // Shut down all the same: the caller asked to stop waiting, not to
      // keep the engine.
      unsent = Status::Cancelled("shutdown: interrupted while " + std::to_string(target - state_.reclaimed_seq) +
                                 " posted operations of clock " + std::to_string(state_.app_clock) +
                                 " were being shipped; their updates are lost");
    } else if (!done && state_.background_error.ok()) {
      unsent = Status::Timeout("shutdown: " + std::to_string(target - state_.reclaimed_seq) +
                               " posted operations of clock " + std::to_string(state_.app_clock) +
                               " were not shipped within wait_timeout; their updates are lost");
    }
  }
  const Phase before = state_.phase.exchange(Phase::kShutdown);
  if (before == Phase::kShutdown) return Status::Ok();
  {
    MutexLock lock(&state_.mu);
    state_.stopping = true;
  }
  state_.cv.NotifyAll();
  {
    MutexLock lock(&state_.age_mu);  // wake request and age waiters
  }
  state_.age_cv.NotifyAll();
  allocator_.Join();
  reclaimer_.Join();
  for (AccessIndex& access : plan_.index.accesses) {
    for (RunIndex* runs : {&access.device_gather, &access.host_gather, &access.device_scatter,
                           &access.host_scatter}) {
      device_->ReleaseIndex(runs);
    }
  }
  plan_.index.accesses.clear();
  for (TableIndex& table : plan_.index.tables) {  // `unpack` is the receive thread's: see ~Impl
    for (std::vector<RunIndex>* by_shard : {&table.pack, &table.direct.runs}) {
      for (RunIndex& runs : *by_shard) device_->ReleaseIndex(&runs);
    }
  }
  return unsent;
}

// --- Engine: the public face ---------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Status Engine::Create(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
                      Transport* transport, std::unique_ptr<Engine>* out) {
  if (num_workers < 1 || rank < 0 || rank >= num_workers) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " of " + std::to_string(num_workers) +
                                   " workers is invalid");
  }
  if (!device || !transport) return Status::InvalidArgument("an engine needs a device and a transport");
  if (config.wait_timeout_ms <= 0) return Status::InvalidArgument("wait_timeout_ms must be > 0");
  if (config.prefetch_clocks < 0 && config.prefetch_clocks != kAutoPrefetchClocks) {
    return Status::InvalidArgument("prefetch_clocks must be >= 0, or -1 for the plan to choose");
  }
  if (config.device_memory_budget < 0) return Status::InvalidArgument("device_memory_budget must be >= 0");
  if (config.clock_part_bytes < 0 && config.clock_part_bytes != kAutoClockPartBytes) {
    return Status::InvalidArgument("clock_part_bytes must be >= 0, or -1 for the device to choose");
  }
  if (config.device_memory_reserve < -1) {
    return Status::InvalidArgument("device_memory_reserve must be >= 0, or -1 for a tenth of the device");
  }
  MLT_RETURN_IF_ERROR(CheckUpdateRule(config.update_rule, "Config.update_rule"));
  out->reset(new Engine(std::make_unique<Impl>(config, rank, num_workers, std::move(device), transport)));
  return Status::Ok();
}

Status Engine::CreateTable(const std::string& name, int64_t num_rows, int64_t row_width, bool local,
                           TableId* out, const std::optional<UpdateRuleConfig>& update_rule) {
  return impl_->CreateTable(name, num_rows, row_width, local, out, update_rule);
}

Status Engine::SetLearningRate(TableId table, float learning_rate) {
  return impl_->SetLearningRate(table, learning_rate);
}

Status Engine::SkipStep(const float* flag, uintptr_t app_stream) { return impl_->SkipStep(flag, app_stream); }

Status Engine::FindTable(const std::string& name, TableInfo* out) const {
  for (const TableInfo& table : impl_->plan_.tables) {
    if (table.name == name) {
      *out = table;
      return Status::Ok();
    }
  }
  return Status::NotFound("unknown table '" + name + "'");
}

std::vector<TableInfo> Engine::tables() const { return impl_->plan_.tables; }

#define MLT_REQUIRE_DEFINING(what)                                                   \
  do {                                                                               \
    if (impl_->state_.phase.load() == Phase::kShutdown) return ShutdownError();                  \
    if (impl_->state_.phase.load() != Phase::kDefining)                                          \
      return Status::OutOfOrder(std::string(what) + " after finish_virtual_iteration"); \
  } while (0)

Status Engine::VirtualRead(TableId table, std::vector<RowId> rows, int slack, Handle* out) {
  MLT_REQUIRE_DEFINING("virtual_read");
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(impl_->LookupTable(table, &info));
  if (slack > kMaxSlack) {
    return Status::InvalidArgument("slack " + std::to_string(slack) + " is above the maximum of " +
                                   std::to_string(kMaxSlack));
  }
  return impl_->recorder_.Read(*info, std::move(rows), slack, out);
}

Status Engine::VirtualPostRead(Handle handle) {
  MLT_REQUIRE_DEFINING("virtual_post_read");
  return impl_->recorder_.PostRead(handle);
}

Status Engine::VirtualPreUpdate(TableId table, std::vector<RowId> rows, Handle* out) {
  MLT_REQUIRE_DEFINING("virtual_pre_update");
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(impl_->LookupTable(table, &info));
  return impl_->recorder_.PreUpdate(*info, std::move(rows), out);
}

Status Engine::VirtualUpdate(Handle handle) {
  MLT_REQUIRE_DEFINING("virtual_update");
  return impl_->recorder_.Update(handle);
}

Status Engine::VirtualLocalAccess(TableId table, std::vector<RowId> rows, bool fetch, Handle* out) {
  MLT_REQUIRE_DEFINING("virtual_local_access");
  const TableInfo* info = nullptr;
  MLT_RETURN_IF_ERROR(impl_->LookupTable(table, &info));
  return impl_->recorder_.LocalAccess(*info, std::move(rows), fetch, out);
}

Status Engine::VirtualPostLocalAccess(Handle handle, bool keep) {
  MLT_REQUIRE_DEFINING("virtual_post_local_access");
  return impl_->recorder_.PostLocalAccess(handle, keep);
}

Status Engine::VirtualClock() {
  MLT_REQUIRE_DEFINING("virtual_clock");
  return impl_->recorder_.Clock();
}

Status Engine::PreviewPlan(PlanPreview* out) {
  MLT_REQUIRE_DEFINING("preview_plan");
  return impl_->PreviewPlan(out);
}

Status Engine::DropTables(TableId first) {
  MLT_REQUIRE_DEFINING("drop_tables");
  return impl_->DropTables(first);
}

Status Engine::ResetVirtualIteration() {
  MLT_REQUIRE_DEFINING("reset_virtual_iteration");
  return impl_->ResetVirtualIteration();
}

Status Engine::ReserveDeviceMemory(int64_t bytes) {
  MLT_REQUIRE_DEFINING("reserve_device_memory");
  return impl_->ReserveDeviceMemory(bytes);
}

Status Engine::ReleaseHostMemoryDuringInit(int64_t bytes) {
  MLT_REQUIRE_DEFINING("release_host_memory_during_init");
  return impl_->ReleaseHostMemoryDuringInit(bytes);
}

#undef MLT_REQUIRE_DEFINING

Status Engine::FinishVirtualIteration() {
  if (impl_->state_.phase.load() == Phase::kShutdown) return ShutdownError();
  return impl_->FinishVirtualIteration();
}
Status Engine::StartIterations() {
  if (impl_->state_.phase.load() == Phase::kShutdown) return ShutdownError();
  return impl_->StartIterations();
}
Status Engine::Read(Handle h, AccessBuffer* out, uintptr_t s) { return impl_->Open(h, OpKind::kRead, out, s); }
Status Engine::PostRead(Handle h, uintptr_t s) { return impl_->Post(h, OpKind::kPostRead, s); }
Status Engine::PreUpdate(Handle h, AccessBuffer* out, uintptr_t s) {
  return impl_->Open(h, OpKind::kPreUpdate, out, s);
}
Status Engine::Update(Handle h, uintptr_t s) { return impl_->Post(h, OpKind::kUpdate, s); }
Status Engine::WriteInitial(Handle h, const float* values, int64_t count) {
  return impl_->WriteInitial(h, values, count);
}
Status Engine::LocalAccess(Handle h, AccessBuffer* out, uintptr_t s) {
  return impl_->Open(h, OpKind::kLocalAccess, out, s);
}
Status Engine::PostLocalAccess(Handle h, uintptr_t s) { return impl_->Post(h, OpKind::kPostLocalAccess, s); }
Status Engine::Run(const std::vector<OpCall>& ops, std::vector<AccessBuffer>* opened, uintptr_t app_stream) {
  return impl_->Run(ops, opened, app_stream);
}
Status Engine::Clock() { return impl_->Clock(); }
Status Engine::FinishClock(uintptr_t app_stream, int64_t* ran) { return impl_->FinishClock(app_stream, ran); }
Status Engine::ForkBranch(BranchId child, BranchId parent, const BranchSettings& settings) {
  return impl_->ForkBranch(child, parent, settings);
}
Status Engine::FreeBranch(BranchId branch) { return impl_->FreeBranch(branch); }
Status Engine::ScheduleBranch(BranchId branch, int64_t clocks) { return impl_->ScheduleBranch(branch, clocks); }
Status Engine::ContinueOnBranch(BranchId branch) { return impl_->ContinueOnBranch(branch); }
Status Engine::DeclareEmptyClock(WorkerId worker, BranchId branch, mltuner::Clock clock) {
  return impl_->DeclareEmptyClock(worker, branch, clock);
}

Status Engine::Fetch(TableId table, const std::vector<RowId>& rows, float* out, BranchId branch) {
  return impl_->Fetch(table, rows, std::nullopt, out, branch);
}
Status Engine::Fetch(TableId table, const std::vector<RowId>& rows, int64_t row_width, float* out, BranchId branch) {
  return impl_->Fetch(table, rows, row_width, out, branch);
}
Status Engine::Flush() { return impl_->Flush(); }
Status Engine::WaitForDataAge(TableId table, mltuner::Clock age) { return impl_->WaitForDataAge(table, age); }
mltuner::Clock Engine::DataAge(TableId table) const { return impl_->DataAge(table); }
EngineStats Engine::Stats() const { return impl_->Stats(); }
std::string Engine::DescribePlan() const {
  if (impl_->state_.phase.load() == Phase::kDefining) return "no plan yet: finish the virtual iteration first";
  const PipelinePlan& plan = impl_->plan_;
  // Which tables' clocks move in parts (Config.clock_part_bytes).
  std::string parts;
  for (const TableInfo& table : plan.tables) {
    if (table.local) continue;
    const TableIndex& index = plan.index.tables[table.id];
    int most = 1;
    for (size_t shard = 0; shard + 1 < index.first_piece.size(); ++shard) {
      most = std::max(most, index.first_piece[shard + 1] - index.first_piece[shard]);
    }
    if (most == 1) continue;
    parts += (parts.empty() ? "" : ", ") + ("'" + table.name + "' in up to " + std::to_string(most) +
                                           " parts a shard of about " + std::to_string(table.part_bytes) + " B");
  }
  return plan.placement.Describe() + "\nclock in parts: " + (parts.empty() ? "none (each shard's rows whole)" : parts);
}
int Engine::rank() const { return impl_->rank_; }
int Engine::num_workers() const { return impl_->num_workers_; }
std::string Engine::device_name() const {
  const Device& device = *impl_->device_;
  return device.host_addressable() ? "cpu" : "cuda:" + std::to_string(device.ordinal());
}
const Config& Engine::config() const { return impl_->config_; }
Status Engine::HandleMessage(Message&& message) { return impl_->HandleMessage(std::move(message)); }
Status Engine::Shutdown() { return impl_->Shutdown(); }
void Engine::Abort(const Status& why) { impl_->Abort(why); }

}  // namespace mltuner
