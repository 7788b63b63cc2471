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

#include "cluster/two_process_model.h"
#include "test_util.h"
#include "wire/batch.h"
#include "wire/message.h"

using namespace mltuner;
using mltuner::testing::TrainModel;
using mltuner::testing::Wire;

namespace {

Config TestConfig(UpdateRuleKind kind = UpdateRuleKind::kAdd) {
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = kind;
  config.update_rule.learning_rate = 0.5f;
  return config;
}

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

TEST(TinyQueueLimitsSlowNothingButTheQueues) {
  // One message at a time in each outbox and inbox: sends wait for the wire
  // to take the last one, deliveries for the shard or the installer to
  // finish the last one, and training still ends with the same values.
  Pair pair = MakePair();
  for (auto& node : pair.node) {
    node->SetOutboxLimit(1);
    node->SetInboxLimit(1);
  }
  Wire wire(pair.node[0].get(), pair.node[1].get());
  std::vector<float> result[2];
  std::thread other([&] { Train(pair.node[1].get(), 6, &result[1]); });
  Train(pair.node[0].get(), 6, &result[0]);
  other.join();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(result[rank].size() == 15);
    for (float value : result[rank]) EXPECT_EQ(value, 18.0f);
    // The largest message is a shard's slice of the table (3 rows x 3
    // floats). The engine's sends wait for an empty outbox; the shard's
    // replies never wait (its thread must keep draining its inbox): those of
    // the clocks this rank ran ahead, at most what the bounds on the way (its
    // outbox, the wire, the peer's inbox: a message each) let through, may
    // sit beside the engine's message.
    EXPECT_TRUE(pair.node[rank]->peak_outbox_bytes() <= 4 * (3 * 3 * 4));
    EXPECT_TRUE(pair.node[rank]->peak_inbox_bytes() > 0);  // the bound itself: inbox_test
  }
  EXPECT_EQ(wire.refused(), 0);
}

