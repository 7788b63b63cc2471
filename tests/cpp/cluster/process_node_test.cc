// ProcessNode: two nodes joined by a test "wire" that does what the Python
// socket transport does (NextOutgoing on one, Deliver on the other), so the
// encoding, validation and routing of real cross-process traffic run here
// without sockets. Also: refusal of misaddressed and corrupt frames, Abort
// ending a blocked wait with kPeerLost, and shard export/import.
#include "mltuner/process_node.h"
#include "mltuner/cluster.h"
#include "memory/device_block.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "wire/message.h"

using namespace mltuner;

namespace {

Config TestConfig(UpdateRuleKind kind = UpdateRuleKind::kAdd) {
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = kind;
  config.update_rule.learning_rate = 0.5f;
  return config;
}

// Moves every outgoing message of each node to the other until stopped.
class Wire {
 public:
  Wire(ProcessNode* a, ProcessNode* b) {
    for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
      threads_.emplace_back([this, from, to] {
        while (!stop_) {
          OutgoingMessage message;
          if (!from->NextOutgoing(20, &message)) continue;
          const Status status = to->Deliver(message.header.data(), message.header.size(), message.payload_values(),
                                            message.payload_bytes());
          if (!status.ok()) ++refused_;
        }
      });
    }
  }
  ~Wire() {
    stop_ = true;
    for (auto& thread : threads_) thread.join();
  }
  int refused() const { return refused_; }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0};
  std::vector<std::thread> threads_;
};

struct Pair {
  std::unique_ptr<ProcessNode> node[2];
};

Pair MakePair(UpdateRuleKind kind = UpdateRuleKind::kAdd) {
  Pair pair;
  for (int rank = 0; rank < 2; ++rank) {
    Status status = ProcessNode::Create(TestConfig(kind), rank, 2, nullptr, &pair.node[rank]);
    if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
  }
  return pair;
}

// Each rank adds (rank + 1) to every row of a 5 x 3 table for `clocks` clocks.
void Train(ProcessNode* node, int clocks, std::vector<float>* fetched) {
  Engine* engine = node->engine();
  TableId table;
  Handle update;
  ASSERT_OK(engine->CreateTable("t", 5, 3, false, &table));
  ASSERT_OK(engine->VirtualPreUpdate(table, {0, 1, 2, 3, 4}, &update));
  ASSERT_OK(engine->VirtualUpdate(update));
  ASSERT_OK(engine->VirtualClock());
  ASSERT_OK(engine->FinishVirtualIteration());
  ASSERT_OK(engine->StartIterations());
  for (int clock = 0; clock < clocks; ++clock) {
    AccessBuffer buffer;
    ASSERT_OK(engine->PreUpdate(update, &buffer));
    for (int i = 0; i < 15; ++i) buffer.data[i] = static_cast<float>(node->rank() + 1);
    ASSERT_OK(engine->Update(update));
    ASSERT_OK(engine->Clock());
  }
  ASSERT_OK(engine->Flush());
  ASSERT_OK(engine->WaitForDataAge(table, clocks - 1));
  fetched->assign(15, 0.0f);
  ASSERT_OK(engine->Fetch(table, {0, 1, 2, 3, 4}, fetched->data()));
}

}  // namespace

TEST(CreateRejectsBadRanks) {
  std::unique_ptr<ProcessNode> node;
  EXPECT_TRUE((ProcessNode::Create(TestConfig(), 2, 2, nullptr, &node).code() == StatusCode::kInvalidArgument));
  EXPECT_TRUE((ProcessNode::Create(TestConfig(), 0, 0, nullptr, &node).code() == StatusCode::kInvalidArgument));
}

TEST(TwoNodesTrainThroughTheWire) {
  Pair pair = MakePair();
  Wire wire(pair.node[0].get(), pair.node[1].get());
  std::vector<float> result[2];
  std::thread other([&] { Train(pair.node[1].get(), 6, &result[1]); });
  Train(pair.node[0].get(), 6, &result[0]);
  other.join();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(result[rank].size() == 15);
    for (float value : result[rank]) EXPECT_EQ(value, 18.0f);  // 6 clocks x (1 + 2)
  }
  EXPECT_EQ(wire.refused(), 0);
  EXPECT_EQ(pair.node[0]->rejected_messages(), 0);
}

