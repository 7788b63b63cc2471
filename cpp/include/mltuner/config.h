// Config: every tunable of the engine in one struct, with units and the
// reason behind each default. There are no singletons and no environment
// reads in the engine; the launcher (Python) fills this struct.
#pragma once

#include <cstdint>
#include <string>

namespace mltuner {

// The server-side update rule of a table on a branch. Workers send what the
// application wrote into its update buffers; the shard combines the updates
// of all workers for one clock and then applies the rule once. For every
// rule but kAdd the update is a gradient, averaged over the workers
// (g = mean_i u_i), which matches synchronous SGD on the concatenation of all
// workers' batches, as DDP does; with one worker (or BSP on the average) the
// rules below take exactly the steps of the torch.optim class they name:
//   kAdd:            w += sum_i u_i                (GeePS: the app sends deltas)
//   kSgd:            torch.optim.SGD(lr, momentum, dampening, weight_decay,
//                    nesterov): g += wd w; b = g on the first step, else
//                    b = m b + (1 - dampening) g; g = nesterov ? g + m b : b;
//                    w -= lr g
//   kDampedMomentum: MLtuner's rule (mltuner.md §2): h = (1-m) g + m h (h
//                    starts at 0); w -= lr h. It takes the steps of
//                    torch.optim.SGD(lr * (1 - m), momentum=m).
//   kAdam:           torch.optim.Adam(lr, betas, eps, weight_decay, amsgrad)
//   kAdamW:          torch.optim.AdamW(...): the same with decoupled weight
//                    decay, w *= 1 - lr wd before the step
// A rule's arithmetic is UpdateValue (mltuner/update_step.h).
enum class UpdateRuleKind : int { kAdd = 0, kSgd = 1, kDampedMomentum = 2, kAdam = 3, kAdamW = 4 };

const char* UpdateRuleName(UpdateRuleKind kind);

// The hyperparameters of a rule; each rule reads the ones its formula names.
// The defaults are torch.optim's (learning rate aside), so a field left alone
// does what torch does when the argument is not given.
struct UpdateRuleConfig {
  UpdateRuleKind kind = UpdateRuleKind::kAdd;
  float learning_rate = 0.01f;  // every rule but add
  float momentum = 0.0f;        // sgd, damped_momentum (MLtuner's configs use 0.9)
  float dampening = 0.0f;       // sgd
  bool nesterov = false;        // sgd
  float weight_decay = 0.0f;    // sgd and adam: added to the gradient; adamw: decoupled
  float beta1 = 0.9f;           // adam, adamw: the Adam paper's defaults
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  bool amsgrad = false;         // adam, adamw: divide by the largest second moment so far
};

// The rule as one line ("sgd lr=0.05 momentum=0.9 ..."), naming only the
// fields its formula reads: for messages, and for the table schema that
// every worker must agree on. Floats have 9 significant digits (exact).
std::string UpdateRuleText(const UpdateRuleConfig& rule);

// Config::prefetch_clocks: chosen by the plan.
constexpr int32_t kAutoPrefetchClocks = -1;
// Config::clock_part_bytes: chosen by the device, parts of
// kHostClockPartBytes where its memory is host memory (the CPU backend),
// of kDeviceClockPartBytes on a GPU. And the most parts of one shard's rows.
constexpr int64_t kAutoClockPartBytes = -1;
constexpr int64_t kHostClockPartBytes = int64_t{1} << 20;
constexpr int64_t kDeviceClockPartBytes = int64_t{16} << 20;
constexpr int kMaxClockParts = 64;

struct Config {
  // Bytes of device memory the engine may use for the parameter cache, local
  // data and the access-buffer pool. 0 means "as much as the plan needs":
  // everything is device-resident. A smaller budget moves parameter rows and
  // local data to host memory; they are swapped in ahead of use. Too small for
  // the access-buffer pool (1 + prefetch_clocks regions, each a clock's
  // buffers packed by lifetime; one region when prefetch_clocks is left to
  // the plan) gives an error with the exact bytes needed.
  //
  // Automatic budget: with 0 here and a device of known capacity
  // (Device::MemoryInfo), a plan that needs more device memory (pool and
  // device-resident stores) than the device has free when the plan is made,
  // less device_memory_reserve, is made again under a budget of exactly
  // that; the plan's description and EngineStats say which budget was used
  // and why.
  int64_t device_memory_budget = 0;

  // Bytes of device memory the automatic budget leaves free for what the
  // engine does not allocate: the framework's own tensors (activations that
  // are not stored as local data, gradients before they are handed over,
  // workspaces, its allocator's cache) and the server shard's buffers in
  // flight. -1: a tenth of the device's total memory (8 GB of an 80-GB
  // card). The server shard's state (values and optimizer state) stays on
  // the device when what is free after the workers' plans, less this,
  // holds it; otherwise it lives in pinned host memory, which the device's
  // update kernels read and write in place over PCIe.
  int64_t device_memory_reserve = -1;

  // The CPU backend's device capacity in bytes, for tests: 0 (the default)
  // leaves it unbounded; a positive value makes it behave as a device of that
  // size (allocations past it fail, MemoryInfo reports what is free), so the
  // automatic budget and the shard's placement run without a GPU.
  int64_t cpu_device_capacity = 0;

