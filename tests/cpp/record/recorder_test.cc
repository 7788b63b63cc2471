// Recorder: handles are numbered in open order, the op list mirrors the calls,
// and every mistake in a virtual iteration is reported at the call that made
// it, with the code and message the Python layer relies on.
#include "record/recorder.h"

#include <string>
#include <vector>

#include "test_util.h"

using namespace mltuner;

namespace {

TableInfo Param(TableId id, int64_t rows = 10, int64_t width = 4, const std::string& name = "") {
  TableInfo info;
  info.id = id;
  info.name = name.empty() ? "p" + std::to_string(id) : name;
  info.num_rows = rows;
  info.row_width = width;
  info.local = false;
  return info;
}

TableInfo Local(TableId id, int64_t rows = 10, int64_t width = 4, const std::string& name = "") {
  TableInfo info = Param(id, rows, width, name.empty() ? "l" + std::to_string(id) : name);
  info.local = true;
  return info;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST(HandlesAreNumberedInOpenOrder) {
  Recorder rec;
  const TableInfo p = Param(0), l = Local(1);
  Handle h0 = -1, h1 = -1, h2 = -1, h3 = -1;
  ASSERT_OK(rec.Read(p, {0, 1}, 0, &h0));
  ASSERT_OK(rec.PreUpdate(p, {2}, &h1));
  ASSERT_OK(rec.PostRead(h0));
  ASSERT_OK(rec.LocalAccess(l, {3, 4}, true, &h2));
  ASSERT_OK(rec.Update(h1));
  ASSERT_OK(rec.Read(p, {5}, 2, &h3));
  EXPECT_EQ(h0, 0);
  EXPECT_EQ(h1, 1);
  EXPECT_EQ(h2, 2);
  EXPECT_EQ(h3, 3);
}

TEST(OpListAndAccessRecordsMirrorTheCalls) {
  Recorder rec;
  const TableInfo p = Param(0, 10, 4, "fc1"), q = Param(1, 5, 2), l = Local(2);
  Handle r = -1, u = -1, a = -1;
  ASSERT_OK(rec.Read(p, {3, 1, 2}, 1, &r));
  ASSERT_OK(rec.PreUpdate(q, {4, 0}, &u));
  ASSERT_OK(rec.LocalAccess(l, {9}, true, &a));
  ASSERT_OK(rec.PostLocalAccess(a, true));
  ASSERT_OK(rec.Update(u));
  ASSERT_OK(rec.PostRead(r));
  EXPECT_TRUE(!rec.clocked());
  ASSERT_OK(rec.Clock());
  EXPECT_TRUE(rec.clocked());
  Recording out;
  ASSERT_OK(rec.Finish(&out));

  const std::vector<RecordedOp> want = {
      {OpKind::kRead, 0},  {OpKind::kPreUpdate, 1},       {OpKind::kLocalAccess, 2},
      {OpKind::kPostLocalAccess, 2}, {OpKind::kUpdate, 1}, {OpKind::kPostRead, 0},
      {OpKind::kClock, -1}};
  ASSERT_EQ(out.ops.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(out.ops[i].kind == want[i].kind);
    EXPECT_EQ(out.ops[i].handle, want[i].handle);
  }
  ASSERT_EQ(out.accesses.size(), size_t{3});
  const AccessRecord& read = out.accesses[0];
  EXPECT_EQ(read.handle, 0);
  EXPECT_TRUE(read.kind == OpKind::kRead);
  EXPECT_EQ(read.table, 0);
  EXPECT_TRUE((read.rows == std::vector<RowId>{3, 1, 2}));  // caller's order kept
  EXPECT_EQ(read.slack, 1);
  EXPECT_EQ(read.open_op, 0);
  EXPECT_EQ(read.close_op, 5);
  const AccessRecord& update = out.accesses[1];
  EXPECT_TRUE(update.kind == OpKind::kPreUpdate);
  EXPECT_EQ(update.table, 1);
  EXPECT_TRUE((update.rows == std::vector<RowId>{4, 0}));
  EXPECT_EQ(update.open_op, 1);
  EXPECT_EQ(update.close_op, 4);
  const AccessRecord& local = out.accesses[2];
  EXPECT_TRUE(local.kind == OpKind::kLocalAccess);
  EXPECT_EQ(local.table, 2);
  EXPECT_TRUE(local.fetch);
  EXPECT_TRUE(local.keep);
  EXPECT_EQ(local.open_op, 2);
  EXPECT_EQ(local.close_op, 3);

  EXPECT_TRUE(Contains(read.Describe("fc1"), "fc1"));
  EXPECT_TRUE(Contains(read.Describe("fc1"), "handle 0"));
  EXPECT_TRUE(Contains(read.Describe("fc1"), "3 rows"));
}

TEST(LocalAccessWithoutFetchOrKeep) {
  Recorder rec;
  const TableInfo l = Local(0);
  Handle a = -1;
  ASSERT_OK(rec.LocalAccess(l, {1}, false, &a));
  ASSERT_OK(rec.PostLocalAccess(a, false));
  ASSERT_OK(rec.Clock());
  Recording out;
  ASSERT_OK(rec.Finish(&out));
  ASSERT_EQ(out.accesses.size(), size_t{1});
  EXPECT_TRUE(!out.accesses[0].fetch);
  EXPECT_TRUE(!out.accesses[0].keep);
}

TEST(RowsOutOfRangeAreRejected) {
  Recorder rec;
  const TableInfo p = Param(0, 10, 4, "emb"), l = Local(1, 3);
  Handle h = -1;
  Status s = rec.Read(p, {0, 10}, 0, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "10"));
  EXPECT_TRUE(Contains(s.message(), "emb"));
  s = rec.Read(p, {-1, 2}, 0, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "-1"));
  EXPECT_CODE(rec.PreUpdate(p, {11}, &h), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.LocalAccess(l, {3}, true, &h), StatusCode::kInvalidArgument);
  // Nothing was recorded: the next handle is 0 and the op list stays empty.
  ASSERT_OK(rec.Read(p, {9}, 0, &h));
  EXPECT_EQ(h, 0);
}