TEST(ATinyOutboxLimitSlowsNothingButTheQueue) {
  // One message at a time in each outbox: sends wait for the wire to take
  // the last one, and training still ends with the same values.
  Pair pair = MakePair();
  for (auto& node : pair.node) node->SetOutboxLimit(1);
  Wire wire(pair.node[0].get(), pair.node[1].get());
  std::vector<float> result[2];
  std::thread other([&] { Train(pair.node[1].get(), 6, &result[1]); });
  Train(pair.node[0].get(), 6, &result[0]);
  other.join();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(result[rank].size() == 15);
    for (float value : result[rank]) EXPECT_EQ(value, 18.0f);
    // The largest message is a shard's slice of the table (3 rows x 3 floats).
    EXPECT_TRUE(pair.node[rank]->peak_outbox_bytes() <= 3 * 3 * 4);
  }
}

TEST(AFullOutboxMakesSendsWaitThenFailsTheJob) {
  Config config = TestConfig();
  config.wait_timeout_ms = 300;
  Pair pair;
  for (int rank = 0; rank < 2; ++rank) ASSERT_OK(ProcessNode::Create(config, rank, 2, nullptr, &pair.node[rank]));
  Handle update[2];
  {
    Wire wire(pair.node[0].get(), pair.node[1].get());  // for the set-up only
    auto set_up = [&](int rank) {
      Engine* engine = pair.node[rank]->engine();
      TableId table;
      ASSERT_OK(engine->CreateTable("t", 4, 3, false, &table));
      ASSERT_OK(engine->VirtualPreUpdate(table, {0, 1, 2, 3}, &update[rank]));
      ASSERT_OK(engine->VirtualUpdate(update[rank]));
      ASSERT_OK(engine->VirtualClock());
      ASSERT_OK(engine->FinishVirtualIteration());
      ASSERT_OK(engine->StartIterations());
    };
    std::thread other(set_up, 1);
    set_up(0);
    other.join();
  }
  // Nothing leaves rank 0 any more, and its outbox holds one message.
  pair.node[0]->SetOutboxLimit(1);
  Engine* engine = pair.node[0]->engine();
  Status status;
  const auto start = std::chrono::steady_clock::now();
  for (int clock = 0; clock < 1000 && status.ok(); ++clock) {
    AccessBuffer buffer;
    status = engine->PreUpdate(update[0], &buffer);
    if (status.ok()) status = engine->Update(update[0]);
    if (status.ok()) status = engine->Clock();
  }
  // The application's own wait for a buffer (which the blocked reclaimer
  // holds) may end first; the reclaimer's send then fails the node.
  EXPECT_TRUE((status.code() == StatusCode::kTimeout));
  while (!pair.node[0]->aborted() && std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(300));
  ASSERT_TRUE(pair.node[0]->aborted());
  AccessBuffer buffer;
  const Status later = engine->PreUpdate(update[0], &buffer);
  EXPECT_TRUE((later.code() == StatusCode::kTimeout));
  EXPECT_TRUE(later.message().find("the outbox to other processes") != std::string::npos);
  EXPECT_TRUE(later.message().find("worker rank 1 is not taking its messages") != std::string::npos);
  EXPECT_TRUE(pair.node[0]->peak_outbox_bytes() <= 2 * 3 * 4);  // one slice (2 rows x 3 floats) at a time
}

TEST(DeliverRefusesMisaddressedAndCorruptFrames) {
  Pair pair = MakePair();
  ProcessNode* node = pair.node[0].get();
  auto deliver = [&](const Message& message) {
    const std::string frame = EncodeHeaderFrame(message);
    return node->Deliver(frame.data(), frame.size(), message.values.data(), message.values.size() * sizeof(float));
  };
  EXPECT_TRUE((deliver(NewMessage(MessageType::kStart, 1, 1, 0)).code() == StatusCode::kCorruptMessage));  // not for me
  EXPECT_TRUE((deliver(NewMessage(MessageType::kStart, 0, 0, 0)).code() == StatusCode::kCorruptMessage));  // from myself
  EXPECT_TRUE((deliver(NewMessage(MessageType::kStart, 7, 0, 0)).code() == StatusCode::kCorruptMessage));  // unknown rank
  const char garbage[] = "definitely not a message";
  EXPECT_TRUE((node->Deliver(garbage, sizeof(garbage), nullptr, 0).code() == StatusCode::kCorruptMessage));
  EXPECT_EQ(node->rejected_messages(), 4);
}

