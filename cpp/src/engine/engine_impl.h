// Engine::Impl: the state shared by the application thread, the allocator
// thread (memory/allocator_thread.cc), the reclaimer thread
// (memory/reclaimer_thread.cc) and the transport's receive thread
// (cache/row_install.cc).
//
// Pipeline. Every (clock c, op i) of the recorded iteration has a sequence
// number seq = c * num_ops + i. The allocator walks seq forward, preparing the
// buffer of each open op into the handle's slot c % depth; the application
// consumes slots in the same order and advances app_seq_; the reclaimer walks
// behind app_seq_, releasing buffers and shipping updates.
//
// Locks:
//   PartitionLocks of a table: taken first, or alone
//   age_mu_      data ages and pending requests
//   mu_          pipeline state (slots, sequence numbers, errors, stats)
// A thread holding one of these may take those below it, never those above.
// The device has its own internal locks. The pool needs none: every buffer
// has a static address (plan/buffer_schedule.h), free once reclaimed_seq_
// passes its WaitSeq.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/table_store.h"
#include "mltuner/engine.h"
#include "mltuner/transport.h"
#include "plan/iteration_plan.h"
#include "plan/placement.h"
#include "plan/row_layout.h"
#include "record/index_builder.h"
#include "record/recorder.h"
#include "wire/message.h"

namespace mltuner {

enum class Phase { kDefining, kRecorded, kRunning, kShutdown };

enum class SlotState { kEmpty, kReady, kInUse, kPosted };

// One prepared buffer of a handle for one clock.
struct Slot {
  mltuner::Clock clock = -1;
  SlotState state = SlotState::kEmpty;
  size_t offset = 0;  // in the pool: placement_.buffers.PoolOffset(handle, clock)
  float* data = nullptr;
  mltuner::Clock data_age = kNoClock;
  DeviceEvent ready;     // the allocator's work filling the buffer
  DeviceEvent app_done;  // the application's work on the buffer, taken at its post
  DeviceEvent released;  // all device work on the buffer, set when the reclaimer releases it
};

// Where an application clock runs: its branch, the branch's own clock
// number, and the slack the branch imposes (-1: each read's own).
struct ClockBranch {
  BranchId branch = 0;
  mltuner::Clock internal = 0;
  int32_t slack = -1;
};

// A run of consecutive application clocks scheduled on one branch.
struct ScheduledBlock {
  mltuner::Clock first = 0;
  int64_t count = 0;
  BranchId branch = 0;
  mltuner::Clock first_internal = 0;
};

// A synchronous request to the shards (fetch or initialisation add).
struct PendingRequest {
  int replies_missing = 0;
  Status error;
  std::vector<Message> replies;
};

class Engine::Impl {
 public:
  Impl(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
       Transport* transport);
  ~Impl();

  // --- application thread (engine/engine.cc) --------------------------------
  Status CreateTable(const std::string& name, int64_t num_rows, int64_t row_width, bool local,
                     TableId* out, const std::optional<UpdateRuleConfig>& update_rule);
  Status SetLearningRate(TableId table, float learning_rate);
  Status LookupTable(TableId table, const TableInfo** out) const;
  Status PreviewPlan(PlanPreview* out);
  Status ResetVirtualIteration();
  Status FinishVirtualIteration();
  Status StartIterations();
  Status Open(Handle handle, OpKind kind, AccessBuffer* out, uintptr_t app_stream);
  Status Post(Handle handle, OpKind kind, uintptr_t app_stream);
  Status Run(const std::vector<OpCall>& ops, std::vector<AccessBuffer>* opened, uintptr_t app_stream);
  Status Clock();
  Status Fetch(TableId table, const std::vector<RowId>& rows, float* out, BranchId branch);
  Status ForkBranch(BranchId child, BranchId parent, const BranchSettings& settings);
  Status FreeBranch(BranchId branch);
  Status ScheduleBranch(BranchId branch, int64_t clocks);
  Status Flush();
  Status WaitForDataAge(TableId table, mltuner::Clock age);
  mltuner::Clock DataAge(TableId table) const;
  EngineStats Stats() const;
  Status Shutdown();
  void Abort(const Status& why);

