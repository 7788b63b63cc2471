// Printable names of the engine's enums, and Status::ToString.
#include <cstdio>

#include "mltuner/config.h"
#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kOutOfOrder: return "OutOfOrder";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kShutdown: return "Shutdown";
    case StatusCode::kCorruptMessage: return "CorruptMessage";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kPeerLost: return "PeerLost";
    case StatusCode::kNonFinite: return "NonFinite";
    case StatusCode::kCancelled: return "Cancelled";
  }
  return "Unknown";
}

Status Status::FromCode(StatusCode code, std::string msg) {
  const int value = static_cast<int>(code);
  const bool known = value > static_cast<int>(StatusCode::kOk) && value <= static_cast<int>(StatusCode::kCancelled);
  return Status(known ? code : StatusCode::kInternal, std::move(msg));
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kRead: return "read";
    case OpKind::kPostRead: return "post_read";
    case OpKind::kPreUpdate: return "pre_update";
    case OpKind::kUpdate: return "update";
    case OpKind::kLocalAccess: return "local_access";
    case OpKind::kPostLocalAccess: return "post_local_access";
    case OpKind::kClock: return "clock";
  }
  return "unknown";
}

const char* UpdateRuleName(UpdateRuleKind kind) {
  switch (kind) {
    case UpdateRuleKind::kAdd: return "add";
    case UpdateRuleKind::kSgd: return "sgd";
    case UpdateRuleKind::kDampedMomentum: return "damped_momentum";
    case UpdateRuleKind::kAdam: return "adam";
    case UpdateRuleKind::kAdamW: return "adamw";
  }
  return "unknown";
}

std::string UpdateRuleText(const UpdateRuleConfig& rule) {
  char text[256];
  const auto d = [](float x) { return static_cast<double>(x); };
  switch (rule.kind) {
    case UpdateRuleKind::kSgd:
      std::snprintf(text, sizeof(text), "sgd lr=%.9g momentum=%.9g dampening=%.9g nesterov=%d weight_decay=%.9g",
                    d(rule.learning_rate), d(rule.momentum), d(rule.dampening), rule.nesterov ? 1 : 0,
                    d(rule.weight_decay));
      return text;
    case UpdateRuleKind::kDampedMomentum:
      std::snprintf(text, sizeof(text), "damped_momentum lr=%.9g momentum=%.9g", d(rule.learning_rate),
                    d(rule.momentum));
      return text;
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW:
      std::snprintf(text, sizeof(text), "%s lr=%.9g beta1=%.9g beta2=%.9g eps=%.9g weight_decay=%.9g amsgrad=%d",
                    UpdateRuleName(rule.kind), d(rule.learning_rate), d(rule.beta1), d(rule.beta2),
                    d(rule.epsilon), d(rule.weight_decay), rule.amsgrad ? 1 : 0);
      return text;
    case UpdateRuleKind::kAdd:
      break;
  }
  return UpdateRuleName(rule.kind);
}

}  // namespace mltuner
