// Update rules against the independent double-precision reference of
// rule_reference.h (torch.optim's algorithms and MLtuner's damped momentum).
#include "server/update_rules.h"

#include "common/update_rule_check.h"

#include <cmath>
#include <random>
#include <vector>

#include "rule_reference.h"
#include "test_util.h"

using namespace mltuner;
using mltuner::testing::ReferenceRule;

namespace {

constexpr int kWorkers = 3;

std::vector<float> RandomVector(std::mt19937* rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(*rng);
  return v;
}

// Relative-plus-absolute closeness between a float run and a double reference.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i])));
  }
}

UpdateRuleConfig Rule(UpdateRuleKind kind) {
  UpdateRuleConfig config;
  config.kind = kind;
  config.learning_rate = 0.05f;
  config.momentum = 0.8f;
  config.beta1 = 0.9f;
  config.beta2 = 0.99f;
  config.epsilon = 1e-6f;
  return config;
}

// Runs `steps` clocks of random updates through the rule and the reference;
// the values and the first state array must agree.
void CheckAgainstReference(const UpdateRuleConfig& config, int steps, double tol, unsigned seed) {
  std::mt19937 rng(seed);
  const int64_t n = 47;
  auto rule = NewUpdateRule(config, n);
  ASSERT_TRUE(rule != nullptr);
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  ReferenceRule reference(config, params);
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    rule->Apply(params.data(), sum.data(), n, kWorkers);
    reference.Step(sum, kWorkers);
  }
  ExpectClose(params, reference.values(), tol);
  if (rule->state_arrays_per_value() > 0) {
    const std::vector<float> state = rule->ExportState();
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(state[i], reference.first_state()[i], tol * (1 + std::fabs(reference.first_state()[i])));
    }
  }
}

}  // namespace

TEST(AddAddsTheSum) {
  std::mt19937 rng(1);
  const int64_t n = 37;
  auto rule = NewUpdateRule(Rule(UpdateRuleKind::kAdd), n);
  ASSERT_TRUE(rule != nullptr);
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  const std::vector<float> before = params;
  const std::vector<float> sum = RandomVector(&rng, n, -1, 1);
  rule->Apply(params.data(), sum.data(), n, kWorkers);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(params[i], before[i] + sum[i]);
  EXPECT_TRUE(rule->ExportState().empty());
}

TEST(PlainSgdStepsAlongTheMeanGradientWithoutState) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  config.momentum = 0;
  CheckAgainstReference(config, 20, 1e-5, 2);
  EXPECT_TRUE(NewUpdateRule(config, 8)->ExportState().empty());
  EXPECT_TRUE(!NewUpdateRule(config, 8)->stateful());
}

// torch.optim.SGD: the buffer is the gradient itself on the first step (not
// dampened), then m b + (1 - dampening) g.
TEST(SgdMomentumFirstStepTakesTheGradient) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  config.momentum = 0.9f;
  config.dampening = 0.5f;
  const int64_t n = 4;
  auto rule = NewUpdateRule(config, n);
  std::vector<float> params = {1, 2, 3, 4};
  const std::vector<float> sum = {3, -3, 6, 0};  // mean over 3 workers: 1, -1, 2, 0
  rule->Apply(params.data(), sum.data(), n, kWorkers);
  const std::vector<float> state = rule->ExportState();
  ASSERT_EQ(state.size(), size_t{n + 1});
  EXPECT_EQ(state[0], 1.0f);
  EXPECT_EQ(state[1], -1.0f);
  EXPECT_EQ(state[2], 2.0f);
  EXPECT_EQ(state[n], 1.0f);  // the step count trails the buffer
  EXPECT_EQ(params[0], 1.0f - 0.05f * 1.0f);
  rule->Apply(params.data(), sum.data(), n, kWorkers);  // now b = 0.9 b + 0.5 g
  EXPECT_NEAR(rule->ExportState()[0], 0.9 * 1 + 0.5 * 1, 1e-6);
}

TEST(SgdMomentumDampeningWeightDecayMatchTorch) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  config.momentum = 0.9f;
  config.dampening = 0.1f;
  config.weight_decay = 0.01f;
  CheckAgainstReference(config, 25, 1e-5, 3);
}

TEST(SgdNesterovMatchesTorch) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  config.momentum = 0.9f;
  config.nesterov = true;
  config.weight_decay = 1e-3f;
  CheckAgainstReference(config, 25, 1e-5, 4);
}

