// IndexBuilder: gather/scatter runs merged and split by residence, the
// update that closes each table's clock, local-data fetch dependencies, and
// the per-shard wire segments of updated and of all rows.
#include "record/index_builder.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "plan/placement.h"
#include "plan/row_layout.h"
#include "record/recorder.h"
#include "sharding/shard_range.h"
#include "test_util.h"

using namespace mltuner;

namespace {

TableInfo Table(TableId id, int64_t rows, int64_t width = 4, bool local = false) {
  TableInfo info;
  info.id = id;
  info.name = "t" + std::to_string(id);
  info.num_rows = rows;
  info.row_width = width;
  info.local = local;
  return info;
}

bool SameRuns(const std::vector<RowRun>& got, const std::vector<RowRun>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].src != want[i].src || got[i].dst != want[i].dst || got[i].count != want[i].count) {
      return false;
    }
  }
  return true;
}

std::string RunsText(const std::vector<RowRun>& runs) {
  std::string out;
  for (const RowRun& r : runs) {
    out += "{" + std::to_string(r.src) + "," + std::to_string(r.dst) + "," + std::to_string(r.count) + "}";
  }
  return out;
}

#define EXPECT_RUNS(got, ...)                                                            \
  do {                                                                                   \
    const std::vector<RowRun> _want = __VA_ARGS__;                                       \
    if (!SameRuns((got), _want))                                                         \
      ::mltuner::testing::ReportFailure(__FILE__, __LINE__,                              \
                                        std::string(#got " = ") + RunsText(got) +        \
                                            " want " + RunsText(_want));                 \
  } while (0)

// Scatter runs are the gather runs with source and destination swapped.
void ExpectMirrored(const AccessIndex& a) {
  for (const auto& pair : {std::make_pair(&a.device_gather, &a.device_scatter),
                           std::make_pair(&a.host_gather, &a.host_scatter)}) {
    const RunIndex& gather = *pair.first;
    const RunIndex& scatter = *pair.second;
    EXPECT_EQ(gather.total_rows, scatter.total_rows);
    ASSERT_EQ(gather.runs.size(), scatter.runs.size());
    int64_t total = 0;
    for (size_t i = 0; i < gather.runs.size(); ++i) {
      EXPECT_EQ(gather.runs[i].src, scatter.runs[i].dst);
      EXPECT_EQ(gather.runs[i].dst, scatter.runs[i].src);
      EXPECT_EQ(gather.runs[i].count, scatter.runs[i].count);
      total += gather.runs[i].count;
    }
    EXPECT_EQ(total, gather.total_rows);
  }
}

// A placement that puts layout positions in `device_positions` on the
// device and the rest on the host, slots dense in position order.
TablePlacement HandPlacement(int64_t num_rows, const std::set<int64_t>& device_positions) {
  TablePlacement t;
  for (int64_t p = 0; p < num_rows; ++p) {
    t.Append(1, device_positions.count(p) ? Residence::kDevice : Residence::kHost);
  }
  return t;
}

struct Built {
  std::vector<TableInfo> tables;
  Recording recording;
  std::vector<RowLayout> layouts;
  Placement placement;
  IterationIndex index;
};

Status Finish(Recorder* rec, const std::vector<TableInfo>& tables, int shards, Built* out) {
  out->tables = tables;
  MLT_RETURN_IF_ERROR(rec->Finish(&out->recording));
  out->layouts = BuildRowLayouts(tables, out->recording);
  MLT_RETURN_IF_ERROR(PlanPlacement(Config(), tables, out->layouts, out->recording, &out->placement));
  out->index = BuildIndexes(tables, out->layouts, out->placement, out->recording, shards);
  return Status::Ok();
}

// Every segment describes rows [begin, begin+count) stored at consecutive
// slots of one residence, and spans exactly their layout positions.
void ExpectSegmentsConsistent(const std::vector<WireSegment>& segments, const RowLayout& layout,
                              const TablePlacement& placement) {
  for (const WireSegment& s : segments) {
    EXPECT_TRUE(s.count > 0);
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t k = 0; k < s.count; ++k) {
      const int64_t position = layout.PositionOf(s.begin + k);
      EXPECT_TRUE(placement.ResidenceOf(position) == s.residence);
      EXPECT_EQ(placement.SlotOf(position), s.slot + k);
      lo = std::min(lo, position);
      hi = std::max(hi, position);
    }
    EXPECT_EQ(s.first_position, lo);
    EXPECT_EQ(s.last_position, hi);
  }
}

