// SharedState: the little the pipeline's threads share — the application
// thread (engine/), the allocator and reclaimer threads (memory/) and the
// receive thread (cache/row_installer.h). Each of those is a class of its own
// over this state; nothing else passes between them.
//
// Pipeline. Every (clock c, op i) of the recorded iteration has a sequence
// number seq = c * num_ops + i. The allocator walks seq forward, preparing the
// buffer of each open op into the handle's slot c % depth; the application
// consumes slots in the same order and advances app_seq; the reclaimer walks
// behind app_seq, releasing buffers and shipping updates.
//
// Locks, in the order they are taken:
//   PartitionLocks of a table: taken first, or alone
//   age_mu       data ages, the cache's branch, pending requests
//   mu           pipeline state (slots, sequence numbers, errors, stats, branches)
// A thread holding one of these may take those below it, never those above.
// The fields each guards are marked GUARDED_BY, checked by clang's
// -Wthread-safety (scripts/check_thread_safety.sh). The device has its own
// internal locks. The pool needs none: every buffer has a static address
// (plan/buffer_schedule.h), free once reclaimed_seq passes its WaitSeq.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"
#include "common/spinning_cond_var.h"
#include "common/thread_annotations.h"
#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "pipeline/branch_schedule.h"
#include "wire/message.h"

namespace mltuner {

enum class Phase { kDefining, kRecorded, kRunning, kShutdown };

// SharedState::cache_branch once a branch was forked under the id of the one
// the cache held (freed): the next clock switches the cache.
inline constexpr BranchId kNoCachedBranch = -1;

enum class SlotState { kEmpty, kReady, kInUse, kPosted };

// One prepared buffer of a handle for one clock. `state` and `clock` change
// only under SharedState::mu; the other fields belong to the thread the state
// names (kEmpty: the allocator, kReady..kInUse: the application, kPosted:
// the reclaimer), which touches them without the lock.
struct Slot {
  mltuner::Clock clock = -1;
  SlotState state = SlotState::kEmpty;
  size_t offset = 0;  // in the pool: placement.buffers.PoolOffset(handle, clock)
  float* data = nullptr;
  mltuner::Clock data_age = kNoClock;
  DeviceEvent ready;     // the allocator's work filling the buffer
  DeviceEvent app_done;  // the application's work on the buffer, taken at its post
  DeviceEvent released;  // all device work on the buffer, set when the reclaimer releases it
};

// A synchronous request to the shards (fetch or initialisation add).
struct PendingRequest {
  int replies_missing = 0;
  Status error;
  std::vector<Message> replies;
};

// A clock marked a skipped step: unconditionally (`word` null), or if the
// float the application copied into the pinned `word` on its stream is
// nonzero once `ready` (a ticket taken after the copy) is done; the
// reclaimer reads it at the clock's first message (Reclaimer::ResolveSkip)
// and then nulls `word` or erases the mark.
struct SkipMark {
  float* word = nullptr;
  DeviceEvent ready;
};

class SharedState {
 public:
  SharedState() = default;
  SharedState(const SharedState&) = delete;
  SharedState& operator=(const SharedState&) = delete;

  // Records a background failure; every later call returns it, and every
  // waiter on either condition variable wakes.
  void Fail(const Status& status) EXCLUDES(mu);
  // The data age of a table (kNoClock for an unknown one).
  mltuner::Clock DataAge(TableId table) const EXCLUDES(age_mu);

  std::atomic<Phase> phase{Phase::kDefining};

  // --- pipeline state -------------------------------------------------------
  mutable Mutex mu;
  // Spins before sleeping: the pipeline's threads hand ops to one another
  // (common/spinning_cond_var.h).
  SpinningCondVar cv{&mu, SpinningCondVar::DefaultSpin()};
  // [handle][clock % depth]: sized before the pipeline threads start; see
  // Slot for which fields mu guards.
  std::vector<std::vector<Slot>> slots;
  int64_t app_seq GUARDED_BY(mu) = 0;        // ops the application has completed
  int64_t reclaimed_seq GUARDED_BY(mu) = 0;  // ops the reclaimer has completed
  mltuner::Clock app_clock GUARDED_BY(mu) = 0;
  bool stopping GUARDED_BY(mu) = false;
  Status background_error GUARDED_BY(mu);
  std::string allocator_waiting_for GUARDED_BY(mu);  // for timeout messages
  EngineStats stats GUARDED_BY(mu);
  // Which branch each application clock runs on.
  BranchSchedule branches GUARDED_BY(mu);
  // Learning rates set by the application: table -> (the application clock
  // whose updates carry it -> rate). Entries of clocks the reclaimer has
  // passed are dropped at the next SetLearningRate.
  std::map<TableId, std::map<mltuner::Clock, float>> new_rates GUARDED_BY(mu);
  // Application clocks whose updates carry kSkipStep (Engine::SkipStep).
  // Entries the reclaimer has passed are dropped at the next SkipStep.
  std::map<mltuner::Clock, SkipMark> skipped_steps GUARDED_BY(mu);

  // --- the cache's data age and pending requests ------------------------------
  mutable Mutex age_mu;
  CondVar age_cv{&age_mu};
  // [table][piece] (a shard's rows, or one part of them: TableIndex::pieces):
  // the clock of the rows installed for the cached branch since its switch.
  // A shard's age is the least of its pieces': a part that came before a
  // switch back to its branch was dropped, and the cache holds another
  // branch's rows there until the branch's rows requested at the switch.
  std::vector<std::vector<mltuner::Clock>> piece_age GUARDED_BY(age_mu);
  std::vector<std::vector<mltuner::Clock>> shard_age GUARDED_BY(age_mu);  // [table][shard]
  std::vector<mltuner::Clock> data_age GUARDED_BY(age_mu);                // [table] = min over shards
  // The branch whose rows the cache holds; kNoCachedBranch once its id was
  // forked again.
  BranchId cache_branch GUARDED_BY(age_mu) = 0;
  int64_t next_request_id GUARDED_BY(age_mu) = 1;
  std::unordered_map<int64_t, std::shared_ptr<PendingRequest>> requests GUARDED_BY(age_mu);
  Status abort_error GUARDED_BY(age_mu);  // set once by Abort; ends every wait on age_cv

  std::atomic<int64_t> messages_received{0};
  std::atomic<int64_t> messages_sent{0};
};

// "worker R's <thread> thread", the context of a background failure.
std::string ThreadContext(int rank, const char* thread);

}  // namespace mltuner
