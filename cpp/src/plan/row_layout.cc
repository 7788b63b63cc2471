#include "plan/row_layout.h"

namespace mltuner {

std::vector<RowLayout> BuildRowLayouts(const std::vector<TableInfo>& tables,
                                       const Recording& recording) {
  std::vector<RowLayout> layouts(tables.size());
  for (const TableInfo& table : tables) {
    RowLayout& layout = layouts[table.id];
    layout.position_of_row.assign(table.num_rows, -1);
    layout.row_at_position.reserve(table.num_rows);
  }
  auto place = [&](TableId table, RowId row) {
    RowLayout& layout = layouts[table];
    if (layout.position_of_row[row] >= 0) return;
    layout.position_of_row[row] = static_cast<int64_t>(layout.row_at_position.size());
    layout.row_at_position.push_back(row);
  };
  for (const RecordedOp& op : recording.ops) {
    if (op.kind != OpKind::kRead && op.kind != OpKind::kPreUpdate &&
        op.kind != OpKind::kLocalAccess) {
      continue;
    }
    const AccessRecord& access = recording.accesses[op.handle];
    for (RowId row : access.rows) place(access.table, row);
  }
  for (const TableInfo& table : tables) {
    for (RowId row = 0; row < table.num_rows; ++row) place(table.id, row);
  }
  return layouts;
}

}  // namespace mltuner