std::vector<RowId> RowsOf(const std::vector<WireSegment>& segments) {
  std::vector<RowId> rows;
  for (const WireSegment& s : segments) {
    for (int64_t k = 0; k < s.count; ++k) rows.push_back(s.begin + k);
  }
  return rows;
}

}  // namespace

TEST(ReadInFirstUseOrderIsOneRun) {
  const std::vector<TableInfo> tables = {Table(0, 12, 8)};
  Recorder rec;
  Handle a, b, c;
  ASSERT_OK(rec.Read(tables[0], {5, 2, 7, 11}, 0, &a));   // positions 0..3
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.PreUpdate(tables[0], {2, 7, 5}, &b));     // positions 1, 2, 0
  ASSERT_OK(rec.Update(b));
  ASSERT_OK(rec.Read(tables[0], {7, 11}, 0, &c));         // positions 2, 3
  ASSERT_OK(rec.PostRead(c));
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  ASSERT_EQ(built.index.accesses.size(), size_t{3});
  const AccessIndex& ra = built.index.accesses[a];
  EXPECT_RUNS(ra.device_gather.runs, {{0, 0, 4}});
  EXPECT_EQ(ra.device_gather.total_rows, int64_t{4});
  EXPECT_RUNS(ra.device_scatter.runs, {{0, 0, 4}});
  EXPECT_TRUE(ra.host_gather.runs.empty());
  EXPECT_EQ(ra.host_gather.total_rows, int64_t{0});
  EXPECT_EQ(ra.buffer_bytes, int64_t{256});  // 4 x 32 B, aligned
  EXPECT_EQ(ra.lock_begin, int64_t{0});
  EXPECT_EQ(ra.lock_count, int64_t{4});
  const AccessIndex& rb = built.index.accesses[b];
  EXPECT_RUNS(rb.device_gather.runs, {{1, 0, 2}, {0, 2, 1}});
  EXPECT_RUNS(rb.device_scatter.runs, {{0, 1, 2}, {2, 0, 1}});
  EXPECT_EQ(rb.lock_begin, int64_t{0});
  EXPECT_EQ(rb.lock_count, int64_t{3});
  const AccessIndex& rc = built.index.accesses[c];
  EXPECT_RUNS(rc.device_gather.runs, {{2, 0, 2}});
  EXPECT_EQ(rc.lock_begin, int64_t{2});
  EXPECT_EQ(rc.lock_count, int64_t{2});
  for (const AccessIndex& access : built.index.accesses) ExpectMirrored(access);
}

TEST(RunsSplitByResidence) {
  const std::vector<TableInfo> tables = {Table(0, 10, 4)};
  Recorder rec;
  Handle a, b;
  ASSERT_OK(rec.Read(tables[0], {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, 0, &a));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.PreUpdate(tables[0], {9, 1, 2, 6, 3}, &b));
  ASSERT_OK(rec.Update(b));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  // Positions (= row ids here) 0..4 on the device, 5..9 on the host.
  Placement placement;
  placement.tables = {HandPlacement(10, {0, 1, 2, 3, 4})};
  const IterationIndex index = BuildIndexes(tables, layouts, placement, recording, 1);
  const AccessIndex& ra = index.accesses[a];
  EXPECT_RUNS(ra.device_gather.runs, {{0, 0, 5}});
  EXPECT_RUNS(ra.host_gather.runs, {{0, 5, 5}});
  EXPECT_RUNS(ra.device_scatter.runs, {{0, 0, 5}});
  EXPECT_RUNS(ra.host_scatter.runs, {{5, 0, 5}});
  EXPECT_EQ(ra.device_gather.total_rows + ra.host_gather.total_rows, int64_t{10});
  // Buffer rows: 9(h4) 1(d1) 2(d2) 6(h1) 3(d3).
  const AccessIndex& rb = index.accesses[b];
  EXPECT_RUNS(rb.device_gather.runs, {{1, 1, 2}, {3, 4, 1}});
  EXPECT_RUNS(rb.host_gather.runs, {{4, 0, 1}, {1, 3, 1}});
  EXPECT_EQ(rb.device_gather.total_rows, int64_t{3});
  EXPECT_EQ(rb.host_gather.total_rows, int64_t{2});
  EXPECT_EQ(rb.lock_begin, int64_t{1});
  EXPECT_EQ(rb.lock_count, int64_t{9});
  ExpectMirrored(ra);
  ExpectMirrored(rb);
}

