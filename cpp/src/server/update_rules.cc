#include "server/update_rules.h"

#include <algorithm>
#include <string>
#include <utility>

namespace mltuner {

std::unique_ptr<UpdateRule> NewUpdateRule(const UpdateRuleConfig& config, int64_t num_values,
                                          std::shared_ptr<Device> device, bool host) {
  switch (config.kind) {
    case UpdateRuleKind::kAdd:
    case UpdateRuleKind::kSgd:
    case UpdateRuleKind::kDampedMomentum:
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW:
      break;
    default:
      return nullptr;  // an out-of-range kind; callers turn this into an error
  }
  if (!device) device = NewCpuDevice();
  if (num_values < 0) num_values = 0;
  std::unique_ptr<UpdateRule> rule(new UpdateRule(device, config, num_values, host));
  if (!rule->AllocateState(StateArraysPerValue(config))) return nullptr;
  return rule;
}

bool UpdateRule::AllocateState(int arrays) {
  state_arrays_ = arrays;
  state_.reset();
  const int64_t floats = arrays * num_values_;
  if (floats == 0) return true;
  // Zero pages: on the CPU backend they take memory only once written.
  return DeviceBlock::MakeZeroed(device_, static_cast<size_t>(floats) * sizeof(float), host_, &state_).ok();
}

bool UpdateRule::keeps_step_count() const {
  switch (config_.kind) {
    case UpdateRuleKind::kSgd: return state_arrays_ > 0;  // the buffer's first step is special
    case UpdateRuleKind::kAdam:
    case UpdateRuleKind::kAdamW: return true;  // bias correction
    default: return false;
  }
}

void UpdateRule::ApplyPart(float* params, const float* update_sum, int64_t offset, int64_t count, int num_workers,
                           bool first_part, Stream s) {
  // sgd's step count moves only while its buffer is in use (momentum != 0),
  // as torch's buffer is only touched then.
  if (first_part && (config_.kind != UpdateRuleKind::kSgd || config_.momentum != 0.0f)) ++steps_;
  const UpdateStep step = MakeUpdateStep(config_, num_workers, steps_);
  device_->ApplyUpdate(step, params, state_ ? state_->floats() + offset : nullptr, update_sum, count, num_values_, s);
}

size_t UpdateRule::state_size() const {
  const size_t arrays = static_cast<size_t>(state_arrays_ * num_values_);
  return keeps_step_count() ? arrays + 1 : arrays;
}

std::vector<float> UpdateRule::ExportState() const {
  std::vector<float> out(state_size(), 0.0f);
  const size_t arrays = static_cast<size_t>(state_arrays_ * num_values_);
  if (arrays > 0) {
    device_->CopyDeviceToHost(out.data(), state_->floats(), arrays * sizeof(float), Stream::kServer);
    device_->Synchronize(Stream::kServer);
  }
  if (keeps_step_count()) out[arrays] = static_cast<float>(steps_);
  return out;
}

Status UpdateRule::ImportState(const float* state, size_t n) {
  if (n != state_size()) {
    return Status::InvalidArgument("update rule state of " + std::to_string(n) + " floats, expected " +
                                   std::to_string(state_size()) + " (" + UpdateRuleText(config_) + ")");
  }
  const size_t arrays = static_cast<size_t>(state_arrays_ * num_values_);
  if (arrays > 0) device_->CopyHostToDevice(state_->floats(), state, arrays * sizeof(float), Stream::kServer);
  if (keeps_step_count()) {
    const float steps = state[arrays];
    if (!(steps >= 0 && steps < 9.0e15f)) {
      return Status::InvalidArgument("update rule state has a step count of " + std::to_string(steps));
    }
    steps_ = static_cast<int64_t>(steps);
  }
  return device_->Synchronize(Stream::kServer);
}

Status UpdateRule::Clone(const UpdateRuleConfig& config, std::unique_ptr<UpdateRule>* out) const {
  UpdateRuleConfig copy_config = config;
  copy_config.kind = config_.kind;
  std::unique_ptr<UpdateRule> copy(new UpdateRule(device_, copy_config, num_values_, host_));
  // The state as it is (an sgd buffer stays, unused, when momentum drops to
  // 0, as torch keeps it), or fresh for an sgd copy that gains momentum.
  const bool fresh_buffer = state_arrays_ == 0 && SgdHasMomentum(copy_config);
  if (!copy->AllocateState(fresh_buffer ? 1 : state_arrays_)) {
    return Status::ResourceExhausted(std::string("no ") + (host_ ? "host" : "device") + " memory for a copy of an update rule's state");
  }
  copy->steps_ = fresh_buffer ? 0 : steps_;
  if (state_) {
    device_->CopyDeviceToDevice(copy->state_->floats(), state_->floats(), state_->bytes(), Stream::kServer);
  }
  *out = std::move(copy);
  return Status::Ok();
}

}  // namespace mltuner
