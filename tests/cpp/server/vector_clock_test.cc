// VectorClock: entries start before the init clock, move by exactly one, and
// the global clock is the minimum, reported exactly when it moves.
#include "server/vector_clock.h"

#include <algorithm>
#include <random>
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
    EXPECT_EQ(clock.finished_clock(), 0);
    EXPECT_EQ(clock.finished_part(), k);
    EXPECT_EQ(clock.global(), k == 2 ? 0 : kInitClock);
  }
  ASSERT_OK(clock.Advance(1, 1, &advanced));
  EXPECT_TRUE(advanced);
  EXPECT_EQ(clock.finished_clock(), 1);
  EXPECT_EQ(clock.finished_part(), 0);
  EXPECT_EQ(clock.global(), 0);
  // A clock's parts cannot be skipped: worker 1 is in clock 1, not 2.
  EXPECT_CODE(clock.Advance(1, 2, &advanced), StatusCode::kOutOfOrder);
  EXPECT_CODE(clock.NextPart(1, 0, &part), StatusCode::kOutOfOrder);
}
