// WaitLedger: records are numbered per slot in queue order, a wait covers
// exactly the records up to the one waited for (never another slot's, never a
// later one), and both hold under concurrent callers.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "device/wait_ledger.h"
#include "test_util.h"

namespace mltuner {
namespace {

TEST(RecordsAreNumberedPerSlotFromOne) {
  WaitLedger ledger(3);
  EXPECT_EQ(ledger.Numbered(0, [] { return true; }), uint64_t{1});
  EXPECT_EQ(ledger.Numbered(0, [] { return true; }), uint64_t{2});
  EXPECT_EQ(ledger.Numbered(2, [] { return true; }), uint64_t{1});
  EXPECT_EQ(ledger.Numbered(0, [] { return false; }), uint64_t{0});  // not queued: no number used
  EXPECT_EQ(ledger.Numbered(0, [] { return true; }), uint64_t{3});
}

TEST(ASlotOutsideTheLedgerRecordsUnnumbered) {
  WaitLedger ledger(2);
  int calls = 0;
  EXPECT_EQ(ledger.Numbered(-1, [&] { return ++calls > 0; }), uint64_t{0});
  EXPECT_EQ(ledger.Numbered(2, [&] { return ++calls > 0; }), uint64_t{0});
  EXPECT_EQ(calls, 2);
  ledger.Note(-1, 0, 5);
  ledger.Note(0, 2, 5);
  EXPECT_TRUE(!ledger.Covers(-1, 0, 1));
  EXPECT_TRUE(!ledger.Covers(0, 2, 1));
}

TEST(AWaitCoversEarlierRecordsOfItsSlotOnly) {
  WaitLedger ledger(3);
  EXPECT_TRUE(!ledger.Covers(1, 0, 1));
  ledger.Note(1, 0, 5);
  for (uint64_t n = 1; n <= 5; ++n) EXPECT_TRUE(ledger.Covers(1, 0, n));
  EXPECT_TRUE(!ledger.Covers(1, 0, 6));
  EXPECT_TRUE(!ledger.Covers(1, 2, 1));  // another recorder
  EXPECT_TRUE(!ledger.Covers(2, 0, 1));  // another waiter
  EXPECT_TRUE(!ledger.Covers(0, 1, 1));  // the pair the other way round
  ledger.Note(1, 0, 3);                  // an older wait takes nothing back
  EXPECT_TRUE(ledger.Covers(1, 0, 5));
  EXPECT_TRUE(!ledger.Covers(1, 0, 0));  // 0: an unnumbered record, never covered
}

// A random run against a plain model of the streams: each waiter's frontier
// per recorder is the latest record it queued a wait for. The ledger may
// skip a wait only where the model's frontier already covers it.
TEST(CoversOnlyWhatWasWaitedFor) {
  constexpr int kSlots = 5;
  WaitLedger ledger(kSlots);
  std::vector<uint64_t> recorded(kSlots, 0);
  std::vector<std::vector<uint64_t>> frontier(kSlots, std::vector<uint64_t>(kSlots, 0));
  std::mt19937 random(7);
  int skipped = 0, queued = 0;
  for (int step = 0; step < 20000; ++step) {
    const int r = static_cast<int>(random() % kSlots);
    if (random() % 2 == 0) {
      recorded[r] = ledger.Numbered(r, [] { return true; });
      continue;
    }
    const int w = static_cast<int>(random() % kSlots);
    if (w == r || recorded[r] == 0) continue;
    const uint64_t n = 1 + random() % recorded[r];  // any record made so far
    if (ledger.Covers(w, r, n)) {
      EXPECT_TRUE(frontier[w][r] >= n);
      ++skipped;
    } else {
      EXPECT_TRUE(frontier[w][r] < n);  // nothing covered is waited for twice
      frontier[w][r] = std::max(frontier[w][r], n);
      ledger.Note(w, r, n);
      ++queued;
    }
  }
  EXPECT_TRUE(skipped > 0 && queued > 0);
}

TEST(ConcurrentCallersNumberWithoutGapsAndKeepTheLatestWait) {
  WaitLedger ledger(2);
  constexpr int kThreads = 8, kEach = 5000;
  std::vector<std::vector<uint64_t>> numbers(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        numbers[t].push_back(ledger.Numbered(0, [] { return true; }));
        ledger.Note(1, 0, static_cast<uint64_t>(t * kEach + i + 1));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<uint64_t> all;
  for (const auto& some : numbers) all.insert(all.end(), some.begin(), some.end());
  std::sort(all.begin(), all.end());
  bool contiguous = true;
  for (size_t i = 0; i < all.size(); ++i) contiguous = contiguous && all[i] == i + 1;
  EXPECT_TRUE(contiguous);
  EXPECT_TRUE(ledger.Covers(1, 0, uint64_t{kThreads} * kEach));
  EXPECT_TRUE(!ledger.Covers(1, 0, uint64_t{kThreads} * kEach + 1));
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
