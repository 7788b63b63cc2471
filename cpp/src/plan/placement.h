// Placement: what lives in device memory under the budget, and how big the
// access-buffer pool is (geeps.md §3).
//
// 1. The pool: one region per clock in flight (1 + prefetch_clocks), each
//    holding a clock's buffers at the static offsets of a BufferSchedule
//    (plan/buffer_schedule.h). Its least size packs the recorded lifetimes
//    tightly (lookahead 0); a budget below that is refused with the exact
//    bytes needed.
// 2. Lookahead up to a floor first: the pool takes the largest lookahead,
//    up to kLookaheadFloorOps, whose pool fits the budget, and then raises
//    single buffers' lookahead towards the floor where it still fits
//    (WidenLookahead: the clock's peak may leave no room for a uniform one
//    while its smaller buffers elsewhere have room). Buffers of a
//    clock then reuse each other's addresses less, so the allocator fills
//    them further ahead of the application and swaps overlap compute; at
//    lookahead 0 every fill waits for the reclaim of the op before it. A
//    few ops ahead is what overlap needs (the link is then busy while each
//    op computes); past that, a longer lookahead only repeats it, while
//    every pool byte it takes is a byte the stores below would have kept
//    off the host link. So the stores come next, and what they leave
//    lengthens the lookahead further. (More regions would not help: the
//    allocator never runs more than prefetch_clocks ahead, so they would
//    sit idle.) Measured on an H100, ratios to no budget at floors of 0,
//    2 and 8 ops and with none: the 12-layer transformer at a quarter of
//    its need 0.56, 0.68, 0.75 and 0.75; ResNet-18 on 224x224 images at
//    batch 128, a quarter, 0.38, 0.40, 0.41 and 0.32-0.37; the same given
//    FSDP's peak memory 0.76 at any floor and 0.42 with none, which sent
//    1.26 GB of its 1.45 GB of activations over the link each way a clock.
// 3. Stores, by value (plan/placement_value.h): each entry — a layer's
//    parameter rows with their update log, a stored activation (the rows one
//    local access writes), a table's untouched rows — claims what the pool
//    left in order of swap bytes saved per clock per device byte, short
//    idle spans first at equal value, while it fits; untouched rows may be
//    split. The rest stay in host memory and are swapped by the allocator
//    (in) and the reclaimer (out), row by row as the indexes say, so one
//    access may mix device and host rows.
// 4. prefetch_clocks, when Config leaves it to the plan (kAutoPrefetchClocks):
//    1 with no budget, or where two regions take the full lookahead under
//    it. Otherwise the plan is made with 1 and with 0 (one region, half the
//    least pool) and takes 0 where two regions do not fit the budget but one
//    does; else the one that looks further ahead up to the floor, then the
//    one that moves fewer bytes over the busier direction of the host link,
//    then the longer lookahead, then 1. Under a tight budget the pool of
//    two regions sits at lookahead 0, every fill waiting for the reclaim
//    before it, while one region spends the same bytes on lookahead within
//    the clock: ResNet-18 at a quarter of its need on an H100 ran at 0.27
//    of no budget with 1, 0.37 with 0.
// A budget of 0 means unlimited: everything on the device, and the largest
// lookahead (no buffer of a clock shares addresses with another).
// The plan predicts the bytes it moves per clock (plan/swap_traffic.h).
#pragma once

#include <string>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/buffer_schedule.h"
#include "plan/device_budget.h"
#include "plan/plan_site.h"
#include "plan/row_layout.h"
#include "plan/swap_traffic.h"
#include "record/recorder.h"