TEST(AlternatingResidenceGivesOneRunPerRow) {
  const std::vector<TableInfo> tables = {Table(0, 6, 2)};
  Recorder rec;
  Handle a;
  ASSERT_OK(rec.Read(tables[0], {0, 1, 2, 3, 4, 5}, 0, &a));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  Placement placement;
  placement.tables = {HandPlacement(6, {0, 2, 4})};
  const IterationIndex index = BuildIndexes(tables, layouts, placement, recording, 2);
  const AccessIndex& ra = index.accesses[a];
  EXPECT_RUNS(ra.device_gather.runs, {{0, 0, 1}, {1, 2, 1}, {2, 4, 1}});
  EXPECT_RUNS(ra.host_gather.runs, {{0, 1, 1}, {1, 3, 1}, {2, 5, 1}});
  ExpectMirrored(ra);
  // Wire segments cannot merge across residences either.
  const TableIndex& t = index.tables[0];
  ASSERT_EQ(t.receive.size(), size_t{2});
  EXPECT_EQ(t.receive[0].size(), size_t{3});
  EXPECT_EQ(t.receive[1].size(), size_t{3});
  for (const auto& shard : t.receive) ExpectSegmentsConsistent(shard, layouts[0], placement.tables[0]);
}

TEST(ClosesTableClockOnlyOnLastUpdateOfEachTable) {
  const std::vector<TableInfo> tables = {Table(0, 8), Table(1, 8), Table(2, 8)};
  Recorder rec;
  Handle ua, ub, uc, r, ud;
  ASSERT_OK(rec.PreUpdate(tables[0], {0, 1}, &ua));
  ASSERT_OK(rec.PreUpdate(tables[1], {2}, &ub));
  ASSERT_OK(rec.PreUpdate(tables[0], {5}, &uc));
  ASSERT_OK(rec.Read(tables[2], {3}, 0, &r));
  ASSERT_OK(rec.Update(uc));   // t0, not last
  ASSERT_OK(rec.Update(ub));   // t1, only update: closes
  ASSERT_OK(rec.PostRead(r));  // t2 is read only: nothing closes it
  ASSERT_OK(rec.Update(ua));   // t0, last in op order: closes (opened first)
  ASSERT_OK(rec.PreUpdate(tables[1], {3}, &ud));
  ASSERT_OK(rec.Update(ud));   // t1, now the last: closes instead of ub
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 2, &built));
  const auto& acc = built.index.accesses;
  EXPECT_TRUE(acc[ua].closes_table_clock);
  EXPECT_TRUE(!acc[uc].closes_table_clock);
  EXPECT_TRUE(!acc[ub].closes_table_clock);
  EXPECT_TRUE(acc[ud].closes_table_clock);
  EXPECT_TRUE(!acc[r].closes_table_clock);
  EXPECT_TRUE(built.index.tables[0].has_updates);
  EXPECT_TRUE(built.index.tables[1].has_updates);
  EXPECT_TRUE(!built.index.tables[2].has_updates);
}