TEST(DuplicateRowsAreRejected) {
  Recorder rec;
  const TableInfo p = Param(0), l = Local(1);
  Handle h = -1;
  Status s = rec.Read(p, {1, 2, 1}, 0, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "twice"));
  EXPECT_CODE(rec.PreUpdate(p, {4, 4}, &h), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.LocalAccess(l, {0, 0}, false, &h), StatusCode::kInvalidArgument);
}

TEST(EmptyRowsAreRejected) {
  Recorder rec;
  const TableInfo p = Param(0), l = Local(1);
  Handle h = -1;
  EXPECT_CODE(rec.Read(p, {}, 0, &h), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.PreUpdate(p, {}, &h), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.LocalAccess(l, {}, true, &h), StatusCode::kInvalidArgument);
}

TEST(NegativeSlackIsRejected) {
  Recorder rec;
  Handle h = -1;
  const Status s = rec.Read(Param(0), {0}, -1, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "slack"));
}

TEST(ParamCallsOnLocalTableAreRejected) {
  Recorder rec;
  Handle h = -1;
  Status s = rec.Read(Local(0, 10, 4, "acts"), {0}, 0, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "acts"));
  EXPECT_TRUE(Contains(s.message(), "local"));
  EXPECT_CODE(rec.PreUpdate(Local(0), {0}, &h), StatusCode::kInvalidArgument);
}

TEST(LocalAccessOnParamTableIsRejected) {
  Recorder rec;
  Handle h = -1;
  const Status s = rec.LocalAccess(Param(0, 10, 4, "w"), {0}, true, &h);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "'w'"));
}

