// Placement: the peak of open buffers, the pool size (regions of packed
// buffers, plan/buffer_schedule.h), the refusal of a budget too small with the
// exact bytes needed, lookahead up to a floor claiming the budget first, entries (layers,
// stored activations) claiming what it leaves by value, the predicted bytes per
// clock, dense unique slots per residence, and prefetch_clocks chosen by the
// plan when Config leaves it (kAutoPrefetchClocks).
//
// The shared example (sizes hand-computed, buffers rounded up to 256 bytes):
//   t0 param 8 rows x 16 floats (64 B/row), t1 param 8 x 10 (40 B/row),
//   t2 local 4 x 16 (64 B/row; rows 2 and 3 are untouched, so placed
//      nowhere: its stores hold 2 rows, 128 B)
//   op 0 read t0 {0,1,2}          192 B -> 256   open  256
//   op 1 read t1 {0..4}           200 B -> 256   open  512
//   op 2 pre_update t0 {0..4}     320 B -> 512   open 1024  <- peak
//   op 3 update                                  open  512
//   op 4 local_access t2 {0,1}    128 B -> 256   open  768
//   op 5 post_local_access                       open  512
//   op 6 post_read t1                            open  256
//   op 7 post_read t0                            open    0
//   op 8 clock
// Packed (lookahead 0) a region is 1024 B: the local access reuses the
// addresses of the update, which closed before it opened. With no reuse
// (lookahead >= the op count) a region is the sum, 1280 B. prefetch 1 gives
// 2 regions: the least pool is 2048 B, the unlimited one 2560 B.
#include "plan/placement.h"
#include "plan/placement_value.h"

#include <algorithm>
#include <string>
#include <vector>

#include "plan/row_layout.h"
#include "record/recorder.h"
#include "test_util.h"

using namespace mltuner;

namespace {

TableInfo Table(TableId id, int64_t rows, int64_t width, bool local = false) {
  TableInfo info;
  info.id = id;
  info.name = "t" + std::to_string(id);
  info.num_rows = rows;
  info.row_width = width;
  info.local = local;
  return info;
}

struct Example {
  std::vector<TableInfo> tables;
  Recording recording;
  std::vector<RowLayout> layouts;
};

Status BuildExample(Example* ex) {
  ex->tables = {Table(0, 8, 16), Table(1, 8, 10), Table(2, 4, 16, true)};
  Recorder rec;
  Handle r0, r1, u, l;
  MLT_RETURN_IF_ERROR(rec.Read(ex->tables[0], {0, 1, 2}, 0, &r0));
  MLT_RETURN_IF_ERROR(rec.Read(ex->tables[1], {0, 1, 2, 3, 4}, 0, &r1));
  MLT_RETURN_IF_ERROR(rec.PreUpdate(ex->tables[0], {0, 1, 2, 3, 4}, &u));
  MLT_RETURN_IF_ERROR(rec.Update(u));
  MLT_RETURN_IF_ERROR(rec.LocalAccess(ex->tables[2], {0, 1}, true, &l));
  MLT_RETURN_IF_ERROR(rec.PostLocalAccess(l, true));
  MLT_RETURN_IF_ERROR(rec.PostRead(r1));
  MLT_RETURN_IF_ERROR(rec.PostRead(r0));
  MLT_RETURN_IF_ERROR(rec.Clock());
  MLT_RETURN_IF_ERROR(rec.Finish(&ex->recording));
  ex->layouts = BuildRowLayouts(ex->tables, ex->recording);
  return Status::Ok();
}

Config WithBudget(int64_t budget, int prefetch = 1) {
  Config config;
  config.device_memory_budget = budget;
  config.prefetch_clocks = prefetch;
  return config;
}

// Slots of each residence are exactly 0..n-1 with n the residence's count,
// and the runs cover the positions in order.
void ExpectDenseSlots(const TablePlacement& t, int64_t num_rows) {
  EXPECT_EQ(t.placed(), num_rows);
  EXPECT_EQ(t.device_rows + t.host_rows, num_rows);
  int64_t next = 0;
  for (const TablePlacement::Run& run : t.runs) {
    EXPECT_EQ(run.first_position, next);
    next += run.count;
  }
  EXPECT_EQ(next, num_rows);
  std::vector<int64_t> device, host;
  for (int64_t p = 0; p < num_rows; ++p) {
    (t.ResidenceOf(p) == Residence::kDevice ? device : host).push_back(t.SlotOf(p));
  }
  EXPECT_EQ(static_cast<int64_t>(device.size()), t.device_rows);
  EXPECT_EQ(static_cast<int64_t>(host.size()), t.host_rows);
  std::sort(device.begin(), device.end());
  std::sort(host.begin(), host.end());
  for (size_t i = 0; i < device.size(); ++i) EXPECT_EQ(device[i], static_cast<int64_t>(i));
  for (size_t i = 0; i < host.size(); ++i) EXPECT_EQ(host[i], static_cast<int64_t>(i));
}

// The rows placement gives a table of the example: all of a parameter
// table, the touched ones (0 and 1) of the local one.
int64_t PlacedRows(const TableInfo& table) { return table.local ? 2 : table.num_rows; }

Residence ResidenceOfRow(const Example& ex, const Placement& plan, TableId table, RowId row) {
  return plan.tables[table].ResidenceOf(ex.layouts[table].PositionOf(row));
}

}  // namespace