TEST(FetchAfterEarlierKeepInSameClock) {
  const std::vector<TableInfo> tables = {Table(0, 6, 4, true)};
  Recorder rec;
  Handle w, f;
  ASSERT_OK(rec.LocalAccess(tables[0], {0, 1}, false, &w));  // op 0
  ASSERT_OK(rec.PostLocalAccess(w, true));                   // op 1: keeps rows 0,1
  ASSERT_OK(rec.LocalAccess(tables[0], {1, 2}, true, &f));   // op 2: fetches row 1
  ASSERT_OK(rec.PostLocalAccess(f, false));                  // op 3
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  EXPECT_EQ(built.index.accesses[f].fetch_after_op, 1);
  EXPECT_TRUE(!built.index.accesses[f].fetch_after_previous_clock);
  EXPECT_EQ(built.index.accesses[w].fetch_after_op, -1);  // not a fetch
}

TEST(FetchWhoseWriterIsLaterDependsOnPreviousClock) {
  const std::vector<TableInfo> tables = {Table(0, 6, 4, true)};
  Recorder rec;
  Handle f, w;
  ASSERT_OK(rec.LocalAccess(tables[0], {3}, true, &f));      // op 0
  ASSERT_OK(rec.PostLocalAccess(f, false));                  // op 1
  ASSERT_OK(rec.LocalAccess(tables[0], {2, 3}, false, &w));  // op 2
  ASSERT_OK(rec.PostLocalAccess(w, true));                   // op 3: keeps row 3
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  EXPECT_EQ(built.index.accesses[f].fetch_after_op, 3);
  EXPECT_TRUE(built.index.accesses[f].fetch_after_previous_clock);
}

TEST(FetchPicksLatestEarlierKeep) {
  const std::vector<TableInfo> tables = {Table(0, 6, 4, true)};
  Recorder rec;
  Handle w1, w2, w3, f;
  ASSERT_OK(rec.LocalAccess(tables[0], {0}, false, &w1));  // op 0
  ASSERT_OK(rec.PostLocalAccess(w1, true));                // op 1
  ASSERT_OK(rec.LocalAccess(tables[0], {0, 4}, false, &w2));  // op 2
  ASSERT_OK(rec.PostLocalAccess(w2, true));                // op 3  <- latest overlapping
  ASSERT_OK(rec.LocalAccess(tables[0], {0}, false, &w3));  // op 4
  ASSERT_OK(rec.PostLocalAccess(w3, false));               // op 5: no keep, no write
  ASSERT_OK(rec.LocalAccess(tables[0], {5}, false, &w3));  // op 6
  ASSERT_OK(rec.PostLocalAccess(w3, true));                // op 7: keep, other rows
  ASSERT_OK(rec.LocalAccess(tables[0], {4, 0}, true, &f));  // op 8
  ASSERT_OK(rec.PostLocalAccess(f, false));
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  EXPECT_EQ(built.index.accesses[f].fetch_after_op, 3);
  EXPECT_TRUE(!built.index.accesses[f].fetch_after_previous_clock);
}

TEST(FetchOfOwnKeptRowsDependsOnPreviousClock) {
  const std::vector<TableInfo> tables = {Table(0, 6, 4, true)};
  Recorder rec;
  Handle a;
  ASSERT_OK(rec.LocalAccess(tables[0], {1, 2}, true, &a));  // op 0
  ASSERT_OK(rec.PostLocalAccess(a, true));                  // op 1
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  EXPECT_EQ(built.index.accesses[a].fetch_after_op, 1);
  EXPECT_TRUE(built.index.accesses[a].fetch_after_previous_clock);
}

TEST(FetchWithoutOverlappingKeepHasNoDependency) {
  // Same row ids in another local table, or kept rows that do not overlap,
  // or an overlapping access that is not kept: no dependency.
  const std::vector<TableInfo> tables = {Table(0, 6, 4, true), Table(1, 6, 4, true)};
  Recorder rec;
  Handle a, b, c, f;
  ASSERT_OK(rec.LocalAccess(tables[1], {0, 1}, false, &a));
  ASSERT_OK(rec.PostLocalAccess(a, true));
  ASSERT_OK(rec.LocalAccess(tables[0], {2}, false, &b));
  ASSERT_OK(rec.PostLocalAccess(b, true));
  ASSERT_OK(rec.LocalAccess(tables[0], {0, 1}, false, &c));
  ASSERT_OK(rec.PostLocalAccess(c, false));
  ASSERT_OK(rec.LocalAccess(tables[0], {0, 1}, true, &f));
  ASSERT_OK(rec.PostLocalAccess(f, false));
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, 1, &built));
  EXPECT_EQ(built.index.accesses[f].fetch_after_op, -1);
  EXPECT_TRUE(!built.index.accesses[f].fetch_after_previous_clock);
}