TEST(DoublePostIsOutOfOrder) {
  Recorder rec;
  const TableInfo p = Param(0), l = Local(1);
  Handle r = -1, u = -1, a = -1;
  ASSERT_OK(rec.Read(p, {0}, 0, &r));
  ASSERT_OK(rec.PostRead(r));
  EXPECT_CODE(rec.PostRead(r), StatusCode::kOutOfOrder);
  ASSERT_OK(rec.PreUpdate(p, {0}, &u));
  ASSERT_OK(rec.Update(u));
  EXPECT_CODE(rec.Update(u), StatusCode::kOutOfOrder);
  ASSERT_OK(rec.LocalAccess(l, {0}, false, &a));
  ASSERT_OK(rec.PostLocalAccess(a, true));
  EXPECT_CODE(rec.PostLocalAccess(a, false), StatusCode::kOutOfOrder);
  ASSERT_OK(rec.Clock());
  Recording out;
  ASSERT_OK(rec.Finish(&out));
  EXPECT_EQ(out.ops.size(), size_t{7});  // the rejected posts were not recorded
  EXPECT_TRUE(out.accesses[2].keep);     // a rejected second post changes nothing
}

TEST(WrongPostKindIsRejected) {
  Recorder rec;
  const TableInfo p = Param(0, 10, 4, "fc"), l = Local(1);
  Handle r = -1, u = -1, a = -1;
  ASSERT_OK(rec.Read(p, {0}, 0, &r));
  ASSERT_OK(rec.PreUpdate(p, {1}, &u));
  ASSERT_OK(rec.LocalAccess(l, {2}, false, &a));
  Status s = rec.Update(r);
  EXPECT_CODE(s, StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "fc"));
  EXPECT_TRUE(Contains(s.message(), OpKindName(OpKind::kPostRead)));  // names the right post
  EXPECT_CODE(rec.PostRead(u), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.PostLocalAccess(r, true), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.PostRead(a), StatusCode::kInvalidArgument);
  EXPECT_CODE(rec.Update(a), StatusCode::kInvalidArgument);
  // The handles are still open and can be closed properly.
  EXPECT_OK(rec.PostRead(r));
  EXPECT_OK(rec.Update(u));
  EXPECT_OK(rec.PostLocalAccess(a, false));
  EXPECT_OK(rec.Clock());
}

TEST(UnknownHandleIsNotFound) {
  Recorder rec;
  Handle r = -1;
  EXPECT_CODE(rec.PostRead(0), StatusCode::kNotFound);
  ASSERT_OK(rec.Read(Param(0), {0}, 0, &r));
  EXPECT_CODE(rec.PostRead(1), StatusCode::kNotFound);
  EXPECT_CODE(rec.PostRead(-1), StatusCode::kNotFound);
  EXPECT_CODE(rec.Update(7), StatusCode::kNotFound);
  const Status s = rec.PostLocalAccess(42, true);
  EXPECT_CODE(s, StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s.message(), "42"));
}

TEST(OpsAfterClockAreOutOfOrder) {
  Recorder rec;
  const TableInfo p = Param(0), l = Local(1);
  Handle r = -1, h = -1;
  ASSERT_OK(rec.Read(p, {0}, 0, &r));
  ASSERT_OK(rec.PostRead(r));
  ASSERT_OK(rec.Clock());
  EXPECT_CODE(rec.Read(p, {1}, 0, &h), StatusCode::kOutOfOrder);
  EXPECT_CODE(rec.PreUpdate(p, {1}, &h), StatusCode::kOutOfOrder);
  EXPECT_CODE(rec.LocalAccess(l, {1}, false, &h), StatusCode::kOutOfOrder);
  EXPECT_CODE(rec.PostRead(r), StatusCode::kOutOfOrder);
  EXPECT_CODE(rec.Clock(), StatusCode::kOutOfOrder);
  Recording out;
  ASSERT_OK(rec.Finish(&out));
  EXPECT_EQ(out.ops.size(), size_t{3});
  EXPECT_EQ(out.accesses.size(), size_t{1});
}

