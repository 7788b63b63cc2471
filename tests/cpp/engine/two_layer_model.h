// The recorded iteration of a small model for engine tests that run whole
// clocks: two parameter tables and a local table of stored activations,
// with reads, reads again, updates sent straight from their buffer and
// through an update log, and activations stored, fetched and kept.
#pragma once

#include <vector>

#include "mltuner/engine.h"

namespace mltuner {

constexpr int64_t kWidth = 16;

// A two-layer model: layer 0 (16 rows, 12 used: 4 untouched) read in forward
// and backward and updated once a clock (sent straight from its buffer);
// layer 1 updated twice a clock (through its update log); two stored
// activations, one written, fetched-and-kept, fetched again.
struct Model {
  TableId layer0 = -1, layer1 = -1, acts = -1;
  std::vector<OpKind> kinds;
  std::vector<Handle> handles;
  std::vector<bool> fetches;  // by op: a local access that fetches its rows
  std::vector<int64_t> values;  // by op: the floats of the buffer it opens (0: a post)
};

// Floats per row of a table of Record's.
inline int64_t WidthOf(const Model& m, TableId table) { return table == m.layer1 ? kWidth / 2 : kWidth; }

inline std::vector<RowId> Range(RowId first, RowId count) {
  std::vector<RowId> rows;
  for (RowId r = first; r < first + count; ++r) rows.push_back(r);
  return rows;
}

// The engine's virtual calls, each remembered in the model's op list for
// RunClock to replay.
class Script {
 public:
  Script(Engine* e, Model* m) : e_(e), m_(m) {}
  Status Read(TableId table, std::vector<RowId> rows, Handle* h) {
    const int64_t values = static_cast<int64_t>(rows.size()) * WidthOf(*m_, table);
    MLT_RETURN_IF_ERROR(e_->VirtualRead(table, std::move(rows), 0, h));
    return Add(OpKind::kRead, *h, values);
  }
  Status PostRead(Handle h) {
    MLT_RETURN_IF_ERROR(e_->VirtualPostRead(h));
    return Add(OpKind::kPostRead, h);
  }
  Status PreUpdate(TableId table, std::vector<RowId> rows, Handle* h) {
    const int64_t values = static_cast<int64_t>(rows.size()) * WidthOf(*m_, table);
    MLT_RETURN_IF_ERROR(e_->VirtualPreUpdate(table, std::move(rows), h));
    return Add(OpKind::kPreUpdate, *h, values);
  }
  Status PostUpdate(Handle h) {
    MLT_RETURN_IF_ERROR(e_->VirtualUpdate(h));
    return Add(OpKind::kUpdate, h);
  }
  Status Update(TableId table, std::vector<RowId> rows) {  // pre_update and update at once
    Handle h = -1;
    MLT_RETURN_IF_ERROR(PreUpdate(table, std::move(rows), &h));
    return PostUpdate(h);
  }
  Status Local(TableId table, std::vector<RowId> rows, bool fetch, Handle* h) {
    const int64_t values = static_cast<int64_t>(rows.size()) * WidthOf(*m_, table);
    MLT_RETURN_IF_ERROR(e_->VirtualLocalAccess(table, std::move(rows), fetch, h));
    MLT_RETURN_IF_ERROR(Add(OpKind::kLocalAccess, *h, values));
    m_->fetches.back() = fetch;
    return Status::Ok();
  }
  Status PostLocal(Handle h, bool keep) {
    MLT_RETURN_IF_ERROR(e_->VirtualPostLocalAccess(h, keep));
    return Add(OpKind::kPostLocalAccess, h);
  }

 private:
  Status Add(OpKind kind, Handle h, int64_t values = 0) {
    m_->kinds.push_back(kind);
    m_->handles.push_back(h);
    m_->fetches.push_back(false);
    m_->values.push_back(values);
    return Status::Ok();
  }
  Engine* e_;
  Model* m_;
};

// The two parameter tables of the model: 16 rows each, layer 1 half as wide.
inline Status CreateLayerTables(Engine* e, Model* m) {
  MLT_RETURN_IF_ERROR(e->CreateTable("layer0", 16, kWidth, false, &m->layer0));
  return e->CreateTable("layer1", 16, kWidth / 2, false, &m->layer1);
}

// `read_back_at_once`: after the second store, its rows are fetched and
// dropped at once, as the PyTorch adapter reads a stored activation back.
inline Status Record(Engine* e, Model* m, bool read_back_at_once = false) {
  MLT_RETURN_IF_ERROR(CreateLayerTables(e, m));
  MLT_RETURN_IF_ERROR(e->CreateTable("acts", 24, kWidth, true, &m->acts));
  Script s(e, m);
  Handle r0, a0, r1, a1, b1, b0, r0b;
  // Forward.
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 12), &r0));
  MLT_RETURN_IF_ERROR(s.Local(m->acts, Range(0, 12), false, &a0));
  MLT_RETURN_IF_ERROR(s.PostLocal(a0, true));
  MLT_RETURN_IF_ERROR(s.PostRead(r0));
  MLT_RETURN_IF_ERROR(s.Read(m->layer1, Range(0, 16), &r1));
  MLT_RETURN_IF_ERROR(s.Local(m->acts, Range(12, 12), false, &a1));
  MLT_RETURN_IF_ERROR(s.PostLocal(a1, true));
  if (read_back_at_once) {
    Handle c = -1;
    MLT_RETURN_IF_ERROR(s.Local(m->acts, Range(12, 12), true, &c));
    MLT_RETURN_IF_ERROR(s.PostLocal(c, false));
  }
  // Backward of layer 1: the activation fetched and kept, two updates.
  MLT_RETURN_IF_ERROR(s.Local(m->acts, Range(12, 12), true, &b1));
  MLT_RETURN_IF_ERROR(s.Update(m->layer1, Range(0, 8)));
  MLT_RETURN_IF_ERROR(s.Update(m->layer1, Range(4, 12)));
  MLT_RETURN_IF_ERROR(s.PostLocal(b1, true));
  MLT_RETURN_IF_ERROR(s.PostRead(r1));
  // Backward of layer 0: read again, one update.
  MLT_RETURN_IF_ERROR(s.Local(m->acts, Range(0, 12), true, &b0));
  MLT_RETURN_IF_ERROR(s.Read(m->layer0, Range(0, 12), &r0b));
  MLT_RETURN_IF_ERROR(s.Update(m->layer0, Range(0, 12)));
  MLT_RETURN_IF_ERROR(s.PostRead(r0b));
  MLT_RETURN_IF_ERROR(s.PostLocal(b0, false));
  MLT_RETURN_IF_ERROR(e->VirtualClock());
  return e->FinishVirtualIteration();
}

}  // namespace mltuner
