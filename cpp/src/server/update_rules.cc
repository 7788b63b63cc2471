// The server-side update rules: add, SGD, momentum and Adam.
//
// Each Apply is one pass of plain loops over contiguous float arrays with no
// calls inside, so the compiler vectorises them. The mean gradient is formed
// as sum * (1 / num_workers): one multiply per element instead of a divide.
#include "server/update_rules.h"

#include <cmath>

namespace mltuner {
namespace {

// REQUIRES num_workers >= 1 (a shard always has at least one worker).
float InverseWorkerCount(int num_workers) {
  return 1.0f / static_cast<float>(num_workers > 0 ? num_workers : 1);
}

// GeePS semantics: workers send deltas, the shard adds their sum.
class AddRule final : public UpdateRule {
 public:
  void Apply(float* params, const float* update_sum, int64_t count, int /*num_workers*/) override {
    for (int64_t i = 0; i < count; ++i) params[i] += update_sum[i];
  }
  std::vector<float>* state() override { return &no_state_; }
  int state_arrays_per_value() const override { return 0; }
  std::unique_ptr<UpdateRule> Clone() const override { return std::make_unique<AddRule>(); }

 private:
  std::vector<float> no_state_;  // always empty
};

class SgdRule final : public UpdateRule {
 public:
  explicit SgdRule(float learning_rate) : learning_rate_(learning_rate) {}

  void Apply(float* params, const float* update_sum, int64_t count, int num_workers) override {
    const float inv_workers = InverseWorkerCount(num_workers);
    const float lr = learning_rate_;
    for (int64_t i = 0; i < count; ++i) {
      const float gradient = update_sum[i] * inv_workers;
      params[i] -= lr * gradient;
    }
  }
  std::vector<float>* state() override { return &no_state_; }
  int state_arrays_per_value() const override { return 0; }
  std::unique_ptr<UpdateRule> Clone() const override {
    return std::make_unique<SgdRule>(learning_rate_);
  }

 private:
  const float learning_rate_;
  std::vector<float> no_state_;  // always empty
};

// h = (1-m) g + m h; w -= lr h. The (1-m) damping follows MLtuner
// (mltuner.md §2), so lr keeps the same scale across momentum values.
class MomentumRule final : public UpdateRule {
 public:
  MomentumRule(float learning_rate, float momentum, int64_t num_values)
      : learning_rate_(learning_rate), momentum_(momentum),
        history_(static_cast<size_t>(num_values), 0.0f) {}

  void Apply(float* params, const float* update_sum, int64_t count, int num_workers) override {
    const float inv_workers = InverseWorkerCount(num_workers);
    const float lr = learning_rate_;
    const float m = momentum_;
    const float one_minus_m = 1.0f - m;
    float* history = history_.data();
    for (int64_t i = 0; i < count; ++i) {
      const float gradient = update_sum[i] * inv_workers;
      history[i] = one_minus_m * gradient + m * history[i];
      params[i] -= lr * history[i];
    }
  }
  std::vector<float>* state() override { return &history_; }
  int state_arrays_per_value() const override { return 1; }
  std::unique_ptr<UpdateRule> Clone() const override {
    auto copy = std::make_unique<MomentumRule>(learning_rate_, momentum_, 0);
    copy->history_ = history_;
    return copy;
  }

 private:
  const float learning_rate_;
  const float momentum_;
  std::vector<float> history_;  // h, one per value
};

// Adam with bias correction. State layout (so a fork or checkpoint copies it
// as one array): [m1 x n][m2 x n][t], t being the number of steps taken.
class AdamRule final : public UpdateRule {
 public:
  AdamRule(const UpdateRuleConfig& config, int64_t num_values)
      : config_(config), num_values_(num_values),
        state_(static_cast<size_t>(2 * num_values + 1), 0.0f) {}

  void Apply(float* params, const float* update_sum, int64_t count, int num_workers) override {
    float& steps = state_[static_cast<size_t>(2 * num_values_)];
    steps += 1.0f;
    // The bias corrections are per step, not per element: compute them once,
    // in double so that 1 - beta^t keeps its digits when beta is near 1.
    const double t = steps;
    const float inv_correction1 = static_cast<float>(1.0 / (1.0 - std::pow(double{config_.beta1}, t)));
    const float inv_correction2 = static_cast<float>(1.0 / (1.0 - std::pow(double{config_.beta2}, t)));

    const float inv_workers = InverseWorkerCount(num_workers);
    const float lr = config_.learning_rate;
    const float b1 = config_.beta1, one_minus_b1 = 1.0f - config_.beta1;
    const float b2 = config_.beta2, one_minus_b2 = 1.0f - config_.beta2;
    const float eps = config_.epsilon;
    float* m1 = state_.data();
    float* m2 = state_.data() + num_values_;
    // GCC vectorises this loop only with -fno-math-errno: otherwise std::sqrt
    // keeps a branch to set errno, which nothing here reads.
    for (int64_t i = 0; i < count; ++i) {
      const float gradient = update_sum[i] * inv_workers;
      m1[i] = b1 * m1[i] + one_minus_b1 * gradient;
      m2[i] = b2 * m2[i] + one_minus_b2 * gradient * gradient;
      const float m_hat = m1[i] * inv_correction1;
      const float v_hat = m2[i] * inv_correction2;
      params[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
  std::vector<float>* state() override { return &state_; }
  int state_arrays_per_value() const override { return 2; }
  std::unique_ptr<UpdateRule> Clone() const override {
    auto copy = std::make_unique<AdamRule>(config_, 0);
    copy->num_values_ = num_values_;
    copy->state_ = state_;
    return copy;
  }

 private:
  const UpdateRuleConfig config_;
  int64_t num_values_;
  std::vector<float> state_;
};

}  // namespace

std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig& config, int64_t num_values) {
  if (num_values < 0) num_values = 0;
  switch (config.kind) {
    case UpdateRuleKind::kAdd: return std::make_unique<AddRule>();
    case UpdateRuleKind::kSgd: return std::make_unique<SgdRule>(config.learning_rate);
    case UpdateRuleKind::kMomentum:
      return std::make_unique<MomentumRule>(config.learning_rate, config.momentum, num_values);
    case UpdateRuleKind::kAdam: return std::make_unique<AdamRule>(config, num_values);
  }
  return nullptr;  // an out-of-range kind; callers turn this into an error
}

}  // namespace mltuner
