// PassSplit: every index of a pass is visited exactly once, whatever the
// sizes, chunks and callers; and the CPU backend passes the device contract
// with its large passes split over four threads (forced here, as the CI
// machine has two cores and would not split at all).
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "device/cpu/pass_split.h"
#include "device/device_contract.h"
#include "mltuner/device.h"
#include "test_util.h"

namespace mltuner {
namespace {

// Before main, so that PassSplit::Shared() (made on first use) splits.
const bool kForcedThreads = setenv("MLTUNER_CPU_PASS_THREADS", "4", 1) == 0;

// Runs a pass of n over `split`; true when each index was visited once and
// every chunk but the last is a multiple of `align` and at least min_chunk.
bool VisitsEachIndexOnce(PassSplit& split, int64_t n, int64_t min_chunk, int64_t align) {
  std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
  for (auto& v : visits) v.store(0);
  std::atomic<bool> shapes_ok{true};
  split.For(n, min_chunk, align, [&](int64_t begin, int64_t end) {
    if (begin % align != 0 || (end < n && (end - begin) % align != 0) || (end < n && end - begin < min_chunk)) {
      shapes_ok.store(false);
    }
    for (int64_t i = begin; i < end; ++i) visits[static_cast<size_t>(i)].fetch_add(1);
  });
  for (const auto& v : visits) {
    if (v.load() != 1) return false;
  }
  return shapes_ok.load();
}

TEST(EveryIndexIsVisitedOnce) {
  PassSplit split(4);
  EXPECT_EQ(split.threads(), 4);
  for (const int64_t n : {0, 1, 15, 16, 17, 1000, 4096, 100003}) {
    for (const int64_t min_chunk : {1, 16, 1000, 200000}) {
      for (const int64_t align : {1, 16}) {
        EXPECT_TRUE(VisitsEachIndexOnce(split, n, min_chunk, align));
      }
    }
  }
}

TEST(APassSmallerThanTwoChunksRunsOnTheCallersThread) {
  PassSplit split(4);
  const std::thread::id caller = std::this_thread::get_id();
  bool elsewhere = false;
  int calls = 0;
  split.For(1000, 600, 1, [&](int64_t, int64_t) {
    ++calls;
    elsewhere = elsewhere || std::this_thread::get_id() != caller;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(!elsewhere);
}

TEST(SeveralCallersSplitAtOnce) {
  PassSplit split(3);
  std::atomic<int> failures{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        if (!VisitsEachIndexOnce(split, 5000 + round, 100, 16)) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(TheSharedSplitterTakesTheVariable) {
  EXPECT_TRUE(kForcedThreads);
  EXPECT_EQ(PassSplit::Shared().threads(), 4);
}

// A child forked while the shared helpers run has none of them (and one may
// have held the splitter's lock at the fork): its passes run on its thread.
TEST(AForkedChildSplitsNothingAndNeverHangs) {
  EXPECT_TRUE(VisitsEachIndexOnce(PassSplit::Shared(), 100000, 1000, 16));  // the helpers exist
  const pid_t child = fork();
  ASSERT_TRUE(child >= 0);
  if (child == 0) {
    const std::thread::id me = std::this_thread::get_id();
    bool alone = true;
    int calls = 0;
    PassSplit::Shared().For(100000, 1000, 16, [&](int64_t, int64_t) {
      ++calls;
      alone = alone && std::this_thread::get_id() == me;
    });
    _exit(calls == 1 && alone && VisitsEachIndexOnce(PassSplit::Shared(), 5000, 100, 16) ? 0 : 1);
  }
  int status = -1;
  for (int waited_ms = 0; waited_ms < 20000; waited_ms += 10) {
    if (waitpid(child, &status, WNOHANG) == child) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!WIFEXITED(status)) {  // still running after 20 s: hung
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    status = -1;
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(TheCpuBackendPassesTheContractWithSplitPasses) {
  auto device = NewCpuDevice();
  contract::RunDeviceContract(*device, "cpu, passes split over 4 threads");
}

TEST(LargeCopiesAndFillsAreExact) {
  auto device = NewCpuDevice();
  constexpr size_t kCount = (size_t{5} << 20) / sizeof(float) + 7;  // five chunks and a ragged end
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_OK(device->Allocate(kCount * sizeof(float), &a));
  ASSERT_OK(device->Allocate(kCount * sizeof(float), &b));
  float* src = static_cast<float*>(a);
  float* dst = static_cast<float*>(b);
  for (size_t i = 0; i < kCount; ++i) src[i] = static_cast<float>(i % 1009) - 500.0f;
  device->CopyDeviceToDevice(dst, src, kCount * sizeof(float), Stream::kApp);
  bool same = true;
  for (size_t i = 0; i < kCount; ++i) same = same && dst[i] == src[i];
  EXPECT_TRUE(same);
  device->AddInto(dst, src, static_cast<int64_t>(kCount), Stream::kApp);
  bool doubled = true;
  for (size_t i = 0; i < kCount; ++i) doubled = doubled && dst[i] == 2 * src[i];
  EXPECT_TRUE(doubled);
  device->Fill(dst, 0.0f, kCount, Stream::kApp);
  bool zero = true;
  for (size_t i = 0; i < kCount; ++i) zero = zero && dst[i] == 0.0f;
  EXPECT_TRUE(zero);
  device->Free(a);
  device->Free(b);
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