namespace mltuner {

// Where each layout position of a table lives. Positions are placed in
// ascending order (the layout is first-use order, and placement walks the
// same ops), each taking the next slot of its residence's store, so a table's
// placement is a few runs of positions, not 9 bytes per row.
struct TablePlacement {
  struct Run {
    int64_t first_position = 0;
    int64_t count = 0;
    Residence residence = Residence::kHost;
    int64_t first_slot = 0;  // in the store of `residence`
  };
  // Ascending, covering positions [0, placed()): every row of a parameter
  // table, the touched ones of a local table (placement_value.h).
  std::vector<Run> runs;
  int64_t device_rows = 0;
  int64_t host_rows = 0;

  // Positions placed so far.
  int64_t placed() const { return device_rows + host_rows; }
  // Places the next `count` positions in `where`.
  void Append(int64_t count, Residence where);
  // The residence of `position` and its row index in that store.
  // REQUIRES: 0 <= position < placed().
  Residence ResidenceOf(int64_t position) const { return RunOf(position).residence; }
  int64_t SlotOf(int64_t position) const {
    const Run& run = RunOf(position);
    return run.first_slot + (position - run.first_position);
  }

 private:
  const Run& RunOf(int64_t position) const;
};

struct Placement {
  std::vector<TablePlacement> tables;  // by table id
  int64_t peak_bytes = 0;              // largest set of open buffers
  int peak_op = -1;                    // op index where it is reached
  BufferSchedule buffers;              // static addresses and waits of the pool
  int64_t pool_bytes = 0;              // access-buffer pool: buffers.pool_bytes(), at least kBufferAlignment
  int64_t pool_min_bytes = 0;          // the pool of these regions at lookahead 0
  int prefetch_clocks = 1;             // clocks the allocator may prepare ahead: buffers.regions - 1
  std::string prefetch_choice;         // why: "set in Config", or the plan's reason for choosing it
  int64_t device_store_bytes = 0;      // resident parameters, logs, local data
  int64_t host_store_bytes = 0;
  int64_t staging_bytes = 0;           // the largest access buffer, at least kBufferAlignment
  HostMemoryNeed host;                 // filled by PlanIteration (plan/iteration_plan.h)
  BudgetChoice budget;                 // the budget planned under, set or automatic: also PlanIteration's
  // What went where, by kind of entry (plan/placement_value.h).
  struct EntryCount {
    int64_t device_entries = 0, device_bytes = 0;
    int64_t host_entries = 0, host_bytes = 0;  // split entries count on both sides
  };
  EntryCount parameters, local_data;
  SwapTraffic traffic;                 // predicted bytes moved per steady-state clock
  // A few lines for logs and the Python `plan` property.
  std::string Describe() const;
};

// The lookahead (ops) the pool takes before stores claim the budget (item 2).
constexpr int kLookaheadFloorOps = 8;

int64_t AlignedBufferBytes(const TableInfo& table, int64_t rows);

// The least access-buffer pool of `recording` (lookahead 0, one region per
// clock in flight): the smallest device_memory_budget PlanPlacement accepts.
// With prefetch_clocks left to the plan, that of one region under a budget
// (the plan falls back to 0), of two without one (the plan takes 1).
// `schedule`, when given, receives that pool's schedule.
int64_t LeastPoolBytes(const Config& config, const std::vector<TableInfo>& tables, const Recording& recording,
                       BufferSchedule* schedule = nullptr);

// The prefetch_clocks whose least pool LeastPoolBytes gives: Config's, or
// when the plan chooses, 0 under a budget and 1 without one.
int LeastPoolPrefetchClocks(const Config& config);

// The placement of `recording` under config.device_memory_budget, with
// config.prefetch_clocks as set or, when it is kAutoPrefetchClocks, chosen
// (item 4 above; out->prefetch_clocks and out->prefetch_choice say which).
// ResourceExhausted, naming the bytes needed, when the budget cannot hold
// the least pool.
Status PlanPlacement(const Config& config, const std::vector<TableInfo>& tables,
                     const std::vector<RowLayout>& layouts, const Recording& recording,
                     Placement* out, const PlanSite& site = PlanSite{});

}  // namespace mltuner
