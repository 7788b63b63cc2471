// Branches (mltuner.md §3, geeps.md §5): a branch is a copy of the
// parameters and optimizer state, forked from a parent on every shard, with
// its own learning rate, momentum, training flag and staleness. The
// application schedules each clock on one branch; each branch counts its own
// clocks, which is what its messages carry and what its data age measures.
// The cache holds one branch at a time: when the allocator reaches a clock of
// another branch it forgets every data age and asks the shards for that
// branch's rows (the GeePS flush on a branch switch); rows of any other
// branch that arrive later are dropped. A clock past the schedule runs on
// `continue_on` (a tuning session's final branch, so the loop trains on),
// appended by the application thread when it reaches that clock, never
// ahead of it: a later ScheduleBranch still decides the clocks after it.
#include <algorithm>

#include "engine/engine_impl.h"
#include "wire/branch_settings.h"

namespace mltuner {

namespace {

// A failure of the job itself (its peers or this engine are gone), as against
// a shard's refusal of the request (its content, no room for it, an error of
// its device), after which the others may hold what it refused.
bool JobFailed(const Status& status) {
  switch (status.code()) {
    case StatusCode::kTimeout:
    case StatusCode::kShutdown:
    case StatusCode::kPeerLost:
    case StatusCode::kCancelled:
      return true;
    default:
      return false;
  }
}

}  // namespace

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
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("fork_branch needs Config.branches = true");
  if (state_.phase.load() != Phase::kRunning) return Status::OutOfOrder("fork_branch before start_iterations");
  const bool lr_ok = settings.learning_rate >= 0 || settings.learning_rate == BranchSettings::kKeepParent;
  const bool momentum_ok =
      (settings.momentum >= 0 && settings.momentum < 1) || settings.momentum == BranchSettings::kKeepParent;
  if (!lr_ok || !momentum_ok || settings.slack < -1) {
    return Status::InvalidArgument("branch " + std::to_string(child) + ": needs learning_rate >= 0, momentum in " +
                                   "[0, 1) (or -1 for the parent's) and slack >= -1");
  }
  {
    MutexLock lock(&state_.mu);
    if (child < 0) return Status::InvalidArgument("branch ids are >= 0, got " + std::to_string(child));
    if (state_.branches.live.count(child) != 0) return Status::InvalidArgument("branch " + std::to_string(child) + " exists");
    if (state_.branches.live.count(parent) == 0) {
      return Status::NotFound("cannot fork from branch " + std::to_string(parent) + ": it does not exist");
    }
    if (static_cast<int>(state_.branches.live.size()) >= config_.max_branches) {
      return Status::ResourceExhausted("cannot fork branch " + std::to_string(child) + ": " +
                                       std::to_string(state_.branches.live.size()) + " branches are live, the limit is " +
                                       std::to_string(config_.max_branches) +
                                       " (free some, or raise Config.max_branches)");
    }
  }
  // Our updates of the parent must reach the shards before the fork request.
  MLT_RETURN_IF_ERROR(Flush());
  const Status forked = SendBranchRequest(MessageType::kFork, child, EncodeBranchSettings(parent, settings));
  if (!forked.ok() && !JobFailed(forked)) {
    // A shard refused (no memory for its copy, say) while the others may
    // have forked. Each shard answers every worker, so every worker got this
    // refusal and asks every shard to free the child; a shard without it
    // says so, which is expected here.
    (void)SendBranchRequest(MessageType::kFreeBranch, child, "");
  }
  MLT_RETURN_IF_ERROR(forked);
  {
    MutexLock lock(&state_.mu);
    state_.branches.live[child] = settings;
    BranchSettings overrides = state_.branches.rule_overrides[parent];
    if (settings.momentum >= 0) overrides.momentum = settings.momentum;
    state_.branches.rule_overrides[child] = overrides;
    // The shards' rates, computed the same way (Flush sent every rate set before).
    state_.branches.rates[child] =
        ForkRates(state_.branches.rates[parent], settings.learning_rate, settings.keep_rate_ratios);
    state_.branches.clocks[child] = 0;
  }
  // The cache may still hold a freed branch of this id (the last clocks ran
  // on it): that is another branch, whose rows and data ages this one must
  // not take.
  MutexLock ages(&state_.age_mu);
  if (state_.cache_branch == child) state_.cache_branch = kNoCachedBranch;
  return Status::Ok();
}

