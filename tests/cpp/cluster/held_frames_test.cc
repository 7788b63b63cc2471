// A host frame whose producer is still running (an update behind the
// application's backward pass, at slack >= 1) waits aside in the send
// thread, with the later messages for the same inbox of the same receiver,
// while the others leave: a shard's rows of the clock before never wait
// behind it. The device here is the CPU backend seen as a GPU
// (host frames for another process) whose writeback tickets stay incomplete
// until the test lets them go. A held message's bytes still count against
// the outbox's bound.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cluster/two_process_model.h"
#include "forwarding_device.h"
#include "mltuner/engine.h"
#include "mltuner/process_node.h"
#include "test_util.h"
#include "wire/message.h"

using namespace mltuner;
using mltuner::testing::Wire;

namespace {

constexpr int64_t kRows = 8;
constexpr int64_t kWidth = 4;

// Writeback tickets taken while held complete once Release is called.
class HeldWritebackDevice final : public ForwardingDevice {
 public:
  bool host_addressable() const override { return false; }  // as a GPU: host frames to another process
  void Hold() { holding_ = true; }
  void Release() { released_->store(true); }

  Status RecordEvent(Stream s, DeviceEvent* out) override {
    MLT_RETURN_IF_ERROR(ForwardingDevice::RecordEvent(s, out));
    *out = std::make_shared<std::shared_ptr<std::atomic<bool>>>(
        s == Stream::kWriteback && holding_ ? released_ : std::make_shared<std::atomic<bool>>(true));
    return Status::Ok();
  }
  Status QueryEvent(const DeviceEvent& event, bool* done) override {
    *done = Done(event);
    return Status::Ok();
  }
  // A thread that waits for a held ticket waits (up to 3 s: a test that
  // fails must not hang) as it would for a GPU.
  Status WaitEventDone(const DeviceEvent& event) override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!Done(event) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return Status::Ok();
  }

 private:
  static bool Done(const DeviceEvent& event) {
    return !event || (*std::static_pointer_cast<std::shared_ptr<std::atomic<bool>>>(event))->load();
  }
  std::atomic<bool> holding_{false};
  std::shared_ptr<std::atomic<bool>> released_ = std::make_shared<std::atomic<bool>>(false);
};

// Hands what `from` sends to `to` until `stop`.
std::thread Forward(ProcessNode* from, ProcessNode* to, const std::atomic<bool>* stop) {
  return std::thread([from, to, stop] {
    OutgoingMessage message;
    while (!*stop) {
      if (from->NextOutgoing(20, &message)) {
        ASSERT_OK(to->Deliver(message.header.data(), message.header.size(), message.payload_values(),
                              message.payload_bytes()));
      }
    }
  });
}

MessageType TypeOf(const OutgoingMessage& message) {
  MessageHeader header;
  std::memcpy(&header, message.header.data(), sizeof(header));
  return static_cast<MessageType>(header.type);
}

}  // namespace

TEST(RowsLeaveWhileAnEarlierUpdateFrameIsStillBeingFilled) {
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = UpdateRuleKind::kAdd;
  HeldWritebackDevice* device0 = nullptr;
  std::unique_ptr<ProcessNode> node[2];
  for (int rank = 0; rank < 2; ++rank) {
    auto device = std::make_unique<HeldWritebackDevice>();
    if (rank == 0) device0 = device.get();
    ASSERT_OK(ProcessNode::Create(config, rank, 2, std::move(device), &node[rank]));
  }
  TableId table[2];
  Handle update[2];
  {
    Wire wire(node[0].get(), node[1].get());  // for the set-up only
    auto set_up = [&](int rank) {
      Engine* engine = node[rank]->engine();
      std::vector<RowId> rows;
      for (RowId r = 0; r < kRows; ++r) rows.push_back(r);
      ASSERT_OK(engine->CreateTable("t", kRows, kWidth, false, &table[rank]));
      ASSERT_OK(engine->VirtualPreUpdate(table[rank], rows, &update[rank]));
      ASSERT_OK(engine->VirtualUpdate(update[rank]));
      ASSERT_OK(engine->VirtualClock());
      ASSERT_OK(engine->FinishVirtualIteration());
      ASSERT_OK(engine->StartIterations());
    };
    std::thread other([&] { set_up(1); });
    set_up(0);
    other.join();
  }
  auto run_clock = [&](int rank) {
    Engine* engine = node[rank]->engine();
    AccessBuffer buffer;
    ASSERT_OK(engine->PreUpdate(update[rank], &buffer));
    for (int64_t i = 0; i < kRows * kWidth; ++i) buffer.data[i] = static_cast<float>(rank + 1);
    ASSERT_OK(engine->Update(update[rank]));
    ASSERT_OK(engine->Clock());
  };
  // Rank 0's update for shard 1 is queued first, its frame held.
  device0->Hold();
  run_clock(0);
  ASSERT_OK(node[0]->engine()->Flush());
  // Then rank 1's update reaches shard 0, which pushes its rows to rank 1.
  run_clock(1);
  ASSERT_OK(node[1]->engine()->Flush());
  std::atomic<bool> stop{false};
  std::thread one_to_zero = Forward(node[1].get(), node[0].get(), &stop);
  // From rank 0: shard 0's rows for rank 1 come out while the update that
  // was queued before them still waits for its frame.
  std::vector<MessageType> sent;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline &&
         std::find(sent.begin(), sent.end(), MessageType::kRows) == sent.end()) {
    OutgoingMessage message;
    if (!node[0]->NextOutgoing(20, &message)) continue;
    sent.push_back(TypeOf(message));
    ASSERT_OK(node[1]->Deliver(message.header.data(), message.header.size(), message.payload_values(),
                               message.payload_bytes()));
  }
  EXPECT_TRUE(std::find(sent.begin(), sent.end(), MessageType::kRows) != sent.end());
  EXPECT_TRUE(std::find(sent.begin(), sent.end(), MessageType::kClockUpdate) == sent.end());
  EXPECT_TRUE(node[0]->outbox_bytes() >= kRows / 2 * kWidth * 4);  // the held update's frame still counts
  // Once its frame is filled the update leaves too, and the clock finishes.
  device0->Release();
  std::thread zero_to_one = Forward(node[0].get(), node[1].get(), &stop);
  for (int rank = 0; rank < 2; ++rank) ASSERT_OK(node[rank]->engine()->WaitForDataAge(table[rank], 0));
  std::vector<float> values(kRows * kWidth);
  std::vector<RowId> rows;
  for (RowId r = 0; r < kRows; ++r) rows.push_back(r);
  ASSERT_OK(node[1]->engine()->Fetch(table[1], rows, values.data()));
  for (float value : values) EXPECT_EQ(value, 3.0f);  // 1 + 2: both updates applied
  EXPECT_EQ(node[0]->outbox_bytes(), 0);
  stop = true;
  one_to_zero.join();
  zero_to_one.join();
  for (auto& n : node) ASSERT_OK(n->Shutdown());
}

MLT_TEST_MAIN
