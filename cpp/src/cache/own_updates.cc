// Read-my-writes: this worker's own steps, added to its cache at once and
// again over each install of rows that do not hold them yet.
#include "cache/own_updates.h"

#include <algorithm>
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

namespace {

// The momentum an sgd or damped-momentum rule carries a step forward with
// (0: none).
float CarriedMomentum(const UpdateRuleConfig& rule) {
  const bool with_history = rule.kind == UpdateRuleKind::kSgd || rule.kind == UpdateRuleKind::kDampedMomentum;
  return with_history && rule.momentum > 0.0f ? rule.momentum : 0.0f;
}

}  // namespace

std::unique_ptr<OwnUpdates> OwnUpdates::ForTable(std::shared_ptr<Device> device, const TableStore& store,
                                                 const UpdateRuleConfig& rule, int read_slack, int num_workers,
                                                 int num_pieces) {
  if (!OwnStepIsLinear(rule) || store.host_values || !store.device_values) return nullptr;
  return std::unique_ptr<OwnUpdates>(
      new OwnUpdates(std::move(device), store, rule, read_slack, num_workers, num_pieces));
}

Status OwnUpdates::Scratch(float** out) {
  MutexLock lock(&mu_);
  if (!scratch_) MLT_RETURN_IF_ERROR(DeviceBlock::Make(device_, store_.device_values->bytes(), false, &scratch_));
  *out = scratch_->floats();
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
  latest_ = kNoClock;
  StopCarrying();
}

void OwnUpdates::StopCarrying() {
  carried_momentum_ = 0.0f;
  std::fill(raw_age_.begin(), raw_age_.end(), kNoClock);
}

void OwnUpdates::AddToCache(const float* step, int64_t offset, int64_t count) {
  device_->AddInto(store_.device_values->floats() + offset, step + offset, count, Stream::kInstall);
}

Status OwnUpdates::StartCarrying(float momentum) {
  if (momentum == carried_momentum_) return Status::Ok();
  StopCarrying();
  if (momentum == 0.0f) return Status::Ok();
  const size_t bytes = store_.device_values->bytes();
  if (!raw_) MLT_RETURN_IF_ERROR(DeviceBlock::MakeZeroed(device_, bytes, false, &raw_));
  if (!drift_) MLT_RETURN_IF_ERROR(DeviceBlock::MakeZeroed(device_, bytes, false, &drift_));
  device_->Fill(drift_->floats(), 0.0f, static_cast<size_t>(values()), Stream::kInstall);
  carried_momentum_ = momentum;
  return Status::Ok();
}

Status OwnUpdates::Apply(BranchId branch, mltuner::Clock clock, const Rule& rule, bool stale, BranchId cache_branch,
                         const float* update) {
  MutexLock lock(&mu_);
  if (!rule.training) return Status::Ok();  // evaluation and testing branches never change
  const UpdateRuleConfig& config = rule.config;
  if (!stale || branch != cache_branch || !OwnStepIsLinear(config)) {
    // The cache is another branch's, or nothing is stale: no step to keep.
    Restart(-1);
    return Status::Ok();
  }
  if (branch != branch_) Restart(branch);
  MLT_RETURN_IF_ERROR(StartCarrying(CarriedMomentum(config)));
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
  // The update was made on the writeback stream; the step goes into the
  // cache on the install stream, after the gathers queued before it, as an
  // install. Step 1 is sgd's first (its buffer set to the update) only at a
  // run's very first clock. With the others' momentum carried, the cache
  // also takes one more clock of it on every row whose last two installs
  // gave it (zero elsewhere).
  DeviceEvent made;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kWriteback, &made));
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, made));
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kInstall, store_.tickets.last_gather()));
  device_->OwnStep(MakeUpdateStep(config, num_workers_, clock + 1), carried_momentum_, step->floats(),
                   state_ ? state_->floats() : nullptr, update, store_.device_values->floats(),
                   carried_momentum_ > 0.0f ? drift_->floats() : nullptr, n, n, Stream::kInstall);
  DeviceEvent added;
  MLT_RETURN_IF_ERROR(device_->RecordEvent(Stream::kInstall, &added));
  // The writeback stream zeroes the update log, or fills the reclaimer's
  // scratch again, only once this pass has read it.
  MLT_RETURN_IF_ERROR(device_->WaitEvent(Stream::kWriteback, added));
  store_.tickets.set_last_install(std::move(added));
  steps_[clock] = std::move(step);
  latest_ = clock;
  ++steps_applied_;
  return Status::Ok();
}

Status OwnUpdates::Reinstall(BranchId branch, int piece, mltuner::Clock age, const std::vector<WireSegment>& segments) {
  MutexLock lock(&mu_);
  if (branch != branch_) return Status::Ok();
  const int64_t width = store_.info.row_width;
  const float m = carried_momentum_;
  // The others' step at `age`: these rows' change since the piece's install
  // of the clock before, less this worker's own step of `age`.
  const auto own_step = steps_.find(age);
  const bool known = m > 0.0f && raw_age_[static_cast<size_t>(piece)] == age - 1 && own_step != steps_.end() &&
                     latest_ >= age;
  double ahead = 0.0, power = 1.0;  // sum of m^j for j = 1..latest - age; then m^(latest - age + 1)
  for (mltuner::Clock j = age; known && j < latest_; ++j) {
    power *= m;
    ahead += power;
  }
  power *= m;
  float* const cache = store_.device_values->floats();
  for (const WireSegment& segment : segments) {
    if (segment.residence != Residence::kDevice) continue;
    const int64_t offset = segment.slot * width, count = segment.count * width;
    if (m > 0.0f) {
      // The others' momentum, carried over the clocks this worker is ahead
      // of the rows; `drift_` keeps the next clock's share.
      device_->Carry(static_cast<float>(ahead), static_cast<float>(power), cache + offset, raw_->floats() + offset,
                     drift_->floats() + offset, known ? own_step->second->floats() + offset : nullptr, count,
                     Stream::kInstall);
    }
    for (auto it = steps_.upper_bound(age); it != steps_.end(); ++it) AddToCache(it->second->floats(), offset, count);
  }
  if (m > 0.0f) raw_age_[static_cast<size_t>(piece)] = age;
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
