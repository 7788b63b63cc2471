// RowLayout: the order in which a table's rows are stored in the cache.
//
// Rows are laid out in first-use order over the recorded op list, so the rows
// of one access (one layer) are contiguous and a gather is one block copy.
// Rows the op list never touches follow, in row-id order.
//
// Memory: rows placed in runs (consecutive ids at consecutive positions: a
// tensor's rows, a whole table) cost one entry per run, so the plan of a
// table of millions of rows holds a few entries instead of 8 bytes per row.
// A layout with more runs than a third of its rows keeps one position per
// row instead (8 bytes a row, less than 24 a run).
#pragma once

#include <vector>

#include "mltuner/types.h"
#include "record/recorder.h"

namespace mltuner {

class RowLayout {
 public:
  // The layout position of `row`. REQUIRES: 0 <= row < num_rows().
  int64_t PositionOf(RowId row) const;
  int64_t num_rows() const { return num_rows_; }
  // The rows in layout order (one entry per row: for tests and checks).
  std::vector<RowId> RowsInOrder() const;
  // Whether the layout keeps one position per row (its runs were too many).
  bool dense() const { return !position_of_row_.empty(); }

 private:
  friend class RowLayoutBuilder;
  struct Run {
    RowId first_row = 0;
    int64_t first_position = 0;
    int64_t count = 0;
  };
  int64_t num_rows_ = 0;
  std::vector<Run> runs_;                // sorted by first_row; empty when dense
  std::vector<int64_t> position_of_row_;  // row id -> position; only when dense
};

// One layout per table, indexed by table id.
std::vector<RowLayout> BuildRowLayouts(const std::vector<TableInfo>& tables,
                                       const Recording& recording);

}  // namespace mltuner