TEST(ClockWithOpenHandlesListsThem) {
  Recorder rec;
  const TableInfo p = Param(0, 10, 4, "conv1"), q = Param(1, 10, 4, "conv2"), l = Local(2, 4, 4, "acts");
  Handle r0 = -1, r1 = -1, u = -1, a = -1;
  ASSERT_OK(rec.Read(p, {0, 1}, 0, &r0));
  ASSERT_OK(rec.Read(q, {2}, 0, &r1));
  ASSERT_OK(rec.PreUpdate(q, {3}, &u));
  ASSERT_OK(rec.LocalAccess(l, {0}, false, &a));
  ASSERT_OK(rec.PostRead(r1));
  const Status s = rec.Clock();
  EXPECT_CODE(s, StatusCode::kOutOfOrder);
  EXPECT_TRUE(Contains(s.message(), "handle 0"));
  EXPECT_TRUE(Contains(s.message(), "conv1"));
  EXPECT_TRUE(Contains(s.message(), "handle 2"));
  EXPECT_TRUE(Contains(s.message(), "handle 3"));
  EXPECT_TRUE(Contains(s.message(), "acts"));
  EXPECT_TRUE(!Contains(s.message(), "handle 1"));  // posted, not listed
  EXPECT_TRUE(!rec.clocked());
  // After closing them the clock is accepted.
  ASSERT_OK(rec.PostRead(r0));
  ASSERT_OK(rec.Update(u));
  ASSERT_OK(rec.PostLocalAccess(a, false));
  EXPECT_OK(rec.Clock());
}

TEST(FinishWithoutClockIsOutOfOrder) {
  Recorder rec;
  Recording out;
  EXPECT_CODE(rec.Finish(&out), StatusCode::kOutOfOrder);
  Handle r = -1;
  ASSERT_OK(rec.Read(Param(0), {0}, 0, &r));
  EXPECT_CODE(rec.Finish(&out), StatusCode::kOutOfOrder);
  ASSERT_OK(rec.PostRead(r));
  EXPECT_CODE(rec.Finish(&out), StatusCode::kOutOfOrder);
  ASSERT_OK(rec.Clock());
  ASSERT_OK(rec.Finish(&out));
  EXPECT_EQ(out.ops.size(), size_t{3});
  EXPECT_TRUE(out.ops.back().kind == OpKind::kClock);
}

// Finish hands the recording over once. A second Finish must not succeed with
// an empty op list: a Recording "ends with exactly one kClock", and the engine
// divides by the op count (AllocatorLoop: seq % num_ops). The engine reaches
// this when FinishVirtualIteration is retried after its kReady wait timed out.
TEST(SecondFinishDoesNotHandOverAnEmptyRecording) {
  Recorder rec;
  Handle r = -1;
  ASSERT_OK(rec.Read(Param(0), {0}, 0, &r));
  ASSERT_OK(rec.PostRead(r));
  ASSERT_OK(rec.Clock());
  Recording first;
  ASSERT_OK(rec.Finish(&first));
  EXPECT_EQ(first.ops.size(), size_t{3});
  Recording second;
  const Status s = rec.Finish(&second);
  EXPECT_CODE(s, StatusCode::kOutOfOrder);
  if (s.ok()) {
    EXPECT_TRUE(!second.ops.empty());
    EXPECT_TRUE(!second.ops.empty() && second.ops.back().kind == OpKind::kClock);
  }
}

TEST(EmptyIterationWithOnlyAClock) {
  Recorder rec;
  ASSERT_OK(rec.Clock());
  Recording out;
  ASSERT_OK(rec.Finish(&out));
  ASSERT_EQ(out.ops.size(), size_t{1});
  EXPECT_TRUE(out.ops[0].kind == OpKind::kClock);
  EXPECT_EQ(out.ops[0].handle, -1);
  EXPECT_TRUE(out.accesses.empty());
}

MLT_TEST_MAIN