TEST(DampedMomentumMatchesReferenceOverTwentySteps) {
  std::mt19937 rng(3);
  const UpdateRuleConfig config = Rule(UpdateRuleKind::kDampedMomentum);
  ASSERT_EQ(NewUpdateRule(config, 53)->ExportState().size(), size_t{53});  // no step count
  CheckAgainstReference(config, 20, 1e-5, 5);
}

// MLtuner's rule with (lr, m) takes the steps of torch's SGD(lr (1 - m), m).
TEST(DampedMomentumEqualsSgdWithScaledRate) {
  UpdateRuleConfig damped = Rule(UpdateRuleKind::kDampedMomentum);
  damped.momentum = 0.9f;
  UpdateRuleConfig sgd = Rule(UpdateRuleKind::kSgd);
  sgd.momentum = 0.9f;
  sgd.learning_rate = static_cast<float>(damped.learning_rate * (1.0 - 0.9));
  std::mt19937 rng(6);
  const int64_t n = 31;
  auto a = NewUpdateRule(damped, n);
  auto b = NewUpdateRule(sgd, n);
  std::vector<float> wa = RandomVector(&rng, n, -1, 1), wb = wa;
  for (int step = 0; step < 30; ++step) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    a->Apply(wa.data(), sum.data(), n, kWorkers);
    b->Apply(wb.data(), sum.data(), n, kWorkers);
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(wa[i], wb[i], 1e-5);
}

TEST(AdamMatchesTorchOverTwentySteps) {
  const UpdateRuleConfig config = Rule(UpdateRuleKind::kAdam);
  std::mt19937 rng(4);
  const int64_t n = 29;
  auto rule = NewUpdateRule(config, n);
  ASSERT_EQ(rule->ExportState().size(), static_cast<size_t>(2 * n + 1));
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  ReferenceRule reference(config, params);
  for (int t = 1; t <= 20; ++t) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    rule->Apply(params.data(), sum.data(), n, kWorkers);
    reference.Step(sum, kWorkers);
  }
  ExpectClose(params, reference.values(), 1e-5);
  const std::vector<float> state = rule->ExportState();
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(state[i], reference.first_state()[i], 1e-5);
    EXPECT_NEAR(state[n + i], reference.second_state()[i], 1e-5);
  }
  EXPECT_EQ(state[2 * n], 20.0f);  // the step counter trails the moments
}

TEST(AdamWeightDecayAndAmsgradMatchTorch) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kAdam);
  config.weight_decay = 0.05f;
  config.amsgrad = true;
  ASSERT_EQ(NewUpdateRule(config, 10)->ExportState().size(), size_t{31});  // m, v, v_max, t
  CheckAgainstReference(config, 30, 1e-5, 7);
}

TEST(AdamWDecaysTheWeightsApartFromTheGradient) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kAdamW);
  config.weight_decay = 0.1f;
  CheckAgainstReference(config, 30, 1e-5, 8);
  config.amsgrad = true;
  CheckAgainstReference(config, 30, 1e-5, 9);
}

// A new learning rate takes effect at the next step, and keeps the state.
TEST(LearningRateChangesBetweenSteps) {
  for (UpdateRuleKind kind : {UpdateRuleKind::kSgd, UpdateRuleKind::kAdam, UpdateRuleKind::kAdamW}) {
    UpdateRuleConfig config = Rule(kind);
    config.momentum = 0.9f;
    config.weight_decay = 0.01f;
    std::mt19937 rng(10);
    const int64_t n = 19;
    auto rule = NewUpdateRule(config, n);
    std::vector<float> params = RandomVector(&rng, n, -1, 1);
    ReferenceRule reference(config, params);
    for (int step = 0; step < 12; ++step) {
      if (step % 4 == 3) {
        const float lr = config.learning_rate * (0.5f / static_cast<float>(step));
        rule->set_learning_rate(lr);
        reference.set_learning_rate(lr);
      }
      const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
      rule->Apply(params.data(), sum.data(), n, kWorkers);
      reference.Step(sum, kWorkers);
    }
    ExpectClose(params, reference.values(), 1e-5);
  }
}

