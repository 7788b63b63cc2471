// Engine: one worker's client of the parameter server (geeps.md §1-3).
//
// Life of an engine:
//   1. CreateTable for every table (same tables, same order on every worker).
//   2. The virtual iteration: Virtual* calls replay one iteration's accesses
//      and return handles; FinishVirtualIteration lays rows out in first-use
//      order, places them under the device-memory budget and prebuilds the
//      gather/scatter indexes.
//   3. Initialisation: real accesses with the recorded handles run
//      synchronously and in any order; reads fetch the servers' values and
//      updates add to them directly (no update rule).
//   4. StartIterations starts the allocator and reclaimer threads. From then
//      on real accesses must follow the recorded order exactly, one clock at a
//      time; buffers are prepared ahead by the allocator thread and released
//      and shipped behind by the reclaimer thread.
//   5. Shutdown (or the destructor) stops the threads and frees memory.
//
// Threading: one application thread calls the access methods; the transport
// calls HandleMessage from its own thread; Fetch, WaitForDataAge, Stats and
// Shutdown may be called from any thread. Every wait ends after
// Config::wait_timeout_ms with a Timeout status that says what it waited for,
// or earlier with Cancelled when the calling thread's interrupt check asks
// (mltuner/interrupt.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

class Transport;
struct Message;

// A buffer handed to the application. `data` is device memory (host memory
// on the CPU backend) holding `rows` x `row_width` floats, in the order of
// the rows given when the access was recorded. `keepalive` keeps the memory
// allocated while the application holds it, even past Shutdown; the values
// are only meaningful until the matching post call.
struct AccessBuffer {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t row_width = 0;
  bool writable = false;  // reads are read-only
  Clock data_age = kNoClock;  // reads: the table's data age when gathered
  std::shared_ptr<void> keepalive;
  std::shared_ptr<Device> device;  // where `data` lives (host_addressable, ordinal)
  // The engine's work filling the buffer (null: complete). Open already made
  // the stream it was given wait for it; another consumer's stream must wait
  // too (DeviceArray.__dlpack__(stream=...) does).
  DeviceEvent ready;
};

// One op of a batch (Engine::Run): an open or post of a recorded handle, or
// the clock (handle unused). An update or post_local_access may carry
// pieces of the application's memory to copy into its buffer (`fill`), a
// post_local_access pieces to copy out of it (`drain`: a stored activation
// read back), on the application's stream just before the post
// (Device::CopyPiecesOnAppStream); `fill_zero_if`, when not null, a float
// whose value at the copy, if nonzero, makes the fill write zeros instead.
struct OpCall {
  OpKind kind = OpKind::kClock;
  Handle handle = -1;
  std::vector<CopyPiece> fill;
  std::vector<CopyPiece> drain;
  const float* fill_zero_if = nullptr;
};

struct EngineStats {
  Clock clock = 0;                 // clocks the application has finished
  double stall_seconds = 0;        // time the application waited for buffers
  double wait_fresh_seconds = 0;   // allocator time waiting for data age
  int64_t bytes_gathered = 0;      // into read buffers, device-resident rows
  int64_t bytes_swapped_in = 0;    // host-resident rows copied to the device
  int64_t bytes_swapped_out = 0;   // device buffers copied to host stores
  int64_t bytes_scattered = 0;     // update bytes added into update logs
  int64_t messages_sent = 0;
  int64_t messages_received = 0;
  int64_t pool_bytes = 0;          // the access-buffer pool
  int64_t pool_min_bytes = 0;      // the least pool (lookahead 0) of the plan's 1 + prefetch_clocks regions
  int32_t prefetch_clocks = 0;     // clocks the allocator may prepare ahead: Config's, or the plan's choice
  BranchId branch = 0;             // the branch of the last finished clock
  Clock branch_clock = 0;          // clocks that branch has finished
  int64_t branch_switches = 0;     // times the cache was reloaded for another branch
  // Config::branches: clocks scheduled from the application's next one on,
  // and the branch that one runs on (-1: none; with none scheduled, the
  // branch unscheduled clocks continue on, ContinueOnBranch).
  int64_t scheduled_ahead = 0;
  BranchId next_branch = -1;
  int64_t own_steps = 0;           // own updates added to the cache at once (Config::read_my_writes)
  int64_t device_store_bytes = 0;
  int64_t host_store_bytes = 0;
  int64_t host_memory_bytes = 0;   // the plan's host memory (HostMemoryNeed::total), checked at finish
  // The device-memory budget the plan was made under (0: none), and whether
  // the engine chose it (Config::device_memory_budget unset, the device too
  // small for the plan): the device's free memory then, less the reserve.
  int64_t budget_bytes = 0;
  bool automatic_budget = false;
  int64_t device_reserve_bytes = 0;       // Config::device_memory_reserve, resolved
  int64_t device_free_at_plan_bytes = -1;  // -1: the device reports no capacity
  bool shard_in_host_memory = false;      // where the plan expects this rank's shard state
  // The plan's prediction of the bytes one steady-state clock moves between
  // host and device memory (plan/swap_traffic.h), either way.
  int64_t predicted_bytes_to_device_per_clock = 0;
  int64_t predicted_bytes_to_host_per_clock = 0;
};

