// Read-my-writes: this worker's own steps, added to its cache at once and
// again over each install of rows that do not hold them yet.
#include "cache/own_updates.h"

#include <utility>

#include "mltuner/update_step.h"

namespace mltuner {

bool OwnStepIsLinear(const UpdateRuleConfig& rule) {
  switch (rule.kind) {
    case UpdateRuleKind::kAdd:
      return true;
    case UpdateRuleKind::kSgd:
    case UpdateRuleKind::kDampedMomentum:
      return rule.weight_decay == 0.0f;  // decay reads the parameters
    default:
      return false;  // Adam divides by the moments of everyone's updates
  }
}

Status OwnUpdates::ForTable(std::shared_ptr<Device> device, const TableStore& store, const UpdateRuleConfig& rule,
                            int num_workers, std::unique_ptr<OwnUpdates>* out) {
  out->reset();
  if (!OwnStepIsLinear(rule) || store.host_values || !store.device_values) return Status::Ok();
  std::unique_ptr<OwnUpdates> own(new OwnUpdates(device, store, rule, num_workers));
  MLT_RETURN_IF_ERROR(DeviceBlock::MakeZeroed(std::move(device), store.device_values->bytes(), false, &own->scratch_));
  *out = std::move(own);
  return Status::Ok();
}

int64_t OwnUpdates::values() const {
  return static_cast<int64_t>(store_.device_values->bytes() / sizeof(float));
}

int64_t OwnUpdates::steps_applied() const {
  MutexLock lock(&mu_);
  return steps_applied_;
}

void OwnUpdates::Restart(BranchId branch) {
  for (auto& [clock, block] : steps_) spare_.push_back(std::move(block));
  steps_.clear();
  branch_ = branch;
  state_.reset();
  state_arrays_ = 0;
}

void OwnUpdates::AddToCache(const float* step, int64_t offset, int64_t count) {
  device_->AddInto(store_.device_values->floats() + offset, step + offset, count, Stream::kInstall);
}

Status OwnUpdates::Apply(BranchId branch, mltuner::Clock clock, const Rule& rule, bool stale, BranchId cache_branch,
                         const float* update) {
  MutexLock lock(&mu_);
  if (rule.new_learning_rate) set_rates_[branch] = *rule.new_learning_rate;
  if (!rule.training) return Status::Ok();  // evaluation and testing branches never change
  UpdateRuleConfig config = rule.config;
  auto set_rate = set_rates_.find(branch);
  if (set_rate != set_rates_.end()) config.learning_rate = set_rate->second;
  if (!stale || branch != cache_branch || !OwnStepIsLinear(config)) {
    // The cache is another branch's, or nothing is stale: no step to keep.
    Restart(-1);
    return Status::Ok();
  }
  if (branch != branch_) Restart(branch);
  const int64_t n = values();
  const int arrays = StateArraysPerValue(config);
  if (arrays != state_arrays_) {  // a branch that gained momentum starts its share at zero
    state_.reset();
    if (arrays > 0) {
      MLT_RETURN_IF_ERROR(DeviceBlock::MakeZeroed(device_, static_cast<size_t>(arrays * n) * sizeof(float), false,
                                                  &state_));
    }
    state_arrays_ = arrays;
  }
  std::shared_ptr<DeviceBlock> step;
  if (!spare_.empty()) {
    step = std::move(spare_.back());
    spare_.pop_back();
  } else {
    MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, static_cast<size_t>(n) * sizeof(float), false, &step));
  }
  // A reused block may still be read by an earlier add on the install
  // stream; the writeback stream, which fills it, waits for those.
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kWriteback, store_.tickets.last_install()));
  // The rule's step from zero is the step itself: -lr h for momentum, the
  // update for add. Step 1 is sgd's first (its buffer set to the update)
  // only at a run's very first clock.
  device_->Fill(step->floats(), 0.0f, static_cast<size_t>(n), Stream::kWriteback);
  const UpdateStep arithmetic = MakeUpdateStep(config, num_workers_, clock + 1);
  device_->ApplyUpdate(arithmetic, step->floats(), state_ ? state_->floats() : nullptr, update, n, n,
                       Stream::kWriteback);
  DeviceEvent made;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kWriteback, &made));
  // Into the cache after the gathers queued before it, as an install.
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, made));
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, store_.tickets.last_gather()));
  AddToCache(step->floats(), 0, n);
  DeviceEvent added;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kInstall, &added));
  store_.tickets.set_last_install(std::move(added));
  steps_[clock] = std::move(step);
  ++steps_applied_;
  return Status::Ok();
}

Status OwnUpdates::Reinstall(BranchId branch, mltuner::Clock age, const std::vector<WireSegment>& segments) {
  MutexLock lock(&mu_);
  if (branch != branch_) return Status::Ok();
  const int64_t width = store_.info.row_width;
  for (auto it = steps_.upper_bound(age); it != steps_.end(); ++it) {
    for (const WireSegment& segment : segments) {
      if (segment.residence == Residence::kDevice) AddToCache(it->second->floats(), segment.slot * width, segment.count * width);
    }
  }
  return Status::Ok();
}

void OwnUpdates::Forget(BranchId branch, mltuner::Clock age) {
  MutexLock lock(&mu_);
  if (branch != branch_) return;
  while (!steps_.empty() && steps_.begin()->first <= age) {
    spare_.push_back(std::move(steps_.begin()->second));
    steps_.erase(steps_.begin());
  }
}

}  // namespace mltuner
