// Sharding: which shard owns which rows of a table. Both sides use it — the
// worker to address shards (fetch, initial values, the indexes of its
// updates and of pushed rows), the shard to know its own slice — so it lives
// apart from both: the worker side never includes server/.
//
// Rows are split contiguously and evenly by row id; with every process
// hosting one shard, shards are numbered like the workers.
//
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "mltuner/types.h"
#include "wire/message.h"

namespace mltuner {

// Rows [begin, begin+count) of a table of num_rows rows that shard `shard` of
// `num_shards` owns: an even contiguous split, the first shards taking one
// extra row when it does not divide.
RowSpan ShardRange(int64_t num_rows, int shard, int num_shards);

// The parts a table's clock moves a shard's rows in (TableInfo::part_bytes):
// ShardRange split evenly into consecutive spans of at most about
// part_bytes each, at most kMaxClockParts (mltuner/config.h); one span, the
// whole range (possibly empty), when the table is not split. Every worker
// sends a shard each part of each clock in this order, the shard applies
// and pushes the rows part by part, and each side finds a message's part
// from that order and its rows.
std::vector<RowSpan> ShardParts(const TableInfo& table, int shard, int num_shards);

// Row ids grouped by the shard that owns them: per shard, spans of
// consecutive ids (ascending) and, in the same order, each row's position in
// the caller's array. Used to address shards (fetch, initial values, the
// direct send of an update buffer). REQUIRES: ids in range, no duplicates.
struct ShardedRows {
  std::vector<std::vector<RowSpan>> spans;
  std::vector<std::vector<int64_t>> order;
};
ShardedRows ShardRows(const TableInfo& table, const std::vector<RowId>& rows, int num_shards);

}  // namespace mltuner