TEST(AlignedBufferBytesRoundsTo256) {
  const TableInfo t16 = Table(0, 100, 16), t10 = Table(1, 100, 10), t1 = Table(2, 100, 1);
  EXPECT_EQ(AlignedBufferBytes(t16, 4), int64_t{256});
  EXPECT_EQ(AlignedBufferBytes(t16, 3), int64_t{256});
  EXPECT_EQ(AlignedBufferBytes(t16, 5), int64_t{512});
  EXPECT_EQ(AlignedBufferBytes(t10, 5), int64_t{256});
  EXPECT_EQ(AlignedBufferBytes(t10, 7), int64_t{512});  // 280 B
  EXPECT_EQ(AlignedBufferBytes(t1, 1), int64_t{256});
  EXPECT_EQ(AlignedBufferBytes(t1, 64), int64_t{256});
  EXPECT_EQ(AlignedBufferBytes(t1, 65), int64_t{512});
  EXPECT_EQ(kBufferAlignment, int64_t{256});
}

TEST(PeakOfOpenBuffers) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(0), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.peak_bytes, int64_t{1024});
  EXPECT_EQ(plan.peak_op, 2);
}

TEST(PeakAfterBuffersClose) {
  // Two sequential layers that never overlap: the peak is the larger one,
  // reached at its own open op.
  const std::vector<TableInfo> tables = {Table(0, 40, 16)};
  Recorder rec;
  Handle a, b, c;
  ASSERT_OK(rec.Read(tables[0], {0, 1}, 0, &a));                  // 256
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Read(tables[0], {2, 3, 4, 5, 6, 7, 8, 9, 10}, 0, &b));  // 576 -> 768
  ASSERT_OK(rec.PostRead(b));
  ASSERT_OK(rec.PreUpdate(tables[0], {11, 12, 13, 14, 15}, &c));  // 320 -> 512
  ASSERT_OK(rec.Update(c));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(0), tables, BuildRowLayouts(tables, recording), recording, &plan));
  EXPECT_EQ(plan.peak_bytes, int64_t{768});
  EXPECT_EQ(plan.peak_op, 2);
}

TEST(UnlimitedBudgetPutsEverythingOnDevice) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  for (int prefetch : {1, 2, 3}) {
    Placement plan;
    ASSERT_OK(PlanPlacement(WithBudget(0, prefetch), ex.tables, ex.layouts, ex.recording, &plan));
    const int64_t regions = 1 + prefetch;
    EXPECT_EQ(plan.buffers.regions, static_cast<int>(regions));
    EXPECT_EQ(plan.pool_bytes, regions * 1280);  // no buffer of a clock reuses another's addresses
    EXPECT_EQ(plan.pool_min_bytes, regions * 1024);
    EXPECT_EQ(plan.buffers.lookahead_ops, static_cast<int>(ex.recording.ops.size()));
    ASSERT_EQ(plan.tables.size(), size_t{3});
    for (const TableInfo& table : ex.tables) {
      const TablePlacement& t = plan.tables[table.id];
      EXPECT_EQ(t.device_rows, PlacedRows(table));
      EXPECT_EQ(t.host_rows, int64_t{0});
      for (int64_t p = 0; p < PlacedRows(table); ++p) EXPECT_TRUE(t.ResidenceOf(p) == Residence::kDevice);
      EXPECT_EQ(t.runs.size(), size_t{1});  // one run: everything on the device
      ExpectDenseSlots(t, PlacedRows(table));
    }
    // One copy of each table: t0 is updated once a clock (straight from its
    // buffer) and t1 never, so neither keeps an update log.
    EXPECT_EQ(plan.device_store_bytes, int64_t{8 * 64 + 8 * 40 + 2 * 64});
    EXPECT_EQ(plan.host_store_bytes, int64_t{0});
  }
}

