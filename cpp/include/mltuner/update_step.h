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
// every backend uses the same ones. As torch.optim does, the scalars that
// combine hyperparameters (1 - dampening, lr / (1 - beta1^t), ...) are
// computed in double and rounded to float once.
struct UpdateStep {
  UpdateRuleKind kind = UpdateRuleKind::kAdd;
  float inv_workers = 1;  // updates are averaged over workers (not for add)
  float learning_rate = 0;
  // sgd: momentum m (with_momentum: m != 0); 1 - dampening; nesterov; the
  // first step with the momentum buffer (torch sets b = g then).
  // damped_momentum: m.
  float momentum = 0;
  bool with_momentum = false;
  float one_minus_dampening = 1;
  bool nesterov = false;
  bool first_step = false;
  // sgd, adam: g += weight_decay w. adamw: w *= decay_factor = 1 - lr wd.
  // with_decay: weight_decay != 0. The rule's choices are flags, not
  // comparisons of values, so that a loop can fix them (the CPU backend
  // compiles one branch-free loop per combination).
  float weight_decay = 0;
  bool with_decay = false;
  float decay_factor = 1;
  // adam, adamw (torch's order of operations):
  //   m = lerp(m, g, 1 - beta1); v = v beta2 + (1 - beta2) g g;
  //   [amsgrad: v_max = max(v_max, v), used for v below]
  //   w += (-step_size m) / (sqrt(v) / bias2_sqrt + eps)
  // with step_size = lr / (1 - beta1^t), bias2_sqrt = sqrt(1 - beta2^t).
  float one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, epsilon = 0;
  float neg_step_size = 0, bias2_sqrt = 1;
  bool amsgrad = false;
};

// Whether the sgd rule keeps a momentum buffer.
inline bool SgdHasMomentum(const UpdateRuleConfig& rule) {
  return rule.kind == UpdateRuleKind::kSgd && rule.momentum != 0.0f;
}

// Float arrays of optimizer state per value that a fresh rule allocates:
// sgd with momentum keeps b, damped momentum h, Adam m and v, and with
// amsgrad v_max (arrays laid out one after the other: [m x n][v x n]...).
inline int StateArraysPerValue(const UpdateRuleConfig& rule) {
  switch (rule.kind) {
    case UpdateRuleKind::kSgd: return SgdHasMomentum(rule) ? 1 : 0;
    case UpdateRuleKind::kDampedMomentum: return 1;
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW: return rule.amsgrad ? 3 : 2;
    default: return 0;
  }
}

// REQUIRES: num_workers >= 1; step >= 1 is the step being taken with the
// rule's state (Adam's t; 1 is sgd's first step with a momentum buffer).
inline UpdateStep MakeUpdateStep(const UpdateRuleConfig& rule, int num_workers, int64_t step) {
  UpdateStep out;
  out.kind = rule.kind;
  out.inv_workers = 1.0f / static_cast<float>(num_workers > 0 ? num_workers : 1);
  out.learning_rate = rule.learning_rate;
  out.momentum = rule.momentum;
  out.with_momentum = rule.momentum != 0.0f;
  out.one_minus_dampening = static_cast<float>(1.0 - static_cast<double>(rule.dampening));
  out.nesterov = rule.nesterov;
  out.first_step = step <= 1;
  out.weight_decay = rule.weight_decay;
  out.with_decay = rule.weight_decay != 0.0f;
  const double lr = rule.learning_rate;
  if (rule.kind == UpdateRuleKind::kAdamW) {
    out.decay_factor = static_cast<float>(1.0 - lr * static_cast<double>(rule.weight_decay));
  }
  if (rule.kind == UpdateRuleKind::kAdam || rule.kind == UpdateRuleKind::kAdamW) {
    // In double, so that 1 - beta^t keeps its digits when beta is near 1.
    const double t = static_cast<double>(step);
    const double beta1 = rule.beta1, beta2 = rule.beta2;
    out.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    out.beta2 = rule.beta2;
    out.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    out.epsilon = rule.epsilon;
    out.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, t))));
    out.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
    out.amsgrad = rule.amsgrad;
  }
  return out;
}

// Value i: params[i] takes one step with update_sum[i] (the sum of the
// workers' updates); state holds the rule's arrays, `stride` floats apart
// (the values of the rule's whole slice; a part of it starts at an offset).
MLT_HOST_DEVICE inline void UpdateValue(const UpdateStep& s, float* params, float* state, const float* update_sum,
                                        int64_t stride, int64_t i) {
  switch (s.kind) {
    case UpdateRuleKind::kAdd:  // GeePS: workers send deltas, the shard adds them
      params[i] = params[i] + update_sum[i];
      return;
    case UpdateRuleKind::kSgd: {  // torch.optim.SGD
      float g = update_sum[i] * s.inv_workers;
      if (s.with_decay) g = g + s.weight_decay * params[i];
      if (s.with_momentum) {
        const float b = s.first_step ? g : s.momentum * state[i] + s.one_minus_dampening * g;
        state[i] = b;
        g = s.nesterov ? g + s.momentum * b : b;
      }
      params[i] = params[i] - s.learning_rate * g;
      return;
    }
    case UpdateRuleKind::kDampedMomentum: {  // h = (1-m) g + m h; w -= lr h (mltuner.md §2)
      const float g = update_sum[i] * s.inv_workers;
      const float h = (1.0f - s.momentum) * g + s.momentum * state[i];
      state[i] = h;
      params[i] = params[i] - s.learning_rate * h;
      return;
    }
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW: {  // torch.optim.Adam / AdamW
      float g = update_sum[i] * s.inv_workers;
      float w = params[i];
      if (s.with_decay) {
        if (s.kind == UpdateRuleKind::kAdamW) {
          w = w * s.decay_factor;
        } else {
          g = g + s.weight_decay * w;
        }
      }
      // torch's lerp: the form that is exact at its nearer end.
      const float m_old = state[i];
      const float m = s.one_minus_beta1 < 0.5f ? m_old + s.one_minus_beta1 * (g - m_old)
                                               : g - (g - m_old) * (1.0f - s.one_minus_beta1);
      const float v_scaled = state[stride + i] * s.beta2;
      const float v = v_scaled + (s.one_minus_beta2 * g) * g;
      state[i] = m;
      state[stride + i] = v;
      float v_used = v;
      if (s.amsgrad) {  // torch.maximum: a NaN on either side wins
        const float v_max = state[2 * stride + i];
        v_used = (v_max != v_max || v_max > v) ? v_max : v;
        state[2 * stride + i] = v_used;
      }
      const float denom = sqrtf(v_used) / s.bias2_sqrt + s.epsilon;
      params[i] = w + (s.neg_step_size * m) / denom;
      return;
    }
  }
}

}  // namespace mltuner
