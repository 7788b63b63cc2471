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
// what the allocator is waiting for (allocator_waiting_for_).
#include <algorithm>
#include <cstring>

#include "engine/engine_impl.h"

namespace mltuner {

namespace {
constexpr auto kPollInterval = std::chrono::milliseconds(100);
}  // namespace

void Engine::Impl::AllocatorLoop() {
  const int64_t num_ops = static_cast<int64_t>(recording_.ops.size());
  // An iteration without accesses (only clocks) leaves nothing to prepare;
  // walking its ops would spin without ever waiting.
  if (recording_.accesses.empty()) return;
  for (int64_t seq = 0;; ++seq) {
    const mltuner::Clock clock = seq / num_ops;
    const RecordedOp& op = recording_.ops[seq % num_ops];
    if (op.kind != OpKind::kRead && op.kind != OpKind::kPreUpdate && op.kind != OpKind::kLocalAccess) {
      continue;
    }
    Slot* slot = &slots_[op.handle][clock % depth_];
    ClockBranch at;
    {
      // The slot must be free (its previous clock reclaimed), we must not run
      // more than prefetch_clocks ahead of the application, and the clock
      // must be scheduled on a branch.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stopping_ || (slot->state == SlotState::kEmpty && clock <= app_clock_ + config_.prefetch_clocks &&
                             (!config_.branches || clock < scheduled_until_));
      });
      if (stopping_) return;
      at = BranchOfLocked(clock);
    }
    BranchId cached;
    {
      std::lock_guard<std::mutex> lock(age_mu_);
      cached = cache_branch_;
    }
    Status status = cached == at.branch ? Status::Ok() : SwitchCache(at.branch);
    if (status.ok()) status = PrepareSlot(seq, recording_.accesses[op.handle], at, slot);
    if (!status.ok()) {
      if (status.code() != StatusCode::kShutdown) Fail(status.WithContext(ThreadContext("allocator")));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot->clock = clock;
      slot->state = SlotState::kReady;
      allocator_waiting_for_.clear();
    }
    cv_.notify_all();
  }
}