TEST(BudgetBelowTheLeastPoolIsRefused) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  for (int64_t budget : {int64_t{1}, int64_t{1024}, int64_t{2047}}) {
    Placement plan;
    const Status s = PlanPlacement(WithBudget(budget), ex.tables, ex.layouts, ex.recording, &plan);
    EXPECT_CODE(s, StatusCode::kResourceExhausted);
    EXPECT_TRUE(s.message().find("needs 2048 bytes (2 regions") != std::string::npos);  // the exact size
    EXPECT_TRUE(s.message().find(std::to_string(budget)) != std::string::npos);
  }
  // Deeper prefetch, one region more.
  Placement deeper;
  const Status s = PlanPlacement(WithBudget(3071, 2), ex.tables, ex.layouts, ex.recording, &deeper);
  EXPECT_CODE(s, StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.message().find("needs 3072 bytes (3 regions") != std::string::npos);
  // Exactly the least pool is enough (everything else goes to host memory).
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(2048), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.pool_bytes, int64_t{2048});
  EXPECT_EQ(plan.pool_min_bytes, int64_t{2048});
  EXPECT_EQ(plan.buffers.lookahead_ops, 0);
  EXPECT_EQ(plan.device_store_bytes, int64_t{0});
  for (const TableInfo& table : ex.tables) {
    EXPECT_EQ(plan.tables[table.id].device_rows, int64_t{0});
    ExpectDenseSlots(plan.tables[table.id], PlacedRows(table));
  }
  EXPECT_EQ(plan.host_store_bytes, int64_t{8 * 64 + 8 * 40 + 2 * 64});
}

// The example's entries, their value (bytes moved per clock on the host /
// device bytes; one worker, so its own shard installs every row each clock;
// t0 has one update a clock, sent straight from its buffer, so no table keeps
// an update log) and idle span (ops from the use before a swap-in to it,
// wrapping over the 9 ops), in the order they claim the budget:
//   t1 rows {0..4}  200 B: read 200 + installs 200         = 400 -> 2, idle 4
//   t0 rows {0,1,2} 192 B: read 192 + installs 192         = 384 -> 2, idle 6
//   t2 rows {0,1}   local, 128 B: fetch 128 + keep 128     = 256 -> 2, idle 8
//   t0 rows {3,4}   128 B: installs 128                    -> 1 (no swap-in: idle 9)
//   t0 rows 5..7 (192 B), t1 rows 5..7 (120 B): installs   -> 1, divisible
//   t2 rows {2,3}: untouched rows of a local table: placed nowhere
TEST(EntriesClaimTheBudgetByValue) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  // 450 B beyond the unpacked pool (2560 B: lookahead comes first): t1's
  // layer (200, left 250), t0's (192, left 58: the same value, a longer idle
  // span), not the local entry (128: the longest idle span of the three) nor
  // t0's rows {3,4} (128); of the untouched rows none of t0 (64 B a row) and
  // one of t1 (40, left 18).
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(2560 + 450), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.pool_bytes, int64_t{2560});
  for (RowId row : {0, 1}) EXPECT_TRUE(ResidenceOfRow(ex, plan, 2, row) == Residence::kHost);
  for (RowId row : {0, 1, 2, 3, 4, 5}) EXPECT_TRUE(ResidenceOfRow(ex, plan, 1, row) == Residence::kDevice);
  for (RowId row : {6, 7}) EXPECT_TRUE(ResidenceOfRow(ex, plan, 1, row) == Residence::kHost);
  for (RowId row : {0, 1, 2}) EXPECT_TRUE(ResidenceOfRow(ex, plan, 0, row) == Residence::kDevice);
  EXPECT_EQ(plan.tables[0].device_rows, int64_t{3});
  for (const TableInfo& table : ex.tables) ExpectDenseSlots(plan.tables[table.id], PlacedRows(table));
  EXPECT_EQ(plan.device_store_bytes, int64_t{5 * 40 + 3 * 64 + 40});
  EXPECT_EQ(plan.host_store_bytes, int64_t{5 * 64 + 2 * 40 + 2 * 64});
  // What went where, and the bytes the host rows move per clock: the local
  // entry's fetch and keep, and the installs of t0 rows 3-7 and t1 rows 6, 7.
  EXPECT_EQ(plan.local_data.device_entries, int64_t{0});
  EXPECT_EQ(plan.local_data.host_entries, int64_t{1});
  EXPECT_EQ(plan.parameters.device_entries, int64_t{2});
  EXPECT_EQ(plan.parameters.host_entries, int64_t{1});
  EXPECT_EQ(plan.traffic.params_in, int64_t{0});
  EXPECT_EQ(plan.traffic.local_in, int64_t{128});
  EXPECT_EQ(plan.traffic.local_out, int64_t{128});
  EXPECT_EQ(plan.traffic.installs_out, int64_t{5 * 64 + 2 * 40});
  EXPECT_EQ(plan.traffic.updates_out + plan.traffic.sends_in, int64_t{0});
  EXPECT_TRUE(plan.Describe().find("predicted per clock: host->device 128 B") != std::string::npos);
  EXPECT_TRUE(plan.Describe().find("device->host 528 B") != std::string::npos);
}

