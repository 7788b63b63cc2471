// The allocator's thresholds for received frames (mltuner/frame_memory.h).
#include "mltuner/frame_memory.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace mltuner {

bool MallocLeftToUs(const std::function<const char*(const char*)>& getenv, std::string* why) {
  const char* opt_out = getenv("MLTUNER_MALLOC_TUNING");
  if (opt_out != nullptr && std::strcmp(opt_out, "0") == 0) {
    *why = "MLTUNER_MALLOC_TUNING=0";
    return false;
  }
  for (const char* variable : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (getenv(variable) != nullptr) {
      *why = std::string(variable) + " is set";
      return false;
    }
  }
  const char* tunables = getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) {
    *why = "GLIBC_TUNABLES sets glibc.malloc";
    return false;
  }
  return true;
}

bool KeepFreedMemoryForFrames(std::string* why) {
  static std::once_flag once;
  static bool changed = false;
  static std::string reason;
  std::call_once(once, [] {
#if defined(__GLIBC__)
    if (!MallocLeftToUs([](const char* name) { return std::getenv(name); }, &reason)) return;
    // Both, or neither: setting either one turns glibc's dynamic thresholds
    // off, and a fixed 128 KiB mmap threshold would unmap every frame.
    changed = mallopt(M_MMAP_THRESHOLD, kFrameMmapThresholdBytes) == 1 &&
              mallopt(M_TRIM_THRESHOLD, kFrameTrimThresholdBytes) == 1;
    reason = changed ? "glibc's mmap threshold 32 MiB, trim threshold 64 MiB" : "mallopt refused";
#else
    reason = "not glibc";
#endif
  });
  *why = reason;
  return changed;
}

}  // namespace mltuner
