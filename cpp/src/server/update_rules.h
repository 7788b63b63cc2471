// Server-side update rules: how a shard turns one clock's combined worker
// updates into new parameter values.
//
// A rule owns its optimizer state (momentum history, Adam moments) for one
// shard slice of one table, so a branch fork can copy it with the parameters.
// Not thread-safe: a shard applies rules from its single handler thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mltuner/config.h"

namespace mltuner {

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  UpdateRule(const UpdateRule&) = delete;
  UpdateRule& operator=(const UpdateRule&) = delete;

  // Applies one clock: `update_sum` holds the sum over all `num_workers`
  // workers' updates, `count` floats, aligned with `params`.
  virtual void Apply(float* params, const float* update_sum, int64_t count,
                     int num_workers) = 0;
  // The optimizer state, flattened (empty for stateless rules); used to copy
  // a rule into a forked branch and by checkpoints.
  virtual std::vector<float>* state() = 0;
  // How the state is laid out: this many arrays of one float per value,
  // then scalars (Adam's step count). Lets a checkpoint re-split the state
  // when it is restored onto a different number of shards.
  virtual int state_arrays_per_value() const = 0;
  virtual std::unique_ptr<UpdateRule> Clone() const = 0;

 protected:
  UpdateRule() = default;
};

// REQUIRES: num_values >= 0. The state is sized for num_values floats.
std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig& config, int64_t num_values);

}  // namespace mltuner