TEST(LocalDataGoesToHostMemoryWhenItDoesNotFit) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  // 127 bytes beyond the pool: the local entry (128 B) does not fit, nor any
  // layer; one untouched row of t0 (64 B) and one of t1 (40 B) do.
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(2048 + 127), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.tables[2].device_rows, int64_t{0});
  EXPECT_EQ(plan.tables[2].host_rows, int64_t{2});
  for (const TableInfo& table : ex.tables) ExpectDenseSlots(plan.tables[table.id], PlacedRows(table));
  EXPECT_EQ(plan.tables[0].device_rows, int64_t{1});
  EXPECT_EQ(plan.tables[1].device_rows, int64_t{1});
  EXPECT_TRUE(ResidenceOfRow(ex, plan, 0, 5) == Residence::kDevice);
  EXPECT_TRUE(ResidenceOfRow(ex, plan, 1, 5) == Residence::kDevice);
  EXPECT_EQ(plan.device_store_bytes, int64_t{64 + 40});
  EXPECT_EQ(plan.pool_bytes, int64_t{2048});
  EXPECT_EQ(plan.traffic.local_in, int64_t{128});
  EXPECT_EQ(plan.traffic.local_out, int64_t{128});
  EXPECT_EQ(plan.local_data.host_entries, int64_t{1});
}

