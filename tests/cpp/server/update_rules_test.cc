// Update rules against independent double-precision references written here
// from the formulas in config.h.
#include "server/update_rules.h"

#include <cmath>
#include <random>
#include <vector>

#include "test_util.h"

using namespace mltuner;

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

TEST(SgdStepsAlongTheMeanGradient) {
  std::mt19937 rng(2);
  const int64_t n = 41;
  const UpdateRuleConfig config = Rule(UpdateRuleKind::kSgd);
  auto rule = NewUpdateRule(config, n);
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  std::vector<double> reference(params.begin(), params.end());
  for (int step = 0; step < 20; ++step) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    rule->Apply(params.data(), sum.data(), n, kWorkers);
    for (int64_t i = 0; i < n; ++i) reference[i] -= double{config.learning_rate} * sum[i] / kWorkers;
  }
  ExpectClose(params, reference, 1e-5);
  EXPECT_TRUE(rule->ExportState().empty());
}

TEST(MomentumMatchesReferenceOverTwentySteps) {
  std::mt19937 rng(3);
  const int64_t n = 53;
  const UpdateRuleConfig config = Rule(UpdateRuleKind::kMomentum);
  auto rule = NewUpdateRule(config, n);
  ASSERT_EQ(rule->ExportState().size(), static_cast<size_t>(n));
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  std::vector<double> w(params.begin(), params.end());
  std::vector<double> h(n, 0.0);
  const double lr = config.learning_rate, m = config.momentum;
  for (int step = 0; step < 20; ++step) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    rule->Apply(params.data(), sum.data(), n, kWorkers);
    for (int64_t i = 0; i < n; ++i) {
      const double g = double{sum[i]} / kWorkers;
      h[i] = (1 - m) * g + m * h[i];
      w[i] -= lr * h[i];
    }
  }
  ExpectClose(params, w, 1e-5);
  const std::vector<float> state = rule->ExportState();
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(state[i], h[i], 1e-5 * (1 + std::fabs(h[i])));
}

TEST(AdamMatchesReferenceOverTwentySteps) {
  std::mt19937 rng(4);
  const int64_t n = 29;
  const UpdateRuleConfig config = Rule(UpdateRuleKind::kAdam);
  auto rule = NewUpdateRule(config, n);
  ASSERT_EQ(rule->ExportState().size(), static_cast<size_t>(2 * n + 1));
  std::vector<float> params = RandomVector(&rng, n, -1, 1);
  std::vector<double> w(params.begin(), params.end());
  std::vector<double> m1(n, 0.0), m2(n, 0.0);
  const double lr = config.learning_rate, b1 = config.beta1, b2 = config.beta2, eps = config.epsilon;
  for (int t = 1; t <= 20; ++t) {
    const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
    rule->Apply(params.data(), sum.data(), n, kWorkers);
    for (int64_t i = 0; i < n; ++i) {
      const double g = double{sum[i]} / kWorkers;
      m1[i] = b1 * m1[i] + (1 - b1) * g;
      m2[i] = b2 * m2[i] + (1 - b2) * g * g;
      const double m_hat = m1[i] / (1 - std::pow(b1, t));
      const double v_hat = m2[i] / (1 - std::pow(b2, t));
      w[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
  ExpectClose(params, w, 1e-4);
  const std::vector<float> state = rule->ExportState();
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(state[i], m1[i], 1e-5);
    EXPECT_NEAR(state[n + i], m2[i], 1e-5);
  }
  EXPECT_EQ(state[2 * n], 20.0f);  // the step counter trails the moments
}

// A clone continues exactly where the original is, and the two then evolve
// independently (a forked branch must not share optimizer state).
TEST(CloneDeepCopiesState) {
  for (UpdateRuleKind kind : {UpdateRuleKind::kMomentum, UpdateRuleKind::kAdam}) {
    std::mt19937 rng(5);
    const int64_t n = 16;
    auto rule = NewUpdateRule(Rule(kind), n);
    std::vector<float> params = RandomVector(&rng, n, -1, 1);
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> sum = RandomVector(&rng, n, -2, 2);
      rule->Apply(params.data(), sum.data(), n, kWorkers);
    }
    std::unique_ptr<UpdateRule> clone;
    ASSERT_TRUE(rule->Clone(Rule(kind), &clone).ok());
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

TEST(UnknownKindGivesNull) {
  UpdateRuleConfig config;
  config.kind = static_cast<UpdateRuleKind>(99);
  EXPECT_TRUE(NewUpdateRule(config, 4) == nullptr);
}

MLT_TEST_MAIN
