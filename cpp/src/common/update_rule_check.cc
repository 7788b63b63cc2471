#include "common/update_rule_check.h"

namespace mltuner {

Status CheckUpdateRule(const UpdateRuleConfig& rule, const std::string& what) {
  const auto bad = [&](const std::string& field, float value, const char* range) {
    return Status::InvalidArgument(what + ": update rule " + UpdateRuleName(rule.kind) + " has " + field + " " +
                                   std::to_string(value) + ", expected " + range);
  };
  const int kind = static_cast<int>(rule.kind);
  if (kind < static_cast<int>(UpdateRuleKind::kAdd) || kind > static_cast<int>(UpdateRuleKind::kAdamW)) {
    return Status::InvalidArgument(what + ": unknown update rule kind " + std::to_string(kind));
  }
  // The comparisons are written so that NaN fails them.
  constexpr float kMaxRate = 1e6f;  // as Python's MAX_LEARNING_RATE and MAX_WEIGHT_DECAY
  if (!(rule.learning_rate >= 0 && rule.learning_rate <= kMaxRate)) {
    return bad("learning_rate", rule.learning_rate, "[0, 1e6]");
  }
  if (!(rule.momentum >= 0 && rule.momentum < 1)) return bad("momentum", rule.momentum, "[0, 1)");
  if (!(rule.dampening >= 0 && rule.dampening <= 1)) return bad("dampening", rule.dampening, "[0, 1]");
  if (!(rule.weight_decay >= 0 && rule.weight_decay <= kMaxRate)) {
    return bad("weight_decay", rule.weight_decay, "[0, 1e6]");
  }
  if (!(rule.beta1 >= 0 && rule.beta1 < 1)) return bad("beta1", rule.beta1, "[0, 1)");
  if (!(rule.beta2 >= 0 && rule.beta2 < 1)) return bad("beta2", rule.beta2, "[0, 1)");
  if (!(rule.epsilon > 0 && rule.epsilon <= 1)) return bad("epsilon", rule.epsilon, "(0, 1]");
  if (rule.kind == UpdateRuleKind::kSgd && rule.nesterov && (rule.momentum <= 0 || rule.dampening != 0)) {
    return Status::InvalidArgument(what + ": sgd with nesterov needs momentum > 0 and dampening 0 (as in torch)");
  }
  return Status::Ok();
}

}  // namespace mltuner
