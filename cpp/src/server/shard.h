// ServerShard: one process's slice of every table, and the logic that keeps
// it: master values, a vector clock per table, the update rule, and the fresh
// rows pushed to every client when a table's global clock advances.
// A worker's clock may be declared empty by another (kEmptyClock, batch
// stealing): it is counted at once and the worker's own update dropped.
//
// Rows are split over shards contiguously by row id (ShardRange), and a
// shard's rows of a large table into parts (ShardParts, TableInfo::part_bytes;
// one part, the whole range, otherwise). Each client sends a shard, per
// table, clock and part, in that order, one kClockUpdate with its updates to
// the part's rows. The shard keeps each worker's updates of a part apart
// until every worker has sent it, then sums them in worker order (so results
// do not depend on arrival order) and applies the update rule to the part.
// Then it sends every client a kRows message with the part's rows, stamped
// with their clock as data age; a client's data age moves at the last part.
//
// Threading: not thread-safe. A transport calls Handle() from one thread.
// Ownership: the shard owns its tables' values and optimizer state.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/rate_ratios.h"
#include "mltuner/config.h"
#include "mltuner/host_headroom.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "mltuner/update_step.h"
#include "memory/device_block.h"
#include "mltuner/device.h"
#include "server/update_rules.h"
#include "server/vector_clock.h"
#include "sharding/shard_range.h"
#include "wire/branch_settings.h"
#include "wire/message.h"
#include "wire/table_schema.h"

namespace mltuner {

// How a worker takes a shard's rows.
enum class RowsRoute {
  kHostFrame,     // host values: the worker's memory is out of the shard's reach
  kDeviceBuffer,  // a buffer in the shard's memory, which the worker holds until it installs
  kCopiedAtSend,  // copied into the worker's process as the message leaves (CUDA IPC, shared memory)
};

class ServerShard {
 public:
  // The shard's values, optimizer state and pending updates live in
  // `device`'s memory (the CPU backend when null), and its sums and rules run
  // on the device's server stream.
  ServerShard(int rank, int num_workers, const UpdateRuleConfig& rule, int max_branches = 40,
              std::shared_ptr<Device> device = nullptr);
  ServerShard(const ServerShard&) = delete;
  ServerShard& operator=(const ServerShard&) = delete;

  // Registers a communicated table (local tables never reach a shard), with
  // its own update rule or, without one, the shard's. Values start at zero.
  // InvalidArgument on a duplicate id or bad sizes.
  Status AddTable(const TableInfo& info);
  // Forgets a table again, before every worker is ready (they compare
  // tables then): for a worker that gives up a recording and its tables.
  Status DropTable(TableId table);

  // Handles one server-bound message and appends the replies to send to
  // *out (their header.receiver is set). A message that is invalid for this
  // shard (unknown table, spans outside the shard, a wrong row width, a clock
  // out of order, a sender out of range) returns a non-OK Status and changes
  // nothing; for kFetch and kInitAdd it also appends a kError reply so the
  // waiting client learns why.
  Status Handle(const Message& in, std::vector<Message>* out);
  // The same, but may take over in.values instead of copying them (a
  // kClockUpdate that covers all of the shard's rows of its table).
  Status Handle(Message&& in, std::vector<Message>* out);

  // How each worker takes the shard's rows (RowsRoute). Default: every
  // worker through host frames.
  void set_rows_routes(std::function<RowsRoute(int worker)> route_of) { rows_route_ = std::move(route_of); }

