// PayloadBound: payloads beyond the limit wait until a held one is given
// back by its last owner (from any thread), one payload above the limit goes
// alone, the bytes are given back with the buffer (which returns to its
// pool), and a wait ends in a Timeout or, once stopping, a Shutdown.
#include "memory/payload_bound.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "test_util.h"

namespace mltuner {
namespace {

std::function<Status(std::shared_ptr<DeviceBuffer>*)> From(DeviceBufferPool* pool, size_t count) {
  return [pool, count](std::shared_ptr<DeviceBuffer>* out) { return pool->Acquire(count, Stream::kWriteback, out); };
}

const std::function<bool()> kNever = [] { return false; };

TEST(APayloadPastTheLimitWaitsForOneToBeGivenBack) {
  DeviceBufferPool pool(std::shared_ptr<Device>(NewCpuDevice()), 1 << 20);
  PayloadBound bound(64);  // 16 floats
  std::shared_ptr<DeviceBuffer> first, second;
  ASSERT_OK(bound.Take(8, 1000, kNever, From(&pool, 8), &first));
  EXPECT_TRUE(bound.HasRoom(8));
  ASSERT_OK(bound.Take(8, 1000, kNever, From(&pool, 8), &second));
  EXPECT_EQ(bound.held_bytes(), 64);
  EXPECT_TRUE(!bound.HasRoom(1));  // Take would wait: the reclaimer sends what it holds first
  std::shared_ptr<DeviceBuffer> copy = first;  // a second owner: the bytes stay until both let go
  std::thread shard([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    first.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    copy.reset();
  });
  const auto started = std::chrono::steady_clock::now();
  std::shared_ptr<DeviceBuffer> third;
  ASSERT_OK(bound.Take(8, 2000, kNever, From(&pool, 8), &third));
  EXPECT_TRUE(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(70));
  shard.join();
  EXPECT_EQ(bound.held_bytes(), 64);
  EXPECT_EQ(pool.allocations(), 2);  // the third reused the first's buffer, back in its pool
  second.reset();
  third.reset();
  EXPECT_EQ(bound.held_bytes(), 0);
  EXPECT_EQ(bound.peak_bytes(), 64);
}

TEST(OnePayloadAboveTheLimitGoesAlone) {
  DeviceBufferPool pool(std::shared_ptr<Device>(NewCpuDevice()), 1 << 20);
  PayloadBound bound(16);
  std::shared_ptr<DeviceBuffer> big;
  ASSERT_OK(bound.Take(100, 1000, kNever, From(&pool, 100), &big));
  EXPECT_EQ(big->count, size_t{100});
  std::shared_ptr<DeviceBuffer> small;
  const Status waited = bound.Take(1, 50, kNever, From(&pool, 1), &small);
  EXPECT_CODE(waited, StatusCode::kTimeout);
  EXPECT_TRUE(waited.message().find("400 B of them not yet applied after 50 ms") != std::string::npos);
  big.reset();
  ASSERT_OK(bound.Take(1, 50, kNever, From(&pool, 1), &small));
}

TEST(AWaitEndsWhenStoppingAndAFailedAcquireHoldsNothing) {
  DeviceBufferPool pool(std::shared_ptr<Device>(NewCpuDevice()), 1 << 20);
  PayloadBound bound(16);
  std::shared_ptr<DeviceBuffer> held;
  ASSERT_OK(bound.Take(4, 1000, kNever, From(&pool, 4), &held));
  std::atomic<bool> stopping{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    stopping = true;
  });
  std::shared_ptr<DeviceBuffer> more;
  EXPECT_CODE(bound.Take(4, 10000, [&] { return stopping.load(); }, From(&pool, 4), &more), StatusCode::kShutdown);
  stopper.join();
  held.reset();
  const auto refuse = [](std::shared_ptr<DeviceBuffer>*) { return Status::ResourceExhausted("no memory"); };
  EXPECT_CODE(bound.Take(4, 1000, kNever, refuse, &more), StatusCode::kResourceExhausted);
  EXPECT_EQ(bound.held_bytes(), 0);
  EXPECT_EQ(PayloadBound(0).limit_bytes(), 0);  // no bound
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
