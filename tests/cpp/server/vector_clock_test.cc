// VectorClock: entries start before the init clock, move by exactly one, and
// the global clock is the minimum, reported exactly when it moves.
#include "server/vector_clock.h"

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "test_util.h"

using namespace mltuner;

TEST(StartsAtNoClock) {
  VectorClock clock(3);
  EXPECT_EQ(clock.num_workers(), 3);
  EXPECT_EQ(clock.global(), kNoClock);
  for (int w = 0; w < 3; ++w) EXPECT_EQ(clock.Get(w), kNoClock);
}

TEST(GlobalMovesOnlyWhenTheLastWorkerArrives) {
  VectorClock clock(3);
  bool advanced = true;
  ASSERT_OK(clock.Advance(1, kInitClock, &advanced));
  EXPECT_TRUE(!advanced);
  ASSERT_OK(clock.Advance(0, kInitClock, &advanced));
  EXPECT_TRUE(!advanced);
  EXPECT_EQ(clock.global(), kNoClock);
  ASSERT_OK(clock.Advance(2, kInitClock, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.global(), kInitClock);

  // Worker 0 runs two clocks ahead; the minimum waits for the others.
  ASSERT_OK(clock.Advance(0, 0, &advanced));
  EXPECT_TRUE(!advanced);
  ASSERT_OK(clock.Advance(0, 1, &advanced));
  EXPECT_TRUE(!advanced);
  ASSERT_OK(clock.Advance(1, 0, &advanced));
  EXPECT_TRUE(!advanced);
  ASSERT_OK(clock.Advance(2, 0, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.global(), 0);
  EXPECT_EQ(clock.Get(0), 1);
}

TEST(RejectsSkippedAndRepeatedClocks) {
  VectorClock clock(2);
  bool advanced = true;
  EXPECT_CODE(clock.Advance(0, 0, &advanced), StatusCode::kOutOfOrder);  // skips -1
  EXPECT_TRUE(!advanced);
  ASSERT_OK(clock.Advance(0, kInitClock, &advanced));
  EXPECT_CODE(clock.Advance(0, kInitClock, &advanced), StatusCode::kOutOfOrder);  // repeat
  EXPECT_CODE(clock.Advance(0, 1, &advanced), StatusCode::kOutOfOrder);           // skip
  EXPECT_EQ(clock.Get(0), kInitClock);
  EXPECT_EQ(clock.Get(1), kNoClock);
}

TEST(RejectsWorkerOutOfRange) {
  VectorClock clock(2);
  bool advanced = false;
  EXPECT_CODE(clock.Advance(-1, kInitClock, &advanced), StatusCode::kInvalidArgument);
  EXPECT_CODE(clock.Advance(2, kInitClock, &advanced), StatusCode::kInvalidArgument);
  EXPECT_EQ(clock.global(), kNoClock);
}

// Random interleavings against a brute-force minimum.
TEST(GlobalIsTheMinimumUnderRandomInterleavings) {
  std::mt19937 rng(7);
  const int workers = 5;
  VectorClock clock(workers);
  std::vector<Clock> reference(workers, kNoClock);
  for (int step = 0; step < 2000; ++step) {
    const int w = static_cast<int>(rng() % workers);
    const Clock before = *std::min_element(reference.begin(), reference.end());
    bool advanced = false;
    ASSERT_OK(clock.Advance(w, reference[w] + 1, &advanced));
    ++reference[w];
    const Clock after = *std::min_element(reference.begin(), reference.end());
    EXPECT_EQ(clock.global(), after);
    EXPECT_EQ(advanced, after > before);
  }
}

MLT_TEST_MAIN

TEST(PartsOfAClockFinishInOrderAndTheClockAtTheLast) {
  VectorClock clock(2, 3);
  EXPECT_EQ(clock.parts(), 3);
  bool advanced = false;
  ASSERT_OK(clock.Advance(0, kInitClock, &advanced));
  ASSERT_OK(clock.Advance(1, kInitClock, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.global(), kInitClock);
  int part = -1;
  ASSERT_OK(clock.NextPart(0, 0, &part));
  EXPECT_EQ(part, 0);
  // Worker 0 sends all three parts of clock 0 and the first of clock 1.
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK(clock.Advance(0, 0, &advanced));
    EXPECT_TRUE(!advanced);
  }
  EXPECT_EQ(clock.Get(0), 0);
  ASSERT_OK(clock.NextPart(0, 1, &part));
  EXPECT_EQ(part, 0);
  ASSERT_OK(clock.Advance(0, 1, &advanced));
  EXPECT_EQ(clock.Get(0), 0);  // clock 1 not complete
  // Worker 1's parts finish each part of clock 0 for everyone, in order.
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK(clock.NextPart(1, 0, &part));
    EXPECT_EQ(part, k);
    ASSERT_OK(clock.Advance(1, 0, &advanced));
    EXPECT_TRUE(advanced);
    EXPECT_EQ(clock.ClockOf(clock.global_position()), 0);
    EXPECT_EQ(clock.PartOf(clock.global_position()), k);
    EXPECT_EQ(clock.global(), k == 2 ? 0 : kInitClock);
    for (int p = 0; p < 3; ++p) EXPECT_EQ(clock.PartClock(p), p <= k ? 0 : kInitClock);
  }
  ASSERT_OK(clock.Advance(1, 1, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.ClockOf(clock.global_position()), 1);
  EXPECT_EQ(clock.PartOf(clock.global_position()), 0);
  EXPECT_EQ(clock.global(), 0);
  // Part 0 is a clock ahead of the others (its rows hold clock 1's update).
  EXPECT_EQ(clock.PartClock(0), 1);
  EXPECT_EQ(clock.PartClock(1), 0);
  EXPECT_EQ(clock.PartClock(2), 0);
  // A clock's parts cannot be skipped: worker 1 is in clock 1, not 2.
  EXPECT_CODE(clock.Advance(1, 2, &advanced), StatusCode::kOutOfOrder);
  EXPECT_CODE(clock.NextPart(1, 0, &part), StatusCode::kOutOfOrder);
}

// Batch stealing: a clock declared empty counts for its worker at once (once
// the clock before it is in), and the worker's own update of it is dropped.
TEST(AClockDeclaredEmptyCountsWithoutItsWorker) {
  VectorClock clock(3);
  bool advanced = false;
  for (int w = 0; w < 3; ++w) ASSERT_OK(clock.Advance(w, kInitClock, &advanced));
  for (int w = 0; w < 3; ++w) ASSERT_OK(clock.Advance(w, 0, &advanced));
  EXPECT_EQ(clock.global(), 0);
  ASSERT_OK(clock.DeclareEmpty(1, 1, &advanced));
  EXPECT_TRUE(!advanced);  // the others have not sent clock 1 yet
  ASSERT_OK(clock.DeclareEmpty(1, 2, &advanced));
  EXPECT_EQ(clock.Get(1), 2);
  EXPECT_EQ(clock.Sent(1), 0);
  ASSERT_OK(clock.Advance(0, 1, &advanced));
  ASSERT_OK(clock.Advance(2, 1, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.global(), 1);
  ASSERT_OK(clock.Advance(0, 2, &advanced));
  ASSERT_OK(clock.Advance(2, 2, &advanced));
  EXPECT_EQ(clock.global(), 2);
  // The late worker's own updates: in order, dropped, the global unmoved.
  EXPECT_TRUE(clock.DeclaredEmpty(1, 1));
  EXPECT_CODE(clock.Advance(1, 2, &advanced), StatusCode::kOutOfOrder);  // clock 1 first
  ASSERT_OK(clock.Advance(1, 1, &advanced));
  EXPECT_TRUE(!advanced);
  EXPECT_TRUE(!clock.DeclaredEmpty(1, 1));
  ASSERT_OK(clock.Advance(1, 2, &advanced));
  EXPECT_EQ(clock.Sent(1), 2);
  ASSERT_OK(clock.Advance(1, 3, &advanced));  // its own again
  EXPECT_EQ(clock.Get(1), 3);
  EXPECT_EQ(clock.global(), 2);
}

TEST(ADeclarationAheadWaitsForTheClockBeforeIt) {
  VectorClock clock(2);
  bool advanced = false;
  for (int w = 0; w < 2; ++w) ASSERT_OK(clock.Advance(w, kInitClock, &advanced));
  ASSERT_OK(clock.DeclareEmpty(1, 1, &advanced));  // worker 1 has not sent clock 0
  EXPECT_EQ(clock.Get(1), kInitClock);
  ASSERT_OK(clock.Advance(0, 0, &advanced));
  ASSERT_OK(clock.Advance(0, 1, &advanced));
  EXPECT_EQ(clock.global(), kInitClock);
  const int64_t before = clock.global_position();
  ASSERT_OK(clock.Advance(1, 0, &advanced));  // clocks 0 and 1 finish at once
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.global(), 1);
  EXPECT_EQ(clock.global_position(), before + 2);
}

TEST(ADeclarationAfterTheWorkerSentPartOfTheClockChangesNothing) {
  VectorClock clock(2, 3);
  bool advanced = false;
  for (int w = 0; w < 2; ++w) ASSERT_OK(clock.Advance(w, kInitClock, &advanced));
  ASSERT_OK(clock.Advance(1, 0, &advanced));  // part 0 of clock 0
  ASSERT_OK(clock.DeclareEmpty(1, 0, &advanced));
  EXPECT_TRUE(!clock.DeclaredEmpty(1, 0));
  EXPECT_EQ(clock.Get(1), kInitClock);
  // Declared empty with parts: counted whole, all three parts at once.
  ASSERT_OK(clock.DeclareEmpty(0, 0, &advanced));
  EXPECT_EQ(clock.Get(0), 0);
  ASSERT_OK(clock.DeclareEmpty(0, 0, &advanced));  // twice: nothing more
  const int64_t before = clock.global_position();
  ASSERT_OK(clock.Advance(1, 0, &advanced));
  ASSERT_OK(clock.Advance(1, 0, &advanced));
  EXPECT_EQ(clock.global(), 0);
  EXPECT_EQ(clock.global_position(), before + 2);
  EXPECT_EQ(clock.PartOf(clock.global_position()), 2);
  // Worker 0's own three parts of clock 0 are dropped, in order.
  for (int k = 0; k < 3; ++k) {
    int part = -1;
    ASSERT_OK(clock.NextPart(0, 0, &part));
    EXPECT_EQ(part, k);
    ASSERT_OK(clock.Advance(0, 0, &advanced));
    EXPECT_TRUE(!advanced);
  }
  EXPECT_TRUE(!clock.DeclaredEmpty(0, 0));
}

TEST(RefusesBadDeclarations) {
  VectorClock clock(2);
  bool advanced = false;
  EXPECT_CODE(clock.DeclareEmpty(2, 0, &advanced), StatusCode::kInvalidArgument);
  EXPECT_CODE(clock.DeclareEmpty(-1, 0, &advanced), StatusCode::kInvalidArgument);
  EXPECT_CODE(clock.DeclareEmpty(0, kInitClock, &advanced), StatusCode::kInvalidArgument);
  EXPECT_TRUE(!clock.DeclaredEmpty(5, 0));
}

// Random sends and declarations against a brute-force count: a worker counts
// through clock c when each clock up to c was sent by it or declared empty
// before it sent any of it.
TEST(DeclarationsUnderRandomInterleavings) {
  std::mt19937 rng(11);
  for (int parts : {1, 2}) {
    const int workers = 4;
    VectorClock clock(workers, parts);
    std::vector<int64_t> sent(workers, -1);  // parts sent by each worker from clock 0 on, less one
    std::vector<std::set<Clock>> declared(workers);
    bool advanced = false;
    for (int w = 0; w < workers; ++w) ASSERT_OK(clock.Advance(w, kInitClock, &advanced));
    auto counted = [&](int w) {
      Clock c = static_cast<Clock>((sent[w] + 1) / parts) - 1;  // the last clock it sent whole
      while (declared[w].count(c + 1) != 0) ++c;
      return c;
    };
    for (int step = 0; step < 3000; ++step) {
      const int w = static_cast<int>(rng() % workers);
      Clock before = counted(0);
      for (int q = 1; q < workers; ++q) before = std::min(before, counted(q));
      if (rng() % 4 == 0) {
        const Clock target = (sent[w] + 1) / parts + static_cast<Clock>(rng() % 3);
        ASSERT_OK(clock.DeclareEmpty(w, target, &advanced));
        if (sent[w] < target * parts) declared[w].insert(target);
      } else {
        const Clock c = static_cast<Clock>((sent[w] + 1) / parts);
        ASSERT_OK(clock.Advance(w, c, &advanced));
        ++sent[w];
      }
      Clock after = counted(0);
      for (int q = 1; q < workers; ++q) after = std::min(after, counted(q));
      EXPECT_EQ(clock.global(), after);
      for (int q = 0; q < workers; ++q) EXPECT_EQ(clock.Get(q), counted(q));
      if (after > before) EXPECT_TRUE(advanced);
    }
  }
}