class Engine {
 public:
  // `transport` must outlive the engine; `rank` is this worker's process
  // rank, which is also the rank of its co-located server shard.
  static Status Create(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device,
                       Transport* transport,
                       std::unique_ptr<Engine>* out);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Tables. A local table holds per-worker data that is never communicated.
  // A communicated table's update rule is `update_rule`, or Config's when
  // none is given (every worker must give the same).
  Status CreateTable(const std::string& name, int64_t num_rows, int64_t row_width, bool local,
                     TableId* out, const std::optional<UpdateRuleConfig>& update_rule = std::nullopt);
  Status FindTable(const std::string& name, TableInfo* out) const;
  std::vector<TableInfo> tables() const;

  // The virtual iteration.
  Status VirtualRead(TableId table, std::vector<RowId> rows, int slack, Handle* out);
  Status VirtualPostRead(Handle handle);
  Status VirtualPreUpdate(TableId table, std::vector<RowId> rows, Handle* out);
  Status VirtualUpdate(Handle handle);
  Status VirtualLocalAccess(TableId table, std::vector<RowId> rows, bool fetch, Handle* out);
  Status VirtualPostLocalAccess(Handle handle, bool keep);
  Status VirtualClock();
  // A dry run of FinishVirtualIteration's plan for the iteration recorded
  // (after VirtualClock): the least device budget it accepts and, when the
  // budget holds that, the plan's sizes and host memory (PlanPreview).
  // Allocates nothing; FinishVirtualIteration then uses this plan.
  Status PreviewPlan(PlanPreview* out);
  // Drops the recorded iteration (tables stay), so that another one can be
  // recorded: for a caller whose preview did not fit. Handles start from 0.
  Status ResetVirtualIteration();
  // Drops table `first` and every table created after it, so that their
  // names and memory are free again: for a caller whose plan did not fit
  // and who will record with other tables. Defining phase, with nothing
  // recorded (ResetVirtualIteration first); ids are reused from `first`.
  Status DropTables(TableId first);
  // Device memory the application will hold beside the engine during each
  // clock (saved activations that autograd keeps instead of local data):
  // plans leave it out of the budget, set or automatic. 0 until set; a
  // later call replaces it. Defining phase only.
  Status ReserveDeviceMemory(int64_t bytes);
  // Host memory the application holds now and frees while it writes initial
  // values in the initialisation phase (worker 0's copy of the model, freed
  // table by table as written). A server shard whose state lives in host
  // memory allocates each table's state as those writes arrive, so the host
  // check lets that state take up to these bytes beyond what is available
  // now; everything else the plan allocates must fit now. 0 until set; a
  // later call replaces it. Defining phase only.
  Status ReleaseHostMemoryDuringInit(int64_t bytes);
  // Plans the iteration (or takes PreviewPlan's plan), refuses it when it
  // needs more host memory than Config::host_memory_limit (or HostMemoryHeadroom)
  // allows, allocates, and waits until every worker finished its own.
  Status FinishVirtualIteration();
  // Initialisation phase only (after FinishVirtualIteration, before
  // StartIterations): adds `count` floats of host memory (the update
  // access's rows in its row order, rows x row_width) to the shards'
  // values, as PreUpdate, writing the buffer and Update would, without a
  // device buffer in between. How worker 0 writes a model's initial values.
  Status WriteInitial(Handle handle, const float* values, int64_t count);
  Status StartIterations();

  // Real accesses with recorded handles. A post call hands the buffer back;
  // `app_stream` is the stream on which the application queued its own work
  // on the buffer (a CUDA stream handle; 0 = the legacy default stream): the
  // engine waits for that work before it reads, reuses or frees the buffer.
  // Buffers may be used on different streams; a post on another stream than
  // the previous post's first makes its stream wait for the work queued on
  // that one up to that post, so posts complete in their call order. The
  // CPU backend ignores it.
  // app_stream (CUDA): the stream the application will use the buffer on;
  // it is made to wait until the buffer is complete, without blocking.
  Status Read(Handle handle, AccessBuffer* out, uintptr_t app_stream = 0);
  Status PostRead(Handle handle, uintptr_t app_stream = 0);
  Status PreUpdate(Handle handle, AccessBuffer* out, uintptr_t app_stream = 0);
  Status Update(Handle handle, uintptr_t app_stream = 0);
  Status LocalAccess(Handle handle, AccessBuffer* out, uintptr_t app_stream = 0);
  Status PostLocalAccess(Handle handle, uintptr_t app_stream = 0);
  Status Clock();
  // Consecutive recorded ops in one call, as if each were called in order;
  // `opened` gets the buffers of the open ops, in order. The posts share one
  // ticket of `app_stream`'s work and the stream waits once for every buffer
  // opened: two driver calls per batch instead of one per op, for a caller
  // that knows its next ops (the PyTorch adapter). A post that carries pieces
  // to copy in (OpCall::fill) may follow its own open in the same batch: the
  // stream waits for the buffers opened so far before the copies. An error
  // stops the batch at the op that failed; the ops before it took effect.
  Status Run(const std::vector<OpCall>& ops, std::vector<AccessBuffer>* opened, uintptr_t app_stream = 0);
  // Runs the rest of the current clock's recorded ops with nothing done in
  // between, and ends the clock: its reads are given back, its updates send
  // what their buffers hold (zeros where nothing was written), its local
  // accesses keep theirs. For a loop interrupted in the middle of a clock (a
  // Ctrl-C), which then goes on from the next one; at a clock boundary it
  // does nothing. *ran: the ops it ran. Interrupted itself, it may be called
  // again and goes on where it stopped.
  Status FinishClock(uintptr_t app_stream, int64_t* ran);