  // Defers the allocation of the tables' values and optimizer state until
  // every worker is ready (kReady: each worker's plan is made and its memory
  // taken), and then places all of it at once: on the device when its free
  // memory less `device_memory_reserve` (Config's, resolved by
  // DeviceReserve) holds it, else in host memory that the device's kernels
  // update in place (plan/device_budget.h), table by table as messages need
  // it (state_in_host_memory). A message that needs the state
  // earlier allocates it then. Call before AddTable. Default: allocated by
  // AddTable, on the device.
  void PlaceStateWhenReady(const Config& config);
  // Whether the tables' state lives in host memory (false until placed).
  // Then a worker of this process (a device receiver) gets its rows as a
  // read-only view of the state itself, not a copy: a copy would be device
  // memory outside the worker's budget or, for the kStart push of every
  // table at once, a second host copy of the model. The rule waits until
  // every view of a table is installed (returned, and its install's ticket
  // passed) before it changes the values, up to Config.wait_timeout_ms.
  // In host memory a table's state is allocated by the first message that
  // needs it (worker 0's initial values, table by table; kStart takes the
  // rest), not all at once when placed.
  bool state_in_host_memory() const { return state_in_host_; }
  // Bytes of values and optimizer state allocated so far, branch 0 and
  // forks together (for tests).
  int64_t state_bytes_allocated() const;

  // Config::check_finite: refuse (kNonFinite, naming the table, branch,
  // clock and worker) a training branch's clock update holding a NaN or an
  // infinity, before any of it is kept. Default: off.
  void set_check_finite(bool check) { check_finite_ = check; }

  // Host memory available for a fork's copy of the state where that lives in
  // host memory (the CPU backend, or state_in_host_memory); an unknown
  // headroom means no check. Default: HostMemoryHeadroom (MemAvailable, the
  // cgroups' limits, RLIMIT_AS). A fork whose copy would not fit is refused
  // with the sizes, not left to the kernel's OOM killer.
  void set_host_memory_available(std::function<HostHeadroom()> available) { host_available_ = std::move(available); }

  int rank() const { return rank_; }
  int num_workers() const { return num_workers_; }
  // For tests and checkpoints: the shard's current values of a table on a
  // branch, its rows in order from ShardRange(...).begin; nullptr for an
  // unknown table or branch.
  std::unique_ptr<std::vector<float>> values(TableId table, BranchId branch = 0) const;
  Clock global_clock(TableId table, BranchId branch = 0) const;
  // The rate the table's rule applies on the branch now; -1 for an unknown
  // table or branch.
  float learning_rate(TableId table, BranchId branch = 0) const;
  int num_branches() const { return static_cast<int>(branches_.size()); }

  // Checkpoints. Export copies a table's slice; the caller picks the moment
  // (a clock boundary every worker has reached). Import replaces a table's
  // values and optimizer state with arrays of exactly the exported sizes; it
  // is refused once updates of a training clock are pending.
  Status ExportTable(TableId table, ShardSlice* out, BranchId branch = 0) const;
  Status ImportTable(TableId table, const float* values, size_t num_values, const float* state,
                     size_t num_state);  // into branch 0

 private:
  // Views of a table's host-resident values lent to device receivers
  // (RowsMessage): how many are out, and the tickets of the returned ones'
  // last reads. Shared with the views' deleters, which may outlive the table.
  struct Loans {
    Mutex mu;
    CondVar returned{&mu};
    int out GUARDED_BY(mu) = 0;
    std::vector<DeviceEvent> last_uses GUARDED_BY(mu);
  };

  // One table on one branch.
  struct TableState {
    TableInfo info;
    BranchId branch = 0;
    bool training = true;          // only training branches apply updates
    RowSpan range;                 // the rows this shard owns
    std::vector<RowSpan> parts;    // `range` as the clock moves it (ShardParts)
    int64_t num_values = 0;        // range.count * row_width
    std::shared_ptr<DeviceBlock> values;  // num_values floats (device or host memory); null when 0 or not yet placed
    UpdateRuleConfig rule_config;         // the rule `rule` is made with once the state is placed
    std::unique_ptr<UpdateRule> rule;
    VectorClock clock;
    // Updates of parts not yet sent by every worker: (clock, part) -> one
    // dense device buffer of the part's rows per worker (null until that
    // worker sends a nonempty update).
    std::map<std::pair<Clock, int>, std::vector<std::shared_ptr<DeviceBuffer>>> pending;
    // Learning rates the workers' clock updates carried (kNewLearningRate),
    // by clock and worker, until the clock is applied.
    std::map<Clock, std::map<WorkerId, float>> new_rates;
    // Clocks some worker's update marked a skipped step (kSkipStep), until
    // the clock's last part is applied (by none of them).
    std::set<Clock> skipped_steps;
    std::shared_ptr<Loans> loans = std::make_shared<Loans>();
    // Set by a fork that kept rate ratios (common/rate_ratios.h): the rate
    // over the fastest's, and the rate that gave.
    double rate_ratio = -1;
    float ratio_rate = 0;
    float* data() const { return values ? values->floats() : nullptr; }
    // Floats before part `part`'s rows in `values`, and in the part.
    int64_t offset_of(int part) const { return (parts[part].begin - range.begin) * info.row_width; }
    int64_t values_of(int part) const { return parts[part].count * info.row_width; }
    // Bytes of values and the rule's optimizer state, allocated or not.
    int64_t state_bytes() const {
      return num_values * static_cast<int64_t>(sizeof(float)) * (1 + StateArraysPerValue(rule_config));
    }
    TableState(int num_workers, int num_parts) : clock(num_workers, num_parts) {}
  };

