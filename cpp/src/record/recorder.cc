#include "record/recorder.h"

#include <algorithm>
#include <functional>
#include <sstream>

namespace mltuner {

OpKind PostKindOf(OpKind open) {
  switch (open) {
    case OpKind::kRead: return OpKind::kPostRead;
    case OpKind::kPreUpdate: return OpKind::kUpdate;
    default: return OpKind::kPostLocalAccess;
  }
}

Status CheckRowIds(const TableInfo& table, const std::vector<RowId>& rows, const char* where) {
  // Rows in ascending order (a whole table, a tensor's rows) need no sorted
  // copy: that copy is 8 bytes a row on top of the recording.
  const bool ascending = std::adjacent_find(rows.begin(), rows.end(), std::greater_equal<RowId>()) == rows.end();
  std::vector<RowId> copy;
  if (!ascending) {
    copy = rows;
    std::sort(copy.begin(), copy.end());
  }
  const std::vector<RowId>& sorted = ascending ? rows : copy;
  if (!sorted.empty() && (sorted.front() < 0 || sorted.back() >= table.num_rows)) {
    const RowId bad = sorted.front() < 0 ? sorted.front() : sorted.back();
    return Status::InvalidArgument("row " + std::to_string(bad) + " is outside table '" + table.name +
                                   "' (rows 0.." + std::to_string(table.num_rows - 1) + ")");
  }
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    // A row twice in one buffer would make its update ambiguous.
    return Status::InvalidArgument("row " + std::to_string(*dup) + " appears twice in " + where + " table '" +
                                   table.name + "'");
  }
  return Status::Ok();
}

std::string AccessRecord::Describe(const std::string& table_name) const {
  std::ostringstream out;
  out << OpKindName(kind) << " of table '" << table_name << "' (handle " << handle << ", "
      << rows.size() << " rows)";
  return out.str();
}

Status Recorder::Open(OpKind kind, const TableInfo& table, std::vector<RowId> rows, Handle* out,
                      AccessRecord** record) {
  if (clocked_) {
    return Status::OutOfOrder(std::string("virtual ") + OpKindName(kind) +
                              " after the virtual clock: the clock must be the last op");
  }
  if (rows.empty()) {
    return Status::InvalidArgument("access to table '" + table.name + "' names no rows");
  }
  MLT_RETURN_IF_ERROR(CheckRowIds(table, rows, "one access to"));
  AccessRecord access;
  access.handle = static_cast<Handle>(recording_.accesses.size());
  access.kind = kind;
  access.table = table.id;
  access.rows = std::move(rows);
  access.open_op = static_cast<int>(recording_.ops.size());
  recording_.ops.push_back({kind, access.handle});
  recording_.accesses.push_back(std::move(access));
  table_names_.push_back(table.name);
  *out = recording_.accesses.back().handle;
  *record = &recording_.accesses.back();
  return Status::Ok();
}

Status Recorder::Close(Handle handle, OpKind post_kind, OpKind open_kind) {
  if (clocked_) {
    return Status::OutOfOrder(std::string("virtual ") + OpKindName(post_kind) +
                              " after the virtual clock");
  }
  if (handle < 0 || handle >= static_cast<Handle>(recording_.accesses.size())) {
    return Status::NotFound("unknown handle " + std::to_string(handle));
  }
  AccessRecord& access = recording_.accesses[handle];
  if (access.kind != open_kind) {
    return Status::InvalidArgument(std::string(OpKindName(post_kind)) + " of handle " +
                                   std::to_string(handle) + ", which is a " +
                                   access.Describe(table_names_[handle]) + "; expected " +
                                   OpKindName(PostKindOf(access.kind)));
  }
  if (access.close_op >= 0) {
    return Status::OutOfOrder("handle " + std::to_string(handle) + " was already posted");
  }
  access.close_op = static_cast<int>(recording_.ops.size());
  recording_.ops.push_back({post_kind, handle});
  return Status::Ok();
}

