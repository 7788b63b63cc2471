#include "record/index_builder.h"

#include <algorithm>

#include "sharding/shard_range.h"

namespace mltuner {

namespace {

// Appends (src, dst) to runs, extending the last run when both continue it.
void AppendToRuns(RunIndex* index, int64_t src, int64_t dst) {
  ++index->total_rows;
  if (!index->runs.empty()) {
    RowRun& last = index->runs.back();
    if (last.src + last.count == src && last.dst + last.count == dst) {
      ++last.count;
      return;
    }
  }
  index->runs.push_back({src, dst, 1});
}

AccessIndex IndexAccess(const TableInfo& table, const RowLayout& layout,
                        const TablePlacement& placement, const AccessRecord& access) {
  AccessIndex index;
  index.buffer_bytes = AlignedBufferBytes(table, static_cast<int64_t>(access.rows.size()));
  int64_t lo = table.num_rows, hi = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(access.rows.size()); ++i) {
    const int64_t position = layout.PositionOf(access.rows[i]);
    const int64_t slot = placement.SlotOf(position);
    lo = std::min(lo, position);
    hi = std::max(hi, position);
    if (placement.ResidenceOf(position) == Residence::kDevice) {
      AppendToRuns(&index.device_gather, slot, i);
      AppendToRuns(&index.device_scatter, i, slot);
    } else {
      AppendToRuns(&index.host_gather, slot, i);
      AppendToRuns(&index.host_scatter, i, slot);
    }
  }
  index.lock_begin = lo;
  index.lock_count = hi - lo + 1;
  return index;
}

// Appends `row` to the wire segments of one shard (rows come in ascending id
// order), extending the last segment when the row continues it.
void AppendToSegments(std::vector<WireSegment>* segments, RowId row, const RowLayout& layout,
                      const TablePlacement& placement) {
  const int64_t position = layout.PositionOf(row);
  const Residence where = placement.ResidenceOf(position);
  const int64_t slot = placement.SlotOf(position);
  if (!segments->empty()) {
    WireSegment& last = segments->back();
    if (last.begin + last.count == row && last.residence == where && last.slot + last.count == slot) {
      ++last.count;
      last.first_position = std::min(last.first_position, position);
      last.last_position = std::max(last.last_position, position);
      return;
    }
  }
  segments->push_back({row, 1, where, slot, position, position});
}

// The wanted rows (all when `wanted` is null) of each piece as wire segments.
std::vector<std::vector<WireSegment>> SegmentsByPiece(const std::vector<WirePiece>& pieces,
                                                      const std::vector<bool>* wanted,
                                                      const RowLayout& layout,
                                                      const TablePlacement& placement) {
  std::vector<std::vector<WireSegment>> by_piece(pieces.size());
  for (size_t p = 0; p < pieces.size(); ++p) {
    const RowSpan& range = pieces[p].range;
    for (RowId row = range.begin; row < range.begin + range.count; ++row) {
      if (wanted == nullptr || (*wanted)[row]) AppendToSegments(&by_piece[p], row, layout, placement);
    }
  }
  return by_piece;
}

// Every shard's parts of the table, in row order.
void ListPieces(const TableInfo& table, int num_shards, TableIndex* index) {
  index->first_piece.assign(1, 0);
  for (int shard = 0; shard < num_shards; ++shard) {
    const std::vector<RowSpan> parts = ShardParts(table, shard, num_shards);
    for (const RowSpan& part : parts) index->pieces.push_back({shard, part});
    index->first_piece.push_back(static_cast<int>(index->pieces.size()));
  }
}

bool Overlaps(const AccessRecord& a, const AccessRecord& b) {
  if (a.table != b.table) return false;
  std::vector<RowId> x = a.rows, y = b.rows;
  std::sort(x.begin(), x.end());
  std::sort(y.begin(), y.end());
  std::vector<RowId> common;
  std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(common));
  return !common.empty();
}

// For each local fetch: the latest keep-access before it (wrapping into the
// previous clock) that writes any of its rows.
void LinkFetchDependencies(const Recording& recording, IterationIndex* index) {
  const int num_ops = static_cast<int>(recording.ops.size());
  for (const AccessRecord& access : recording.accesses) {
    if (access.kind != OpKind::kLocalAccess || !access.fetch) continue;
    AccessIndex& target = index->accesses[access.handle];
    for (int back = 1; back <= num_ops; ++back) {
      const int op_index = ((access.open_op - back) % num_ops + num_ops) % num_ops;
      const RecordedOp& op = recording.ops[op_index];
      if (op.kind != OpKind::kPostLocalAccess) continue;
      const AccessRecord& writer = recording.accesses[op.handle];
      if (!writer.keep || !Overlaps(writer, access)) continue;
      target.fetch_after_op = op_index;
      target.fetch_after_previous_clock = op_index >= access.open_op;
      break;
    }
  }
}

