// Two processes whose devices run every stream late and out of step
// (lagging_device.h) train to the bits of the CPU backend in one process:
// the tickets between a worker's streams, its payloads in host frames, the
// transport's waits for them and the installs of what arrives, as on two
// GPUs of two processes. The application copies in and out of its buffers as
// a GPU application does with a synchronous cudaMemcpy: after its stream ran
// everything queued on it.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cluster/two_process_model.h"
#include "lagging_device.h"
#include "test_util.h"

using namespace mltuner;

namespace {

constexpr int kClocks = 10;

Config TestConfig() {
  Config config;
  config.wait_timeout_ms = 20000;
  config.update_rule.kind = UpdateRuleKind::kDampedMomentum;
  config.update_rule.learning_rate = 0.05f;
  config.update_rule.momentum = 0.9f;
  return config;
}

// Lagging devices of `seed`, one per rank, and the copy that reaches their
// buffers once both application streams are drained.
struct LaggingPair {
  explicit LaggingPair(uint32_t seed) : seed(seed) {}
  DeviceFactory factory() {
    return [this](int rank, std::unique_ptr<Device>* made) {
      auto device = std::make_unique<LaggingDevice>(seed + 1000u * static_cast<uint32_t>(rank));
      devices[rank] = device.get();
      *made = std::move(device);
      return Status::Ok();
    };
  }
  testing::BufferCopy copy() {
    return [this](void* dst, const void* src, size_t bytes) {
      for (LaggingDevice* device : devices) device->FinishApp();
      std::memcpy(dst, src, bytes);
    };
  }
  uint32_t seed;
  LaggingDevice* devices[2] = {nullptr, nullptr};
};

void ExpectLaggingProcessesMatch(Config config) {
  std::vector<float> reference[2];
  testing::TrainInOneProcess(config, kClocks, reference);
  const int failed_before = ::mltuner::testing::Failures();
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    for (const bool batches : {false, true}) {
      LaggingPair pair(seed);
      testing::TwoNodeRun run;
      testing::TrainInTwoProcesses(config, pair.factory(), kClocks, &run, pair.copy(), false, batches);
      EXPECT_EQ(run.refused, 0);
      EXPECT_EQ(run.rejected, int64_t{0});
      for (int rank = 0; rank < 2; ++rank) testing::ExpectSameBits(run.values[rank], reference[rank]);
      if (::mltuner::testing::Failures() > failed_before) {
        std::fprintf(stderr, "  differs at seed %u%s\n", seed, batches ? ", batches" : "");
        return;
      }
    }
  }
}

}  // namespace

TEST(TwoLaggingProcessesTrainAsOneCpuProcess) { ExpectLaggingProcessesMatch(TestConfig()); }

TEST(TwoLaggingProcessesUnderABudgetTrainAsOneCpuProcess) {
  // The least pool and a few rows: the rest of each table in host memory,
  // swapped in and out on the lagging streams.
  Config config = TestConfig();
  const PlanPreview preview = testing::ModelPreview(config);
  ASSERT_TRUE(preview.pool_min_bytes > 0);
  config.device_memory_budget = preview.pool_min_bytes + 512;
  ExpectLaggingProcessesMatch(config);
}

MLT_TEST_MAIN
