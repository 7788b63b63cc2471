// Arena: alignment, next-fit order, blocking, close, and a concurrent stress.
#include "memory/arena.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "test_util.h"

namespace mltuner {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kNoWait{0};

TEST(RoundsToAlignment) {
  Arena arena(4096, 256);
  size_t a = 1, b = 1, c = 1;
  ASSERT_OK(arena.Allocate(1, kNoWait, &a));
  ASSERT_OK(arena.Allocate(257, kNoWait, &b));
  ASSERT_OK(arena.Allocate(256, kNoWait, &c));
  EXPECT_EQ(a, size_t{0});
  EXPECT_EQ(b, size_t{256});
  EXPECT_EQ(c, size_t{768});
  EXPECT_EQ(arena.used(), size_t{1024});
  for (size_t off : {a, b, c}) EXPECT_EQ(off % 256, size_t{0});

  Arena small(1000, 64);
  size_t d = 0;
  ASSERT_OK(small.Allocate(65, kNoWait, &d));
  EXPECT_EQ(small.used(), size_t{128});
}

TEST(RefusesZeroAndTooBig) {
  Arena arena(1024, 256);
  size_t off = 0;
  EXPECT_CODE(arena.Allocate(0, kNoWait, &off), StatusCode::kInvalidArgument);
  const Status s = arena.Allocate(2048, kNoWait, &off);
  EXPECT_CODE(s, StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.message().find("2048") != std::string::npos);
  EXPECT_TRUE(s.message().find("1024") != std::string::npos);
  EXPECT_CODE(arena.Allocate(SIZE_MAX, kNoWait, &off), StatusCode::kResourceExhausted);
  // Fits in bytes but not after rounding up to the alignment.
  Arena ragged(1000, 256);
  EXPECT_CODE(ragged.Allocate(900, kNoWait, &off), StatusCode::kResourceExhausted);
  EXPECT_TRUE(!arena.TryAllocate(0, &off));
  EXPECT_TRUE(!arena.TryAllocate(2048, &off));
  EXPECT_EQ(arena.num_allocations(), size_t{0});
}

TEST(NextFitWrapsAround) {
  Arena arena(1024, 256);
  size_t off[4];
  for (size_t& o : off) ASSERT_TRUE(arena.TryAllocate(256, &o));
  EXPECT_EQ(off[3], size_t{768});
  size_t extra = 0;
  EXPECT_TRUE(!arena.TryAllocate(1, &extra));  // full

  // Free the first two: the search starts at the end, wraps, takes 0 then 256.
  arena.Free(off[0]);
  arena.Free(off[1]);
  ASSERT_TRUE(arena.TryAllocate(256, &extra));
  EXPECT_EQ(extra, size_t{0});
  ASSERT_TRUE(arena.TryAllocate(256, &extra));
  EXPECT_EQ(extra, size_t{256});

  // Next-fit, not first-fit: with holes at 0 and 512, a search starting at
  // 512 (just after the last block) takes 512 first, then wraps to 0.
  arena.Free(0);
  arena.Free(off[2]);  // 512
  ASSERT_TRUE(arena.TryAllocate(256, &extra));
  EXPECT_EQ(extra, size_t{512});
  ASSERT_TRUE(arena.TryAllocate(256, &extra));
  EXPECT_EQ(extra, size_t{0});

  // A hole too small ahead is skipped for a big enough one further on.
  Arena ring(2048, 256);
  size_t b[8];
  for (size_t& o : b) ASSERT_TRUE(ring.TryAllocate(256, &o));
  ring.Free(b[2]);  // [512, 768)
  size_t got = 0;
  ASSERT_TRUE(ring.TryAllocate(256, &got));  // wraps from 2048 to the first hole
  EXPECT_EQ(got, size_t{512});               // the search now resumes at 768
  ring.Free(b[4]);  // [1024, 1280): too small for 512
  ring.Free(b[6]);
  ring.Free(b[7]);  // [1536, 2048)
  ASSERT_TRUE(ring.TryAllocate(512, &got));
  EXPECT_EQ(got, size_t{1536});
  ring.Free(b[0]);  // [0, 256); the search resumes at 2048 and wraps
  ASSERT_TRUE(ring.TryAllocate(256, &got));
  EXPECT_EQ(got, size_t{0});
  ASSERT_TRUE(ring.TryAllocate(256, &got));  // resumes at 256: the next hole is [1024, 1280)
  EXPECT_EQ(got, size_t{1024});
}

TEST(BlockingAllocateWokenByFree) {
  Arena arena(1024, 256);
  size_t a = 0, b = 0;
  ASSERT_OK(arena.Allocate(512, kNoWait, &a));
  ASSERT_OK(arena.Allocate(512, kNoWait, &b));
  std::thread freer([&] {
    std::this_thread::sleep_for(milliseconds(30));
    arena.Free(b);
  });
  size_t c = 99;
  const auto start = std::chrono::steady_clock::now();
  const Status s = arena.Allocate(512, milliseconds(10000), &c);
  const auto waited = std::chrono::steady_clock::now() - start;
  freer.join();
  ASSERT_OK(s);
  EXPECT_EQ(c, size_t{512});
  EXPECT_TRUE(waited < milliseconds(5000));
}

TEST(TimesOutWhenNothingIsFreed) {
  Arena arena(1024, 256);
  size_t a = 0;
  ASSERT_OK(arena.Allocate(1024, kNoWait, &a));
  size_t b = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_CODE(arena.Allocate(256, milliseconds(50), &b), StatusCode::kTimeout);
  EXPECT_TRUE(std::chrono::steady_clock::now() - start >= milliseconds(50));
  EXPECT_CODE(arena.Allocate(256, kNoWait, &b), StatusCode::kTimeout);
  EXPECT_CODE(arena.Allocate(256, milliseconds(-5), &b), StatusCode::kTimeout);
  EXPECT_EQ(arena.num_allocations(), size_t{1});
}

TEST(CloseWakesWaiters) {
  Arena arena(1024, 256);
  size_t a = 0;
  ASSERT_OK(arena.Allocate(1024, kNoWait, &a));
  std::vector<Status> results(3);
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&, i] {
      size_t off = 0;
      results[i] = arena.Allocate(256, std::chrono::milliseconds::max(), &off);
    });
  }
  std::this_thread::sleep_for(milliseconds(30));
  arena.Close();
  for (std::thread& t : waiters) t.join();
  for (const Status& s : results) EXPECT_CODE(s, StatusCode::kShutdown);
  // Later calls fail at once, even with room.
  arena.Free(a);
  size_t b = 0;
  EXPECT_CODE(arena.Allocate(256, milliseconds(1000), &b), StatusCode::kShutdown);
  EXPECT_TRUE(!arena.TryAllocate(256, &b));
}