TEST(AbortEndsABlockedWaitWithPeerLost) {
  Pair pair = MakePair();  // no wire: rank 1's shard never answers rank 0
  Engine* engine = pair.node[0]->engine();
  TableId table;
  ASSERT_OK(engine->CreateTable("t", 4, 2, false, &table));
  Status finished;
  std::thread blocked([&] {
    Handle read;
    Status status = engine->VirtualRead(table, {0, 1, 2, 3}, 0, &read);
    if (status.ok()) status = engine->VirtualPostRead(read);
    if (status.ok()) status = engine->VirtualClock();
    if (status.ok()) status = engine->FinishVirtualIteration();  // waits for rank 1's kReady
    finished = status;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  pair.node[0]->Abort(Status::PeerLost("worker rank 1 stopped answering"));
  blocked.join();
  EXPECT_TRUE((finished.code() == StatusCode::kPeerLost));
  EXPECT_TRUE(pair.node[0]->aborted());
  EXPECT_TRUE((engine->Fetch(table, {0}, nullptr).code() == StatusCode::kPeerLost));
}

TEST(ShardExportImportRoundTrip) {
  Pair pair = MakePair(UpdateRuleKind::kAdam);
  Wire wire(pair.node[0].get(), pair.node[1].get());
  std::vector<float> result[2];
  std::thread other([&] { Train(pair.node[1].get(), 3, &result[1]); });
  Train(pair.node[0].get(), 3, &result[0]);
  other.join();
  ShardSlice slice;
  ASSERT_OK(pair.node[1]->ExportShardTable(0, &slice));
  EXPECT_EQ(slice.first_row, 3);  // 5 rows over 2 shards: [0, 3) and [3, 5)
  EXPECT_EQ(slice.num_rows, 2);
  EXPECT_EQ(slice.state_arrays, 2);
  EXPECT_EQ(slice.state.size(), size_t{2 * 6 + 1});
  EXPECT_EQ(slice.state.back(), 3.0f);  // Adam's step count
  EXPECT_EQ(slice.global_clock, 2);
  for (size_t i = 0; i < slice.values.size(); ++i) EXPECT_EQ(slice.values[i], result[0][9 + i]);
  EXPECT_TRUE((pair.node[1]->ImportShardTable(0, slice.values.data(), 5, slice.state.data(), slice.state.size()).code() == StatusCode::kInvalidArgument));
  EXPECT_TRUE((pair.node[1]->ExportShardTable(9, &slice).code() == StatusCode::kNotFound));
}

MLT_TEST_MAIN

namespace {

// A model whose payloads take every send and receive path: table "a" has two
// updates per clock (the update log; rows recorded out of id order, so a
// shard's rows make several segments), table "b" one (sent straight from its
// buffer). Updates are a deterministic function of the rows read, the rank
// and the clock, so BSP gives the same bits however the payloads travel.
// `at_clock` runs after each clock's Clock().
void TrainModel(Engine* engine, int rank, int clocks, std::vector<float>* out,
                const std::function<void(int clock)>& at_clock) {
  TableId a, b;
  Handle read_a, read_b, up_a1, up_a2, up_b;
  ASSERT_OK(engine->CreateTable("a", 40, 7, false, &a));
  ASSERT_OK(engine->CreateTable("b", 13, 5, false, &b));
  std::vector<RowId> all_a, first_a, second_a, all_b;
  for (RowId row = 0; row < 40; ++row) all_a.push_back((row * 17) % 40);  // a permutation
  for (RowId row = 0; row < 40; row += 3) first_a.push_back(row);
  for (RowId row = 39; row >= 0; row -= 2) second_a.push_back(row);
  for (RowId row = 0; row < 13; ++row) all_b.push_back(row);
  ASSERT_OK(engine->VirtualRead(a, all_a, 0, &read_a));
  ASSERT_OK(engine->VirtualRead(b, all_b, 0, &read_b));
  ASSERT_OK(engine->VirtualPostRead(read_a));
  ASSERT_OK(engine->VirtualPostRead(read_b));
  ASSERT_OK(engine->VirtualPreUpdate(a, first_a, &up_a1));
  ASSERT_OK(engine->VirtualUpdate(up_a1));
  ASSERT_OK(engine->VirtualPreUpdate(b, all_b, &up_b));
  ASSERT_OK(engine->VirtualUpdate(up_b));
  ASSERT_OK(engine->VirtualPreUpdate(a, second_a, &up_a2));
  ASSERT_OK(engine->VirtualUpdate(up_a2));
  ASSERT_OK(engine->VirtualClock());
  ASSERT_OK(engine->FinishVirtualIteration());
  ASSERT_OK(engine->StartIterations());
  for (int clock = 0; clock < clocks; ++clock) {
    AccessBuffer ra, rb, ua1, ub, ua2;
    ASSERT_OK(engine->Read(read_a, &ra));
    ASSERT_OK(engine->Read(read_b, &rb));
    std::vector<float> va(ra.data, ra.data + 40 * 7), vb(rb.data, rb.data + 13 * 5);
    ASSERT_OK(engine->PostRead(read_a));
    ASSERT_OK(engine->PostRead(read_b));
    const auto grad = [&](float x, size_t i) {
      return static_cast<float>(std::sin(x * 0.37 + 0.01 * static_cast<double>(i) + rank + 0.1 * clock) * 0.01);
    };
    ASSERT_OK(engine->PreUpdate(up_a1, &ua1));
    for (size_t i = 0; i < first_a.size() * 7; ++i) ua1.data[i] = grad(va[i % va.size()], i);
    ASSERT_OK(engine->Update(up_a1));
    ASSERT_OK(engine->PreUpdate(up_b, &ub));
    for (size_t i = 0; i < vb.size(); ++i) ub.data[i] = grad(vb[i], i + 1000);
    ASSERT_OK(engine->Update(up_b));
    ASSERT_OK(engine->PreUpdate(up_a2, &ua2));
    for (size_t i = 0; i < second_a.size() * 7; ++i) ua2.data[i] = grad(va[(i * 3) % va.size()], i + 2000);
    ASSERT_OK(engine->Update(up_a2));
    ASSERT_OK(engine->Clock());
    if (at_clock) at_clock(clock);
  }
  ASSERT_OK(engine->Flush());
  ASSERT_OK(engine->WaitForDataAge(a, clocks - 1));
  ASSERT_OK(engine->WaitForDataAge(b, clocks - 1));
  std::vector<RowId> ids_a(40), ids_b(13);
  for (RowId row = 0; row < 40; ++row) ids_a[row] = row;
  for (RowId row = 0; row < 13; ++row) ids_b[row] = row;
  out->assign(40 * 7 + 13 * 5, 0.0f);
  ASSERT_OK(engine->Fetch(a, ids_a, out->data()));
  ASSERT_OK(engine->Fetch(b, ids_b, out->data() + 40 * 7));
}

}  // namespace

// Payloads to another process travel in recycled host frames (packed by one
// gather, landed by one scatter); within one process as device buffers. The
// two must give the same bits, and after the first clocks the frame pools
// allocate nothing.
TEST(RemoteFramesAreBitIdenticalToInProcessPayloadsAndRecycled) {
  constexpr int kClocks = 24;
  std::vector<float> local[2];
  {
    std::unique_ptr<LocalCluster> cluster;
    ASSERT_OK(LocalCluster::Create(TestConfig(UpdateRuleKind::kSgd), 2, &cluster));
    std::thread other([&] { TrainModel(cluster->worker(1), 1, kClocks, &local[1], nullptr); });
    TrainModel(cluster->worker(0), 0, kClocks, &local[0], nullptr);
    other.join();
    ASSERT_OK(cluster->Shutdown());
  }
  Pair pair = MakePair(UpdateRuleKind::kSgd);
  std::vector<float> remote[2];
  int64_t allocations_at[2][2] = {{-1, -1}, {-1, -1}};  // [rank][after clock 8, after the last]
  {
    Wire wire(pair.node[0].get(), pair.node[1].get());
    const auto run = [&](int rank) {
      ProcessNode* node = pair.node[rank].get();
      TrainModel(node->engine(), rank, kClocks, &remote[rank], [&](int clock) {
        if (clock == 8) allocations_at[rank][0] = node->receive_frames().allocations();
        if (clock == kClocks - 1) allocations_at[rank][1] = node->receive_frames().allocations();
      });
    };
    std::thread other(run, 1);
    run(0);
    other.join();
    EXPECT_EQ(wire.refused(), 0);
  }
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(remote[rank].size() == local[rank].size());
    EXPECT_TRUE(std::memcmp(remote[rank].data(), local[rank].data(), local[rank].size() * sizeof(float)) == 0);
    EXPECT_TRUE(remote[rank] == remote[0]);
    EXPECT_TRUE(std::any_of(remote[rank].begin(), remote[rank].end(), [](float v) { return v != 0.0f; }));
    EXPECT_TRUE(allocations_at[rank][0] > 0);
    // Each clock brings 4 payloads from the other process (updates and rows
    // of two tables): 96 in all. Frames are recycled, so the pool allocates
    // only for the most payloads ever alive at once, which BSP bounds to a
    // few clocks' worth (more when a thread of a loaded machine falls
    // behind), never one per message. The pool's own test checks the exact
    // count with a fixed number in flight (memory/host_frames_test).
    std::fprintf(stderr, "  rank %d: frames allocated %lld after clock 8, %lld after clock %d\n", rank,
                 static_cast<long long>(allocations_at[rank][0]), static_cast<long long>(allocations_at[rank][1]),
                 kClocks - 1);
    EXPECT_TRUE(allocations_at[rank][1] <= 4 * 4);
  }
  EXPECT_EQ(pair.node[0]->rejected_messages(), 0);
}
