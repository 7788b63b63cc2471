// Names the calling thread, so that profilers, top -H and a benchmark's
// per-thread CPU accounting (/proc/self/task/*/comm) can tell the engine's
// threads apart. Linux keeps 15 characters; elsewhere it does nothing.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace mltuner {

inline void NameThisThread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace mltuner