// Two stored activations of the same size, each written once and read back
// once: the same bytes saved per device byte. The one read back soon after it
// is written (B: its swap-in could not hide behind compute) keeps the
// device; the long-idle one (A, read back at the end of backward) goes to
// host memory.
TEST(ShortIdleEntryStaysOnTheDeviceBeforeALongIdleOne) {
  const std::vector<TableInfo> tables = {Table(0, 8, 16), Table(1, 8, 16, true)};
  Recorder rec;
  Handle w, write_a, write_b, read_b, read_a, u;
  ASSERT_OK(rec.Read(tables[0], {0, 1, 2, 3, 4, 5, 6, 7}, 0, &w));
  ASSERT_OK(rec.LocalAccess(tables[1], {0, 1, 2, 3}, false, &write_a));  // A: forward, layer 1
  ASSERT_OK(rec.PostLocalAccess(write_a, true));
  ASSERT_OK(rec.LocalAccess(tables[1], {4, 5, 6, 7}, false, &write_b));  // B: forward, layer 2
  ASSERT_OK(rec.PostLocalAccess(write_b, true));
  ASSERT_OK(rec.LocalAccess(tables[1], {4, 5, 6, 7}, true, &read_b));    // B: backward, layer 2
  ASSERT_OK(rec.PostLocalAccess(read_b, false));
  ASSERT_OK(rec.PreUpdate(tables[0], {0, 1, 2, 3, 4, 5, 6, 7}, &u));
  ASSERT_OK(rec.Update(u));
  ASSERT_OK(rec.PostRead(w));
  ASSERT_OK(rec.LocalAccess(tables[1], {0, 1, 2, 3}, true, &read_a));    // A: backward, layer 1
  ASSERT_OK(rec.PostLocalAccess(read_a, false));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);

  std::vector<PlacementEntry> entries;
  ASSERT_OK(ListPlacementEntries(tables, layouts, recording, PlanSite{}, &entries));
  const PlacementEntry* a = nullptr;
  const PlacementEntry* b = nullptr;
  for (const PlacementEntry& entry : entries) {
    if (entry.first_handle == write_a) a = &entry;
    if (entry.first_handle == write_b) b = &entry;
  }
  ASSERT_TRUE(a != nullptr && b != nullptr);
  EXPECT_EQ(a->device_bytes, b->device_bytes);
  EXPECT_EQ(a->moved_bytes, int64_t{2 * 4 * 64});  // out at the write, in at the read
  EXPECT_EQ(a->moved_bytes, b->moved_bytes);
  EXPECT_EQ(b->idle_ops, 1);  // written at ops 3-4, fetched at op 5
  EXPECT_TRUE(a->idle_ops > b->idle_ops);
  EXPECT_TRUE(ClaimsBudgetFirst(*b, *a));

  // Room for one of them beside the deepest pool (and nothing else: the
  // parameters' 1024 B do not fit).
  Placement unlimited;
  ASSERT_OK(PlanPlacement(WithBudget(0, 0), tables, layouts, recording, &unlimited));
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(unlimited.pool_bytes + 4 * 64, 0), tables, layouts, recording, &plan));
  for (RowId row : {4, 5, 6, 7}) {
    EXPECT_TRUE(plan.tables[1].ResidenceOf(layouts[1].PositionOf(row)) == Residence::kDevice);
  }
  for (RowId row : {0, 1, 2, 3}) {
    EXPECT_TRUE(plan.tables[1].ResidenceOf(layouts[1].PositionOf(row)) == Residence::kHost);
  }
  EXPECT_EQ(plan.local_data.device_entries, int64_t{1});
  EXPECT_EQ(plan.local_data.host_entries, int64_t{1});
  EXPECT_EQ(plan.traffic.local_in, int64_t{4 * 64});
  EXPECT_EQ(plan.traffic.local_out, int64_t{4 * 64});
  EXPECT_TRUE(plan.Describe().find("local data: 1 entries on the device (256 B), 1 in host memory (256 B)") !=
              std::string::npos);
}

TEST(BudgetIsNeverExceeded) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  for (int64_t budget = 2048; budget <= 2048 + 2200; budget += 37) {
    Placement plan;
    ASSERT_OK(PlanPlacement(WithBudget(budget), ex.tables, ex.layouts, ex.recording, &plan));
    EXPECT_TRUE(plan.pool_bytes + plan.device_store_bytes <= budget);
    EXPECT_TRUE(plan.pool_bytes >= plan.pool_min_bytes && plan.pool_min_bytes >= 2 * plan.peak_bytes);
    EXPECT_EQ(plan.pool_bytes, plan.buffers.pool_bytes());
    for (const TableInfo& table : ex.tables) ExpectDenseSlots(plan.tables[table.id], PlacedRows(table));
    // The prediction counts host rows only: none at all moves nothing.
    if (plan.host_store_bytes == 0) {
      EXPECT_EQ(plan.traffic.host_to_device() + plan.traffic.device_to_host(), int64_t{0});
    }
    // The total store size is fixed; only the split moves.
    EXPECT_EQ(plan.device_store_bytes + plan.host_store_bytes,
              int64_t{8 * 64 + 8 * 40 + 2 * 64});
  }
  // A generous budget puts everything on the device, with the unlimited pool.
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(1 << 20), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.host_store_bytes, int64_t{0});
  EXPECT_EQ(plan.pool_bytes, int64_t{2560});
}