TEST(SendSegmentsCoverUpdatedRowsPerShard) {
  // 10 rows over 3 shards: [0,4), [4,7), [7,10).
  const int kShards = 3;
  const std::vector<TableInfo> tables = {Table(0, 10, 3), Table(1, 5, 2), Table(2, 4, 2, true)};
  Recorder rec;
  Handle r, u1, u2, r1, l;
  ASSERT_OK(rec.Read(tables[0], {9, 0, 1, 2, 3, 4, 5, 6, 7, 8}, 0, &r));
  ASSERT_OK(rec.PostRead(r));
  ASSERT_OK(rec.PreUpdate(tables[0], {8, 2, 3}, &u1));
  ASSERT_OK(rec.Update(u1));
  ASSERT_OK(rec.PreUpdate(tables[0], {5, 1, 9}, &u2));
  ASSERT_OK(rec.Update(u2));
  ASSERT_OK(rec.Read(tables[1], {4, 0}, 0, &r1));  // t1 is read only
  ASSERT_OK(rec.PostRead(r1));
  ASSERT_OK(rec.LocalAccess(tables[2], {0}, true, &l));
  ASSERT_OK(rec.PostLocalAccess(l, true));
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, kShards, &built));

  const std::set<RowId> updated = {1, 2, 3, 5, 8, 9};
  const TableIndex& t0 = built.index.tables[0];
  EXPECT_TRUE(t0.has_updates);
  ASSERT_EQ(t0.send.size(), size_t{kShards});
  ASSERT_EQ(t0.receive.size(), size_t{kShards});
  for (int shard = 0; shard < kShards; ++shard) {
    const RowSpan range = ShardRange(10, shard, kShards);
    std::vector<RowId> want_send, want_receive;
    for (RowId row = range.begin; row < range.begin + range.count; ++row) {
      want_receive.push_back(row);
      if (updated.count(row)) want_send.push_back(row);
    }
    EXPECT_TRUE(RowsOf(t0.send[shard]) == want_send);
    EXPECT_TRUE(RowsOf(t0.receive[shard]) == want_receive);
    ExpectSegmentsConsistent(t0.send[shard], built.layouts[0], built.placement.tables[0]);
    ExpectSegmentsConsistent(t0.receive[shard], built.layouts[0], built.placement.tables[0]);
  }
  // Layout is 9,0,1,...,8 so rows 0..8 sit at consecutive slots 1..9: shard 0
  // sends {1,2,3} as one segment, shard 2 sends {8} and {9} apart (row 9 is
  // at slot 0).
  ASSERT_EQ(t0.send[0].size(), size_t{1});
  EXPECT_EQ(t0.send[0][0].begin, RowId{1});
  EXPECT_EQ(t0.send[0][0].count, int64_t{3});
  EXPECT_EQ(t0.send[0][0].slot, int64_t{2});
  ASSERT_EQ(t0.send[2].size(), size_t{2});
  EXPECT_EQ(t0.receive[0].size(), size_t{1});
  EXPECT_EQ(t0.receive[1].size(), size_t{1});
  EXPECT_EQ(t0.receive[2].size(), size_t{2});

  // A read-only table sends nothing but still receives all of its rows.
  const TableIndex& t1 = built.index.tables[1];
  EXPECT_TRUE(!t1.has_updates);
  ASSERT_EQ(t1.send.size(), size_t{kShards});
  for (int shard = 0; shard < kShards; ++shard) {
    EXPECT_TRUE(t1.send[shard].empty());
    const RowSpan range = ShardRange(5, shard, kShards);
    std::vector<RowId> want;
    for (RowId row = range.begin; row < range.begin + range.count; ++row) want.push_back(row);
    EXPECT_TRUE(RowsOf(t1.receive[shard]) == want);
    ExpectSegmentsConsistent(t1.receive[shard], built.layouts[1], built.placement.tables[1]);
  }
  // Local data is never communicated.
  EXPECT_TRUE(built.index.tables[2].send.empty());
  EXPECT_TRUE(built.index.tables[2].receive.empty());
}