// A clone continues exactly where the original is, and the two then evolve
// independently (a forked branch must not share optimizer state).
TEST(CloneDeepCopiesState) {
  UpdateRuleConfig sgd = Rule(UpdateRuleKind::kSgd);
  sgd.momentum = 0.9f;
  for (const UpdateRuleConfig& config : {Rule(UpdateRuleKind::kDampedMomentum), Rule(UpdateRuleKind::kAdam), sgd}) {
    std::mt19937 rng(5);
    const int64_t n = 16;
    auto rule = NewUpdateRule(config, n);
    std::vector<float> params = RandomVector(&rng, n, -1, 1);
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
      rule->Apply(params.data(), sum.data(), n, kWorkers);
    }
    std::unique_ptr<UpdateRule> clone;
    ASSERT_TRUE(rule->Clone(config, &clone).ok());
    EXPECT_TRUE(clone->ExportState() == rule->ExportState());

    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    std::vector<float> original_params = params;
    std::vector<float> clone_params = params;
    rule->Apply(original_params.data(), sum.data(), n, kWorkers);
    clone->Apply(clone_params.data(), sum.data(), n, kWorkers);
    EXPECT_TRUE(original_params == clone_params);  // same state, same step: bit-identical
    EXPECT_TRUE(clone->ExportState() == rule->ExportState());

    const std::vector<float> clone_state = clone->ExportState();
    rule->Apply(original_params.data(), sum.data(), n, kWorkers);
    EXPECT_TRUE(clone->ExportState() == clone_state);  // the original's step left the clone alone
  }
}

// A branch that turns momentum on for plain sgd starts a buffer as torch
// does when the momentum first appears: b = g at its first step.
TEST(SgdCloneThatGainsMomentumStartsAFreshBuffer) {
  UpdateRuleConfig plain = Rule(UpdateRuleKind::kSgd);
  plain.momentum = 0;
  const int64_t n = 3;
  auto rule = NewUpdateRule(plain, n);
  std::vector<float> params = {1, 1, 1};
  const std::vector<float> sum = {3, 6, -3};
  rule->Apply(params.data(), sum.data(), n, kWorkers);
  UpdateRuleConfig with_momentum = plain;
  with_momentum.momentum = 0.5f;
  std::unique_ptr<UpdateRule> clone;
  ASSERT_OK(rule->Clone(with_momentum, &clone));
  EXPECT_EQ(clone->state_arrays_per_value(), 1);
  clone->Apply(params.data(), sum.data(), n, kWorkers);
  const std::vector<float> state = clone->ExportState();
  EXPECT_EQ(state[0], 1.0f);
  EXPECT_EQ(state[1], 2.0f);
  EXPECT_EQ(state[n], 1.0f);
}

TEST(ImportRestoresTheStepCount) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  config.momentum = 0.9f;
  const int64_t n = 5;
  auto rule = NewUpdateRule(config, n);
  std::vector<float> params(n, 1.0f), sum(n, 3.0f);
  rule->Apply(params.data(), sum.data(), n, kWorkers);
  auto restored = NewUpdateRule(config, n);
  const std::vector<float> state = rule->ExportState();
  ASSERT_OK(restored->ImportState(state.data(), state.size()));
  std::vector<float> a = params, b = params;
  rule->Apply(a.data(), sum.data(), n, kWorkers);
  restored->Apply(b.data(), sum.data(), n, kWorkers);  // not a first step: b = 0.9 b + g
  EXPECT_TRUE(a == b);
  EXPECT_CODE(restored->ImportState(state.data(), state.size() - 1), StatusCode::kInvalidArgument);
}

TEST(CheckUpdateRuleRefusesTorchsInvalidSettings) {
  UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  EXPECT_OK(CheckUpdateRule(config, "t"));
  config.nesterov = true;
  config.momentum = 0;
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
  config.momentum = 0.9f;
  config.dampening = 0.1f;
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
  config = Rule(UpdateRuleKind::kAdam);
  config.beta2 = 1.0f;
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
  config = Rule(UpdateRuleKind::kAdamW);
  config.epsilon = 0;
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
  config.epsilon = 1e-8f;
  config.learning_rate = std::nanf("");
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
  config.learning_rate = 0.1f;
  config.kind = static_cast<UpdateRuleKind>(7);
  EXPECT_CODE(CheckUpdateRule(config, "t"), StatusCode::kInvalidArgument);
}

TEST(UnknownKindGivesNull) {
  UpdateRuleConfig config;
  config.kind = static_cast<UpdateRuleKind>(99);
  EXPECT_TRUE(NewUpdateRule(config, 4) == nullptr);
}

MLT_TEST_MAIN
