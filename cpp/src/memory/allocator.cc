// The allocator thread (geeps.md §2): runs ahead of the application along
// the op list, preparing each open op's buffer — allocate from the pool, wait
// until the rows are fresh enough, gather them (or zero an update buffer, or
// fetch local data) — so the application only waits when prefetch fell
// behind.
//
// Its own waits have no deadline: being ahead, it may legitimately wait for
// the application (pool space, slot reuse) or for slower workers (freshness).
// Pool space cannot deadlock or fragment: each buffer has a static address
// and waits only for an earlier op to be reclaimed (plan/buffer_schedule.h).
// The application's wait for the buffer carries the deadline, and reports
// what the allocator is waiting for (SharedState::allocator_waiting_for).
#include "common/thread_name.h"
#include "memory/allocator.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "memory/swap.h"

namespace mltuner {

namespace {
constexpr auto kPollInterval = std::chrono::milliseconds(100);
}  // namespace

Allocator::Allocator(int rank, int num_workers, std::shared_ptr<Device> device, Transport* transport,
                     const PipelinePlan* plan, SharedState* state)
    : rank_(rank),
      num_workers_(num_workers),
      device_(std::move(device)),
      transport_(transport),
      plan_(plan),
      state_(state) {}

void Allocator::Start() {
  int max_slack = 0;
  std::vector<bool> read(plan_->tables.size(), false), updated(plan_->tables.size(), false);
  for (const AccessRecord& access : plan_->recording.accesses) {
    if (access.kind == OpKind::kRead) {
      read[access.table] = true;
      max_slack = std::max(max_slack, access.slack);
    } else if (access.kind == OpKind::kPreUpdate) {
      updated[access.table] = true;
    }
  }
  last_update_op_.assign(plan_->tables.size(), -1);
  for (int64_t i = 0; i < plan_->num_ops(); ++i) {
    const RecordedOp& op = plan_->recording.ops[i];
    if (op.kind == OpKind::kUpdate) last_update_op_[plan_->recording.accesses[op.handle].table] = i;
  }
  unread_slack_.assign(plan_->tables.size(), -1);
  for (size_t table = 0; table < plan_->tables.size(); ++table) {
    if (updated[table] && !read[table]) unread_slack_[table] = max_slack;
  }
  thread_ = std::thread([this] {
    NameThisThread("mlt-allocator");
    Loop();
  });
}

void Allocator::Join() {
  if (thread_.joinable()) thread_.join();
}

void Allocator::Loop() {
  const int64_t num_ops = plan_->num_ops();
  const int prefetch_clocks = plan_->placement.prefetch_clocks;
  // An iteration without accesses (only clocks) leaves nothing to prepare;
  // walking its ops would spin without ever waiting.
  if (plan_->recording.accesses.empty()) return;
  for (int64_t seq = 0;; ++seq) {
    const mltuner::Clock clock = seq / num_ops;
    const RecordedOp& op = plan_->recording.ops[seq % num_ops];
    if (op.kind != OpKind::kRead && op.kind != OpKind::kPreUpdate && op.kind != OpKind::kLocalAccess) {
      continue;
    }
    Slot* slot = &state_->slots[op.handle][clock % plan_->depth];
    ClockBranch at;
    {
      // The slot must be free (its previous clock reclaimed), we must not run
      // more than the plan's prefetch_clocks (Config's, or its choice) ahead
      // of the application, and the clock must be scheduled on a branch.
      MutexLock lock(&state_->mu);
      while (!state_->stopping &&
             !(slot->state == SlotState::kEmpty && clock <= state_->app_clock + prefetch_clocks &&
               state_->branches.Scheduled(clock))) {
        state_->cv.Wait();
      }
      if (state_->stopping) return;
      at = state_->branches.At(clock);
    }
    BranchId cached;
    {
      MutexLock lock(&state_->age_mu);
      cached = state_->cache_branch;
    }
    Status status = cached == at.branch ? Status::Ok() : SwitchCache(at.branch);
    if (status.ok()) status = PrepareSlot(seq, plan_->recording.accesses[op.handle], at, slot);
    if (!status.ok()) {
      if (status.code() != StatusCode::kShutdown) state_->Fail(status.WithContext(ThreadContext(rank_, "allocator")));
      return;
    }
    {
      MutexLock lock(&state_->mu);
      slot->clock = clock;
      slot->state = SlotState::kReady;
      state_->allocator_waiting_for.clear();
    }
    state_->cv.NotifyAll();
  }
}

Status Allocator::PrepareSlot(int64_t seq, const AccessRecord& access, const ClockBranch& at, Slot* slot) {
  const int64_t num_ops = plan_->num_ops();
  const mltuner::Clock clock = seq / num_ops;
  const AccessIndex& index = plan_->index.accesses[access.handle];

  // 1. Space in the pool: the buffer's static addresses, once their last
  // earlier user is reclaimed.
  MLT_RETURN_IF_ERROR(WaitForPoolSpace(access, clock));
  slot->offset = static_cast<size_t>(plan_->placement.buffers.PoolOffset(access.handle, clock));
  slot->data = reinterpret_cast<float*>(reinterpret_cast<char*>(plan_->pool_memory->floats()) + slot->offset);
  const size_t values = plan_->BufferValues(access);

  // 2. Fill it.
  switch (access.kind) {
    case OpKind::kRead: {
      mltuner::Clock age = kNoClock;
      MLT_RETURN_IF_ERROR(WaitFresh(access, at, seq % num_ops, &age));
      if (plan_->own_updates[access.table] && ServesSlack(at.SlackOf(access.slack)) && clock > 0) {
        MLT_RETURN_IF_ERROR(WaitForOwnStep(access.table, clock - 1));
      }
      auto guard = plan_->stores[access.table]->locks->LockShared(index.lock_begin, index.lock_count);
      MLT_RETURN_IF_ERROR(GatherInto(access, slot->data, Stream::kPrefetch));
      // The age is read again under the partition locks: installs of newer rows
      // may have landed, never older ones.
      slot->data_age = std::max(age, state_->DataAge(access.table));
      break;
    }
    case OpKind::kPreUpdate:
      if (unread_slack_[access.table] >= 0) {
        // No read of this table holds this worker back, so without a bound
        // its updates could run ahead of the other workers' without limit,
        // piling up in the shards' pending clocks. A clock's updates wait
        // one clock longer than a read with the largest slack recorded would.
        const int slack = std::max(at.slack, unread_slack_[access.table]);
        mltuner::Clock age = kNoClock;
        MLT_RETURN_IF_ERROR(WaitForAge(access.table, at.internal - slack - 2, &age));
      }
      device_->Fill(slot->data, 0.0f, values, Stream::kPrefetch);
      break;
    case OpKind::kLocalAccess:
      if (access.fetch) {
        if (index.fetch_after_op >= 0) {
          const int64_t writer_clock = clock - (index.fetch_after_previous_clock ? 1 : 0);
          if (writer_clock >= 0) {
            MLT_RETURN_IF_ERROR(WaitForWriteBack(writer_clock * num_ops + index.fetch_after_op + 1,
                                                 plan_->recording.ops[index.fetch_after_op].handle, writer_clock));
          }
        }
        MLT_RETURN_IF_ERROR(GatherInto(access, slot->data, Stream::kPrefetch));
      }
      break;
    default:
      return Status::Internal("allocator asked to prepare a post op");
  }
  // No wait here: the application's stream waits for this ticket when the
  // buffer is opened. Errors of earlier queued work surface now.
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kPrefetch, &slot->ready));
  return device_->TakeError();
}