TEST(Bookkeeping) {
  Arena arena(1 << 20, 256);
  EXPECT_EQ(arena.capacity(), size_t{1} << 20);
  std::vector<size_t> offsets;
  size_t expect_used = 0;
  for (size_t bytes : {100, 256, 1000, 4096, 1}) {
    size_t off = 0;
    ASSERT_OK(arena.Allocate(bytes, kNoWait, &off));
    offsets.push_back(off);
    expect_used += (bytes + 255) / 256 * 256;
    EXPECT_EQ(arena.used(), expect_used);
    EXPECT_EQ(arena.num_allocations(), offsets.size());
  }
  for (size_t off : offsets) arena.Free(off);
  EXPECT_EQ(arena.used(), size_t{0});
  EXPECT_EQ(arena.num_allocations(), size_t{0});
}

// Two producers allocate random sizes (blocking), a consumer frees them in
// random order. A shadow map of live blocks checks that no two overlap.
TEST(ConcurrentStressNeverOverlaps) {
  constexpr size_t kCapacity = 64 * 1024;
  constexpr size_t kAlign = 64;
  constexpr int kPerProducer = 3000;
  Arena arena(kCapacity, kAlign);

  std::mutex mu;
  std::map<size_t, size_t> live;  // offset -> requested bytes, guarded by mu
  std::vector<size_t> to_free;    // guarded by mu
  std::atomic<int> overlaps{0};
  std::atomic<int> failures{0};
  std::atomic<int> producers_done{0};

  auto produce = [&](uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < kPerProducer; ++i) {
      const size_t bytes = 1 + rng() % (kCapacity / 8);
      size_t off = 0;
      if (!arena.Allocate(bytes, milliseconds(10000), &off).ok()) {
        ++failures;
        continue;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (off % kAlign != 0 || off + bytes > kCapacity) ++overlaps;
      auto next = live.lower_bound(off);
      if (next != live.end() && next->first < off + bytes) ++overlaps;
      if (next != live.begin() && std::prev(next)->first + std::prev(next)->second > off) ++overlaps;
      live.emplace(off, bytes);
      to_free.push_back(off);
    }
    ++producers_done;
  };
  auto consume = [&] {
    std::mt19937_64 rng(99);
    for (;;) {
      bool picked = false;
      size_t off = 0;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!to_free.empty()) {
          const size_t pick = rng() % to_free.size();
          off = to_free[pick];
          to_free[pick] = to_free.back();
          to_free.pop_back();
          live.erase(off);  // before Free, so a re-use of off is no false overlap
          picked = true;
        } else if (producers_done.load() == 2) {
          return;
        }
      }
      if (picked) {
        arena.Free(off);
      } else {
        std::this_thread::yield();
      }
    }
  };

  std::thread p1(produce, 1), p2(produce, 2), c(consume);
  p1.join();
  p2.join();
  c.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(arena.num_allocations(), size_t{0});
  EXPECT_EQ(arena.used(), size_t{0});
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