Status Engine::Impl::PrepareSlot(int64_t seq, const AccessRecord& access, const ClockBranch& at, Slot* slot) {
  const int64_t num_ops = static_cast<int64_t>(recording_.ops.size());
  const mltuner::Clock clock = seq / num_ops;
  const AccessIndex& index = index_.accesses[access.handle];
  const TableInfo& table = tables_[access.table];

  // 1. Space in the pool: the buffer's static addresses, once their last
  // earlier user is reclaimed.
  MLT_RETURN_IF_ERROR(WaitForPoolSpace(access, clock));
  slot->offset = static_cast<size_t>(placement_.buffers.PoolOffset(access.handle, clock));
  slot->data = reinterpret_cast<float*>(reinterpret_cast<char*>(pool_memory_->floats()) + slot->offset);
  const size_t values = access.rows.size() * static_cast<size_t>(table.row_width);

  // 2. Fill it.
  switch (access.kind) {
    case OpKind::kRead: {
      mltuner::Clock age = kNoClock;
      MLT_RETURN_IF_ERROR(WaitFresh(access, at, &age));
      auto guard = stores_[access.table]->locks->LockShared(index.lock_begin, index.lock_count);
      GatherInto(access, slot->data, Stream::kPrefetch);
      // The age is read again under the partition locks: installs of newer rows
      // may have landed, never older ones.
      slot->data_age = std::max(age, DataAge(access.table));
      break;
    }
    case OpKind::kPreUpdate:
      device_->Fill(slot->data, 0.0f, values, Stream::kPrefetch);
      break;
    case OpKind::kLocalAccess:
      if (access.fetch) {
        if (index.fetch_after_op >= 0) {
          const int64_t writer_clock = clock - (index.fetch_after_previous_clock ? 1 : 0);
          if (writer_clock >= 0) MLT_RETURN_IF_ERROR(WaitForWriteBack(writer_clock * num_ops + index.fetch_after_op + 1));
        }
        GatherInto(access, slot->data, Stream::kPrefetch);
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

Status Engine::Impl::WaitFresh(const AccessRecord& access, const ClockBranch& at, mltuner::Clock* age) {
  // SSP: a read at clock c (of its branch) with slack s needs every worker's
  // updates through clock c - s - 1 of that branch.
  const int slack = at.slack >= 0 ? at.slack : access.slack;
  const mltuner::Clock needed = at.internal - slack - 1;
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(age_mu_);
  while (data_age_[access.table] < needed) {
    if (phase_.load() == Phase::kShutdown) return Status::Shutdown("stopping");
    {
      std::lock_guard<std::mutex> pipeline(mu_);
      if (stopping_) return Status::Shutdown("stopping");
      allocator_waiting_for_ = "data age >= " + std::to_string(needed) + " of table '" +
                               tables_[access.table].name + "' (it is at " +
                               std::to_string(data_age_[access.table]) +
                               "): a worker is slow, stopped or gone";
    }
    age_cv_.wait_for(lock, kPollInterval);
  }
  *age = data_age_[access.table];
  lock.unlock();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> pipeline(mu_);
  stats_.wait_fresh_seconds += waited;
  return Status::Ok();
}

Status Engine::Impl::WaitForPoolSpace(const AccessRecord& access, mltuner::Clock clock) {
  const BufferSchedule& schedule = placement_.buffers;
  const int64_t needed = schedule.WaitSeq(access.handle, clock);
  const BufferAddress& buffer = schedule.buffers[access.handle];
  std::unique_lock<std::mutex> lock(mu_);
  if (reclaimed_seq_ < needed) {
    const AccessRecord& holder = recording_.accesses[buffer.wait_handle];
    allocator_waiting_for_ = "the reclaimer to release " + std::to_string(buffer.bytes) +
                             " bytes of access-buffer pool (region " + std::to_string(clock % schedule.regions) +
                             ", offset " + std::to_string(buffer.offset) + ") for " +
                             access.Describe(tables_[access.table].name) + ": their last user is the " +
                             holder.Describe(tables_[holder.table].name) + " of clock " +
                             std::to_string(clock - buffer.wait_clocks_back) + ", closed by op " +
                             std::to_string(buffer.wait_op) + " (sequence number " + std::to_string(needed - 1) +
                             ")";
    cv_.wait(lock, [&] { return stopping_ || reclaimed_seq_ >= needed; });
    if (stopping_) return Status::Shutdown("stopping");
  }
  if (needed == 0 || buffer.wait_handle < 0) return Status::Ok();
  // On the device too: the fill below waits for the last user's release
  // ticket. That slot is not prepared again before this buffer (a later
  // user of the same addresses would be the one named), so its ticket is
  // still the right one; earlier users are ordered before it the same way.
  const mltuner::Clock holder_clock = clock - buffer.wait_clocks_back;
  DeviceEvent released = slots_[buffer.wait_handle][holder_clock % depth_].released;
  lock.unlock();
  return device_->WaitEvent(Stream::kPrefetch, released);
}

Status Engine::Impl::WaitForWriteBack(int64_t seq_needed) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return stopping_ || reclaimed_seq_ >= seq_needed; });
  if (stopping_) return Status::Shutdown("stopping");
  return Status::Ok();
}

void Engine::Impl::GatherInto(const AccessRecord& access, float* buffer, Stream stream) {
  const AccessIndex& index = index_.accesses[access.handle];
  const TableStore& store = *stores_[access.table];
  const int64_t width = store.info.row_width;
  const size_t row_bytes = static_cast<size_t>(store.info.row_bytes());
  if (index.device_gather.total_rows > 0) {
    device_->Gather(buffer, store.values(Residence::kDevice), index.device_gather, width, stream);
  }
  // Host-resident rows are swapped in run by run, straight from the host store
  // (pinned memory on CUDA) on the prefetch stream.
  const float* host = store.values(Residence::kHost);
  for (const RowRun& run : index.host_gather.runs) {
    device_->CopyHostToDevice(buffer + run.dst * width, host + run.src * width, run.count * row_bytes, stream);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_gathered += index.device_gather.total_rows * static_cast<int64_t>(row_bytes);
  stats_.bytes_swapped_in += index.host_gather.total_rows * static_cast<int64_t>(row_bytes);
}

}  // namespace mltuner
