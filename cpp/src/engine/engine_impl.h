// Engine::Impl: the application thread's side of a worker, composing the
// pipeline's layers over their shared state (pipeline/shared_state.h, which
// also states the lock order):
//   Allocator    (memory/allocator.h)      the allocator thread, ahead of the application
//   Reclaimer    (memory/reclaimer.h)      the reclaimer thread, behind it
//   RowInstaller (cache/row_installer.h)   the transport's receive thread
// It records the virtual iteration, plans (PipelinePlan), validates every
// application call, hands out the buffers the allocator prepared and marks
// them posted for the reclaimer; branches and synchronous requests too.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/row_installer.h"
#include "memory/allocator.h"
#include "memory/reclaimer.h"
#include "mltuner/engine.h"
#include "mltuner/transport.h"
#include "pipeline/plan.h"
#include "pipeline/shared_state.h"
#include "plan/iteration_plan.h"
#include "record/recorder.h"
#include "wire/message.h"

namespace mltuner {

class Engine::Impl {
 public:
  Impl(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
       Transport* transport);
  ~Impl();

  // --- application thread (engine/engine.cc) --------------------------------
  Status CreateTable(const std::string& name, int64_t num_rows, int64_t row_width, bool local,
                     TableId* out, const std::optional<UpdateRuleConfig>& update_rule);
  Status SetLearningRate(TableId table, float learning_rate);
  Status SkipStep(const float* flag, uintptr_t app_stream);
  Status LookupTable(TableId table, const TableInfo** out) const;
  Status PreviewPlan(PlanPreview* out);
  Status ResetVirtualIteration();
  Status DropTables(TableId first);
  Status ReserveDeviceMemory(int64_t bytes);
  Status ReleaseHostMemoryDuringInit(int64_t bytes);
  // Where a plan is made: this worker and its device's memory now, less
  // what the application reserved.
  Status Site(PlanSite* out) const;
  // config_ with the budget, when one is set, less what the application
  // reserved (ReserveDeviceMemory): what plans are made under.
  Config PlanConfig() const;
  Status FinishVirtualIteration();
  Status StartIterations();
  Status Open(Handle handle, OpKind kind, AccessBuffer* out, uintptr_t app_stream);
  Status Post(Handle handle, OpKind kind, uintptr_t app_stream);
  Status Run(const std::vector<OpCall>& ops, std::vector<AccessBuffer>* opened, uintptr_t app_stream);
  Status FinishClock(uintptr_t app_stream, int64_t* ran);
  Status Clock();
  // `row_width`: the width the caller sized `out` by, checked against the
  // table's (none: the table's).
  Status Fetch(TableId table, const std::vector<RowId>& rows, std::optional<int64_t> row_width, float* out,
               BranchId branch);
  Status WriteInitial(Handle handle, const float* values, int64_t count);
  Status ForkBranch(BranchId child, BranchId parent, const BranchSettings& settings);
  Status FreeBranch(BranchId branch);
  Status ScheduleBranch(BranchId branch, int64_t clocks);
  Status ContinueOnBranch(BranchId branch);
  Status DeclareEmptyClock(WorkerId worker, BranchId branch, mltuner::Clock clock);
  Status Flush();
  Status WaitForDataAge(TableId table, mltuner::Clock age);
  mltuner::Clock DataAge(TableId table) const { return state_.DataAge(table); }
  EngineStats Stats() const;
  Status Shutdown();
  void Abort(const Status& why);

  // --- receive thread ---------------------------------------------------------
  Status HandleMessage(Message&& message) { return installer_.Handle(std::move(message)); }

  const Config config_;
  const int rank_;
  const int num_workers_;
  std::shared_ptr<Device> device_;
  Transport* const transport_;
  Recorder recorder_;
  std::unique_ptr<IterationPlan> previewed_;  // PreviewPlan's plan of the recording, for FinishVirtualIteration
  Status finish_error_;  // why the one FinishVirtualIteration failed, if it did
  int64_t application_device_bytes_ = 0;  // ReserveDeviceMemory
  int64_t host_bytes_freed_during_init_ = 0;  // ReleaseHostMemoryDuringInit
  PipelinePlan plan_;    // tables while defining; all of it constant after FinishVirtualIteration
  std::shared_ptr<DeviceBlock> skip_words_;  // SkipStep's pinned flags, one per clock in flight
  SharedState state_;

