#include "server/update_rules.h"

#include <utility>

namespace mltuner {

std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig& config, int64_t num_values,
                                          std::shared_ptr<Device> device) {
  switch (config.kind) {
    case UpdateRuleKind::kAdd:
    case UpdateRuleKind::kSgd:
    case UpdateRuleKind::kMomentum:
    case UpdateRuleKind::kAdam:
      break;
    default:
      return nullptr;  // an out-of-range kind; callers turn this into an error
  }
  if (!device) device = NewCpuDevice();
  if (num_values < 0) num_values = 0;
  std::unique_ptr<UpdateRule> rule(new UpdateRule(device, config, num_values));
  const int64_t floats = StateArraysPerValue(config.kind) * num_values;
  if (floats > 0) {
    if (!DeviceBlock::Make(device, static_cast<size_t>(floats) * sizeof(float), false, &rule->state_).ok()) {
      return nullptr;
    }
    device->Fill(rule->state_->floats(), 0.0f, static_cast<size_t>(floats), Stream::kServer);
  }
  return rule;
}

void UpdateRule::Apply(float* params, const float* update_sum, int64_t count, int num_workers, Stream s) {
  ++steps_;
  const UpdateStep step = MakeUpdateStep(config_, num_workers, steps_);
  device_->ApplyUpdate(step, params, state_ ? state_->floats() : nullptr, update_sum, count, s);
}

size_t UpdateRule::state_size() const {
  const size_t arrays = static_cast<size_t>(state_arrays_per_value() * num_values_);
  return config_.kind == UpdateRuleKind::kAdam ? arrays + 1 : arrays;
}

std::vector<float> UpdateRule::ExportState() const {
  std::vector<float> out(state_size(), 0.0f);
  const size_t arrays = static_cast<size_t>(state_arrays_per_value() * num_values_);
  if (arrays > 0) {
    device_->CopyDeviceToHost(out.data(), state_->floats(), arrays * sizeof(float), Stream::kServer);
    device_->Synchronize(Stream::kServer);
  }
  if (config_.kind == UpdateRuleKind::kAdam) out[arrays] = static_cast<float>(steps_);
  return out;
}

Status UpdateRule::ImportState(const float* state, size_t n) {
  if (n != state_size()) {
    return Status::InvalidArgument("update rule state of " + std::to_string(n) + " floats, expected " +
                                   std::to_string(state_size()));
  }
  const size_t arrays = static_cast<size_t>(state_arrays_per_value() * num_values_);
  if (arrays > 0) device_->CopyHostToDevice(state_->floats(), state, arrays * sizeof(float), Stream::kServer);
  if (config_.kind == UpdateRuleKind::kAdam) steps_ = static_cast<int64_t>(state[arrays]);
  return device_->Synchronize(Stream::kServer);
}

Status UpdateRule::Clone(const UpdateRuleConfig& config, std::unique_ptr<UpdateRule>* out) const {
  UpdateRuleConfig copy_config = config;
  copy_config.kind = config_.kind;
  std::unique_ptr<UpdateRule> copy = NewUpdateRule(copy_config, num_values_, device_);
  if (!copy) return Status::ResourceExhausted("no device memory for a copy of an update rule's state");
  copy->steps_ = steps_;
  if (state_) {
    device_->CopyDeviceToDevice(copy->state_->floats(), state_->floats(), state_->bytes(), Stream::kServer);
  }
  *out = std::move(copy);
  return Status::Ok();
}

}  // namespace mltuner
