// SpinningCondVar: a notification reaches a waiter whether it spins or
// sleeps, none is lost when two threads hand a token back and forth many
// times (each wait bounded, so a lost one fails instead of hanging), and a
// wait without a notification ends at its deadline.
#include "common/spinning_cond_var.h"

#include <chrono>
#include <thread>

#include "test_util.h"

namespace mltuner {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

// One thread flips `turn` to the other's and notifies, `rounds` times each;
// true when every wait saw its turn before its deadline.
bool PingPong(microseconds spin, int rounds, bool notify_held) {
  Mutex mu;
  SpinningCondVar cv(&mu, spin);
  int turn = 0;  // guarded by mu
  bool ok[2] = {true, true};
  auto player = [&](int me) {
    for (int i = 0; i < rounds && ok[me]; ++i) {
      const auto deadline = steady_clock::now() + milliseconds(5000);
      {
        MutexLock lock(&mu);
        while (turn != me) {
          if (!cv.WaitUntil(deadline) && turn != me) {
            ok[me] = false;
            break;
          }
        }
        if (!ok[me]) break;
        turn = 1 - me;
        if (notify_held) cv.NotifyAllHeld();
      }
      if (!notify_held) cv.NotifyAll();
    }
    // The other player may still wait for a turn this one gives no more.
    MutexLock lock(&mu);
    turn = 1 - me;
    cv.NotifyAllHeld();
  };
  std::thread other(player, 1);
  player(0);
  other.join();
  return ok[0] && ok[1];
}

TEST(NoNotificationIsLostHandingATokenBackAndForth) {
  EXPECT_TRUE(PingPong(microseconds(0), 20000, false));
  EXPECT_TRUE(PingPong(microseconds(50), 20000, false));
  EXPECT_TRUE(PingPong(microseconds(0), 20000, true));
  // A spin much shorter than a hand-off: waiters keep falling asleep.
  EXPECT_TRUE(PingPong(microseconds(1), 20000, false));
}

TEST(ASleepingWaiterWakesOnANotificationAfterItsSpin) {
  for (microseconds spin : {microseconds(0), microseconds(100)}) {
    Mutex mu;
    SpinningCondVar cv(&mu, spin);
    bool done = false;
    std::thread notifier([&] {
      std::this_thread::sleep_for(milliseconds(30));  // well past the spin
      {
        MutexLock lock(&mu);
        done = true;
      }
      cv.NotifyAll();
    });
    const auto started = steady_clock::now();
    {
      MutexLock lock(&mu);
      while (!done) ASSERT_TRUE(cv.WaitUntil(steady_clock::now() + milliseconds(5000)) || done);
    }
    notifier.join();
    EXPECT_TRUE(steady_clock::now() - started >= milliseconds(25));
    EXPECT_TRUE(steady_clock::now() - started < milliseconds(4000));
  }
}

TEST(AWaitWithoutANotificationEndsAtItsDeadline) {
  for (microseconds spin : {microseconds(0), microseconds(100), microseconds(50000)}) {
    Mutex mu;
    SpinningCondVar cv(&mu, spin);
    const auto started = steady_clock::now();
    const auto deadline = started + milliseconds(20);
    MutexLock lock(&mu);
    bool woken = true;
    while (woken && steady_clock::now() < deadline) woken = cv.WaitUntil(deadline);
    EXPECT_TRUE(!woken);
    EXPECT_TRUE(steady_clock::now() >= deadline);
    EXPECT_TRUE(steady_clock::now() - started < milliseconds(2000));
  }
}

TEST(TheDefaultSpinFollowsTheEnvironment) {
  setenv("MLTUNER_SPIN_WAIT_US", "7", 1);
  EXPECT_TRUE(SpinningCondVar::DefaultSpin() == microseconds(7));
  setenv("MLTUNER_SPIN_WAIT_US", "0", 1);
  EXPECT_TRUE(SpinningCondVar::DefaultSpin() == microseconds(0));
  setenv("MLTUNER_SPIN_WAIT_US", "not a number", 1);
  const bool many_cores = std::thread::hardware_concurrency() >= 8;
  EXPECT_TRUE(SpinningCondVar::DefaultSpin() == (many_cores ? microseconds(50) : microseconds(0)));
  unsetenv("MLTUNER_SPIN_WAIT_US");
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
