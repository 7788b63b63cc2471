// The range check of an update rule's hyperparameters: a property of the
// public UpdateRuleConfig, which the engine checks where the application
// gives a rule (Config, create_table); it lives apart from server/, which
// runs the rules, so the worker side need not include the server.
#pragma once

#include <string>

#include "mltuner/config.h"
#include "mltuner/status.h"

namespace mltuner {

// OK when every hyperparameter of `rule` is in torch.optim's range (and the
// kind exists); else InvalidArgument naming `what` and the field.
Status CheckUpdateRule(const UpdateRuleConfig& rule, const std::string& what);

}  // namespace mltuner