TEST(SegmentsWithMoreShardsThanRows) {
  // 2 rows over 4 shards: shards 2 and 3 own nothing.
  const int kShards = 4;
  const std::vector<TableInfo> tables = {Table(0, 2, 5)};
  Recorder rec;
  Handle u;
  ASSERT_OK(rec.PreUpdate(tables[0], {1, 0}, &u));
  ASSERT_OK(rec.Update(u));
  ASSERT_OK(rec.Clock());
  Built built;
  ASSERT_OK(Finish(&rec, tables, kShards, &built));
  const TableIndex& t = built.index.tables[0];
  ASSERT_EQ(t.send.size(), size_t{kShards});
  EXPECT_TRUE((RowsOf(t.send[0]) == std::vector<RowId>{0}));
  EXPECT_TRUE((RowsOf(t.send[1]) == std::vector<RowId>{1}));
  EXPECT_TRUE(t.send[2].empty() && t.send[3].empty());
  EXPECT_TRUE(t.receive[2].empty() && t.receive[3].empty());
  EXPECT_TRUE(built.index.accesses[u].closes_table_clock);
}

TEST(MixedResidenceSegmentsFromPlanner) {
  // A budget that leaves part of a table on the host: every segment stays in
  // one residence with consecutive slots, and together they cover the shard.
  const int kShards = 2;
  const std::vector<TableInfo> tables = {Table(0, 64, 16)};
  Recorder rec;
  Handle a, b, u;
  std::vector<RowId> first, second;
  for (RowId r = 0; r < 64; r += 2) first.push_back(r);
  for (RowId r = 1; r < 64; r += 2) second.push_back(r);
  ASSERT_OK(rec.Read(tables[0], first, 0, &a));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Read(tables[0], second, 0, &b));
  ASSERT_OK(rec.PostRead(b));
  ASSERT_OK(rec.PreUpdate(tables[0], second, &u));
  ASSERT_OK(rec.Update(u));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  // The deepest pool (what no budget gets; lookahead claims the budget
  // first) + one layer's rows (no update log: one update a clock): the
  // second (both save as many bytes per clock, and the second is read again
  // sooner: plan/placement_value.h).
  Config config;
  Placement unlimited;
  ASSERT_OK(PlanPlacement(config, tables, layouts, recording, &unlimited));
  config.device_memory_budget = unlimited.pool_bytes + 32 * 64;
  Placement placement;
  ASSERT_OK(PlanPlacement(config, tables, layouts, recording, &placement));
  ASSERT_EQ(placement.tables[0].device_rows, int64_t{32});
  const IterationIndex index = BuildIndexes(tables, layouts, placement, recording, kShards);
  EXPECT_RUNS(index.accesses[b].device_gather.runs, {{0, 0, 32}});
  EXPECT_TRUE(index.accesses[b].host_gather.runs.empty());
  EXPECT_RUNS(index.accesses[a].host_gather.runs, {{0, 0, 32}});
  EXPECT_TRUE(index.accesses[a].device_gather.runs.empty());
  const TableIndex& t = index.tables[0];
  for (int shard = 0; shard < kShards; ++shard) {
    const RowSpan range = ShardRange(64, shard, kShards);
    std::vector<RowId> all, odd;
    for (RowId row = range.begin; row < range.begin + range.count; ++row) {
      all.push_back(row);
      if (row % 2) odd.push_back(row);
    }
    EXPECT_TRUE(RowsOf(t.receive[shard]) == all);
    EXPECT_TRUE(RowsOf(t.send[shard]) == odd);
    // Even and odd rows alternate residence: one segment per row.
    EXPECT_EQ(t.receive[shard].size(), all.size());
    ExpectSegmentsConsistent(t.receive[shard], layouts[0], placement.tables[0]);
    ExpectSegmentsConsistent(t.send[shard], layouts[0], placement.tables[0]);
  }
}

MLT_TEST_MAIN