Status Engine::Impl::FreeBranch(BranchId branch) {
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("free_branch needs Config.branches = true");
  if (state_.phase.load() != Phase::kRunning) return Status::OutOfOrder("free_branch before start_iterations");
  {
    MutexLock lock(&state_.mu);
    if (state_.branches.live.count(branch) == 0) return Status::NotFound("branch " + std::to_string(branch) + " does not exist");
    for (mltuner::Clock c = state_.app_clock; c < state_.branches.scheduled_until; ++c) {
      if (state_.branches.At(c).branch == branch) {
        return Status::OutOfOrder("branch " + std::to_string(branch) + " is scheduled for clock " +
                                  std::to_string(c) + ", which has not run yet");
      }
    }
  }
  MLT_RETURN_IF_ERROR(Flush());
  MLT_RETURN_IF_ERROR(SendBranchRequest(MessageType::kFreeBranch, branch, ""));
  MutexLock lock(&state_.mu);
  state_.branches.live.erase(branch);
  state_.branches.rule_overrides.erase(branch);
  state_.branches.rates.erase(branch);
  state_.branches.clocks.erase(branch);
  if (state_.branches.continue_on == branch) state_.branches.continue_on = -1;
  return Status::Ok();
}

Status Engine::Impl::ScheduleBranch(BranchId branch, int64_t clocks) {
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("schedule_branch needs Config.branches = true");
  if (clocks < 1) return Status::InvalidArgument("schedule_branch needs clocks >= 1, got " + std::to_string(clocks));
  {
    MutexLock lock(&state_.mu);
    if (state_.branches.live.count(branch) == 0) return Status::NotFound("branch " + std::to_string(branch) + " does not exist");
    state_.branches.Append(branch, clocks);
  }
  state_.cv.NotifyAll();
  return Status::Ok();
}

Status Engine::Impl::ContinueOnBranch(BranchId branch) {
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (!config_.branches) return Status::OutOfOrder("continue_on_branch needs Config.branches = true");
  MutexLock lock(&state_.mu);
  if (branch >= 0 && state_.branches.live.count(branch) == 0) {
    return Status::NotFound("branch " + std::to_string(branch) + " does not exist");
  }
  state_.branches.continue_on = branch < 0 ? -1 : branch;
  return Status::Ok();
}

// Batch stealing: the late worker's clock is counted on every shard now,
// instead of when its (zero) update arrives.
Status Engine::Impl::DeclareEmptyClock(WorkerId worker, BranchId branch, mltuner::Clock clock) {
  if (state_.phase.load() == Phase::kShutdown) return Status::Shutdown("the engine is shut down");
  if (state_.phase.load() != Phase::kRunning) return Status::OutOfOrder("declare_empty_clock before start_iterations");
  if (worker < 0 || worker >= num_workers_) {
    return Status::InvalidArgument("declare_empty_clock: worker " + std::to_string(worker) + " is not in [0, " +
                                   std::to_string(num_workers_) + ")");
  }
  if (clock < 0) return Status::InvalidArgument("declare_empty_clock: clock " + std::to_string(clock) + " < 0");
  {
    MutexLock lock(&state_.mu);
    if (state_.branches.enabled) {
      const auto scheduled = state_.branches.clocks.find(branch);
      if (scheduled == state_.branches.clocks.end()) {
        return Status::NotFound("declare_empty_clock: branch " + std::to_string(branch) + " does not exist");
      }
      if (clock >= scheduled->second) {
        return Status::OutOfOrder("declare_empty_clock: clock " + std::to_string(clock) + " of branch " +
                                  std::to_string(branch) + " is not scheduled (it has " +
                                  std::to_string(scheduled->second) + ")");
      }
    } else if (branch != 0) {
      return Status::NotFound("declare_empty_clock: branch " + std::to_string(branch) +
                              " does not exist (Config.branches is off)");
    }
  }
  for (int shard = 0; shard < num_workers_; ++shard) {
    Message notice = NewMessage(MessageType::kEmptyClock, rank_, shard, -1);
    notice.header.branch = branch;
    notice.header.clock = clock;
    notice.header.request_id = worker;
    MLT_RETURN_IF_ERROR(transport_->Send(std::move(notice)));
  }
  return Status::Ok();
}

}  // namespace mltuner