  // `owned` is in.values when the caller gives them up, else null.
  Status HandleClockUpdate(const Message& in, std::vector<Message>* out);
  Status HandleStart(const Message& in, std::vector<Message>* out);
  Status HandleFetch(const Message& in, std::vector<Message>* out);
  Status HandleInitAdd(const Message& in, std::vector<Message>* out);
  Status HandleReady(const Message& in, std::vector<Message>* out);
  Status HandleFork(const Message& in, std::vector<Message>* out);
  Status HandleFreeBranch(const Message& in, std::vector<Message>* out);
  Status HandleBranchRows(const Message& in, std::vector<Message>* out);
  // Records one worker's fork or free request; true once every worker's is
  // in (then *requests holds them all and the entry is removed).
  bool CollectRequest(std::map<BranchId, std::map<WorkerId, std::pair<int64_t, std::string>>>* pending,
                      const Message& in, std::map<WorkerId, std::pair<int64_t, std::string>>* requests);
  Status Fork(BranchId child, BranchId parent, const BranchSettings& settings);
  // The rates of `parent`'s rated tables (every rule but add), for ForkRates.
  std::map<TableId, TableRate> RatesOf(BranchId parent) const;
  TableState* Find(BranchId branch, TableId table) const;
  // The error for a table not found on `branch` (an unknown or freed branch).
  Status NotHere(TableId table, BranchId branch) const;
  // Part `part`'s rows for `worker`, stamped with data age `age`.
  // `shared_frame`: the host frame of this push that every worker outside
  // the shard's memory gets, each through a view (filled once, by the first
  // that needs it); null for a reply to one worker.
  Status RowsMessage(const TableState& table, int part, Clock age, int worker, Message* out,
                     std::shared_ptr<DeviceBuffer>* shared_frame = nullptr);
  // A view of a part of the table's host-resident values for a device
  // receiver (see Loans), ready after the work queued on the server stream so far.
  Status LendValues(const TableState& table, int part, std::shared_ptr<DeviceBuffer>* out);
  // Blocks until every view of the table's values is returned, then queues
  // their last reads before the server stream's next work (which writes the
  // values); a Timeout after Config.wait_timeout_ms.
  Status WaitForLoans(const TableState& table);
  // Whether every span of `in` lies in `rows` (the shard's, or a part's).
  Status CheckSpans(const TableState& table, const RowSpan& rows, const Message& in) const;
  // Sends every client part `part`'s rows, stamped with data age `age`.
  Status PushRows(const TableState& table, int part, Clock age, std::vector<Message>* out);
  // Every part's rows, stamped with the table's global clock.
  Status PushAllRows(const TableState& table, std::vector<Message>* out);
  // Applies the rule to part `part` of clock `finished`, whose every update
  // has just arrived (or been declared empty).
  Status ApplyPart(TableState* table, Clock finished, int part);
  // Gives a clock's update buffers (applied, or a skipped step's) back to
  // their pools once the server stream has done what it queued on them.
  Status ReleaseUpdates(std::vector<std::shared_ptr<DeviceBuffer>>& updates);
  // Applies and pushes the parts the table's global position passed since
  // position `before` (VectorClock::global_position).
  Status FinishParts(TableState* table, int64_t before, std::vector<Message>* out);
  // kEmptyClock (VectorClock::DeclareEmpty), and a late worker's own update
  // of such a clock, checked to be zero and dropped.
  Status HandleEmptyClock(const Message& in, std::vector<Message>* out);
  Status DropDeclaredEmpty(TableState* table, const Message& in);
  // *sum = the updates of one clock added in worker order (null when none
  // was sent); may append a buffer it acquired to `updates`.
  Status SumInWorkerOrder(std::vector<std::shared_ptr<DeviceBuffer>>& updates, int64_t count,
                          std::shared_ptr<DeviceBuffer>* sum);
  // Sets the rule's learning rate for the finished clock when the workers
  // asked for a new one; an error when they asked for different ones.
  Status TakeNewLearningRate(TableState* table, Clock finished);
  // kNonFinite when the update in `in` holds a NaN or an infinity.
  Status CheckFinite(const TableState& table, const Message& in);
  // A message's values in device memory, queued after their producer's work
  // on the server stream; null when it has none. On a device whose memory
  // is host memory a host frame is used as it is (it may be borrowed: read
  // only, see DeviceBuffer::borrowed).
  Status PayloadOnDevice(const Message& in, std::shared_ptr<DeviceBuffer>* out);
  // dense rows of `range` += the span-ordered payload at `source` (device
  // memory, or any host memory on a host-addressable device), on the
  // server stream.
  void AddSpansOnDevice(const Message& in, const RowSpan& range, int64_t row_width, const float* source,
                        float* dense);
  // A table's state record; its values (zero) and rule are allocated only
  // when `allocate`.
  Status NewTableState(const TableInfo& info, bool allocate, std::unique_ptr<TableState>* out);
  // Values (zero) and the rule with zero state, where the shard's state lives.
  Status AllocateState(TableState* table);
  // PlaceStateWhenReady's placement: the first call decides where the state
  // lives and, on the device, allocates every table's; later calls do nothing.
  Status PlaceState();
  // A table's state allocated if it is not yet (state in host memory).
  Status EnsureState(TableState* table);
  // ResourceExhausted when a copy of `parent`'s state for fork `child` would
  // take more host memory than is available.
  Status CheckForkFits(BranchId child, BranchId parent) const;
  // The state a message needs: its table's, or every table's for one that
  // names none (kStart, forks).
  Status EnsureStateFor(const Message& in);