Status Allocator::WaitFresh(const AccessRecord& access, const ClockBranch& at, int64_t op, mltuner::Clock* age) {
  // SSP: a read at clock c (of its branch) with slack s needs every worker's
  // updates through clock c - s - 1 of that branch, and at least the
  // branch's initial rows: without them a read in the first s clocks (of a
  // run, or of a branch the cache just switched to) would see zeros or
  // another branch's rows.
  const int slack = at.SlackOf(access.slack);
  mltuner::Clock needed = at.internal - slack - 1;
  // A BSP read recorded after its table's clock update has shipped (an
  // update, then a read of the table) waits for that clock too: whether its
  // rows were installed before the gather was a race, so the read saw clock
  // c - 1 or c by chance. Every worker ships that update before the read,
  // so the wait ends once the clock's round trip does.
  if (slack == 0 && last_update_op_[access.table] >= 0 && last_update_op_[access.table] < op) needed = at.internal;
  return WaitForAge(access.table, std::max<mltuner::Clock>(needed, kInitClock), age);
}

Status Allocator::WaitForAge(TableId table, mltuner::Clock needed, mltuner::Clock* age) {
  const auto start = std::chrono::steady_clock::now();
  {
    MutexLock lock(&state_->age_mu);
    while (state_->data_age[table] < needed) {
      if (state_->phase.load() == Phase::kShutdown) return Status::Shutdown("stopping");
      {
        MutexLock pipeline(&state_->mu);
        if (state_->stopping) return Status::Shutdown("stopping");
        std::string behind;  // the shards whose rows hold the age back
        for (size_t shard = 0; shard < state_->shard_age[table].size(); ++shard) {
          if (state_->shard_age[table][shard] < needed) behind += (behind.empty() ? "" : ", ") + std::to_string(shard);
        }
        state_->allocator_waiting_for = "data age >= " + std::to_string(needed) + " of table '" +
                                        plan_->tables[table].name + "' (it is at " +
                                        std::to_string(state_->data_age[table]) + "; behind: the rows of shard " +
                                        behind + "): a worker is slow, stopped or gone";
      }
      state_->age_cv.WaitFor(kPollInterval);
    }
    *age = state_->data_age[table];
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MutexLock pipeline(&state_->mu);
  state_->stats.wait_fresh_seconds += waited;
  return Status::Ok();
}

Status Allocator::WaitForOwnStep(TableId table, mltuner::Clock clock) {
  const int64_t op = last_update_op_[table];
  if (op < 0) return Status::Ok();
  const int64_t needed = clock * plan_->num_ops() + op + 1;
  MutexLock lock(&state_->mu);
  if (state_->reclaimed_seq >= needed) return Status::Ok();
  state_->allocator_waiting_for = "this worker's own update of table '" + plan_->tables[table].name +
                                  "' at clock " + std::to_string(clock) + " (read-my-writes): the application " +
                                  "has not posted it, or the reclaimer is behind";
  while (!state_->stopping && state_->reclaimed_seq < needed) state_->cv.Wait();
  return state_->stopping ? Status::Shutdown("stopping") : Status::Ok();
}

Status Allocator::WaitForPoolSpace(const AccessRecord& access, mltuner::Clock clock) {
  const BufferSchedule& schedule = plan_->placement.buffers;
  const int64_t needed = schedule.WaitSeq(access.handle, clock);
  const BufferAddress& buffer = schedule.buffers[access.handle];
  const std::vector<TableInfo>& tables = plan_->tables;
  DeviceEvent released, written;
  {
    MutexLock lock(&state_->mu);
    if (state_->reclaimed_seq < needed) {
      const AccessRecord& holder = plan_->recording.accesses[buffer.wait_handle];
      state_->allocator_waiting_for =
          "the reclaimer to release " + std::to_string(buffer.bytes) + " bytes of access-buffer pool (region " +
          std::to_string(clock % schedule.regions) + ", offset " + std::to_string(buffer.offset) + ") for " +
          access.Describe(tables[access.table].name) + ": their last user is the " +
          holder.Describe(tables[holder.table].name) + " of clock " +
          std::to_string(clock - buffer.wait_clocks_back) + ", closed by op " + std::to_string(buffer.wait_op) +
          " (sequence number " + std::to_string(needed - 1) + ")";
      while (!state_->stopping && state_->reclaimed_seq < needed) state_->cv.Wait();
      if (state_->stopping) return Status::Shutdown("stopping");
    }
    if (needed == 0 || buffer.wait_handle < 0) return Status::Ok();
    // On the device too: the fill below waits for the last user's release
    // ticket. That slot is not prepared again before this buffer (a later
    // user of the same addresses would be the one named), so its ticket is
    // still the right one; earlier users are ordered before it the same way,
    // except copies on the writeback stream after a read's ticket: the
    // schedule names the last such user too (BufferSchedule).
    const mltuner::Clock holder_clock = clock - buffer.wait_clocks_back;
    released = state_->slots[buffer.wait_handle][holder_clock % plan_->depth].released;
    const mltuner::Clock writer_clock = clock - buffer.writeback_wait_clocks_back;
    if (buffer.writeback_wait_handle >= 0 && writer_clock >= 0) {
      written = state_->slots[buffer.writeback_wait_handle][writer_clock % plan_->depth].released;
    }
  }
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kPrefetch, written));
  return device_->WaitEvent(Stream::kPrefetch, released);
}