  // Bytes of host memory the plan may need (HostMemoryNeed::total: host
  // stores, staging, payloads in flight, and on the CPU backend the pool and
  // device stores). FinishVirtualIteration refuses a plan that needs more,
  // with the sizes, instead of the kernel killing the process at a later
  // clock. 0 means "what this process may still allocate"
  // (HostMemoryHeadroom: MemAvailable, the cgroups' limits, RLIMIT_AS; no
  // check where none can be read).
  int64_t host_memory_limit = 0;

  // Every blocking wait (freshness, buffer, pool space, replies) gives up
  // after this long with a Timeout error instead of hanging. 60 s is long
  // enough for a slow worker on a loaded 2-core machine, short enough that a
  // stuck job is noticed.
  int64_t wait_timeout_ms = 60000;

  // How many clocks the allocator thread may run ahead of the application.
  // 1 is double buffering (GeePS); each clock more adds a region (a clock's
  // buffers) to the access-buffer pool. 0: one region, half the least pool;
  // nothing of the next clock is prepared before this one ends.
  // kAutoPrefetchClocks (-1, the default): the plan chooses 0 or 1
  // (plan/placement.h): 1 without a budget, 0 under one that cannot hold
  // two regions' least pool, or where one region leaves room to prepare
  // more ops ahead within the clock than two do. Measured on an H100,
  // ResNet-18 at a quarter of its need ran at 0.37 of no budget with 0,
  // 0.27 with 1. The plan's description and EngineStats give the value used.
  int32_t prefetch_clocks = kAutoPrefetchClocks;

  // A table whose rows on one shard exceed this many bytes moves its clock
  // in parts of about this size (at most kMaxClockParts per shard): each
  // part's update leaves once packed, the shard applies the rule to a part
  // once every worker's part is in and pushes its fresh rows at once, so a
  // large table's packing, sending, applying and installing overlap, as a
  // model of many smaller tables' do. Results are the same bit for bit;
  // between the parts of a clock, a cache may hold some rows one clock
  // fresher than the table's data age, as it may between shards. 0: every
  // shard's rows move whole. Every worker of a job must use the same value
  // (it is part of the table schema the shards compare). The default
  // (kAutoClockPartBytes) takes 1 MiB parts on the CPU backend (16 cores,
  // one table of 100 MiB between 2 processes: 208 -> 96 ms a clock) and
  // 16 MiB parts on a GPU, where a part costs more (its events, kernels and
  // CUDA IPC notice): two H200s, one 256 MiB table, 2.05 ms a clock whole,
  // 1.72 in 16 MiB parts, 2.46 in 4 MiB parts.
  int64_t clock_part_bytes = kAutoClockPartBytes;

  // Partition locks per table in the client cache: a gather locks only the
  // partitions it reads, so installs of fresh rows in other partitions run
  // concurrently. 8 keeps lock contention negligible for 2-4 threads.
  int32_t partitions_per_table = 8;

  // The server-side update rule of every communicated table that was not
  // created with its own (Engine::CreateTable's `rule`).
  UpdateRuleConfig update_rule;
  // Branches (mltuner.md §3): with `branches` on, every clock runs on the
  // branch the application scheduled for it (Engine::ScheduleBranch), and the
  // allocator prepares a clock only once it is scheduled. Off, every clock
  // runs on branch 0 and nothing needs scheduling.
  bool branches = false;
  // Live branches a shard may hold at once (each is a copy of the parameters
  // and optimizer state). MLtuner's configs use 30-40.
  int32_t max_branches = 40;

  // Read-my-writes under bounded staleness (cache/own_updates.h): a read
  // with slack >= 1 sees this worker's own updates through the clock before
  // it, the step the shards' rule takes for them added to the cache at once,
  // while the other workers' may come up to the slack late (with momentum,
  // their momentum is carried over the clocks their rows lag). For tables whose
  // rule is add, sgd or damped momentum without weight decay, and whose rows
  // all live on the device, with no device-memory budget (set or automatic),
  // for reads at slack 1 to 8; other reads are as without it. Reads at slack
  // 0 are the same either way. It costs device memory of the table's size
  // per clock the reads may lag (at most slack + 1), plus the rule's state.
  bool read_my_writes = true;

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

// A branch's own tunables, fixed when it is forked. The learning rate and
// momentum replace those of every table's rule on the branch; kKeepParent
// keeps the parent's (each table's own).
struct BranchSettings {
  static constexpr float kKeepParent = -1.0f;
  float learning_rate = kKeepParent;
  float momentum = kKeepParent;
  // Only training branches apply updates; an evaluation or testing branch
  // runs clocks (and advances its clock) without changing its parameters.
  bool training = true;
  // Staleness of every read on this branch; -1 keeps each read's recorded slack.
  int32_t slack = -1;
  // With a learning_rate: it is the rate of the parent's fastest table, and
  // every table keeps its rate's ratio to that one (param groups of
  // different rates, a group at 0 stays at 0; an add table, which has no
  // rate, aside); a parent forked so keeps its ratios while no rate changed,
  // so a chain of forks rounds once. Where every parent table's rate is 0,
  // each table takes learning_rate. Without: every table takes it.
  bool keep_rate_ratios = false;
};

}  // namespace mltuner