  const int rank_;
  const int num_workers_;
  const UpdateRuleConfig rule_config_;
  const int max_branches_;
  std::shared_ptr<Device> device_;
  DeviceBufferPool buffers_;
  DeviceBufferPool frames_;  // host frames of rows pushed to other processes
  std::function<RowsRoute(int)> rows_route_;
  std::function<HostHeadroom()> host_available_;
  bool check_finite_ = false;
  bool defer_state_ = false;   // PlaceStateWhenReady was called
  bool state_placed_ = true;   // false while deferred and not yet placed
  int64_t device_memory_reserve_ = 0;
  int64_t wait_timeout_ms_ = Config().wait_timeout_ms;
  bool state_in_host_ = false;
  // Every table on every live branch, by (branch, table).
  std::map<std::pair<BranchId, TableId>, std::unique_ptr<TableState>> tables_;
  std::set<BranchId> branches_{0};
  // Fork and free requests waiting for the other workers: branch -> worker ->
  // (request id, settings bytes: wire/branch_settings.h).
  std::map<BranchId, std::map<WorkerId, std::pair<int64_t, std::string>>> fork_requests_;
  std::map<BranchId, std::map<WorkerId, std::pair<int64_t, std::string>>> free_requests_;
  // kReady received so far: worker -> (request id, its table schema bytes: wire/table_schema.h).
  std::map<WorkerId, std::pair<int64_t, std::string>> ready_requests_;
};

}  // namespace mltuner
