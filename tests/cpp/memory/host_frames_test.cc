// Host frames (DeviceBufferPool over host memory): recycling by size, no
// allocation in a steady state whose bytes in flight fit the idle bound, the
// bound itself, and the tickets: a recycled frame's next writer waits for
// its last use (its stream on the device, or its thread for a host writer).
#include "memory/device_block.h"

#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "forwarding_device.h"
#include "test_util.h"

namespace mltuner {
namespace {

// The CPU backend, counting allocations by kind, handing out real (non-null)
// tickets, and logging which tickets streams and threads waited for.
class CountingDevice final : public ForwardingDevice {
 public:
  std::string name() const override { return "counting-cpu"; }
  Status Allocate(size_t b, void** out) override {
    ++device_allocations;
    return ForwardingDevice::Allocate(b, out);
  }
  Status AllocateHost(size_t b, void** out) override {
    ++host_allocations;
    return ForwardingDevice::AllocateHost(b, out);
  }
  void FreeHost(void* p) override {
    ++host_frees;
    ForwardingDevice::FreeHost(p);
  }
  Status Synchronize(Stream) override { return Status::Ok(); }
  Status TakeError() override { return Status::Ok(); }
  Status RecordEvent(Stream, DeviceEvent* out) override {
    *out = std::make_shared<int>(0);
    return Status::Ok();
  }
  Status WaitEvent(Stream s, const DeviceEvent& event) override {
    std::lock_guard<std::mutex> lock(mu);
    if (event) stream_waits.push_back({s, event});
    return Status::Ok();
  }
  Status WaitOnAppStream(uintptr_t, const DeviceEvent&) override { return Status::Ok(); }
  Status WaitEventDone(const DeviceEvent& event) override {
    std::lock_guard<std::mutex> lock(mu);
    if (event) thread_waits.push_back(event);
    return Status::Ok();
  }

