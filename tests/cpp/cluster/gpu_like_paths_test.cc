// The paths a GPU takes, on the CPU (gpu_like_device.h): one process and two
// processes of a GPU-like device train to the bits of the CPU backend, with
// the shard's state on the device or in host memory, with a device budget
// that keeps some rows in host memory, and with branches forked from a
// host-resident state.
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cluster/two_process_model.h"
#include "gpu_like_device.h"
#include "test_util.h"

using namespace mltuner;

namespace {

constexpr int kClocks = 10;

Config TestConfig(UpdateRuleKind kind) {
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = kind;
  config.update_rule.learning_rate = 0.05f;
  config.update_rule.momentum = 0.9f;
  config.device_memory_reserve = 0;
  return config;
}

// GPU-like devices with `free_bytes` free each, sharing one wait count.
DeviceFactory GpuLike(int64_t free_bytes, const GpuLikeDevice::WaitCount& waits) {
  return [free_bytes, waits](int, std::unique_ptr<Device>* out) {
    *out = std::make_unique<GpuLikeDevice>(free_bytes, waits);
    return Status::Ok();
  };
}

// The model trained on the CPU backend in one process, and on GPU-like
// devices (`free_bytes` free) in one process and in two, all with `config`.
void ExpectGpuLikeRunsMatch(const Config& config, int64_t free_bytes) {
  std::vector<float> reference[2];
  testing::TrainInOneProcess(config, kClocks, reference);
  auto waits = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local, GpuLike(free_bytes, waits));
  for (int rank = 0; rank < 2; ++rank) testing::ExpectSameBits(local[rank], reference[rank]);
  for (const bool batches : {false, true}) {  // one message at a time, or as the socket transport takes them
    testing::TwoNodeRun remote;
    testing::TrainInTwoProcesses(config, GpuLike(free_bytes, waits), kClocks, &remote, {}, false, batches);
    EXPECT_EQ(remote.refused, 0);
    EXPECT_EQ(remote.rejected, 0);
    for (int rank = 0; rank < 2; ++rank) testing::ExpectSameBits(remote.values[rank], reference[rank]);
  }
  EXPECT_TRUE(waits->load() > 0);  // host readers waited on tickets through the device
}

// Two workers of one process: two clocks on branch 0, a fork with its own
// rate, two clocks on it, one more on branch 0; out[rank][branch] = the
// values each worker fetches of each branch at the end.
void TrainBranches(const Config& config, const DeviceFactory& make_device, std::vector<float> out[2][2]) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 2, &cluster, make_device));
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      Engine* e = cluster->worker(rank);
      testing::ModelHandles m;
      Status s = testing::RecordModel(e, &m);
      if (s.ok()) s = e->FinishVirtualIteration();
      if (s.ok()) s = e->StartIterations();
      BranchSettings own_rate;
      own_rate.training = true;
      own_rate.learning_rate = 0.01f;
      const std::vector<std::pair<BranchId, int>> blocks = {{0, 2}, {1, 2}, {0, 1}};
      int clock = 0;
      for (const auto& [branch, clocks] : blocks) {
        if (s.ok() && branch == 1) s = e->ForkBranch(1, 0, own_rate);
        if (s.ok()) s = e->ScheduleBranch(branch, clocks);
        for (int c = 0; s.ok() && c < clocks; ++c) s = testing::TrainClock(e, m, rank, clock++, testing::Memcpy());
      }
      if (s.ok()) s = e->Flush();
      // Branch 0's last clock is applied once its rows are here, and branch
      // 1's, sent before it by every worker, before that.
      if (s.ok()) s = e->WaitForDataAge(m.a, 2);
      if (s.ok()) s = e->WaitForDataAge(m.b, 2);
      for (BranchId branch = 0; s.ok() && branch < 2; ++branch) s = testing::FetchModel(e, m, &out[rank][branch], branch);
      if (!s.ok()) errors[rank] = s.ToString();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& error : errors) {
    if (!error.empty()) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, error);
  }
  ASSERT_OK(cluster->Shutdown());
}

}  // namespace

TEST(TheShardsStateOnTheDevice) { ExpectGpuLikeRunsMatch(TestConfig(UpdateRuleKind::kDampedMomentum), -1); }

TEST(TheShardsStateInHostMemory) {
  // One free byte: no room for any shard state, so it lives in host memory
  // and this process's worker installs views of it.
  Config config = TestConfig(UpdateRuleKind::kDampedMomentum);
  config.device_memory_budget = int64_t{1} << 30;  // the plan itself is not squeezed
  ExpectGpuLikeRunsMatch(config, 1);
}

TEST(ADeviceBudgetThatKeepsRowsInHostMemory) {
  Config config = TestConfig(UpdateRuleKind::kSgd);
  const PlanPreview preview = testing::ModelPreview(config);
  ASSERT_TRUE(preview.pool_min_bytes > 0);
  config.device_memory_budget = preview.pool_min_bytes + 512;  // the pool, and a few rows
  ExpectGpuLikeRunsMatch(config, -1);
}
TEST(BranchesOfAShardStateInHostMemory) {
  // Forks copy the host-resident state; a branch switch asks the shards for
  // the branch's rows, which this process's workers get as views of it.
  Config config = TestConfig(UpdateRuleKind::kDampedMomentum);
  config.branches = true;
  config.device_memory_budget = int64_t{1} << 30;
  std::vector<float> reference[2][2], gpu_like[2][2];
  TrainBranches(config, nullptr, reference);
  auto waits = std::make_shared<std::atomic<int64_t>>(0);
  TrainBranches(config, GpuLike(1, waits), gpu_like);
  for (int rank = 0; rank < 2; ++rank) {
    for (int branch = 0; branch < 2; ++branch) testing::ExpectSameBits(gpu_like[rank][branch], reference[rank][branch]);
  }
  EXPECT_TRUE(reference[0][0] != reference[0][1]);  // the fork's own rate took
  EXPECT_TRUE(waits->load() > 0);
}

MLT_TEST_MAIN