TEST(LookaheadWithinTheFloorClaimsTheBudgetBeforeStores) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  const int64_t stores = 8 * 64 + 8 * 40 + 2 * 64;
  // One byte short of the unpacked pool: any lookahead >= 1 keeps the local
  // access off the update's addresses (region 1280), so none fits, and the
  // stores get the 511 B left.
  Placement short_plan;
  ASSERT_OK(PlanPlacement(WithBudget(2559), ex.tables, ex.layouts, ex.recording, &short_plan));
  EXPECT_EQ(short_plan.buffers.lookahead_ops, 0);
  EXPECT_EQ(short_plan.pool_bytes, int64_t{2048});
  EXPECT_TRUE(short_plan.device_store_bytes > 0 && short_plan.device_store_bytes <= 511);
  // Exactly the unpacked pool: the lookahead (here within the floor) takes
  // it all, before any store.
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(2560), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_TRUE(plan.buffers.lookahead_ops >= 1);
  EXPECT_EQ(plan.pool_bytes, int64_t{2560});
  EXPECT_EQ(plan.pool_min_bytes, int64_t{2048});
  EXPECT_EQ(plan.device_store_bytes, int64_t{0});
  // The local access (handle 3) no longer shares the update's (handle 2) addresses.
  const BufferAddress& local = plan.buffers.buffers[3];
  const BufferAddress& update = plan.buffers.buffers[2];
  EXPECT_TRUE(local.offset >= update.offset + update.bytes || update.offset >= local.offset + local.bytes);
  // The stores get what the deepest pool leaves.
  Placement full;
  ASSERT_OK(PlanPlacement(WithBudget(2560 + stores), ex.tables, ex.layouts, ex.recording, &full));
  EXPECT_EQ(full.pool_bytes, int64_t{2560});
  EXPECT_EQ(full.device_store_bytes, stores);
}

TEST(StoresComeBeforeLookaheadPastTheFloor) {
  // Twelve reads of 256 B (a table of 4 rows x 16 floats each), each closed
  // before the next opens: at lookahead L a region holds 1 + (L + 1) / 2 of
  // them, so lookahead past the floor costs pool bytes the stores could take.
  std::vector<TableInfo> tables;
  Recorder rec;
  for (int t = 0; t < 12; ++t) {
    tables.push_back(Table(t, 4, 16));
    Handle h;
    ASSERT_OK(rec.Read(tables[t], {0, 1, 2, 3}, 0, &h));
    ASSERT_OK(rec.PostRead(h));
  }
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  const int num_ops = static_cast<int>(recording.ops.size());
  const auto pool_at = [&](int lookahead) {
    return ScheduleBuffers(recording, std::vector<int64_t>(12, 256), 1, lookahead).pool_bytes();
  };
  const int64_t floor_pool = pool_at(kLookaheadFloorOps), full_pool = pool_at(num_ops), stores = 12 * 256;
  ASSERT_TRUE(kLookaheadFloorOps < num_ops && pool_at(0) < floor_pool && floor_pool < full_pool);
  // Room for the floor's pool and every store: every row stays on the
  // device, nothing moves, and the lookahead stops where the budget ends.
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(floor_pool + stores, 0), tables, layouts, recording, &plan));
  EXPECT_EQ(plan.device_store_bytes, stores);
  EXPECT_EQ(plan.pool_bytes, floor_pool);
  EXPECT_TRUE(plan.buffers.lookahead_ops >= kLookaheadFloorOps);
  EXPECT_EQ(plan.traffic.host_to_device(), int64_t{0});
  // What the stores leave lengthens the lookahead: room for the whole pool too.
  Placement roomy;
  ASSERT_OK(PlanPlacement(WithBudget(full_pool + stores, 0), tables, layouts, recording, &roomy));
  EXPECT_EQ(roomy.buffers.lookahead_ops, num_ops);
  EXPECT_EQ(roomy.device_store_bytes, stores);
  // Short of the floor's pool: the largest lookahead that fits, the stores get the rest.
  Placement tight;
  ASSERT_OK(PlanPlacement(WithBudget(floor_pool - 1, 0), tables, layouts, recording, &tight));
  EXPECT_TRUE(tight.buffers.lookahead_ops < kLookaheadFloorOps);
  EXPECT_EQ(tight.pool_bytes, pool_at(tight.buffers.lookahead_ops));
  EXPECT_EQ(tight.device_store_bytes, (floor_pool - 1 - tight.pool_bytes) / 256 * 256);
}

// prefetch_clocks left to the plan (kAutoPrefetchClocks) on the shared
// example: least pools 1024 B (one region) and 2048 B (two); at any
// lookahead >= 1 a region is 1280 B, so one region takes the full lookahead
// from 1280 B and two from 2560 B.
TEST(ChosenPrefetchIsOneWithoutABudget) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(0, kAutoPrefetchClocks), ex.tables, ex.layouts, ex.recording, &plan));
  EXPECT_EQ(plan.prefetch_clocks, 1);
  EXPECT_EQ(plan.buffers.regions, 2);
  EXPECT_EQ(plan.pool_bytes, int64_t{2560});
  EXPECT_EQ(plan.pool_min_bytes, int64_t{2048});  // the least pool of two regions, as with prefetch_clocks 1
  EXPECT_TRUE(plan.Describe().find("\nprefetch_clocks 1 (chosen: no device_memory_budget)\n") != std::string::npos);
  EXPECT_EQ(LeastPoolBytes(WithBudget(0, kAutoPrefetchClocks), ex.tables, ex.recording), int64_t{2048});
  // A value set in Config is kept, and said to be.
  for (int prefetch : {0, 1, 2}) {
    Placement set;
    ASSERT_OK(PlanPlacement(WithBudget(0, prefetch), ex.tables, ex.layouts, ex.recording, &set));
    EXPECT_EQ(set.prefetch_clocks, prefetch);
    EXPECT_EQ(set.buffers.regions, 1 + prefetch);
    EXPECT_TRUE(set.Describe().find("prefetch_clocks " + std::to_string(prefetch) + " (set in Config)") !=
                std::string::npos);
  }
}