  // --- receive thread (cache/row_install.cc) ----------------------------------
  Status HandleMessage(Message&& message);

  const Config config_;
  const int rank_;
  const int num_workers_;
  std::shared_ptr<Device> device_;
  Transport* const transport_;
  Recorder recorder_;
  std::unique_ptr<IterationPlan> previewed_;  // PreviewPlan's plan of the recording, for FinishVirtualIteration
  Status finish_error_;  // why the one FinishVirtualIteration failed, if it did
  std::atomic<Phase> phase_{Phase::kDefining};

  // Constant after FinishVirtualIteration.
  std::vector<TableInfo> tables_;
  Recording recording_;
  std::vector<RowLayout> layouts_;
  Placement placement_;
  IterationIndex index_;
  std::vector<std::unique_ptr<TableStore>> stores_;  // by table id
  int depth_ = 2;                                    // slots per handle = pool regions
  std::shared_ptr<DeviceBlock> pool_memory_;
  std::shared_ptr<DeviceBlock> staging_;  // reclaimer: device -> host for host-resident updates
  // Device buffers for update payloads to shards that share this device.
  std::unique_ptr<DeviceBufferPool> payloads_;

 private:
  // --- initialisation phase (engine/init_access.cc) -------------------------
  Status OpenInit(Handle handle, AccessBuffer* out);
  Status PostInit(Handle handle, uintptr_t app_stream);
  Status InitAdd(const AccessRecord& access, const float* host_values);
  Status SendRequests(std::vector<Message> requests, std::vector<Message>* replies);
  Status WaitUntilAllReady();
  Status PlanAndPrepare();

  // --- real phase (engine/engine.cc) -----------------------------------------
  Status CheckExpected(Handle handle, OpKind kind) const;
  // What every open or post checks first: the phase, the handle, and that
  // `kind` opens (or closes) the access the handle recorded.
  Status CheckAccessCall(Handle handle, OpKind kind) const;
  // The running phase's open without the application stream's wait (the
  // caller waits, once per batch), and its post with the application's
  // ticket already taken. REQUIRES: CheckAccessCall passed.
  Status OpenSlot(Handle handle, OpKind kind, AccessBuffer* out);
  Status PostSlot(Handle handle, OpKind kind, DeviceEvent app_done, uintptr_t app_stream);
  // Copies a batch op's pieces into its buffer on the application's stream.
  Status FillBeforePost(const OpCall& op, uintptr_t app_stream);
  // REQUIRES: mu_ held. OutOfOrder unless (kind, handle) is the next recorded op.
  Status CheckNextOp(OpKind kind, Handle handle) const;
  // The buffer handed to the application for `access`.
  AccessBuffer BufferFor(const AccessRecord& access, float* data, mltuner::Clock data_age,
                         std::shared_ptr<void> keepalive) const;
  Status WaitForSlot(Handle handle, mltuner::Clock clock, Slot** out);
  // Config::debug_buffers: fills a buffer handed back by the application
  // with NaN, on stream `s` after the work queued there.
  void Poison(const AccessRecord& access, float* data, Stream s);
  Status PoisonPostedRead(const AccessRecord& access, float* data, uintptr_t app_stream, DeviceEvent* app_done);
  std::string DescribeOp(int op_index) const;

  // --- allocator thread (memory/allocator_thread.cc) -------------------------
  void AllocatorLoop();
  Status PrepareSlot(int64_t seq, const AccessRecord& access, const ClockBranch& at, Slot* slot);
  Status WaitFresh(const AccessRecord& access, const ClockBranch& at, mltuner::Clock* age);
  // Points the cache at another branch: forgets every data age and asks the
  // shards for that branch's rows.
  Status SwitchCache(BranchId branch);
  Status WaitForWriteBack(int64_t seq_needed);
  // Waits until the last earlier user of the buffer's static addresses is
  // reclaimed (BufferSchedule::WaitSeq).
  Status WaitForPoolSpace(const AccessRecord& access, mltuner::Clock clock);
  void GatherInto(const AccessRecord& access, float* buffer, Stream stream);

