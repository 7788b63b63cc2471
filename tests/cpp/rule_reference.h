// A double-precision reference of the server-side update rules, written from
// torch.optim's documented algorithms (SGD, Adam, AdamW) and MLtuner's damped
// momentum, for the rule tests to compare the float arithmetic with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mltuner/config.h"

namespace mltuner::testing {

class ReferenceRule {
 public:
  ReferenceRule(const UpdateRuleConfig& rule, const std::vector<float>& initial)
      : rule_(rule), w_(initial.begin(), initial.end()), a_(initial.size()), b_(initial.size()), c_(initial.size()) {}

  // One step with the mean gradient sum / workers (the sum itself for add).
  void Step(const std::vector<float>& sum, int workers) {
    ++t_;
    const double lr = rule_.learning_rate, m = rule_.momentum, wd = rule_.weight_decay;
    const double b1 = rule_.beta1, b2 = rule_.beta2, eps = rule_.epsilon;
    for (size_t i = 0; i < w_.size(); ++i) {
      double g = double{sum[i]} / workers;
      switch (rule_.kind) {
        case UpdateRuleKind::kAdd:
          w_[i] += sum[i];
          break;
        case UpdateRuleKind::kSgd:
          g += wd * w_[i];
          if (m != 0) {
            a_[i] = t_ == 1 ? g : m * a_[i] + (1 - double{rule_.dampening}) * g;
            g = rule_.nesterov ? g + m * a_[i] : a_[i];
          }
          w_[i] -= lr * g;
          break;
        case UpdateRuleKind::kDampedMomentum:
          a_[i] = (1 - m) * g + m * a_[i];
          w_[i] -= lr * a_[i];
          break;
        case UpdateRuleKind::kAdam:
        case UpdateRuleKind::kAdamW: {
          if (rule_.kind == UpdateRuleKind::kAdamW) {
            w_[i] *= 1 - lr * wd;
          } else {
            g += wd * w_[i];
          }
          a_[i] = b1 * a_[i] + (1 - b1) * g;
          b_[i] = b2 * b_[i] + (1 - b2) * g * g;
          c_[i] = std::max(c_[i], b_[i]);
          const double v = rule_.amsgrad ? c_[i] : b_[i];
          const double m_hat = a_[i] / (1 - std::pow(b1, static_cast<double>(t_)));
          const double v_hat = v / (1 - std::pow(b2, static_cast<double>(t_)));
          w_[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
          break;
        }
      }
    }
  }

  const std::vector<double>& values() const { return w_; }
  // The first state array: the momentum buffer, or Adam's first moment.
  const std::vector<double>& first_state() const { return a_; }
  const std::vector<double>& second_state() const { return b_; }
  const std::vector<double>& max_second_state() const { return c_; }
  void set_learning_rate(float lr) { rule_.learning_rate = lr; }

 private:
  UpdateRuleConfig rule_;
  int64_t t_ = 0;
  std::vector<double> w_, a_, b_, c_;
};

}  // namespace mltuner::testing
