// Allocator: the allocator thread (geeps.md §2). It runs ahead of the
// application along the op list, preparing each open op's buffer — its
// static addresses in the pool, rows fresh enough gathered into it (or zeros
// for an update, or fetched local data) — so the application only waits when
// prefetch fell behind.
//
// Threading: Start() runs the thread; it ends when SharedState::stopping is
// set or on a failure (SharedState::Fail). GatherInto may also be called by
// the application thread before Start (the initialisation phase).
// Ownership: owns its thread; the plan, state, device and transport are the
// engine's and outlive it.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "mltuner/device.h"
#include "mltuner/transport.h"
#include "pipeline/plan.h"
#include "pipeline/shared_state.h"

namespace mltuner {

class Allocator {
 public:
  // How far ahead it prepares is the plan's (Placement::prefetch_clocks):
  // Config's prefetch_clocks, or the plan's choice.
  Allocator(int rank, int num_workers, std::shared_ptr<Device> device, Transport* transport,
            const PipelinePlan* plan, SharedState* state);
  ~Allocator() { Join(); }
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  void Start();
  // Waits for the thread to end. REQUIRES: stopping set (or the thread failed).
  void Join();

  // Queues the rows of a read or local fetch into `buffer` on `stream`:
  // device-resident rows with one gather, host-resident rows swapped in on
  // the swap-in stream joined to `stream` (memory/swap.h).
  Status GatherInto(const AccessRecord& access, float* buffer, Stream stream) EXCLUDES(state_->mu);

 private:
  void Loop();
  Status PrepareSlot(int64_t seq, const AccessRecord& access, const ClockBranch& at, Slot* slot);
  Status WaitFresh(const AccessRecord& access, const ClockBranch& at, int64_t op, mltuner::Clock* age)
      EXCLUDES(state_->age_mu, state_->mu);
  // Waits until `table`'s data age (every worker's clocks in this worker's
  // cache) reaches `needed`; `*age` gets the age then.
  Status WaitForAge(TableId table, mltuner::Clock needed, mltuner::Clock* age) EXCLUDES(state_->age_mu, state_->mu);
  // Points the cache at another branch: forgets every data age and asks the
  // shards for that branch's rows.
  Status SwitchCache(BranchId branch) EXCLUDES(state_->age_mu, state_->mu);
  // Waits until the reclaimer passed `seq_needed` (the post of `writer` at
  // `writer_clock`), then makes the prefetch stream wait for that slot's
  // release ticket (its write-back copies).
  Status WaitForWriteBack(int64_t seq_needed, Handle writer, mltuner::Clock writer_clock) EXCLUDES(state_->mu);
  // Read-my-writes: waits until the reclaimer has added this worker's own
  // step of `clock` for `table` to the cache (OwnUpdates::Apply; the
  // gather then waits for it on the device, as for an install).
  Status WaitForOwnStep(TableId table, mltuner::Clock clock) EXCLUDES(state_->mu);
  // Waits until the last earlier user of the buffer's static addresses is
  // reclaimed (BufferSchedule::WaitSeq).
  Status WaitForPoolSpace(const AccessRecord& access, mltuner::Clock clock) EXCLUDES(state_->mu);

  const int rank_;
  const int num_workers_;
  const std::shared_ptr<Device> device_;
  Transport* const transport_;
  const PipelinePlan* const plan_;
  SharedState* const state_;
  // Per table this worker updates but never reads: the largest slack
  // recorded for any read (what bounds how far ahead its updates of that
  // table may run, see PrepareSlot); -1 for the others. Set by Start.
  std::vector<int> unread_slack_;
  // Per table: the op of the iteration whose reclaim ships its clock's
  // update (its last update); -1 for a table without updates. Set by Start.
  std::vector<int64_t> last_update_op_;
  std::thread thread_;
};

}  // namespace mltuner
