// The arithmetic of read-my-writes (cpp/src/cache/own_updates.h) for one
// value, shared by the CPU backend and the CUDA kernels like UpdateValue, so
// that each is one pass over a table's values.
#pragma once

#include <cstdint>

#include "mltuner/update_step.h"

namespace mltuner {

// This worker's own step of a clock: `own_step[i]` becomes the step the
// shards' rule `s` takes for `update[i]` (the rule run from zero with this
// worker's share of its state), and the cache takes it at once. With
// `drift` (the other workers' momentum, carried), the cache also takes
// drift[i], which then decays by `momentum` for the next clock.
MLT_HOST_DEVICE inline void OwnStepValue(const UpdateStep& s, float momentum, float* own_step, float* state,
                                         const float* update, float* cache, float* drift, int64_t stride,
                                         int64_t i) {
  own_step[i] = 0.0f;
  UpdateValue(s, own_step, state, update, stride, i);
  float value = cache[i] + own_step[i];
  if (drift != nullptr) {
    value = value + drift[i];
    drift[i] = drift[i] * momentum;
  }
  cache[i] = value;
}

// Right after the shard's rows of clock d landed in the cache: the other
// workers' step at d is their change since the rows of d - 1 (`raw`) less
// this worker's own step of d (`own_step_d`; null where the rows of d - 1
// are not known). The cache then takes `ahead` (m + ... + m^(L-d), L this
// worker's clock) times it, and `drift` keeps `next` (m^(L-d+1)) times it
// for the next own step; `raw` keeps the shard's rows.
MLT_HOST_DEVICE inline void CarryValue(float ahead, float next, float* cache, float* raw, float* drift,
                                       const float* own_step_d, int64_t i) {
  const float rows = cache[i];
  if (own_step_d != nullptr) {
    const float others = rows - raw[i] - own_step_d[i];
    cache[i] = rows + ahead * others;
    drift[i] = next * others;
  } else {
    drift[i] = 0.0f;
  }
  raw[i] = rows;
}

}  // namespace mltuner
