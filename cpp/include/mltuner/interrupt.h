// Interrupting the engine's waits.
//
// A thread about to make an engine call that may block (a read waiting for a
// peer's clock, a fetch or an initial write waiting for the shards, Flush,
// WaitForDataAge, FinishVirtualIteration, branch requests, Shutdown's wait
// for the reclaimer) may install a check for the scope of the call. While the
// call is blocked, its wait asks the check every kInterruptPollInterval, with
// the engine's locks released; when the check answers true the wait gives up
// and the call returns StatusCode::kCancelled. The engine stays usable: the
// interrupted call took nothing, so it may be made again, and Shutdown works.
//
// The Python binding installs one on the main thread that asks
// PyErr_CheckSignals, so Ctrl-C interrupts a blocked call. A call whose
// thread has no check waits as before, at no extra cost; a call that does not
// block never asks.
#pragma once

#include <chrono>
#include <functional>

namespace mltuner {

// True: give up the wait. Called on the waiting thread, with no engine lock
// held.
using InterruptCheck = std::function<bool()>;

// How long a blocked wait runs between two asks of the check.
inline constexpr std::chrono::milliseconds kInterruptPollInterval{50};

// Installs `check` as the calling thread's interrupt check for its scope
// (nested scopes: the innermost counts). Must be destroyed on the thread that
// made it.
class ScopedInterruptCheck {
 public:
  explicit ScopedInterruptCheck(InterruptCheck check);
  ~ScopedInterruptCheck();
  ScopedInterruptCheck(const ScopedInterruptCheck&) = delete;
  ScopedInterruptCheck& operator=(const ScopedInterruptCheck&) = delete;

  // The calling thread's innermost check; null when none is installed.
  static const InterruptCheck* Current();

 private:
  const InterruptCheck check_;
  const InterruptCheck* const previous_;
};

}  // namespace mltuner
