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

// Checks that the layout is a permutation of 0..n-1 and that PositionOf and
// RowsInOrder are inverse maps.
void ExpectPermutation(const RowLayout& layout, int64_t n) {
  ASSERT_EQ(layout.num_rows(), n);
  const std::vector<RowId> order = layout.RowsInOrder();
  ASSERT_EQ(static_cast<int64_t>(order.size()), n);
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int64_t p = 0; p < n; ++p) {
    const RowId row = order[p];
    ASSERT_TRUE(row >= 0 && row < n);
    EXPECT_TRUE(!seen[row]);
    seen[row] = true;
    EXPECT_EQ(layout.PositionOf(row), p);
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
  EXPECT_TRUE(layouts[0].RowsInOrder() == want);
  EXPECT_EQ(layouts[0].PositionOf(7), 0);
  EXPECT_EQ(layouts[0].PositionOf(3), 1);
  EXPECT_EQ(layouts[0].PositionOf(8), 9);
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
  EXPECT_TRUE((layouts[0].RowsInOrder() == std::vector<RowId>{4, 5, 1, 0, 2, 3}));
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
  EXPECT_TRUE((layouts[0].RowsInOrder() == std::vector<RowId>{2, 0, 1, 3}));
  EXPECT_TRUE((layouts[1].RowsInOrder() == std::vector<RowId>{0, 1, 2, 3, 4}));
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
  EXPECT_TRUE((layouts[0].RowsInOrder() == std::vector<RowId>{1, 3, 0, 2, 4}));
  EXPECT_TRUE((layouts[1].RowsInOrder() == std::vector<RowId>{4, 2, 0, 1, 3}));
  EXPECT_TRUE((layouts[2].RowsInOrder() == std::vector<RowId>{3, 1, 0, 2}));
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
  EXPECT_TRUE((layouts[0].RowsInOrder() == std::vector<RowId>{0, 1, 2}));
  EXPECT_TRUE((layouts[1].RowsInOrder() == std::vector<RowId>{0}));
  ExpectPermutation(layouts[0], 3);
}

// A whole table read in order, then a tensor's rows: a few runs, not a
// position per row; the same order as a layout of many scattered rows,
// which keeps one position per row.
TEST(RunsOfRowsCostOneEntryEachScatteredRowsGoDense) {
  const int64_t n = 100000;
  const std::vector<TableInfo> tables = {Table(0, n), Table(1, n)};
  Recorder rec;
  Handle a = -1, b = -1, c = -1;
  std::vector<RowId> block;
  for (RowId row = 5000; row < 9000; ++row) block.push_back(row);
  ASSERT_OK(rec.Read(tables[0], block, 0, &a));
  ASSERT_OK(rec.PostRead(a));
  std::vector<RowId> all(static_cast<size_t>(n));
  for (RowId row = 0; row < n; ++row) all[row] = row;
  ASSERT_OK(rec.PreUpdate(tables[0], all, &b));
  ASSERT_OK(rec.Update(b));
  std::vector<RowId> odd;  // every odd row, then the even ones follow as untouched rows
  for (RowId row = 1; row < n; row += 2) odd.push_back(row);
  ASSERT_OK(rec.Read(tables[1], odd, 0, &c));
  ASSERT_OK(rec.PostRead(c));
  ASSERT_OK(rec.Clock());
  Recording recording;
  ASSERT_OK(rec.Finish(&recording));
  const std::vector<RowLayout> layouts = BuildRowLayouts(tables, recording);
  EXPECT_TRUE(!layouts[0].dense());
  EXPECT_TRUE(layouts[1].dense());
  ExpectPermutation(layouts[0], n);
  ExpectPermutation(layouts[1], n);
  EXPECT_EQ(layouts[0].PositionOf(5000), 0);
  EXPECT_EQ(layouts[0].PositionOf(8999), 3999);
  EXPECT_EQ(layouts[0].PositionOf(0), 4000);
  EXPECT_EQ(layouts[0].PositionOf(9000), 9000);
  EXPECT_EQ(layouts[1].PositionOf(1), 0);
  EXPECT_EQ(layouts[1].PositionOf(0), n / 2);
  EXPECT_EQ(layouts[1].PositionOf(n - 2), n - 1);
}

MLT_TEST_MAIN