 private:
  // --- initialisation phase (engine/init_access.cc) -------------------------
  Status OpenInit(Handle handle, AccessBuffer* out);
  Status PostInit(Handle handle, uintptr_t app_stream);
  Status InitAdd(const AccessRecord& access, const float* host_values);
  // Sends `requests` and waits for every reply. Interrupted (Cancelled), the
  // request stays known to the installer until its replies are in.
  Status SendRequests(std::vector<Message> requests, std::vector<Message>* replies) EXCLUDES(state_.age_mu);
  // Forgets the abandoned requests the shards have answered.
  void ForgetAnsweredAbandonedRequests() REQUIRES(state_.age_mu);
  Status WaitUntilAllReady();
  Status PlanAndPrepare();
  void MakeOwnUpdates();

  // --- real phase (engine/engine.cc) -----------------------------------------
  Status CheckExpected(Handle handle, OpKind kind) const;
  // What every open or post checks first: the phase, the handle, and that
  // `kind` opens (or closes) the access the handle recorded.
  Status CheckAccessCall(Handle handle, OpKind kind) const;
  // The index within a clock's recorded ops of `table`'s first update post
  // (the clock's op count when it has none).
  int64_t FirstUpdateOp(TableId table) const;
  // The running phase's open without the application stream's wait (the
  // caller waits, once per batch), and its post with the application's
  // ticket already taken. REQUIRES: CheckAccessCall passed.
  // `notify`: wake the background threads now; a batch wakes them once, at
  // its end (WaitForSlot wakes them before it blocks).
  Status OpenSlot(Handle handle, OpKind kind, AccessBuffer* out, bool notify = true) EXCLUDES(state_.mu);
  Status PostSlot(Handle handle, OpKind kind, DeviceEvent app_done, uintptr_t app_stream, bool notify = true)
      EXCLUDES(state_.mu);
  // Copies a batch op's pieces out of and into its buffer on the application's
  // stream.
  Status CopyBeforePost(const OpCall& op, uintptr_t app_stream) EXCLUDES(state_.mu);
  // OutOfOrder unless (kind, handle) is the next recorded op.
  Status CheckNextOp(OpKind kind, Handle handle) const REQUIRES(state_.mu);
  // The buffer handed to the application for `access`.
  AccessBuffer BufferFor(const AccessRecord& access, float* data, mltuner::Clock data_age,
                         std::shared_ptr<void> keepalive) const;
  Status WaitForSlot(Handle handle, mltuner::Clock clock, Slot** out) EXCLUDES(state_.mu);
  // Config::debug_buffers: fills a buffer handed back by the application
  // with NaN, on stream `s` after the work queued there.
  void Poison(const AccessRecord& access, float* data, Stream s);
  Status PoisonPostedRead(const AccessRecord& access, float* data, uintptr_t app_stream, DeviceEvent* app_done);
  // The application's ticket of a post, on `app_stream`. Release tickets
  // must follow one another in post order whatever stream each post names:
  // a fill waits only for the last earlier user's (BufferSchedule). So a
  // post on another stream than the last first makes its stream wait for
  // the last ticket; with one stream this is RecordAppWork alone.
  Status TakeAppTicket(uintptr_t app_stream, DeviceEvent* out);
  std::string DescribeOp(int op_index) const;

  // --- branches (engine/branches.cc) -------------------------------------------
  Status SendBranchRequest(MessageType type, BranchId branch, const std::string& text);

  std::chrono::steady_clock::time_point Deadline() const;
  // Waits, until the wait timeout, for the reclaimer to pass `target` (or
  // stop); true if it did. *interrupted: whether the calling thread's
  // interrupt check (mltuner/interrupt.h) ended the wait.
  bool WaitReclaimedLocked(int64_t target, bool* interrupted) REQUIRES(state_.mu);

  // The pipeline's stages; they read plan_ and share state_.
  Allocator allocator_;
  Reclaimer reclaimer_;
  RowInstaller installer_;
  // The initialisation phase's buffers, by handle (application thread only).
  std::vector<Slot> init_slots_;
  std::vector<std::shared_ptr<DeviceBlock>> init_blocks_;
  // The last post's ticket and its stream (application thread only).
  DeviceEvent last_app_ticket_;
  uintptr_t last_app_stream_ = 0;
  // Ids of interrupted requests whose replies may still come (SendRequests;
  // guarded by state_.age_mu, as state_.requests).
  std::vector<int64_t> abandoned_requests_ GUARDED_BY(state_.age_mu);
};

}  // namespace mltuner
