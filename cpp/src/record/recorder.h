// Recorder: turns the calls of a virtual iteration into an op list.
//
// The application replays one iteration without data. Each open call (read,
// pre_update, local_access) returns a new handle; each post call closes one.
// The recorder checks the sequence as it goes — rows in range and unique,
// every handle posted exactly once, the right post for the right open, one
// clock at the end — so a mistake is reported at the call that made it.
// Not thread-safe: one application thread records.
#pragma once

#include <string>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

// The post op that closes an open op (read -> post_read, pre_update ->
// update, local_access -> post_local_access).
OpKind PostKindOf(OpKind open);

// InvalidArgument naming the row when a row id is outside the table or
// appears twice; `where` completes "row 3 appears twice in <where> table 't'".
Status CheckRowIds(const TableInfo& table, const std::vector<RowId>& rows, const char* where);

// One open access, as recorded.
struct AccessRecord {
  Handle handle = -1;
  OpKind kind = OpKind::kRead;  // kRead, kPreUpdate or kLocalAccess
  TableId table = -1;
  std::vector<RowId> rows;      // in the order the buffer holds them
  int slack = 0;                // reads only
  bool fetch = false;           // local access: load old contents
  bool keep = false;            // local access: write back on post
  int open_op = -1;             // index of the open op in the op list
  int close_op = -1;            // index of the post op

  // "read of table 'fc1' (handle 3, 12 rows)"
  std::string Describe(const std::string& table_name) const;
};

struct RecordedOp {
  OpKind kind = OpKind::kClock;
  Handle handle = -1;  // -1 for kClock
};

struct Recording {
  std::vector<RecordedOp> ops;         // ends with exactly one kClock
  std::vector<AccessRecord> accesses;  // indexed by handle
};

// Whether a parameter table keeps an update log: only when its clock holds
// two or more updates, which the log sums. A table updated once a clock
// ships that update straight from its buffer (record/index_builder.h,
// DirectSend), so a log would be memory never written.
bool KeepsUpdateLog(const TableInfo& table, const Recording& recording);

class Recorder {
 public:
  Recorder() = default;
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  Status Read(const TableInfo& table, std::vector<RowId> rows, int slack, Handle* out);
  Status PostRead(Handle handle);
  Status PreUpdate(const TableInfo& table, std::vector<RowId> rows, Handle* out);
  Status Update(Handle handle);
  Status LocalAccess(const TableInfo& table, std::vector<RowId> rows, bool fetch, Handle* out);
  Status PostLocalAccess(Handle handle, bool keep);
  Status Clock();
  // The recording so far, for a plan made before it is handed over;
  // OutOfOrder, naming the call `what`, if the iteration has no clock yet or
  // was handed over. The pointer stays valid until Finish or Reset.
  Status Peek(const char* what, const Recording** out) const;
  // Hands over the recording. OutOfOrder if a handle is still open or the
  // iteration has no clock.
  Status Finish(Recording* out);
  // Drops what was recorded, so that another iteration can be recorded
  // (handles count from 0 again). OutOfOrder once the recording was handed over.
  Status Reset();

  bool clocked() const { return clocked_; }
  // Nothing recorded since the start or the last Reset.
  bool empty() const { return recording_.ops.empty(); }
  bool finished() const { return finished_; }

 private:
  Status Open(OpKind kind, const TableInfo& table, std::vector<RowId> rows, Handle* out,
              AccessRecord** record);
  Status Close(Handle handle, OpKind post_kind, OpKind open_kind);

  Recording recording_;
  std::vector<std::string> table_names_;  // by handle, for messages
  bool clocked_ = false;
  bool finished_ = false;  // the recording was handed over
};

}  // namespace mltuner
