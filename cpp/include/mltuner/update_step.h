// UpdateStep: one step of a server-side update rule, and the arithmetic it
// does per value. Both backends (the CPU loops and the CUDA kernels) call
// UpdateValue, so they do the same float operations in the same order; built
// without contracting a*b+c into fused multiply-adds (-ffp-contract=off,
// nvcc -fmad=false), their results are bit-identical.
#pragma once

#include <cmath>
#include <cstdint>

#include "mltuner/config.h"

#if defined(__CUDACC__)
#define MLT_HOST_DEVICE __host__ __device__
#else
#define MLT_HOST_DEVICE
#endif

namespace mltuner {

// The per-step scalars, computed once on the host (MakeUpdateStep) so that
// every backend uses the same ones.
struct UpdateStep {
  UpdateRuleKind kind = UpdateRuleKind::kAdd;
  float learning_rate = 0;
  float momentum = 0;
  float beta1 = 0, beta2 = 0, epsilon = 0;
  float inv_workers = 1;            // updates are averaged over workers (not for add)
  float inv_bias1 = 1, inv_bias2 = 1;  // Adam: 1 / (1 - beta^t)
};

// Floats of optimizer state per value: momentum keeps h, Adam keeps m and v
// (as two arrays: [m x n][v x n]).
inline int StateArraysPerValue(UpdateRuleKind kind) {
  switch (kind) {
    case UpdateRuleKind::kMomentum: return 1;
    case UpdateRuleKind::kAdam: return 2;
    default: return 0;
  }
}

// REQUIRES: num_workers >= 1; step >= 1 is the step being taken (Adam).
inline UpdateStep MakeUpdateStep(const UpdateRuleConfig& rule, int num_workers, int64_t step) {
  UpdateStep out;
  out.kind = rule.kind;
  out.learning_rate = rule.learning_rate;
  out.momentum = rule.momentum;
  out.beta1 = rule.beta1;
  out.beta2 = rule.beta2;
  out.epsilon = rule.epsilon;
  out.inv_workers = 1.0f / static_cast<float>(num_workers > 0 ? num_workers : 1);
  if (rule.kind == UpdateRuleKind::kAdam) {
    // In double, so that 1 - beta^t keeps its digits when beta is near 1.
    const double t = static_cast<double>(step);
    out.inv_bias1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(rule.beta1), t)));
    out.inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(rule.beta2), t)));
  }
  return out;
}

// Value i of `count`: params[i] takes one step with update_sum[i] (the sum of
// the workers' updates); state holds StateArraysPerValue(kind) arrays of
// `count` floats.
MLT_HOST_DEVICE inline void UpdateValue(const UpdateStep& s, float* params, float* state, const float* update_sum,
                                        int64_t count, int64_t i) {
  switch (s.kind) {
    case UpdateRuleKind::kAdd:  // GeePS: workers send deltas, the shard adds them
      params[i] = params[i] + update_sum[i];
      return;
    case UpdateRuleKind::kSgd: {
      const float g = update_sum[i] * s.inv_workers;
      params[i] = params[i] - s.learning_rate * g;
      return;
    }
    case UpdateRuleKind::kMomentum: {  // h = (1-m) g + m h; w -= lr h (mltuner.md §2)
      const float g = update_sum[i] * s.inv_workers;
      const float h = (1.0f - s.momentum) * g + s.momentum * state[i];
      state[i] = h;
      params[i] = params[i] - s.learning_rate * h;
      return;
    }
    case UpdateRuleKind::kAdam: {
      const float g = update_sum[i] * s.inv_workers;
      const float m = s.beta1 * state[i] + (1.0f - s.beta1) * g;
      const float v = s.beta2 * state[count + i] + (1.0f - s.beta2) * (g * g);
      state[i] = m;
      state[count + i] = v;
      const float m_hat = m * s.inv_bias1;
      const float v_hat = v * s.inv_bias2;
      params[i] = params[i] - s.learning_rate * m_hat / (sqrtf(v_hat) + s.epsilon);
      return;
    }
  }
}

}  // namespace mltuner
