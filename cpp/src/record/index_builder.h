// IndexBuilder: everything the background threads need per access and per
// table, computed once at the end of the virtual iteration so that each clock
// only replays it.
//
// Per access: gather runs (store slot -> buffer row) split by residence, the
// matching scatter runs (buffer row -> store slot), the layout positions to
// lock, whether the update closes its table's clock, and for a local fetch
// the earlier keep-access whose write-back it must wait for.
// Per table and piece (a shard's rows, or one part of them when the table's
// clock moves in parts): the wire segments of updated rows (what to send)
// and of all the piece's rows (where pushed rows are installed).
#pragma once

#include <vector>

#include "mltuner/types.h"
#include "mltuner/device.h"
#include "plan/placement.h"
#include "plan/row_layout.h"
#include "record/recorder.h"
#include "wire/message.h"

namespace mltuner {

struct AccessIndex {
  int64_t buffer_bytes = 0;  // aligned
  RunIndex device_gather;    // src = device slot, dst = buffer row
  RunIndex host_gather;      // src = host slot, dst = buffer row
  RunIndex device_scatter;   // src = buffer row, dst = device slot
  RunIndex host_scatter;     // src = buffer row, dst = host slot
  int64_t lock_begin = 0;    // layout positions this access touches
  int64_t lock_count = 0;
  bool closes_table_clock = false;  // the last update of its table in a clock
  // Local fetch only: the post op of the latest earlier keep-access to any of
  // the same rows (cyclically: it may be in the previous clock), or -1.
  int fetch_after_op = -1;
  bool fetch_after_previous_clock = false;
};

// A block of rows with consecutive ids stored in consecutive slots of one
// residence.
struct WireSegment {
  RowId begin = 0;
  int64_t count = 0;
  Residence residence = Residence::kHost;
  int64_t slot = 0;
  int64_t first_position = 0;  // layout positions spanned, for locking
  int64_t last_position = 0;
};

// The unit a table's clock travels in: one shard's rows, or one part of
// them (sharding/shard_range.h, ShardParts). A clock sends each piece its
// own update message, and each piece's fresh rows come back in their own.
struct WirePiece {
  int shard = 0;
  RowSpan range;  // possibly empty: a shard that owns no rows has one empty piece
};

// How a table whose clock holds exactly one update ships it: straight from
// that update's buffer, skipping the update log (no scatter-add, no zeroing).
struct DirectSend {
  Handle handle = -1;                        // the one update, or -1
  std::vector<std::vector<RowSpan>> spans;   // by piece: consecutive row ids
  std::vector<RunIndex> runs;                // by piece: buffer row -> message row
};

struct TableIndex {
  bool has_updates = false;
  // Every shard's pieces, shard by shard in part order: in row order. The
  // vectors below are by piece; shard s's are [first_piece[s], first_piece[s + 1]).
  std::vector<WirePiece> pieces;
  std::vector<int> first_piece;
  DirectSend direct;
  std::vector<std::vector<WireSegment>> send;     // by piece: updated rows
  std::vector<std::vector<WireSegment>> receive;  // by piece: all its rows
  // The wire segments' device-resident rows as run indexes, by piece (made
  // with the segments, prepared on the device with the access indexes):
  // `pack` gathers update-log slots into payload rows (one kernel fills a
  // contiguous staging payload), `unpack` scatters a received payload's rows
  // into cache slots (one kernel installs them). `send_on_device` /
  // `receive_on_device`: every row of the piece's segments is device-resident,
  // so the packed payload is the whole message.
  std::vector<RunIndex> pack;
  std::vector<RunIndex> unpack;
  std::vector<bool> send_on_device;
  std::vector<bool> receive_on_device;
};

// The piece of `shard`'s rows that starts at row `begin`, or -1.
int FindPiece(const TableIndex& index, int shard, RowId begin);

struct IterationIndex {
  std::vector<AccessIndex> accesses;  // by handle
  std::vector<TableIndex> tables;     // by table id
};

IterationIndex BuildIndexes(const std::vector<TableInfo>& tables,
                            const std::vector<RowLayout>& layouts, const Placement& placement,
                            const Recording& recording, int num_shards);

}  // namespace mltuner