TEST(ChosenPrefetchIsZeroWhenTwoRegionsDoNotFit) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  for (int64_t budget : {int64_t{1024}, int64_t{1279}, int64_t{1280}, int64_t{2047}}) {
    Placement plan;
    ASSERT_OK(PlanPlacement(WithBudget(budget, kAutoPrefetchClocks), ex.tables, ex.layouts, ex.recording, &plan));
    EXPECT_EQ(plan.prefetch_clocks, 0);
    EXPECT_EQ(plan.buffers.regions, 1);
    EXPECT_EQ(plan.pool_min_bytes, int64_t{1024});
    EXPECT_TRUE(plan.pool_bytes + plan.device_store_bytes <= budget);
    EXPECT_EQ(plan.buffers.lookahead_ops, budget >= 1280 ? 9 : 0);
    EXPECT_TRUE(plan.Describe().find("prefetch_clocks 0 (chosen: the budget of " + std::to_string(budget) +
                                     " bytes is below the least pool of two regions (2048 bytes), not of one "
                                     "(1024 bytes))") != std::string::npos);
    // The same placement as prefetch_clocks 0 set by hand.
    Placement set;
    ASSERT_OK(PlanPlacement(WithBudget(budget, 0), ex.tables, ex.layouts, ex.recording, &set));
    EXPECT_EQ(plan.pool_bytes, set.pool_bytes);
    EXPECT_EQ(plan.device_store_bytes, set.device_store_bytes);
    EXPECT_EQ(plan.buffers.lookahead_ops, set.buffers.lookahead_ops);
  }
  // Below one region's least pool: refused, naming it and two regions' least.
  Placement plan;
  const Status s = PlanPlacement(WithBudget(1023, kAutoPrefetchClocks), ex.tables, ex.layouts, ex.recording, &plan);
  EXPECT_CODE(s, StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.message().find("budget of 1023 bytes is too small: the access-buffer pool needs 1024 bytes (1 region,") !=
              std::string::npos);
  EXPECT_TRUE(s.message().find("takes one region when the budget cannot hold two (2048 bytes)") != std::string::npos);
  EXPECT_EQ(LeastPoolBytes(WithBudget(1023, kAutoPrefetchClocks), ex.tables, ex.recording), int64_t{1024});
}

TEST(ChosenPrefetchIsZeroWhenOneRegionLooksFurtherAhead) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  // 2048-2559 B: two regions fit only at lookahead 0; one region at the full lookahead.
  for (int64_t budget : {int64_t{2048}, int64_t{2300}, int64_t{2559}}) {
    Placement two, one, plan;
    ASSERT_OK(PlanPlacement(WithBudget(budget, 1), ex.tables, ex.layouts, ex.recording, &two));
    ASSERT_OK(PlanPlacement(WithBudget(budget, 0), ex.tables, ex.layouts, ex.recording, &one));
    EXPECT_EQ(two.buffers.lookahead_ops, 0);
    EXPECT_EQ(one.buffers.lookahead_ops, 9);
    ASSERT_OK(PlanPlacement(WithBudget(budget, kAutoPrefetchClocks), ex.tables, ex.layouts, ex.recording, &plan));
    EXPECT_EQ(plan.prefetch_clocks, 0);
    EXPECT_EQ(plan.buffers.lookahead_ops, 9);
    EXPECT_EQ(plan.pool_bytes, int64_t{1280});
    EXPECT_EQ(plan.device_store_bytes, one.device_store_bytes);  // the 768+ B left buy stores too
    EXPECT_TRUE(plan.Describe().find("prefetch_clocks 0 (chosen: under the budget one region prepares 9 ops "
                                     "ahead, two regions 0)") != std::string::npos);
  }
}

