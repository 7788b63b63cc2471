// The reclaimer's bursts: updates for other ranks' shards that it builds
// while the application has already posted its next ops leave together
// through Transport::SendAll, in the order they were built; this rank's own
// shard gets its part of each table at once (Send). Rank 0 of 2 workers
// over a transport that records how each message left. (Where the
// application's call waits for a buffer midway, the reclaimer catches up
// and a clock's burst leaves in two: the test allows that.) A table whose
// clock moves in parts sends each part as soon as it is built instead.
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <thread>

#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "mltuner/transport.h"
#include "test_util.h"
#include "wire/message.h"

using namespace mltuner;

namespace {

constexpr int kTables = 16;
constexpr int64_t kRows = 8;  // per table: rows 0..3 on shard 0, 4..7 on shard 1
constexpr int64_t kWidth = 4;

// Acknowledges kReady as both shards, answers kStart with both shards'
// initial rows and each kClockUpdate with its shard's rows of that clock (as
// if every worker had sent its part), and records how each kClockUpdate
// left: which call carried it.
class RecordingTransport : public Transport {
 public:
  struct Sent {
    std::string call;  // "Send", or "SendAll#n" for the n-th SendAll
    int receiver;
    TableId table;
    RowId first_row;  // of its spans, or -1 for a bare update
  };

  Engine* engine = nullptr;
  int num_tables = kTables;           // the engine's, each pushed at kStart
  int64_t rows_per_part = kRows / 2;  // of a shard's rows in a push; 1 for a table in parts of a row

  Status Send(Message&& message) override { return Take(std::move(message), "Send"); }
  Status SendAll(std::vector<Message>&& messages) override {
    std::string call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call = "SendAll#" + std::to_string(++send_alls_);
    }
    for (Message& message : messages) MLT_RETURN_IF_ERROR(Take(std::move(message), call));
    return Status::Ok();
  }
  Status AddTableToShard(int, const TableInfo&) override { return Status::Ok(); }
  Status DropTableFromShard(int, TableId) override { return Status::Ok(); }

  std::vector<Sent> updates() {
    std::lock_guard<std::mutex> lock(mu_);
    return updates_;
  }

 private:
  Status Take(Message&& message, const std::string& call) {
    const MessageHeader& h = message.header;
    if (message.type() == MessageType::kReady) {
      Message ack = NewMessage(MessageType::kAck, h.receiver, h.sender, -1);
      ack.header.request_id = h.request_id;
      return engine->HandleMessage(std::move(ack));
    }
    if (message.type() == MessageType::kStart) {
      for (TableId table = 0; table < num_tables; ++table) {
        for (RowId row = h.receiver * kRows / 2; row < (h.receiver + 1) * kRows / 2; row += rows_per_part) {
          MLT_RETURN_IF_ERROR(Rows(h.receiver, table, kInitClock, {row, rows_per_part}));
        }
      }
      return Status::Ok();
    }
    if (message.type() == MessageType::kClockUpdate) {
      std::lock_guard<std::mutex> lock(mu_);
      updates_.push_back({call, h.receiver, h.table, message.spans.empty() ? -1 : message.spans[0].begin});
    }
    if (message.type() != MessageType::kClockUpdate) return Status::Ok();
    // The rows the update covered (a part's, when the table moves in parts).
    const RowSpan rows = message.spans.empty() ? RowSpan{h.receiver * kRows / 2, kRows / 2} : message.spans[0];
    return Rows(h.receiver, h.table, h.clock, rows);
  }

  Status Rows(int shard, TableId table, Clock clock, RowSpan span = {-1, 0}) {
    if (span.begin < 0) span = {shard * kRows / 2, kRows / 2};
    Message rows = NewMessage(MessageType::kRows, shard, 0, table);
    rows.header.clock = clock;
    rows.header.row_width = kWidth;
    rows.spans.push_back(span);
    rows.header.num_spans = 1;
    rows.values.assign(static_cast<size_t>(span.count * kWidth), 0.5f);
    return engine->HandleMessage(std::move(rows));
  }

  std::mutex mu_;
  int send_alls_ = 0;
  std::vector<Sent> updates_;
};

}  // namespace

