// Branches (mltuner.md §3, geeps.md §5): a branch is a copy of the
// parameters and optimizer state, forked from a parent on every shard, with
// its own learning rate, momentum, training flag and staleness. The
// application schedules each clock on one branch; each branch counts its own
// clocks, which is what its messages carry and what its data age measures.
// The cache holds one branch at a time: when the allocator reaches a clock of
// another branch it forgets every data age and asks the shards for that
// branch's rows (the GeePS flush on a branch switch); rows of any other
// branch that arrive later are dropped.
#include <algorithm>

#include "engine/engine_impl.h"
#include "wire/branch_settings.h"

namespace mltuner {

ClockBranch Engine::Impl::BranchOfLocked(mltuner::Clock clock) const {
  ClockBranch at;
  at.internal = clock;
  if (!config_.branches) return at;
  // The last block that starts at or before `clock`.
  auto block = std::upper_bound(schedule_.begin(), schedule_.end(), clock,
                                [](mltuner::Clock c, const ScheduledBlock& b) { return c < b.first; });
  if (block == schedule_.begin()) return at;  // not scheduled: callers check first
  --block;
  at.branch = block->branch;
  at.internal = block->first_internal + (clock - block->first);
  auto settings = branches_.find(block->branch);
  at.slack = settings == branches_.end() ? -1 : settings->second.slack;
  return at;
}

ClockBranch Engine::Impl::BranchOf(mltuner::Clock clock) const {
  std::lock_guard<std::mutex> lock(mu_);
  return BranchOfLocked(clock);
}

Status Engine::Impl::SendBranchRequest(MessageType type, BranchId branch, const std::string& text) {
  std::vector<Message> requests;
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message request = NewMessage(type, rank_, shard, -1);
    request.header.branch = branch;
    request.text = text;
    request.header.text_bytes = static_cast<uint32_t>(text.size());
    requests.push_back(std::move(request));
  }
  std::vector<Message> replies;
  return SendRequests(std::move(requests), &replies);
}

Status Engine::Impl::ForkBranch(BranchId child, BranchId parent, const BranchSettings& settings) {
  if (phase_.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("fork_branch needs Config.branches = true");
  if (phase_.load() != Phase::kRunning) return Status::OutOfOrder("fork_branch before start_iterations");
  const bool lr_ok = settings.learning_rate >= 0 || settings.learning_rate == BranchSettings::kKeepParent;
  const bool momentum_ok =
      (settings.momentum >= 0 && settings.momentum < 1) || settings.momentum == BranchSettings::kKeepParent;
  if (!lr_ok || !momentum_ok || settings.slack < -1) {
    return Status::InvalidArgument("branch " + std::to_string(child) + ": needs learning_rate >= 0, momentum in " +
                                   "[0, 1) (or -1 for the parent's) and slack >= -1");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (child < 0) return Status::InvalidArgument("branch ids are >= 0, got " + std::to_string(child));
    if (branches_.count(child) != 0) return Status::InvalidArgument("branch " + std::to_string(child) + " exists");
    if (branches_.count(parent) == 0) {
      return Status::NotFound("cannot fork from branch " + std::to_string(parent) + ": it does not exist");
    }
    if (static_cast<int>(branches_.size()) >= config_.max_branches) {
      return Status::ResourceExhausted("cannot fork branch " + std::to_string(child) + ": " +
                                       std::to_string(branches_.size()) + " branches are live, the limit is " +
                                       std::to_string(config_.max_branches) +
                                       " (free some, or raise Config.max_branches)");
    }
  }
  // Our updates of the parent must reach the shards before the fork request.
  MLT_RETURN_IF_ERROR(Flush());
  MLT_RETURN_IF_ERROR(SendBranchRequest(MessageType::kFork, child, EncodeBranchSettings(parent, settings)));
  std::lock_guard<std::mutex> lock(mu_);
  branches_[child] = settings;
  branch_clocks_[child] = 0;
  return Status::Ok();
}

Status Engine::Impl::FreeBranch(BranchId branch) {
  if (phase_.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("free_branch needs Config.branches = true");
  if (phase_.load() != Phase::kRunning) return Status::OutOfOrder("free_branch before start_iterations");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (branches_.count(branch) == 0) return Status::NotFound("branch " + std::to_string(branch) + " does not exist");
    for (mltuner::Clock c = app_clock_; c < scheduled_until_; ++c) {
      if (BranchOfLocked(c).branch == branch) {
        return Status::OutOfOrder("branch " + std::to_string(branch) + " is scheduled for clock " +
                                  std::to_string(c) + ", which has not run yet");
      }
    }
  }
  MLT_RETURN_IF_ERROR(Flush());
  MLT_RETURN_IF_ERROR(SendBranchRequest(MessageType::kFreeBranch, branch, ""));
  std::lock_guard<std::mutex> lock(mu_);
  branches_.erase(branch);
  branch_clocks_.erase(branch);
  return Status::Ok();
}

Status Engine::Impl::ScheduleBranch(BranchId branch, int64_t clocks) {
  if (phase_.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("schedule_branch needs Config.branches = true");
  if (clocks < 1) return Status::InvalidArgument("schedule_branch needs clocks >= 1, got " + std::to_string(clocks));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (branches_.count(branch) == 0) return Status::NotFound("branch " + std::to_string(branch) + " does not exist");
    // A block that continues the last one on the same branch just extends it.
    if (!schedule_.empty() && schedule_.back().branch == branch) {
      schedule_.back().count += clocks;
    } else {
      schedule_.push_back({scheduled_until_, clocks, branch, branch_clocks_[branch]});
    }
    branch_clocks_[branch] += clocks;
    scheduled_until_ += clocks;
  }
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::Impl::SwitchCache(BranchId branch) {
  {
    std::lock_guard<std::mutex> lock(age_mu_);
    cache_branch_ = branch;
    for (auto& ages : shard_age_) std::fill(ages.begin(), ages.end(), kNoClock);
    std::fill(data_age_.begin(), data_age_.end(), kNoClock);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.branch_switches;
  }
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message request = NewMessage(MessageType::kBranchRows, rank_, shard, -1);
    request.header.branch = branch;
    MLT_RETURN_IF_ERROR(transport_->Send(std::move(request)));
    ++messages_sent_;
  }
  return Status::Ok();
}

}  // namespace mltuner
