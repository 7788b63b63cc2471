// Sharding: the contiguous split of a table's rows over shards, and the
// grouping of a caller's row ids by owning shard.
#include "sharding/shard_range.h"

#include <vector>

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
