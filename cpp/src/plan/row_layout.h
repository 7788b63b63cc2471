// RowLayout: the order in which a table's rows are stored in the cache.
//
// Rows are laid out in first-use order over the recorded op list, so the rows
// of one access (one layer) are contiguous and a gather is one block copy.
// Rows the op list never touches follow, in row-id order.
#pragma once

#include <vector>

#include "mltuner/types.h"
#include "record/recorder.h"

namespace mltuner {

struct RowLayout {
  std::vector<int64_t> position_of_row;  // row id -> layout position
  std::vector<RowId> row_at_position;    // layout position -> row id
};

// One layout per table, indexed by table id.
std::vector<RowLayout> BuildRowLayouts(const std::vector<TableInfo>& tables,
                                       const Recording& recording);

}  // namespace mltuner