  int device_allocations = 0;
  int host_allocations = 0;
  int host_frees = 0;
  std::mutex mu;
  std::vector<std::pair<Stream, DeviceEvent>> stream_waits;
  std::vector<DeviceEvent> thread_waits;
};

TEST(HostFramesComeFromAllocateHostAndAreRecycledBySize) {
  auto device = std::make_shared<CountingDevice>();
  DeviceBufferPool frames(device, 1 << 20, /*host=*/true);
  EXPECT_TRUE(frames.host());
  float* first = nullptr;
  {
    std::shared_ptr<DeviceBuffer> frame;
    ASSERT_OK(frames.Acquire(100, Stream::kWriteback, &frame));
    EXPECT_EQ(frame->count, 100u);
    EXPECT_TRUE(frame->block->host());
    first = frame->data;
  }
  EXPECT_EQ(device->host_allocations, 1);
  EXPECT_EQ(device->device_allocations, 0);
  EXPECT_EQ(frames.idle_bytes(), 400u);
  std::shared_ptr<DeviceBuffer> again, other;
  ASSERT_OK(frames.Acquire(100, Stream::kWriteback, &again));
  EXPECT_TRUE(again->data == first);  // the same memory
  ASSERT_OK(frames.Acquire(50, Stream::kWriteback, &other));  // another size: a new frame
  EXPECT_TRUE(other->data != first);
  EXPECT_EQ(frames.allocations(), 2);
  EXPECT_EQ(device->host_allocations, 2);
}

// A frame goes back at once, carrying its last use's ticket: nothing blocks
// when it is released, and its next writer waits for the ticket — a device
// writer on its stream, a host writer (a received payload's memcpy) on its
// thread. Without a consumer's ticket, the producer's `ready` is the last use.
TEST(ARecycledFramesNextWriterWaitsForItsLastUse) {
  auto device = std::make_shared<CountingDevice>();
  DeviceBufferPool frames(device, 1 << 20, /*host=*/true);
  DeviceEvent read_by_copy;
  {
    std::shared_ptr<DeviceBuffer> frame;
    ASSERT_OK(frames.Acquire(64, Stream::kWriteback, &frame));
    ASSERT_OK(device->RecordEvent(Stream::kPrefetch, &frame->last_use));
    read_by_copy = frame->last_use;
  }
  EXPECT_TRUE(device->thread_waits.empty());  // releasing waited for nothing
  {
    std::shared_ptr<DeviceBuffer> frame;
    ASSERT_OK(frames.Acquire(64, Stream::kWriteback, &frame));
    ASSERT_TRUE(device->stream_waits.size() == 1);
    EXPECT_TRUE(device->stream_waits[0].first == Stream::kWriteback);
    EXPECT_TRUE(device->stream_waits[0].second == read_by_copy);
    EXPECT_TRUE(frame->ready == nullptr && frame->last_use == nullptr);  // fresh tickets
    ASSERT_OK(device->RecordEvent(Stream::kWriteback, &frame->ready));  // filled; nobody read it
    read_by_copy = frame->ready;
  }
  std::shared_ptr<DeviceBuffer> frame;
  ASSERT_OK(frames.AcquireForHost(64, &frame));
  ASSERT_TRUE(device->thread_waits.size() == 1);
  EXPECT_TRUE(device->thread_waits[0] == read_by_copy);
  EXPECT_EQ(frames.allocations(), 1);
  // WaitReady: a consumer on the host waits for the producer's ticket.
  ASSERT_OK(device->RecordEvent(Stream::kWriteback, &frame->ready));
  ASSERT_OK(WaitReady(frame.get()));
  EXPECT_TRUE(device->thread_waits.size() == 2 && device->thread_waits[1] == frame->ready);
  ASSERT_OK(WaitReady(nullptr));
}

// A frame read by several consumers at once (one push to the workers of
// other GPUs of a LocalCluster): each reads through its own view and leaves
// its own last use from its own thread; the frame goes back only with the
// last view, and its next writer waits for every consumer's ticket. (Once
// the consumers wrote one `last_use` of the shared frame: a data race that
// crashed multi-GPU LocalClusters, and the pool waited for one reader only.)
TEST(ASharedFramesNextWriterWaitsForEveryViewsLastUse) {
  auto device = std::make_shared<CountingDevice>();
  DeviceBufferPool frames(device, 1 << 20, /*host=*/true);
  constexpr int kReaders = 3;
  std::vector<DeviceEvent> reads(kReaders);
  {
    std::shared_ptr<DeviceBuffer> frame;
    ASSERT_OK(frames.Acquire(64, Stream::kServer, &frame));
    ASSERT_OK(device->RecordEvent(Stream::kServer, &frame->ready));
    std::vector<std::shared_ptr<DeviceBuffer>> views;
    for (int k = 0; k < kReaders; ++k) views.push_back(ShareView(frame));
    frame.reset();  // the views keep it
    EXPECT_EQ(frames.idle_bytes(), 0u);
    for (int k = 0; k < kReaders; ++k) {
      EXPECT_TRUE(views[k]->data == views[0]->data && views[k]->count == 64u && views[k]->ready == views[0]->ready);
      EXPECT_TRUE(views[k]->borrowed);
      ASSERT_OK(device->RecordEvent(Stream::kInstall, &reads[k]));
    }
    std::vector<std::thread> readers;
    for (int k = 0; k < kReaders; ++k) {
      readers.emplace_back([&views, &reads, k] {
        views[k]->last_use = reads[k];
        views[k].reset();
      });
    }
    for (std::thread& reader : readers) reader.join();
  }
  EXPECT_EQ(frames.idle_bytes(), 256u);  // back once the last view went
  std::shared_ptr<DeviceBuffer> frame;
  ASSERT_OK(frames.Acquire(64, Stream::kServer, &frame));
  EXPECT_EQ(frames.allocations(), 1);
  ASSERT_TRUE(device->stream_waits.size() == static_cast<size_t>(kReaders) + 1);  // the producer's `ready` too
  for (const DeviceEvent& read : reads) {
    bool waited = false;
    for (const auto& [stream, ticket] : device->stream_waits) waited |= stream == Stream::kServer && ticket == read;
    EXPECT_TRUE(waited);
  }
  EXPECT_TRUE(frame->shared_uses == nullptr);  // a fresh frame
}

// Clocks of payloads (sizes repeating every clock), each alive for `in_flight`
// clocks (until the shard applied them, or ZeroMQ sent them). With the idle
// bound at one clock's bytes times the clocks in flight, the steady state
// allocates nothing; a bound below that allocates every clock.
int64_t AllocationsAfterClocks(size_t idle_bound, int clocks, int in_flight, int64_t* after_warmup) {
  auto device = std::make_shared<CountingDevice>();
  DeviceBufferPool frames(device, idle_bound, /*host=*/true);
  const std::vector<size_t> sizes = {1000, 37, 1000, 4096, 5};  // two tables of one size
  std::deque<std::vector<std::shared_ptr<DeviceBuffer>>> alive;
  for (int clock = 0; clock < clocks; ++clock) {
    std::vector<std::shared_ptr<DeviceBuffer>> batch;
    for (size_t count : sizes) {
      batch.emplace_back();
      if (!frames.Acquire(count, Stream::kWriteback, &batch.back()).ok()) return -1;
    }
    alive.push_back(std::move(batch));
    if (static_cast<int>(alive.size()) > in_flight) alive.pop_front();
    if (clock == in_flight + 1) *after_warmup = frames.allocations();
  }
  return frames.allocations();
}

TEST(SteadyStateAllocatesNothingWithinTheBoundFromThePlan) {
  const size_t per_clock = (1000 + 37 + 1000 + 4096 + 5) * sizeof(float);
  const int in_flight = 3;  // slack 1 + 2
  int64_t warm = 0;
  const int64_t total = AllocationsAfterClocks(per_clock * in_flight, 50, in_flight, &warm);
  EXPECT_EQ(warm, 5 * (in_flight + 1));  // the clocks in flight, and the one being filled
  EXPECT_EQ(total, warm);
  // Too small a bound: frees and allocates again every clock.
  int64_t small_warm = 0;
  const int64_t small = AllocationsAfterClocks(per_clock / 2, 50, in_flight, &small_warm);
  EXPECT_TRUE(small > small_warm + 40);
}

TEST(TheIdleBoundFreesAboveItAndCanFollowThePeak) {
  auto device = std::make_shared<CountingDevice>();
  DeviceBufferPool frames(device, 1 << 20, /*host=*/true);
  {
    std::vector<std::shared_ptr<DeviceBuffer>> held(4);
    for (auto& frame : held) ASSERT_OK(frames.Acquire(256, Stream::kWriteback, &frame));
  }
  EXPECT_EQ(frames.idle_bytes(), 4u * 1024u);
  frames.set_max_idle_bytes(2048);  // the plan's bound: two frames stay
  EXPECT_EQ(frames.idle_bytes(), 2048u);
  EXPECT_EQ(device->host_frees, 2);

  // Bound to the peak: whatever was in use at once stays idle for the next
  // round, starting from a bound of zero.
  auto peak_device = std::make_shared<CountingDevice>();
  DeviceBufferPool peak(peak_device, 0, /*host=*/true);
  peak.set_idle_bound_to_peak(true);
  for (int round = 0; round < 10; ++round) {
    std::vector<std::shared_ptr<DeviceBuffer>> held(3);
    for (auto& frame : held) ASSERT_OK(peak.Acquire(100, Stream::kReceive, &frame));
  }
  EXPECT_EQ(peak.allocations(), 3);
  EXPECT_EQ(peak_device->host_frees, 0);
}

// A frame outlives its pool (ZeroMQ may still hold one at shutdown): it is
// freed when let go.
TEST(AFrameOutlivesItsPool) {
  auto device = std::make_shared<CountingDevice>();
  std::shared_ptr<DeviceBuffer> frame;
  {
    DeviceBufferPool frames(device, 1 << 20, /*host=*/true);
    ASSERT_OK(frames.Acquire(10, Stream::kWriteback, &frame));
  }
  frame->data[9] = 1.0f;
  frame.reset();
  EXPECT_EQ(device->host_frees, 1);
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
