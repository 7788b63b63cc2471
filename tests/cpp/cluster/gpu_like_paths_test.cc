// The paths a GPU takes, on the CPU (gpu_like_device.h): one process and two
// processes of a GPU-like device train to the bits of the CPU backend, with
// the shard's state on the device or in host memory, and with a device
// budget that keeps some rows in host memory.
#include <cstring>
#include <memory>
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

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
}

// The model trained on the CPU backend in one process, and on GPU-like
// devices (`free_bytes` free) in one process and in two, all with `config`.
void ExpectGpuLikeRunsMatch(const Config& config, int64_t free_bytes) {
  std::vector<float> reference[2];
  testing::TrainInOneProcess(config, kClocks, reference);
  auto waits = std::make_shared<std::atomic<int64_t>>(0);
  std::vector<float> local[2];
  testing::TrainInOneProcess(config, kClocks, local, GpuLike(free_bytes, waits));
  testing::TwoNodeRun remote;
  testing::TrainInTwoProcesses(config, GpuLike(free_bytes, waits), kClocks, &remote);
  EXPECT_EQ(remote.refused, 0);
  EXPECT_EQ(remote.rejected, 0);
  for (int rank = 0; rank < 2; ++rank) {
    ExpectSameBits(local[rank], reference[rank]);
    ExpectSameBits(remote.values[rank], reference[rank]);
  }
  EXPECT_TRUE(waits->load() > 0);  // host readers waited on tickets through the device
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
MLT_TEST_MAIN