// For a table updated by exactly one access per clock: per piece, the row
// spans of that access (sorted by id) and the runs that copy its buffer rows
// into the message in span order. Rows recorded in ascending order (the
// usual case) are walked as they are; others through a sorted copy of their
// buffer order.
DirectSend PlanDirectSend(const std::vector<WirePiece>& pieces, const AccessRecord& update) {
  const std::vector<RowId>& rows = update.rows;
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int64_t> by_id;  // buffer rows in ascending row id; empty when already so
  if (!std::is_sorted(rows.begin(), rows.end())) {
    by_id.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) by_id[i] = i;
    std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
  }
  DirectSend direct;
  direct.handle = update.handle;
  direct.spans.resize(pieces.size());
  direct.runs.resize(pieces.size());
  std::vector<int64_t> message_rows(pieces.size(), 0);
  size_t piece = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t buffer_row = by_id.empty() ? k : by_id[k];
    const RowId row = rows[buffer_row];
    while (row >= pieces[piece].range.begin + pieces[piece].range.count && piece + 1 < pieces.size()) ++piece;
    std::vector<RowSpan>& spans = direct.spans[piece];
    if (!spans.empty() && spans.back().begin + spans.back().count == row) {
      ++spans.back().count;
    } else {
      spans.push_back({row, 1});
    }
    AppendToRuns(&direct.runs[piece], buffer_row, message_rows[piece]++);
  }
  return direct;
}

}  // namespace

int FindPiece(const TableIndex& index, int shard, RowId begin) {
  if (shard < 0 || shard + 1 >= static_cast<int>(index.first_piece.size())) return -1;
  const auto first = index.pieces.begin() + index.first_piece[shard];
  const auto last = index.pieces.begin() + index.first_piece[shard + 1];
  const auto found =
      std::lower_bound(first, last, begin, [](const WirePiece& piece, RowId row) { return piece.range.begin < row; });
  return found != last && found->range.begin == begin ? static_cast<int>(found - index.pieces.begin()) : -1;
}

IterationIndex BuildIndexes(const std::vector<TableInfo>& tables,
                            const std::vector<RowLayout>& layouts, const Placement& placement,
                            const Recording& recording, int num_shards) {
  IterationIndex index;
  index.tables.resize(tables.size());
  for (const AccessRecord& access : recording.accesses) {
    index.accesses.push_back(IndexAccess(tables[access.table], layouts[access.table],
                                         placement.tables[access.table], access));
  }

  // The last update of each table in the op list closes its clock.
  std::vector<int> last_update(tables.size(), -1);
  for (const RecordedOp& op : recording.ops) {
    if (op.kind == OpKind::kUpdate) last_update[recording.accesses[op.handle].table] = op.handle;
  }
  for (const TableInfo& table : tables) {
    if (table.local) continue;
    TableIndex& table_index = index.tables[table.id];
    std::vector<bool> updated(table.num_rows, false);
    for (const AccessRecord& access : recording.accesses) {
      if (access.table != table.id || access.kind != OpKind::kPreUpdate) continue;
      for (RowId row : access.rows) updated[row] = true;
    }
    ListPieces(table, num_shards, &table_index);
    const std::vector<WirePiece>& pieces = table_index.pieces;
    table_index.has_updates = last_update[table.id] >= 0;
    if (table_index.has_updates) index.accesses[last_update[table.id]].closes_table_clock = true;
    if (table_index.has_updates && !KeepsUpdateLog(table, recording)) {
      table_index.direct = PlanDirectSend(pieces, recording.accesses[last_update[table.id]]);
    }
    table_index.send = SegmentsByPiece(pieces, &updated, layouts[table.id], placement.tables[table.id]);
    table_index.receive = SegmentsByPiece(pieces, nullptr, layouts[table.id], placement.tables[table.id]);
    table_index.pack.resize(pieces.size());
    table_index.unpack.resize(pieces.size());
    table_index.send_on_device.assign(pieces.size(), true);
    table_index.receive_on_device.assign(pieces.size(), true);
    for (size_t p = 0; p < pieces.size(); ++p) {
      int64_t payload_row = 0;  // updates: the segments' rows in order
      for (const WireSegment& segment : table_index.send[p]) {
        if (segment.residence == Residence::kDevice) {
          table_index.pack[p].runs.push_back({segment.slot, payload_row, segment.count});
          table_index.pack[p].total_rows += segment.count;
        } else {
          table_index.send_on_device[p] = false;
        }
        payload_row += segment.count;
      }
      const RowSpan& range = pieces[p].range;  // rows: the piece's whole range
      for (const WireSegment& segment : table_index.receive[p]) {
        if (segment.residence == Residence::kDevice) {
          table_index.unpack[p].runs.push_back({segment.begin - range.begin, segment.slot, segment.count});
          table_index.unpack[p].total_rows += segment.count;
        } else {
          table_index.receive_on_device[p] = false;
        }
      }
    }
  }
  LinkFetchDependencies(recording, &index);
  return index;
}

}  // namespace mltuner
