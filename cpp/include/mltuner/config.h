// Config: every tunable of the engine in one struct, with units and the
// reason behind each default. There are no singletons and no environment
// reads in the engine; the launcher (Python) fills this struct.
#pragma once

#include <cstdint>
#include <string>

namespace mltuner {

// The server-side update rule of a branch. Workers send what the application
// wrote into its update buffers; the shard combines the updates of all
// workers for one clock and then applies the rule once:
//   kAdd:      w += sum_i u_i                      (GeePS: app sends deltas)
//   kSgd:      g = mean_i u_i;  w -= lr * g
//   kMomentum: g = mean_i u_i;  h = (1-m) g + m h;  w -= lr * h   (mltuner.md §2)
//   kAdam:     g = mean_i u_i;  Adam(beta1, beta2, eps) with bias correction
// Averaging (not summing) gradients matches synchronous SGD on the
// concatenation of all workers' batches, which is what DDP does.
enum class UpdateRuleKind : int { kAdd = 0, kSgd = 1, kMomentum = 2, kAdam = 3 };

const char* UpdateRuleName(UpdateRuleKind kind);

struct UpdateRuleConfig {
  UpdateRuleKind kind = UpdateRuleKind::kAdd;
  float learning_rate = 0.01f;  // used by sgd, momentum, adam
  float momentum = 0.9f;        // used by momentum
  float beta1 = 0.9f;           // Adam defaults from the Adam paper
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
};

struct Config {
  // Bytes of device memory the engine may use for the parameter cache, local
  // data and the access-buffer pool. 0 means "as much as the plan needs":
  // everything is device-resident. A smaller budget moves parameter rows and
  // local data to host memory; they are swapped in ahead of use. Too small for
  // the access-buffer pool (1 + prefetch_clocks regions, each a clock's
  // buffers packed by lifetime) gives an error with the exact bytes needed.
  int64_t device_memory_budget = 0;

  // Every blocking wait (freshness, buffer, pool space, replies) gives up
  // after this long with a Timeout error instead of hanging. 60 s is long
  // enough for a slow worker on a loaded 2-core machine, short enough that a
  // stuck job is noticed.
  int64_t wait_timeout_ms = 60000;

  // How many clocks the allocator thread may run ahead of the application.
  // 1 is double buffering (GeePS); each clock more adds a region (a clock's
  // buffers) to the access-buffer pool.
  int32_t prefetch_clocks = 1;

  // Partition locks per table in the client cache: a gather locks only the
  // partitions it reads, so installs of fresh rows in other partitions run
  // concurrently. 8 keeps lock contention negligible for 2-4 threads.
  int32_t partitions_per_table = 8;

  // The server-side update rule of the default branch.
  UpdateRuleConfig update_rule;
  // Branches (mltuner.md §3): with `branches` on, every clock runs on the
  // branch the application scheduled for it (Engine::ScheduleBranch), and the
  // allocator prepares a clock only once it is scheduled. Off, every clock
  // runs on branch 0 and nothing needs scheduling.
  bool branches = false;
  // Live branches a shard may hold at once (each is a copy of the parameters
  // and optimizer state). MLtuner's configs use 30-40.
  int32_t max_branches = 40;

  // The shards refuse a clock's update that holds a NaN or an infinity, on a
  // training branch, and fail that clock with a kNonFinite error naming the
  // table, branch, clock and worker, instead of letting one bad gradient
  // turn the parameters into NaN for good. Off by default: each update is
  // then read once more, and on a GPU the server stream is synchronized to
  // learn the count (about one pass over the update in device memory).
  bool check_finite = false;

  // Debugging use-after-post: every buffer handed back to the engine is
  // filled with NaN once the engine is done with it (a read buffer at its
  // post, on the application's stream order; an update or local buffer after
  // it was shipped or written back), so an application that keeps reading a
  // buffer after its post sees NaN instead of another clock's values. Off by
  // default: it costs a fill of every buffer every clock.
  bool debug_buffers = false;
};

// A branch's own tunables, fixed when it is forked.
struct BranchSettings {
  float learning_rate = 0.01f;
  float momentum = 0.9f;
  // Only training branches apply updates; an evaluation or testing branch
  // runs clocks (and advances its clock) without changing its parameters.
  bool training = true;
  // Staleness of every read on this branch; -1 keeps each read's recorded slack.
  int32_t slack = -1;
};

}  // namespace mltuner