TEST(AFullOutboxMakesSendsWaitThenFailsTheJob) {
  Config config = TestConfig();
  config.wait_timeout_ms = 300;
  Pair pair;
  for (int rank = 0; rank < 2; ++rank) ASSERT_OK(ProcessNode::Create(config, rank, 2, nullptr, &pair.node[rank]));
  Handle read[2], update[2];
  {
    Wire wire(pair.node[0].get(), pair.node[1].get());  // for the set-up only
    auto set_up = [&](int rank) {
      Engine* engine = pair.node[rank]->engine();
      TableId table;
      ASSERT_OK(engine->CreateTable("t", 4, 3, false, &table));
      // A read with a large slack lets rank 0 run far ahead of the silent
      // rank 1 (an unread table would hold it two clocks ahead).
      ASSERT_OK(engine->VirtualRead(table, {0, 1, 2, 3}, 1000, &read[rank]));
      ASSERT_OK(engine->VirtualPostRead(read[rank]));
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
    status = engine->Read(read[0], &buffer);
    if (status.ok()) status = engine->PostRead(read[0]);
    if (status.ok()) status = engine->PreUpdate(update[0], &buffer);
    if (status.ok()) status = engine->Update(update[0]);
    if (status.ok()) status = engine->Clock();
  }
  // The application's own wait for a buffer (which the blocked reclaimer
  // holds) may end first; the reclaimer's send then fails the node.
  EXPECT_TRUE((status.code() == StatusCode::kTimeout));
  // Counted from here, not from the start: the loop's own wait may take
  // most of a loaded machine's first seconds. Unloaded the node fails within
  // 10 ms; a CI machine busy with other tests once took longer than 5 s.
  const auto stopped = std::chrono::steady_clock::now();
  while (!pair.node[0]->aborted() && std::chrono::steady_clock::now() - stopped < std::chrono::seconds(20)) {
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

// A kRows of `rows` rows of width 4 for `receiver`, numbered by request_id.
Message Numbered(int sender, int receiver, int64_t number, int64_t rows) {
  Message message = NewMessage(MessageType::kRows, sender, receiver, 0);
  message.header.request_id = number;
  message.header.row_width = 4;
  message.spans = {{0, rows}};
  message.values.assign(static_cast<size_t>(rows * 4), static_cast<float>(number));
  return message;
}

// The request ids of the messages in one socket message (a batch, or one).
std::vector<int64_t> Numbers(const OutgoingMessage& out) {
  std::vector<FramePair> parts;
  int sender = -1, receiver = -1;
  if (IsBatch(out.header.data(), out.header.size())) {
    if (!DecodeBatch(out.header.data(), out.header.size(), out.payload_values(), out.payload_bytes(), &parts,
                     &sender, &receiver).ok()) {
      return {-1};
    }
  } else {
    parts.push_back({out.header.data(), out.header.size(), out.payload_values(), out.payload_bytes()});
  }
  std::vector<int64_t> numbers;
  for (const FramePair& part : parts) {
    Message message;
    if (!DecodeMessage(part.frame0, part.frame0_bytes, part.payload, part.payload_bytes, &message).ok()) return {-2};
    numbers.push_back(message.header.request_id);
  }
  return numbers;
}

TEST(WaitingSmallMessagesLeaveAsOneBatchPerPeerInOrder) {
  std::unique_ptr<ProcessNode> node;
  ASSERT_OK(ProcessNode::Create(TestConfig(), 0, 3, nullptr, &node));
  const int64_t large = ProcessNode::kBatchBelowBytes / 16;  // rows of 16 bytes: a payload at the bound
  // For rank 1: 1, 2, then a large one (alone, as it is), then 4, 5. For rank 2: 3, 6.
  const std::vector<std::pair<int, int64_t>> sends = {{1, 2}, {1, 1}, {2, 3}, {1, large}, {1, 2}, {1, 5}, {2, 1}};
  for (size_t i = 0; i < sends.size(); ++i) {
    ASSERT_OK(node->Send(Numbered(0, sends[i].first, static_cast<int64_t>(i + 1), sends[i].second)));
  }
  std::vector<OutgoingMessage> out = node->NextOutgoingBatch(0, 64, size_t{1} << 20);
  ASSERT_EQ(out.size(), size_t{4});
  EXPECT_EQ(out[0].receiver, 1);
  EXPECT_TRUE(Numbers(out[0]) == (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(out[1].receiver, 1);
  EXPECT_TRUE(Numbers(out[1]) == (std::vector<int64_t>{4}));
  EXPECT_TRUE(!IsBatch(out[1].header.data(), out[1].header.size()));  // the large one, zero-copy
  EXPECT_TRUE(out[1].frame != nullptr || !out[1].payload.empty());
  EXPECT_EQ(out[2].receiver, 1);
  EXPECT_TRUE(Numbers(out[2]) == (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(out[3].receiver, 2);
  EXPECT_TRUE(Numbers(out[3]) == (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(node->outbox_messages(), 0);
  EXPECT_EQ(node->outbox_bytes(), 0);
  EXPECT_TRUE(node->NextOutgoingBatch(0, 64, size_t{1} << 20).empty());
}

TEST(SendAllQueuesABurstThatLeavesAsOneBatch) {
  std::unique_ptr<ProcessNode> node;
  ASSERT_OK(ProcessNode::Create(TestConfig(), 0, 2, nullptr, &node));
  // Sixteen tables' updates of 64 KiB each (under kBatchBelowBytes), as the
  // reclaimer hands them on after a step(): one socket message.
  const int64_t rows = (int64_t{64} << 10) / 16;
  std::vector<Message> burst;
  for (int64_t i = 1; i <= 16; ++i) burst.push_back(Numbered(0, 1, i, rows));
  ASSERT_OK(node->SendAll(std::move(burst)));
  EXPECT_EQ(node->outbox_messages(), 16);
  std::vector<OutgoingMessage> out = node->NextOutgoingBatch(0, 64, size_t{64} << 20);
  ASSERT_EQ(out.size(), size_t{1});
  EXPECT_TRUE(IsBatch(out[0].header.data(), out[0].header.size()));
  std::vector<int64_t> want(16);
  for (int64_t i = 0; i < 16; ++i) want[static_cast<size_t>(i)] = i + 1;
  EXPECT_TRUE(Numbers(out[0]) == want);
  EXPECT_TRUE(ProcessNode::kBatchBelowBytes > static_cast<size_t>(rows * 16));
  // A message to an unknown rank is refused, naming it.
  std::vector<Message> bad;
  bad.push_back(Numbered(0, 5, 1, 1));
  const Status refused = node->SendAll(std::move(bad));
  EXPECT_TRUE((refused.code() == StatusCode::kInvalidArgument));
  EXPECT_TRUE(refused.message().find("unknown process 5") != std::string::npos);
}

TEST(ABatchTakesAtMostItsMessagesAndBytes) {
  std::unique_ptr<ProcessNode> node;
  ASSERT_OK(ProcessNode::Create(TestConfig(), 0, 2, nullptr, &node));
  for (int64_t i = 1; i <= 5; ++i) ASSERT_OK(node->Send(Numbered(0, 1, i, 2)));  // 32 bytes each
  std::vector<OutgoingMessage> out = node->NextOutgoingBatch(0, 2, size_t{1} << 20);
  ASSERT_EQ(out.size(), size_t{1});
  EXPECT_TRUE(Numbers(out[0]) == (std::vector<int64_t>{1, 2}));
  out = node->NextOutgoingBatch(0, 64, 64);  // past the first, 64 payload bytes in all
  ASSERT_EQ(out.size(), size_t{1});
  EXPECT_TRUE(Numbers(out[0]) == (std::vector<int64_t>{3, 4}));
  out = node->NextOutgoingBatch(0, 64, 0);  // the first is always taken
  ASSERT_EQ(out.size(), size_t{1});
  EXPECT_TRUE(Numbers(out[0]) == (std::vector<int64_t>{5}));
}

TEST(DeliverOpensABatchAndRefusesItsBadPartsAlone) {
  Pair pair = MakePair();
  ProcessNode* node = pair.node[0].get();
  const auto encoded = [](const Message& message) {
    return std::pair<std::string, std::vector<float>>(EncodeHeaderFrame(message), message.values);
  };
  const auto batch = [&](int sender, int receiver, const std::vector<Message>& messages, std::string* frame0,
                         std::vector<float>* payload) {
    std::vector<std::pair<std::string, std::vector<float>>> kept;
    for (const Message& message : messages) kept.push_back(encoded(message));
    std::vector<FramePair> parts;
    for (const auto& [head, values] : kept) {
      parts.push_back({head.data(), head.size(), values.data(), values.size() * sizeof(float)});
    }
    return EncodeBatch(sender, receiver, parts, frame0, payload);
  };
  std::string frame0;
  std::vector<float> payload;
  // An envelope for another rank: refused whole, counted once.
  ASSERT_OK(batch(1, 1, {NewMessage(MessageType::kStart, 1, 0, 0)}, &frame0, &payload));
  EXPECT_TRUE((node->Deliver(frame0.data(), frame0.size(), payload.data(), payload.size() * 4).code() == StatusCode::kCorruptMessage));
  EXPECT_EQ(node->rejected_messages(), 1);
  // A good envelope with one part from myself and one not for me: both parts
  // refused and counted, the call reports the first.
  ASSERT_OK(batch(1, 0, {NewMessage(MessageType::kStart, 0, 0, 0), NewMessage(MessageType::kStart, 1, 1, 0)}, &frame0,
                  &payload));
  const Status refused = node->Deliver(frame0.data(), frame0.size(), payload.data(), payload.size() * 4);
  EXPECT_TRUE((refused.code() == StatusCode::kCorruptMessage));
  EXPECT_TRUE(refused.message().find("from process 0") != std::string::npos);
  EXPECT_EQ(node->rejected_messages(), 3);
}

// Training through a wire that takes batches (as the socket transport does)
// gives the bits of one process, and batches did form.
TEST(BatchedTrafficIsBitIdenticalToInProcessPayloads) {
  const Config config = TestConfig(UpdateRuleKind::kSgd);
  const int kClocks = 12;
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local);
  testing::TwoNodeRun remote;
  testing::TrainInTwoProcesses(config, nullptr, kClocks, &remote, {}, /*lend=*/false, /*batches=*/true);
  EXPECT_EQ(remote.refused, 0);
  EXPECT_EQ(remote.rejected, 0);
  EXPECT_TRUE(remote.batches > 0);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(remote.values[rank].size() == local[rank].size());
    EXPECT_TRUE(std::memcmp(remote.values[rank].data(), local[rank].data(), local[rank].size() * sizeof(float)) == 0);
  }
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


// Payloads to another process travel in recycled host frames (packed by one
// gather, landed by one scatter); within one process as device buffers. The
// two must give the same bits — with every row device-resident, and with a
// budget that leaves some rows in host memory (the per-segment paths beside
// the kernels) — and the frame pools must recycle.
void ExpectRemoteFramesMatchOneProcess(const Config& config) {
  constexpr int kClocks = 24;
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local);
  testing::TwoNodeRun remote;
  testing::TrainInTwoProcesses(config, nullptr, kClocks, &remote);
  EXPECT_EQ(remote.refused, 0);
  EXPECT_EQ(remote.rejected, 0);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(remote.values[rank].size() == local[rank].size());
    EXPECT_TRUE(std::memcmp(remote.values[rank].data(), local[rank].data(), local[rank].size() * sizeof(float)) == 0);
    EXPECT_TRUE(remote.values[rank] == remote.values[0]);
    EXPECT_TRUE(std::any_of(remote.values[rank].begin(), remote.values[rank].end(), [](float v) { return v != 0.0f; }));
    // Each clock brings 4 payloads from the other process (updates and rows
    // of two tables): 96 in all. Frames are recycled, so the pool allocates
    // only for the most payloads ever alive at once, which BSP and the
    // bounded inboxes keep to a few clocks' worth, never one per message.
    // How many clocks' worth depends on timing: host-resident rows install
    // slower, and on a loaded 2-core machine up to 18 frames were seen
    // (4-8 unloaded). The pool's own test checks the exact count with a
    // fixed number in flight (memory/host_frames_test).
    std::fprintf(stderr, "  rank %d: frames allocated %lld after clock 8, %lld after clock %d\n", rank,
                 static_cast<long long>(remote.frames_at[rank][0]), static_cast<long long>(remote.frames_at[rank][1]),
                 kClocks - 1);
    EXPECT_TRUE(remote.frames_at[rank][0] > 0);
    EXPECT_TRUE(remote.frames_at[rank][1] <= 8 * 4);
  }
}

TEST(RemoteFramesAreBitIdenticalToInProcessPayloadsAndRecycled) {
  ExpectRemoteFramesMatchOneProcess(TestConfig(UpdateRuleKind::kSgd));
}

// The socket transport's receive path on the CPU backend: each payload is
// used where it was received (no copy into a frame of the node's own), read
// only, and handed back once applied or installed.
TEST(PayloadsUsedInPlaceAreBitIdenticalNeverWrittenAndAllHandedBack) {
  const Config config = TestConfig(UpdateRuleKind::kSgd);
  const int kClocks = 12;
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local);
  testing::TwoNodeRun remote;
  testing::TrainInTwoProcesses(config, nullptr, kClocks, &remote, {}, /*lend=*/true);
  EXPECT_EQ(remote.refused, 0);
  EXPECT_EQ(remote.rejected, 0);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(remote.values[rank].size() == local[rank].size());
    EXPECT_TRUE(std::memcmp(remote.values[rank].data(), local[rank].data(), local[rank].size() * sizeof(float)) == 0);
    // Used in place: no frame of the node's own was needed for any payload.
    EXPECT_EQ(remote.frames_at[rank][1], 0);
  }
  // Every clock, each process receives 4 payloads (updates and rows of two tables).
  EXPECT_TRUE(remote.lent_returned >= 2 * 4 * kClocks);
  EXPECT_EQ(remote.lent_written, 0);
  EXPECT_EQ(remote.lent_unreturned, 0);
}

TEST(RemoteFramesWithHostResidentRowsAreBitIdentical) {
  Config config = TestConfig(UpdateRuleKind::kSgd);
  const int64_t deepest_pool = testing::ModelPreview(config).pool_bytes;  // no budget: the deepest lookahead
  ASSERT_TRUE(deepest_pool > 0);
  config.device_memory_budget = deepest_pool + 1200;  // beside it, about half of table a's rows (cache + log) fit
  const PlanPreview preview = testing::ModelPreview(config);
  EXPECT_TRUE(preview.fits && preview.host_store_bytes > 0 && preview.device_store_bytes > 0);
  ExpectRemoteFramesMatchOneProcess(config);
}