TEST(AStepsUpdatesForOtherRanksLeaveAsOneBurstInOrder) {
  Config config;
  config.wait_timeout_ms = 10000;
  RecordingTransport transport;
  std::unique_ptr<Engine> engine;
  ASSERT_OK(Engine::Create(config, 0, 2, NewCpuDevice(), &transport, &engine));
  transport.engine = engine.get();
  std::vector<Handle> updates;
  for (int t = 0; t < kTables; ++t) {
    TableId table = -1;
    ASSERT_OK(engine->CreateTable("t" + std::to_string(t), kRows, kWidth, false, &table));
    std::vector<RowId> rows;
    for (RowId row = 0; row < kRows; ++row) rows.push_back(row);
    Handle handle = -1;
    ASSERT_OK(engine->VirtualPreUpdate(table, rows, &handle));
    ASSERT_OK(engine->VirtualUpdate(handle));
    updates.push_back(handle);
  }
  ASSERT_OK(engine->VirtualClock());
  ASSERT_OK(engine->FinishVirtualIteration());
  ASSERT_OK(engine->StartIterations());
  // Clocks posted at once, as the PyTorch adapter's step() does: every
  // update opened and posted, then the clock, in one call.
  constexpr int kClocks = 5;
  std::vector<OpCall> ops;
  for (Handle handle : updates) {
    ops.push_back({OpKind::kPreUpdate, handle, {}, {}});
    ops.push_back({OpKind::kUpdate, handle, {}, {}});
  }
  ops.push_back({OpKind::kClock, -1, {}, {}});
  for (int clock = 0; clock < kClocks; ++clock) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the allocator prepares the buffers
    std::vector<AccessBuffer> opened;
    ASSERT_OK(engine->Run(ops, &opened));
  }
  ASSERT_OK(engine->Flush());
  ASSERT_OK(engine->Shutdown());

  const std::vector<RecordingTransport::Sent> sent = transport.updates();
  ASSERT_EQ(sent.size(), static_cast<size_t>(2 * kTables * kClocks));
  std::vector<TableId> to_peer;
  std::vector<std::string> bursts;
  for (const RecordingTransport::Sent& s : sent) {
    if (s.receiver == 0) {
      EXPECT_EQ(s.call, std::string("Send"));  // this rank's own shard: at once
      continue;
    }
    EXPECT_TRUE(s.call.rfind("SendAll#", 0) == 0);  // the peer's: in bursts
    to_peer.push_back(s.table);
    if (bursts.empty() || bursts.back() != s.call) bursts.push_back(s.call);
  }
  ASSERT_EQ(to_peer.size(), static_cast<size_t>(kTables * kClocks));
  for (size_t i = 0; i < to_peer.size(); ++i) EXPECT_EQ(to_peer[i], static_cast<TableId>(i % kTables));
  // At most two bursts a clock (one when nothing waited), never one per table.
  EXPECT_TRUE(bursts.size() <= static_cast<size_t>(2 * kClocks));
}

// A table whose clock moves in parts of one row: each part's update leaves
// as soon as it is built (the peer's each in a SendAll of its own, this
// rank's own shard's by Send), in row order; the read of the next clock
// waits for the last part of every shard (a wrong data age would stall it
// into the wait timeout).
TEST(APartOfALargeTableLeavesAsSoonAsItIsBuilt) {
  Config config;
  config.wait_timeout_ms = 10000;
  config.clock_part_bytes = kWidth * sizeof(float);  // a row a part: 4 a shard
  RecordingTransport transport;
  std::unique_ptr<Engine> engine;
  ASSERT_OK(Engine::Create(config, 0, 2, NewCpuDevice(), &transport, &engine));
  transport.engine = engine.get();
  transport.num_tables = 1;
  transport.rows_per_part = 1;
  TableId table = -1;
  ASSERT_OK(engine->CreateTable("t0", kRows, kWidth, false, &table));
  std::vector<RowId> rows;
  for (RowId row = 0; row < kRows; ++row) rows.push_back(row);
  Handle read = -1, update = -1;
  ASSERT_OK(engine->VirtualRead(table, rows, 0, &read));
  ASSERT_OK(engine->VirtualPostRead(read));
  ASSERT_OK(engine->VirtualPreUpdate(table, rows, &update));
  ASSERT_OK(engine->VirtualUpdate(update));
  ASSERT_OK(engine->VirtualClock());
  ASSERT_OK(engine->FinishVirtualIteration());
  EXPECT_TRUE(engine->DescribePlan().find("'t0' in up to 4 parts a shard") != std::string::npos);
  ASSERT_OK(engine->StartIterations());
  constexpr int kClocks = 4;
  for (int clock = 0; clock < kClocks; ++clock) {
    std::vector<OpCall> ops = {{OpKind::kRead, read, {}, {}},        {OpKind::kPostRead, read, {}, {}},
                               {OpKind::kPreUpdate, update, {}, {}}, {OpKind::kUpdate, update, {}, {}},
                               {OpKind::kClock, -1, {}, {}}};
    std::vector<AccessBuffer> opened;
    ASSERT_OK(engine->Run(ops, &opened));
  }
  ASSERT_OK(engine->Flush());
  ASSERT_OK(engine->Shutdown());

  const std::vector<RecordingTransport::Sent> sent = transport.updates();
  ASSERT_EQ(sent.size(), static_cast<size_t>(kRows * kClocks));  // a message a row: every part of both shards
  std::vector<std::string> peer_calls;
  for (size_t i = 0; i < sent.size(); ++i) {
    EXPECT_EQ(sent[i].first_row, static_cast<RowId>(i % kRows));  // in row order, part by part
    EXPECT_EQ(sent[i].receiver, sent[i].first_row < kRows / 2 ? 0 : 1);
    if (sent[i].receiver == 0) {
      EXPECT_EQ(sent[i].call, std::string("Send"));
    } else {
      peer_calls.push_back(sent[i].call);
    }
  }
  for (size_t i = 1; i < peer_calls.size(); ++i) EXPECT_TRUE(peer_calls[i] != peer_calls[i - 1]);  // each alone
}

MLT_TEST_MAIN
