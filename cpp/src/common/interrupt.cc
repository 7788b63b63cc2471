// ScopedInterruptCheck: a thread-local stack of interrupt checks.
#include "mltuner/interrupt.h"

#include <utility>

namespace mltuner {

namespace {

thread_local const InterruptCheck* current_check = nullptr;

}  // namespace

ScopedInterruptCheck::ScopedInterruptCheck(InterruptCheck check)
    : check_(std::move(check)), previous_(current_check) {
  current_check = check_ ? &check_ : previous_;
}

ScopedInterruptCheck::~ScopedInterruptCheck() { current_check = previous_; }

const InterruptCheck* ScopedInterruptCheck::Current() { return current_check; }

}  // namespace mltuner
