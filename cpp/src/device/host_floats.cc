// Host-side float helpers shared by the CPU backend and the engine.
#include <cstring>

#include "mltuner/device.h"

namespace mltuner {

// NaN and the infinities are the floats whose exponent bits are all ones.
// Comparing bits keeps the loop free of branches (so it vectorises) and does
// not depend on what a fast-math build assumes about std::isfinite.
int64_t CountNonFiniteHost(const float* data, int64_t count) {
  int64_t found = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, data + i, sizeof(bits));
    found += (bits & 0x7f800000u) == 0x7f800000u ? 1 : 0;
  }
  return found;
}

}  // namespace mltuner