Status Allocator::WaitForWriteBack(int64_t seq_needed, Handle writer, mltuner::Clock writer_clock) {
  DeviceEvent written;
  {
    MutexLock lock(&state_->mu);
    while (!state_->stopping && state_->reclaimed_seq < seq_needed) state_->cv.Wait();
    if (state_->stopping) return Status::Shutdown("stopping");
    // The reclaimer does not wait for its write-back copies: the fetch waits
    // on the device for the writer's release ticket, taken after them.
    // Preparing a slot leaves its ticket alone, and a later release of the
    // slot is a later ticket on the same (writeback) stream, which covers it.
    written = state_->slots[writer][writer_clock % plan_->depth].released;
  }
  return device_->WaitEvent(Stream::kPrefetch, written);
}

Status Allocator::GatherInto(const AccessRecord& access, float* buffer, Stream stream) {
  const AccessIndex& index = plan_->index.accesses[access.handle];
  const TableStore& store = *plan_->stores[access.table];
  const int64_t width = store.info.row_width;
  const size_t row_bytes = static_cast<size_t>(store.info.row_bytes());
  // The rows of the data age read under the caller's partition locks were
  // installed on another stream (CacheTickets).
  MLT_RETURN_IF_ERROR(device_->WaitEvent(stream, store.tickets.last_install()));
  if (index.device_gather.total_rows > 0) {
    device_->Gather(buffer, store.values(Residence::kDevice), index.device_gather, width, stream);
  }
  // Host-resident rows straight from the host store (pinned on CUDA), in one
  // swap of all their runs. Joined to `stream` while the caller still holds
  // the partition locks, so the ticket below covers this swap too.
  if (index.host_gather.total_rows > 0) {
    const float* host = store.values(Residence::kHost);
    MLT_RETURN_IF_ERROR(OnSwapStream(*device_, stream, Stream::kSwapIn, [&](Stream swap) {
      device_->SwapRuns(buffer, host, index.host_gather, width, SwapDirection::kIn, swap);
    }));
  }
  if (!store.info.local) {  // a later install of these rows waits for this gather
    DeviceEvent gathered;
    MLT_RETURN_IF_ERROR(device_->RecordEvent(stream, &gathered));
    store.tickets.set_last_gather(std::move(gathered));
  }
  MutexLock lock(&state_->mu);
  state_->stats.bytes_gathered += index.device_gather.total_rows * static_cast<int64_t>(row_bytes);
  state_->stats.bytes_swapped_in += index.host_gather.total_rows * static_cast<int64_t>(row_bytes);
  return Status::Ok();
}

Status Allocator::SwitchCache(BranchId branch) {
  {
    MutexLock lock(&state_->age_mu);
    state_->cache_branch = branch;
    for (auto& ages : state_->shard_age) std::fill(ages.begin(), ages.end(), kNoClock);
    for (auto& ages : state_->piece_age) std::fill(ages.begin(), ages.end(), kNoClock);
    std::fill(state_->data_age.begin(), state_->data_age.end(), kNoClock);
  }
  {
    MutexLock lock(&state_->mu);
    ++state_->stats.branch_switches;
  }
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message request = NewMessage(MessageType::kBranchRows, rank_, shard, -1);
    request.header.branch = branch;
    MLT_RETURN_IF_ERROR(transport_->Send(std::move(request)));
    ++state_->messages_sent;
  }
  return Status::Ok();
}

}  // namespace mltuner