  // Branches (Config::branches; mltuner.md §3). Every worker makes the same
  // calls at the same clock boundaries. Fork copies `parent`'s parameters and
  // optimizer state into `child` on every shard, once all workers asked, and
  // returns when that is done; Free releases a branch. ScheduleBranch runs
  // the next `clocks` clocks on `branch` (each branch counts its own clocks,
  // so staleness and data age are per branch); the cache is reloaded on a
  // switch. Without Config::branches, every clock runs on branch 0.
  Status ForkBranch(BranchId child, BranchId parent, const BranchSettings& settings);
  Status FreeBranch(BranchId branch);
  Status ScheduleBranch(BranchId branch, int64_t clocks);
  // Clocks that reach the end of the schedule run on `branch` one by one
  // (the trained model's after a tuning session) instead of being refused;
  // -1 refuses them again. Freeing the branch ends it too.
  Status ContinueOnBranch(BranchId branch);
  // Batch stealing: `worker`'s clock `clock` of `branch` computes nothing
  // (its samples went to the others), so every shard counts it now rather
  // than when that worker's own update arrives, which it then drops; that
  // update must be zero (a shard refuses it otherwise). Any worker may
  // declare it, once the clock is scheduled; a declaration that reaches a
  // shard after the worker's own update changes nothing. No reply.
  Status DeclareEmptyClock(WorkerId worker, BranchId branch, mltuner::Clock clock);

  // Sets a communicated table's learning rate, from the first clock whose
  // updates of the table the application has not posted yet (the current
  // clock until its first update of the table, as torch applies a rate set
  // before optimizer.step(); clock 0 before start_iterations): that clock's
  // updates carry it to the shards, which use it for the table on the
  // clock's branch from then on. Every worker must make the same call at
  // the same point of the same clock (a shard fails the clock otherwise).
  Status SetLearningRate(TableId table, float learning_rate);

  // Makes the current clock a skipped step on the servers (a mixed-precision
  // scaler found an inf or NaN gradient, where torch skips optimizer.step()):
  // its updates carry kSkipStep, and a shard that gets one from any worker
  // applies no rule to any table for that clock, so values and optimizer
  // state (momentum, Adam's moments and step count) stay as they were; the
  // clock still advances. With `flag` (a float in the device's memory that
  // the application writes on `app_stream`), only if it is nonzero once the
  // work queued there so far is done: the reclaimer reads it before the
  // clock's first update leaves, so the application never waits for the
  // device. Only while no update of the clock has been posted (OutOfOrder
  // otherwise: some may have left without the mark).
  Status SkipStep(const float* flag = nullptr, uintptr_t app_stream = 0);

  // The servers' current values of `rows` (any phase), into out (rows x
  // width), from `branch` (-1: the branch of the last finished clock).
  Status Fetch(TableId table, const std::vector<RowId>& rows, float* out, BranchId branch = -1);
  // As Fetch, into `out` sized rows x `row_width` by a caller that knows the
  // table by a description of its own (a binding's Table object, which may
  // outlive a DropTables and a new table under the same id): InvalidArgument,
  // naming the table and both widths, unless `row_width` is the table's.
  Status Fetch(TableId table, const std::vector<RowId>& rows, int64_t row_width, float* out, BranchId branch = -1);
  // Waits until every update of the clocks the application finished has been
  // handed to the transport.
  Status Flush();
  // Waits until the table's data age on the branch of the last finished
  // clock is at least `age` (counted in that branch's clocks).
  Status WaitForDataAge(TableId table, mltuner::Clock age);
  mltuner::Clock DataAge(TableId table) const;
  EngineStats Stats() const;
  // The placement (Placement::Describe) and which tables' clocks move in
  // parts (Config::clock_part_bytes), once the virtual iteration is finished.
  std::string DescribePlan() const;
  int rank() const;
  int num_workers() const;
  // Where the engine's buffers live, as torch names devices: "cpu" or "cuda:N".
  std::string device_name() const;
  const Config& config() const;

  // Called by the transport with a client-bound message.
  Status HandleMessage(Message&& message);

  // Called by a transport that lost a peer: every current wait ends and
  // every later call fails with `why` (the first reason given wins).
  void Abort(const Status& why);

  // Stops the threads and releases memory. Later calls return kShutdown.
  Status Shutdown();

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mltuner
