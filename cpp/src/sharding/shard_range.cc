#include "sharding/shard_range.h"

#include <algorithm>
#include <utility>

#include "mltuner/config.h"

namespace mltuner {

RowSpan ShardRange(int64_t num_rows, int shard, int num_shards) {
  RowSpan range;
  if (num_rows <= 0 || num_shards <= 0 || shard < 0 || shard >= num_shards) return range;
  const int64_t base = num_rows / num_shards;
  const int64_t extra = num_rows % num_shards;  // the first `extra` shards own one more row
  range.begin = shard * base + std::min<int64_t>(shard, extra);
  range.count = base + (shard < extra ? 1 : 0);
  return range;
}

std::vector<RowSpan> ShardParts(const TableInfo& table, int shard, int num_shards) {
  const RowSpan range = ShardRange(table.num_rows, shard, num_shards);
  const int64_t range_bytes = range.count * table.row_bytes();
  if (table.part_bytes <= 0 || range_bytes <= table.part_bytes) return {range};
  const int64_t rows_per_part = std::max<int64_t>(1, table.part_bytes / table.row_bytes());
  const int64_t parts = std::min<int64_t>(kMaxClockParts, (range.count + rows_per_part - 1) / rows_per_part);
  std::vector<RowSpan> out;
  out.reserve(static_cast<size_t>(parts));
  for (int64_t part = 0; part < parts; ++part) {
    RowSpan span = ShardRange(range.count, static_cast<int>(part), static_cast<int>(parts));
    span.begin += range.begin;
    out.push_back(span);
  }
  return out;
}

ShardedRows ShardRows(const TableInfo& table, const std::vector<RowId>& rows, int num_shards) {
  std::vector<std::pair<RowId, int64_t>> sorted;
  sorted.reserve(rows.size());
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) sorted.push_back({rows[i], i});
  std::sort(sorted.begin(), sorted.end());
  ShardedRows out;
  out.spans.resize(num_shards);
  out.order.resize(num_shards);
  int shard = 0;
  RowSpan range = ShardRange(table.num_rows, shard, num_shards);
  for (const auto& [row, position] : sorted) {
    while (row >= range.begin + range.count && shard + 1 < num_shards) {
      range = ShardRange(table.num_rows, ++shard, num_shards);
    }
    std::vector<RowSpan>& spans = out.spans[shard];
    if (!spans.empty() && spans.back().begin + spans.back().count == row) {
      ++spans.back().count;
    } else {
      spans.push_back({row, 1});
    }
    out.order[shard].push_back(position);
  }
  return out;
}

}  // namespace mltuner