TEST(ChosenPrefetchIsOneWhenTwoRegionsLookAsFarAhead) {
  Example ex;
  ASSERT_OK(BuildExample(&ex));
  // From 2560 B two regions take the full lookahead: one cannot do better.
  for (int64_t budget : {int64_t{2560}, int64_t{1} << 20}) {
    Placement plan;
    ASSERT_OK(PlanPlacement(WithBudget(budget, kAutoPrefetchClocks), ex.tables, ex.layouts, ex.recording, &plan));
    EXPECT_EQ(plan.prefetch_clocks, 1);
    EXPECT_EQ(plan.buffers.regions, 2);
    EXPECT_EQ(plan.buffers.lookahead_ops, 9);
    EXPECT_EQ(plan.pool_min_bytes, int64_t{2048});
    EXPECT_TRUE(plan.Describe().find("prefetch_clocks 1 (chosen: the budget holds two regions at the full "
                                     "lookahead)") != std::string::npos);
  }
}

TEST(ChosenPrefetchMovesFewerBytesAtEqualLookahead) {
  // Four reads one after the other, of 1280, 1280, 1024 and 1536 B (rows of
  // 64 floats, 256 B): at lookahead 0 a region is the
  // largest, 1536 B (two: 3072 B); at lookahead >= 1 each read overlaps the
  // next and the packing (largest first, lowest offset clear) needs 3584 B.
  // From 3072 to 3583 B both sit at lookahead 0 (one region raises single
  // buffers' lookahead in 2560 B) and one region leaves 512 B or more to rows
  // on the device, two regions at most 511 B: one region, which moves fewer
  // bytes. From 3584 B one region looks ahead.
  std::vector<TableInfo> tables = {Table(0, 8, 64), Table(1, 8, 64), Table(2, 8, 64)};
  Recorder rec;
  Handle h;
  for (const auto& [table, rows] : std::vector<std::pair<int, int>>{{0, 5}, {1, 5}, {2, 4}, {0, 6}}) {
    std::vector<RowId> ids;
    for (int r = 0; r < rows; ++r) ids.push_back(r);
    ASSERT_OK(rec.Read(tables[table], ids, 0, &h));
    ASSERT_OK(rec.PostRead(h));
  }
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  for (int64_t budget : {int64_t{3072}, int64_t{3583}}) {
    Placement two, one, plan;
    ASSERT_OK(PlanPlacement(WithBudget(budget, 1), tables, layouts, recording, &two));
    ASSERT_OK(PlanPlacement(WithBudget(budget, 0), tables, layouts, recording, &one));
    EXPECT_EQ(two.buffers.lookahead_ops, 0);
    EXPECT_EQ(one.buffers.lookahead_ops, 0);
    EXPECT_EQ(one.pool_bytes, int64_t{2560});
    EXPECT_EQ(one.buffers.widest_lookahead_ops, 2);
    EXPECT_TRUE(two.device_store_bytes <= budget - 3072 && one.device_store_bytes >= 512);
    const auto busier = [](const Placement& p) {
      return std::max(p.traffic.host_to_device(), p.traffic.device_to_host());
    };
    EXPECT_TRUE(busier(one) < busier(two));
    ASSERT_OK(PlanPlacement(WithBudget(budget, kAutoPrefetchClocks), tables, layouts, recording, &plan));
    EXPECT_EQ(plan.prefetch_clocks, 0);
    EXPECT_EQ(plan.pool_bytes, one.pool_bytes);
    EXPECT_EQ(plan.device_store_bytes, one.device_store_bytes);
    EXPECT_TRUE(plan.Describe().find("prefetch_clocks 0 (chosen: under the budget one region moves fewer bytes "
                                     "over the busier direction of the host link a clock (" +
                                     std::to_string(busier(one)) + " B with one region, " +
                                     std::to_string(busier(two)) + " B with two))") !=
                std::string::npos);
  }
  Placement plan;
  ASSERT_OK(PlanPlacement(WithBudget(3584, kAutoPrefetchClocks), tables, layouts, recording, &plan));
  EXPECT_EQ(plan.prefetch_clocks, 0);
  EXPECT_TRUE(plan.buffers.lookahead_ops >= 1);
  EXPECT_EQ(plan.pool_bytes, int64_t{3584});
}

MLT_TEST_MAIN
