// Server-side update rules: how a shard turns one clock's combined worker
// updates into new parameter values, on the shard's device.
//
// A rule owns its optimizer state (momentum buffer, Adam moments) for one
// shard slice of one table, in the device's memory, so a branch fork copies
// it with the parameters without leaving the device. The arithmetic is
// UpdateValue (mltuner/update_step.h), the same on every backend.
// Not thread-safe: a shard applies rules from its single handler thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memory/device_block.h"
#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/update_step.h"

namespace mltuner {

class UpdateRule {
 public:
  UpdateRule(const UpdateRule&) = delete;
  UpdateRule& operator=(const UpdateRule&) = delete;

  // Applies one clock on stream `s`: `update_sum` holds the sum over all
  // `num_workers` workers' updates, `count` floats aligned with `params` (both
  // in the device's memory). REQUIRES: count == the rule's num_values.
  void Apply(float* params, const float* update_sum, int64_t count, int num_workers, Stream s = Stream::kServer) {
    ApplyPart(params, update_sum, 0, count, num_workers, /*first_part=*/true, s);
  }
  // The same step over values [offset, offset + count) of the slice, for a
  // shard that applies a clock part by part (sharding/shard_range.h,
  // ShardParts): `params` and `update_sum` start at value `offset`. A
  // clock's first part starts its step (the step count, Adam's t, moves once
  // a clock); its other parts take the same step.
  void ApplyPart(float* params, const float* update_sum, int64_t offset, int64_t count, int num_workers,
                 bool first_part, Stream s = Stream::kServer);

  // Whether a clock without updates still changes something: a rule with
  // state takes a zero-gradient step (its history decays), and weight decay
  // shrinks the values. add and plain sgd skip such a clock.
  bool stateful() const { return state_arrays_ > 0 || config_.weight_decay != 0.0f; }
  const UpdateRuleConfig& config() const { return config_; }
  // The learning rate of the clocks applied from now on (an application's
  // schedule; the shard checks every worker asked for the same).
  void set_learning_rate(float learning_rate) { config_.learning_rate = learning_rate; }

  // The optimizer state flattened for checkpoints and tests: the state
  // arrays, then the step count of the rules that keep one (sgd with a
  // momentum buffer, adam, adamw). Waits for the device.
  std::vector<float> ExportState() const;
  size_t state_size() const;
  // REQUIRES: n == state_size().
  Status ImportState(const float* state, size_t n);
  // How ExportState is laid out: this many arrays of one float per value,
  // then scalars. Lets a checkpoint re-split the state over other shards.
  int state_arrays_per_value() const { return state_arrays_; }
  // A deep copy (the state copied on the device) with other hyperparameters
  // of the same kind. An sgd copy that gains momentum gets a fresh buffer
  // (set to the gradient at its first step, as torch does).
  Status Clone(const UpdateRuleConfig& config, std::unique_ptr<UpdateRule>* out) const;

 private:
  friend std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig&, int64_t, std::shared_ptr<Device>, bool);
  UpdateRule(std::shared_ptr<Device> device, const UpdateRuleConfig& config, int64_t num_values, bool host)
      : device_(std::move(device)), config_(config), num_values_(num_values), host_(host) {}
  // Allocates `arrays` zeroed state arrays. False when out of memory.
  bool AllocateState(int arrays);
  bool keeps_step_count() const;

  std::shared_ptr<Device> device_;
  UpdateRuleConfig config_;
  int64_t num_values_;
  bool host_;  // the state lives in host memory (Device::AllocateHost)
  int state_arrays_ = 0;
  int64_t steps_ = 0;                   // steps taken with the state (Adam's t)
  std::shared_ptr<DeviceBlock> state_;  // state_arrays_ x num_values floats, or null
};

// A rule over num_values values with zero state on `device` (the CPU backend
// when null), in its memory or, with `host`, in host memory that its kernels
// read and write in place (REQUIRES: device->maps_host_memory()); copies
// (Clone) keep the placement. Null for an unknown kind or when the state
// cannot be allocated.
std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig& config, int64_t num_values,
                                          std::shared_ptr<Device> device = nullptr, bool host = false);

}  // namespace mltuner