Status Recorder::Read(const TableInfo& table, std::vector<RowId> rows, int slack, Handle* out) {
  if (table.local) {
    return Status::InvalidArgument("table '" + table.name +
                                   "' holds local data: use local_access, not read");
  }
  if (slack < 0) {
    return Status::InvalidArgument("slack must be >= 0, got " + std::to_string(slack));
  }
  AccessRecord* record = nullptr;
  MLT_RETURN_IF_ERROR(Open(OpKind::kRead, table, std::move(rows), out, &record));
  record->slack = slack;
  return Status::Ok();
}

Status Recorder::PostRead(Handle handle) {
  return Close(handle, OpKind::kPostRead, OpKind::kRead);
}

Status Recorder::PreUpdate(const TableInfo& table, std::vector<RowId> rows, Handle* out) {
  if (table.local) {
    return Status::InvalidArgument("table '" + table.name +
                                   "' holds local data: use local_access, not pre_update");
  }
  AccessRecord* record = nullptr;
  return Open(OpKind::kPreUpdate, table, std::move(rows), out, &record);
}

Status Recorder::Update(Handle handle) { return Close(handle, OpKind::kUpdate, OpKind::kPreUpdate); }

Status Recorder::LocalAccess(const TableInfo& table, std::vector<RowId> rows, bool fetch,
                             Handle* out) {
  if (!table.local) {
    return Status::InvalidArgument("table '" + table.name +
                                   "' is a parameter table: use read/pre_update, not local_access");
  }
  AccessRecord* record = nullptr;
  MLT_RETURN_IF_ERROR(Open(OpKind::kLocalAccess, table, std::move(rows), out, &record));
  record->fetch = fetch;
  return Status::Ok();
}

Status Recorder::PostLocalAccess(Handle handle, bool keep) {
  MLT_RETURN_IF_ERROR(Close(handle, OpKind::kPostLocalAccess, OpKind::kLocalAccess));
  recording_.accesses[handle].keep = keep;
  return Status::Ok();
}

Status Recorder::Clock() {
  if (clocked_) return Status::OutOfOrder("the virtual iteration already has its clock");
  std::vector<Handle> open;
  for (const AccessRecord& access : recording_.accesses) {
    if (access.close_op < 0) open.push_back(access.handle);
  }
  if (!open.empty()) {
    std::ostringstream out;
    out << "virtual clock with handles still open:";
    for (Handle h : open) out << " " << recording_.accesses[h].Describe(table_names_[h]) << ";";
    return Status::OutOfOrder(out.str());
  }
  recording_.ops.push_back({OpKind::kClock, -1});
  clocked_ = true;
  return Status::Ok();
}

Status Recorder::Peek(const char* what, const Recording** out) const {
  if (finished_) return Status::OutOfOrder("the virtual iteration was already finished");
  if (!clocked_) return Status::OutOfOrder(std::string(what) + " before the virtual clock");
  *out = &recording_;
  return Status::Ok();
}

Status Recorder::Reset() {
  if (finished_) return Status::OutOfOrder("the virtual iteration was already finished");
  recording_ = Recording();
  table_names_.clear();
  clocked_ = false;
  return Status::Ok();
}

Status Recorder::Finish(Recording* out) {
  if (finished_) return Status::OutOfOrder("the virtual iteration was already finished");
  if (!clocked_) {
    return Status::OutOfOrder("finish_virtual_iteration before the virtual clock");
  }
  *out = std::move(recording_);
  recording_ = Recording();
  finished_ = true;
  return Status::Ok();
}

bool KeepsUpdateLog(const TableInfo& table, const Recording& recording) {
  if (table.local) return false;
  int updates = 0;
  for (const RecordedOp& op : recording.ops) {
    if (op.kind == OpKind::kUpdate && recording.accesses[op.handle].table == table.id && ++updates >= 2) return true;
  }
  return false;
}

}  // namespace mltuner
