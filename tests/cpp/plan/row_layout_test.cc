// RowLayout: rows in first-use order over the op list, untouched rows after
// them in id order, each table laid out on its own.
#include "plan/row_layout.h"

#include <vector>

#include "record/recorder.h"
#include "test_util.h"

using namespace mltuner;

namespace {

TableInfo Table(TableId id, int64_t rows, bool local = false) {
  TableInfo info;
  info.id = id;
  info.name = "t" + std::to_string(id);
  info.num_rows = rows;
  info.row_width = 3;
  info.local = local;
  return info;
}

// Checks that the two maps of a layout are inverse permutations of 0..n-1.
void ExpectPermutation(const RowLayout& layout, int64_t n) {
  ASSERT_EQ(static_cast<int64_t>(layout.row_at_position.size()), n);
  ASSERT_EQ(static_cast<int64_t>(layout.position_of_row.size()), n);
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int64_t p = 0; p < n; ++p) {
    const RowId row = layout.row_at_position[p];
    ASSERT_TRUE(row >= 0 && row < n);
    EXPECT_TRUE(!seen[row]);
    seen[row] = true;
    EXPECT_EQ(layout.position_of_row[row], p);
  }
}

}  // namespace

TEST(FirstUseOrderOverOps) {
  const std::vector<TableInfo> tables = {Table(0, 10)};
  Recorder rec;
  Handle a = -1, b = -1, c = -1;
  // Ops in order: read {7,3}, pre_update {3,9,0} (3 already placed), read {5}.
  ASSERT_OK(rec.Read(tables[0], {7, 3}, 0, &a));
  ASSERT_OK(rec.PreUpdate(tables[0], {3, 9, 0}, &b));
  ASSERT_OK(rec.Update(b));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Read(tables[0], {5}, 0, &c));
  ASSERT_OK(rec.PostRead(c));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  ASSERT_EQ(layouts.size(), size_t{1});
  ExpectPermutation(layouts[0], 10);
  // Used rows first in first-use order, then untouched 1,2,4,6,8 in id order.
  const std::vector<RowId> want = {7, 3, 9, 0, 5, 1, 2, 4, 6, 8};
  EXPECT_TRUE(layouts[0].row_at_position == want);
  EXPECT_EQ(layouts[0].position_of_row[7], 0);
  EXPECT_EQ(layouts[0].position_of_row[3], 1);
  EXPECT_EQ(layouts[0].position_of_row[8], 9);
}

TEST(OpenOrderNotPostOrderDecides) {
  // The second read is opened before the first is posted: open order counts.
  const std::vector<TableInfo> tables = {Table(0, 6)};
  Recorder rec;
  Handle a = -1, b = -1;
  ASSERT_OK(rec.Read(tables[0], {4, 5}, 0, &a));
  ASSERT_OK(rec.Read(tables[0], {1, 0}, 0, &b));
  ASSERT_OK(rec.PostRead(b));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  ExpectPermutation(layouts[0], 6);
  EXPECT_TRUE((layouts[0].row_at_position == std::vector<RowId>{4, 5, 1, 0, 2, 3}));
}

TEST(UntouchedTableIsInIdOrder) {
  const std::vector<TableInfo> tables = {Table(0, 4), Table(1, 5)};
  Recorder rec;
  Handle a = -1;
  ASSERT_OK(rec.Read(tables[0], {2}, 0, &a));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  ASSERT_EQ(layouts.size(), size_t{2});
  EXPECT_TRUE((layouts[0].row_at_position == std::vector<RowId>{2, 0, 1, 3}));
  EXPECT_TRUE((layouts[1].row_at_position == std::vector<RowId>{0, 1, 2, 3, 4}));
  ExpectPermutation(layouts[1], 5);
}

TEST(TablesAreLaidOutIndependently) {
  const std::vector<TableInfo> tables = {Table(0, 5), Table(1, 5), Table(2, 4, /*local=*/true)};
  Recorder rec;
  Handle a = -1, b = -1, c = -1, d = -1, e = -1;
  // Interleaved accesses: each table's order depends only on its own ops.
  ASSERT_OK(rec.Read(tables[1], {4, 2}, 0, &a));
  ASSERT_OK(rec.Read(tables[0], {1}, 0, &b));
  ASSERT_OK(rec.LocalAccess(tables[2], {3, 1}, true, &c));
  ASSERT_OK(rec.PreUpdate(tables[0], {3, 1, 0}, &d));
  ASSERT_OK(rec.PreUpdate(tables[1], {0, 4}, &e));
  ASSERT_OK(rec.Update(e));
  ASSERT_OK(rec.Update(d));
  ASSERT_OK(rec.PostLocalAccess(c, true));
  ASSERT_OK(rec.PostRead(b));
  ASSERT_OK(rec.PostRead(a));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  ASSERT_EQ(layouts.size(), size_t{3});
  EXPECT_TRUE((layouts[0].row_at_position == std::vector<RowId>{1, 3, 0, 2, 4}));
  EXPECT_TRUE((layouts[1].row_at_position == std::vector<RowId>{4, 2, 0, 1, 3}));
  EXPECT_TRUE((layouts[2].row_at_position == std::vector<RowId>{3, 1, 0, 2}));
  ExpectPermutation(layouts[0], 5);
  ExpectPermutation(layouts[1], 5);
  ExpectPermutation(layouts[2], 4);
}

TEST(EmptyIterationGivesIdentityLayouts) {
  const std::vector<TableInfo> tables = {Table(0, 3), Table(1, 1)};
  Recorder rec;
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  EXPECT_TRUE((layouts[0].row_at_position == std::vector<RowId>{0, 1, 2}));
  EXPECT_TRUE((layouts[1].row_at_position == std::vector<RowId>{0}));
  ExpectPermutation(layouts[0], 3);
}

MLT_TEST_MAIN
