#include "plan/row_layout.h"

#include <algorithm>

namespace mltuner {

// Places rows one at a time at the next position. A bit per row says which
// rows are placed; positions are kept as runs until they are too many.
class RowLayoutBuilder {
 public:
  explicit RowLayoutBuilder(int64_t num_rows) : placed_(static_cast<size_t>(num_rows), false) {
    layout_.num_rows_ = num_rows;
  }

  void Place(RowId row) {
    if (placed_[row]) return;
    placed_[row] = true;
    const int64_t position = next_++;
    if (layout_.dense()) {
      layout_.position_of_row_[row] = position;
      return;
    }
    std::vector<RowLayout::Run>& runs = layout_.runs_;
    if (!runs.empty() && runs.back().first_row + runs.back().count == row) {
      ++runs.back().count;
      return;
    }
    runs.push_back({row, position, 1});
    if (static_cast<int64_t>(runs.size()) > layout_.num_rows_ / 3 + 1) Densify();
  }

  // Rows not placed yet, in id order.
  void PlaceTheRest() {
    for (RowId row = 0; row < layout_.num_rows_; ++row) Place(row);
  }

  RowLayout Finish() {
    std::sort(layout_.runs_.begin(), layout_.runs_.end(),
              [](const RowLayout::Run& a, const RowLayout::Run& b) { return a.first_row < b.first_row; });
    return std::move(layout_);
  }

 private:
  void Densify() {
    layout_.position_of_row_.assign(static_cast<size_t>(layout_.num_rows_), -1);
    for (const RowLayout::Run& run : layout_.runs_) {
      for (int64_t k = 0; k < run.count; ++k) layout_.position_of_row_[run.first_row + k] = run.first_position + k;
    }
    layout_.runs_.clear();
    layout_.runs_.shrink_to_fit();
  }

  RowLayout layout_;
  std::vector<bool> placed_;
  int64_t next_ = 0;
};

int64_t RowLayout::PositionOf(RowId row) const {
  if (dense()) return position_of_row_[row];
  // The last run starting at or before `row`; the runs cover every row.
  auto after = std::upper_bound(runs_.begin(), runs_.end(), row,
                                [](RowId r, const Run& run) { return r < run.first_row; });
  const Run& run = *(after - 1);
  return run.first_position + (row - run.first_row);
}

std::vector<RowId> RowLayout::RowsInOrder() const {
  std::vector<RowId> rows(static_cast<size_t>(num_rows_), -1);
  for (RowId row = 0; row < num_rows_; ++row) rows[PositionOf(row)] = row;
  return rows;
}

std::vector<RowLayout> BuildRowLayouts(const std::vector<TableInfo>& tables,
                                       const Recording& recording) {
  std::vector<RowLayoutBuilder> builders;
  builders.reserve(tables.size());
  for (const TableInfo& table : tables) builders.emplace_back(table.num_rows);
  for (const RecordedOp& op : recording.ops) {
    if (op.kind != OpKind::kRead && op.kind != OpKind::kPreUpdate &&
        op.kind != OpKind::kLocalAccess) {
      continue;
    }
    const AccessRecord& access = recording.accesses[op.handle];
    RowLayoutBuilder& builder = builders[access.table];
    for (RowId row : access.rows) builder.Place(row);
  }
  std::vector<RowLayout> layouts;
  layouts.reserve(tables.size());
  for (RowLayoutBuilder& builder : builders) {
    builder.PlaceTheRest();
    layouts.push_back(builder.Finish());
  }
  return layouts;
}

}  // namespace mltuner
