// Inbox: a FIFO drained by one thread, bounded in payload bytes for what
// other processes push (PushBounded): a push waits while the bytes queued
// (and being delivered) would pass the limit, an empty inbox takes any one
// message, a wait ends with kTimeout, and StopWaiting / Stop end waits.
#include "cluster/shard_host.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "wire/message.h"

using namespace mltuner;

namespace {

// A message whose payload is `floats` host values, tagged by its clock.
Message Payload(int floats, int64_t tag) {
  Message message = NewMessage(MessageType::kClockUpdate, 1, 0, 0);
  message.header.clock = tag;
  message.values.assign(static_cast<size_t>(floats), 1.0f);
  return message;
}

// Holds every delivery until Open(); records the tags in order.
class Gate {
 public:
  void Deliver(Message&& message) {
    std::unique_lock<std::mutex> lock(mu_);
    open_cv_.wait(lock, [&] { return open_; });
    tags_.push_back(message.header.clock);
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    open_cv_.notify_all();
  }
  std::vector<int64_t> tags() {
    std::lock_guard<std::mutex> lock(mu_);
    return tags_;
  }

 private:
  std::mutex mu_;
  std::condition_variable open_cv_;
  bool open_ = false;
  std::vector<int64_t> tags_;
};

}  // namespace

TEST(AFullInboxMakesPushesWaitThenTimesOut) {
  Gate gate;
  Inbox inbox;
  inbox.SetLimit(100);  // bytes: 25 floats
  inbox.Start("test-inbox", [&](Message&& m) { gate.Deliver(std::move(m)); });
  ASSERT_OK(inbox.PushBounded(Payload(20, 0), 50));  // being delivered (held by the gate), still counted
  const auto start = std::chrono::steady_clock::now();
  const Status full = inbox.PushBounded(Payload(10, 1), 200);  // 80 + 40 > 100
  EXPECT_TRUE(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(200));
  EXPECT_TRUE((full.code() == StatusCode::kTimeout));
  EXPECT_TRUE(full.message().find("has held 80 bytes (its limit is 100)") != std::string::npos);
  EXPECT_EQ(inbox.queued_bytes(), 80);
  // Room comes back once the delivery ends: the waiting push then goes in.
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    gate.Open();
  });
  ASSERT_OK(inbox.PushBounded(Payload(10, 2), 5000));
  opener.join();
  inbox.Stop();
  EXPECT_TRUE((gate.tags() == std::vector<int64_t>{0, 2}));
  EXPECT_EQ(inbox.queued_bytes(), 0);
  EXPECT_TRUE(inbox.peak_bytes() <= 100);
}

TEST(DrainedRunsOnceABurstIsDeliveredBeforeTheThreadWaits) {
  // The shard sends its held replies from `drained`: once per burst of
  // messages, after the last of them, never while more are queued.
  Gate gate;
  std::mutex mu;
  std::vector<std::string> events;
  Inbox inbox;
  inbox.Start(
      "test-inbox",
      [&](Message&& m) {
        const int64_t tag = m.header.clock;
        gate.Deliver(std::move(m));
        std::lock_guard<std::mutex> lock(mu);
        events.push_back("m" + std::to_string(tag));
      },
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        events.push_back("drained");
      });
  for (int64_t tag = 0; tag < 3; ++tag) inbox.Push(Payload(1, tag));  // the first waits at the gate
  gate.Open();
  const auto settled = [&](size_t count) {
    for (int i = 0; i < 5000; ++i) {  // up to 10 s on a loaded machine
      {
        std::lock_guard<std::mutex> lock(mu);
        if (events.size() >= count) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  settled(4);
  inbox.Push(Payload(1, 3));
  settled(6);
  inbox.Stop();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_TRUE((events == std::vector<std::string>{"m0", "m1", "m2", "drained", "m3", "drained"}));
}

TEST(AnEmptyInboxTakesOneMessageLargerThanTheLimit) {
  Gate gate;
  Inbox inbox;
  inbox.SetLimit(16);
  inbox.Start("test-inbox", [&](Message&& m) { gate.Deliver(std::move(m)); });
  ASSERT_OK(inbox.PushBounded(Payload(100, 0), 0));  // 400 bytes, alone
  EXPECT_TRUE((inbox.PushBounded(Payload(1, 1), 20).code() == StatusCode::kTimeout));
  gate.Open();
  inbox.Stop();
  EXPECT_EQ(inbox.peak_bytes(), 400);
}

TEST(PushesFromThisProcessNeverWaitButCount) {
  Gate gate;
  Inbox inbox;
  inbox.SetLimit(8);
  inbox.Start("test-inbox", [&](Message&& m) { gate.Deliver(std::move(m)); });
  for (int i = 0; i < 5; ++i) inbox.Push(Payload(4, i));  // 16 bytes each, over the limit at once
  EXPECT_EQ(inbox.queued_bytes(), 80);
  EXPECT_TRUE((inbox.PushBounded(Payload(1, 9), 10).code() == StatusCode::kTimeout));
  gate.Open();
  inbox.Stop();
  EXPECT_TRUE((gate.tags() == std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(StopWaitingEndsAWaitAndQueues) {
  Gate gate;
  Inbox inbox;
  inbox.SetLimit(4);
  inbox.Start("test-inbox", [&](Message&& m) { gate.Deliver(std::move(m)); });
  ASSERT_OK(inbox.PushBounded(Payload(1, 0), 0));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    inbox.StopWaiting();  // as the node does when the job is aborted
  });
  const auto start = std::chrono::steady_clock::now();
  ASSERT_OK(inbox.PushBounded(Payload(1, 1), 10000));
  EXPECT_TRUE(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  aborter.join();
  gate.Open();
  inbox.Stop();
  EXPECT_TRUE((gate.tags() == std::vector<int64_t>{0, 1}));
}

TEST(NoLimitNeverWaits) {
  Gate gate;
  Inbox inbox;
  inbox.Start("test-inbox", [&](Message&& m) { gate.Deliver(std::move(m)); });
  for (int i = 0; i < 100; ++i) ASSERT_OK(inbox.PushBounded(Payload(1000, i), 0));
  EXPECT_EQ(inbox.peak_bytes(), 100 * 4000);
  gate.Open();
  inbox.Stop();
  EXPECT_EQ(static_cast<int>(gate.tags().size()), 100);
}

MLT_TEST_MAIN
