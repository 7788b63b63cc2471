// Sharding: the contiguous split of a table's rows over shards, and the
// grouping of a caller's row ids by owning shard.
#include "sharding/shard_range.h"

#include <algorithm>
#include <vector>

#include "mltuner/config.h"
#include "test_util.h"

using namespace mltuner;

TEST(ShardRangeSplitsContiguouslyFirstShardsLarger) {
  EXPECT_EQ(ShardRange(7, 0, 3).begin, 0);
  EXPECT_EQ(ShardRange(7, 0, 3).count, 3);
  EXPECT_EQ(ShardRange(7, 1, 3).begin, 3);
  EXPECT_EQ(ShardRange(7, 1, 3).count, 2);
  EXPECT_EQ(ShardRange(7, 2, 3).begin, 5);
  EXPECT_EQ(ShardRange(7, 2, 3).count, 2);
  EXPECT_EQ(ShardRange(2, 2, 3).count, 0);  // fewer rows than shards
  for (int64_t rows = 1; rows < 40; ++rows) {
    for (int shards = 1; shards < 9; ++shards) {
      int64_t next = 0;
      for (int s = 0; s < shards; ++s) {
        const RowSpan range = ShardRange(rows, s, shards);
        EXPECT_EQ(range.begin, next);
        EXPECT_TRUE(range.count == rows / shards || range.count == rows / shards + 1);
        next = range.begin + range.count;
      }
      EXPECT_EQ(next, rows);
    }
  }
}

TEST(ShardRowsGroupsIdsIntoAscendingSpansAndKeepsPositions) {
  TableInfo table;
  table.num_rows = 7;  // shards of 3 own [0,3), [3,5), [5,7)
  table.row_width = 1;
  const ShardedRows sharded = ShardRows(table, {6, 0, 1, 4, 2, 5}, 3);
  ASSERT_EQ(sharded.spans.size(), 3u);
  ASSERT_EQ(sharded.spans[0].size(), 1u);
  EXPECT_EQ(sharded.spans[0][0].begin, 0);
  EXPECT_EQ(sharded.spans[0][0].count, 3);
  EXPECT_TRUE(sharded.order[0] == (std::vector<int64_t>{1, 2, 4}));
  ASSERT_EQ(sharded.spans[1].size(), 1u);
  EXPECT_EQ(sharded.spans[1][0].begin, 4);
  EXPECT_EQ(sharded.spans[1][0].count, 1);
  EXPECT_TRUE(sharded.order[1] == (std::vector<int64_t>{3}));
  ASSERT_EQ(sharded.spans[2].size(), 1u);
  EXPECT_EQ(sharded.spans[2][0].begin, 5);
  EXPECT_EQ(sharded.spans[2][0].count, 2);
  EXPECT_TRUE(sharded.order[2] == (std::vector<int64_t>{5, 0}));
}

MLT_TEST_MAIN

TEST(ShardPartsSplitALargeShardEvenlyAndCoverItInOrder) {
  TableInfo table;
  table.num_rows = 1000;
  table.row_width = 256;  // 1 KiB rows: shards of 2 own 500 KiB each
  EXPECT_EQ(ShardParts(table, 1, 2).size(), size_t{1});  // not split: part_bytes 0
  EXPECT_EQ(ShardParts(table, 1, 2)[0].begin, 500);
  table.part_bytes = 1 << 20;  // larger than a shard's rows: whole
  EXPECT_EQ(ShardParts(table, 0, 2).size(), size_t{1});
  for (int64_t part_bytes : {int64_t{100} << 10, int64_t{64} << 10, int64_t{1000}, int64_t{1}}) {
    table.part_bytes = part_bytes;
    for (int shard = 0; shard < 2; ++shard) {
      const RowSpan range = ShardRange(table.num_rows, shard, 2);
      const std::vector<RowSpan> parts = ShardParts(table, shard, 2);
      EXPECT_TRUE(static_cast<int>(parts.size()) <= kMaxClockParts);
      int64_t next = range.begin;
      int64_t smallest = range.count, largest = 0;
      for (const RowSpan& part : parts) {
        EXPECT_EQ(part.begin, next);
        next = part.begin + part.count;
        smallest = std::min(smallest, part.count);
        largest = std::max(largest, part.count);
      }
      EXPECT_EQ(next, range.begin + range.count);
      EXPECT_TRUE(largest - smallest <= 1);  // even: no small tail part
      // At most about part_bytes each, unless the cap on parts says otherwise.
      if (static_cast<int>(parts.size()) < kMaxClockParts) {
        EXPECT_TRUE(largest * table.row_bytes() <= std::max<int64_t>(part_bytes, table.row_bytes()));
      }
    }
  }
  table.part_bytes = 100 << 10;  // 500 rows in parts of at most 100 rows: 5
  EXPECT_EQ(ShardParts(table, 0, 2).size(), size_t{5});
  table.part_bytes = 1;  // a part a row would be 500: capped
  EXPECT_EQ(static_cast<int>(ShardParts(table, 0, 2).size()), kMaxClockParts);
  table.num_rows = 1;  // shard 1 of 2 owns no row: one empty part
  EXPECT_EQ(ShardParts(table, 1, 2).size(), size_t{1});
  EXPECT_EQ(ShardParts(table, 1, 2)[0].count, 0);
}