  // --- reclaimer thread (memory/reclaimer_thread.cc) -------------------------
  void ReclaimerLoop();
  Status ReclaimOp(int64_t seq);
  void ScatterAddUpdate(const AccessRecord& access, const float* buffer);
  void WriteBackLocal(const AccessRecord& access, const float* buffer);
  Status BuildTableClock(TableId table, mltuner::Clock clock, std::vector<Message>* messages);
  Status BuildDirectUpdate(const AccessRecord& access, const float* buffer, mltuner::Clock clock,
                           std::vector<Message>* messages);
  // A kClockUpdate to `shard` with `values` floats of payload, in device
  // memory when the shard shares this device (then its data is *device).
  // It carries the table's new learning rate when the application set one
  // for this clock.
  Status NewUpdateMessage(TableId table, int shard, mltuner::Clock clock, size_t values, Message* out,
                          float** data, bool* on_device);
  Status MarkReady(DeviceEvent ready, std::vector<Message>* messages);
  Status SendAll(std::vector<Message> messages);
  // Frees the slot; `released` is the ticket after which the device no
  // longer touches its addresses (the next user's fill waits for it).
  void ReleaseSlot(Slot* slot, DeviceEvent released);

  // --- receive thread (cache/row_install.cc) ---------------------------------
  Status InstallRows(const Message& message);
  Status CompleteRequest(Message&& message);

  // --- branches (engine/branches.cc) -------------------------------------------
  // The branch of an application clock. REQUIRES: mu_ held; the clock is
  // scheduled (always true without Config::branches).
  ClockBranch BranchOfLocked(mltuner::Clock clock) const;
  ClockBranch BranchOf(mltuner::Clock clock) const;
  Status SendBranchRequest(MessageType type, BranchId branch, const std::string& text);

  // Records a background failure; every later call returns it.
  void Fail(const Status& status);
  // "worker R's <thread> thread", the context of a background failure.
  std::string ThreadContext(const char* thread) const;
  std::chrono::steady_clock::time_point Deadline() const;

 public:
  // Pipeline state, guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<Slot>> slots_;  // [handle][clock % depth_]
  int64_t app_seq_ = 0;        // ops the application has completed
  int64_t reclaimed_seq_ = 0;  // ops the reclaimer has completed
  mltuner::Clock app_clock_ = 0;
  bool stopping_ = false;
  Status background_error_;
  std::string allocator_waiting_for_;  // for timeout messages
  std::vector<Slot> init_slots_;       // by handle, initialisation phase only
  std::vector<std::shared_ptr<DeviceBlock>> init_blocks_;
  EngineStats stats_;
  // Branches, guarded by mu_. Without Config::branches every clock is
  // scheduled on branch 0 and these stay empty.
  std::vector<ScheduledBlock> schedule_;
  mltuner::Clock scheduled_until_ = 0;               // clocks [0, this) have a branch
  std::map<BranchId, BranchSettings> branches_;      // live branches
  std::map<BranchId, mltuner::Clock> branch_clocks_;  // clocks scheduled per branch
  // Learning rates set by the application, guarded by mu_: table -> (the
  // application clock whose updates carry it -> rate). Entries of clocks the
  // reclaimer has passed are dropped at the next SetLearningRate.
  std::map<TableId, std::map<mltuner::Clock, float>> new_rates_;

  // Data age and pending requests, guarded by age_mu_.
  mutable std::mutex age_mu_;
  std::condition_variable age_cv_;
  std::vector<std::vector<mltuner::Clock>> shard_age_;  // [table][shard]
  std::vector<mltuner::Clock> data_age_;                // [table] = min over shards
  int64_t next_request_id_ = 1;
  std::unordered_map<int64_t, std::shared_ptr<PendingRequest>> requests_;
  Status abort_error_;  // set once by Abort; ends every wait on age_cv_
  BranchId cache_branch_ = 0;  // the branch whose rows the cache holds
  std::atomic<int64_t> messages_received_{0};
  std::atomic<int64_t> messages_sent_{0};

  std::thread allocator_;
  std::thread reclaimer_;
};

}  // namespace mltuner
