// The plan's predicted bytes per clock (plan/swap_traffic.h) against the
// bytes a counting device sees: host -> device and device -> host copies,
// and gathers / scatter-adds between host memory (AllocateHost, mapped) and
// device memory, over steady-state clocks of one worker, at budgets from the
// least pool to unlimited, with swaps by kernel (mapped host memory, the CPU
// backend) and by a copy per run (CUDA's way).
//
// The window is exact: with Config::branches the allocator prepares only
// scheduled clocks, so after Flush and the last clock's data age nothing of
// the next clock has moved yet.
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/two_layer_model.h"
#include "forwarding_device.h"
#include "mltuner/cluster.h"
#include "mltuner/engine.h"
#include "test_util.h"

using namespace mltuner;

namespace {

// Counts the bytes crossing between host and device memory. Host memory is
// what AllocateHost gave (the engine's host stores, logs and staging); a
// copy's direction is its name.
class TrafficCountingDevice final : public ForwardingDevice {
 public:
  explicit TrafficCountingDevice(bool mapped) : mapped_(mapped) {}
  std::string name() const override { return mapped_ ? "counting cpu (mapped)" : "counting cpu (copies)"; }
  bool maps_host_memory() const override { return mapped_; }

  Status AllocateHost(size_t bytes, void** out) override {
    MLT_RETURN_IF_ERROR(ForwardingDevice::AllocateHost(bytes, out));
    std::lock_guard<std::mutex> lock(mu_);
    host_[reinterpret_cast<uintptr_t>(*out)] = bytes;
    return Status::Ok();
  }
  void FreeHost(void* p) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      host_.erase(reinterpret_cast<uintptr_t>(p));
    }
    ForwardingDevice::FreeHost(p);
  }
  void CopyHostToDevice(void* d, const void* s, size_t b, Stream st) override {
    to_device += static_cast<int64_t>(b);
    ForwardingDevice::CopyHostToDevice(d, s, b, st);
  }
  void CopyDeviceToHost(void* d, const void* s, size_t b, Stream st) override {
    to_host += static_cast<int64_t>(b);
    ForwardingDevice::CopyDeviceToHost(d, s, b, st);
  }
  void Gather(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    CountKernel(d, s, i, w);
    ForwardingDevice::Gather(d, s, i, w, st);
  }
  void ScatterAdd(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    CountKernel(d, s, i, w);
    ForwardingDevice::ScatterAdd(d, s, i, w, st);
  }

  std::atomic<int64_t> to_device{0};
  std::atomic<int64_t> to_host{0};

 private:
  bool IsHost(const void* p) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto after = host_.upper_bound(at);
    if (after == host_.begin()) return false;
    --after;
    return at < after->first + after->second;
  }
  void CountKernel(const float* d, const float* s, const RunIndex& index, int64_t width) {
    const int64_t bytes = index.total_rows * width * static_cast<int64_t>(sizeof(float));
    const bool from_host = IsHost(s), to_host_memory = IsHost(d);
    if (from_host && !to_host_memory) to_device += bytes;
    if (to_host_memory && !from_host) to_host += bytes;
  }

  const bool mapped_;
  std::mutex mu_;
  std::map<uintptr_t, size_t> host_;  // AllocateHost blocks: start -> bytes
};

// One clock: every open buffer gets small integers (the values do not
// matter here, only what moves).
Status RunClock(Engine* e, const Model& m, int clock) {
  for (size_t i = 0; i < m.kinds.size(); ++i) {
    AccessBuffer buffer;
    auto values = [&buffer] { return buffer.rows * buffer.row_width; };
    switch (m.kinds[i]) {
      case OpKind::kRead: MLT_RETURN_IF_ERROR(e->Read(m.handles[i], &buffer)); break;
      case OpKind::kPreUpdate:
        MLT_RETURN_IF_ERROR(e->PreUpdate(m.handles[i], &buffer));
        for (int64_t k = 0; k < values(); ++k) buffer.data[k] = static_cast<float>((clock + k) % 3);
        break;
      case OpKind::kLocalAccess:
        MLT_RETURN_IF_ERROR(e->LocalAccess(m.handles[i], &buffer));
        for (int64_t k = 0; k < values(); ++k) buffer.data[k] += 1.0f;
        break;
      case OpKind::kPostRead: MLT_RETURN_IF_ERROR(e->PostRead(m.handles[i])); break;
      case OpKind::kUpdate: MLT_RETURN_IF_ERROR(e->Update(m.handles[i])); break;
      case OpKind::kPostLocalAccess: MLT_RETURN_IF_ERROR(e->PostLocalAccess(m.handles[i])); break;
      default: return Status::Internal("unexpected op");
    }
  }
  return e->Clock();
}

struct Measured {
  int64_t predicted_to_device = 0, predicted_to_host = 0;
  int64_t to_device = 0, to_host = 0;  // over kWindow clocks
  int64_t host_store_bytes = 0;
  std::string plan;
};

constexpr int kWarmup = 3;
constexpr int kWindow = 4;

Status Drain(Engine* e, const Model& m, Clock last) {
  MLT_RETURN_IF_ERROR(e->Flush());
  MLT_RETURN_IF_ERROR(e->WaitForDataAge(m.layer0, last));
  return e->WaitForDataAge(m.layer1, last);
}

void Measure(int64_t budget, bool mapped, Measured* out) {
  Config config;
  config.update_rule.kind = UpdateRuleKind::kAdd;
  config.device_memory_budget = budget;
  config.prefetch_clocks = 1;
  config.wait_timeout_ms = 10000;
  config.branches = true;
  TrafficCountingDevice* device = nullptr;
  DeviceFactory factory = [&device, mapped](int, std::unique_ptr<Device>* made) {
    auto counting = std::make_unique<TrafficCountingDevice>(mapped);
    device = counting.get();
    *made = std::move(counting);
    return Status::Ok();
  };
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 1, &cluster, factory));
  Engine* e = cluster->worker(0);
  Model m;
  ASSERT_OK(Record(e, &m));
  ASSERT_OK(e->ScheduleBranch(0, kWarmup));
  ASSERT_OK(e->StartIterations());
  for (int c = 0; c < kWarmup; ++c) ASSERT_OK(RunClock(e, m, c));
  ASSERT_OK(Drain(e, m, kWarmup - 1));
  const int64_t in_before = device->to_device.load(), out_before = device->to_host.load();
  ASSERT_OK(e->ScheduleBranch(0, kWindow));
  for (int c = kWarmup; c < kWarmup + kWindow; ++c) ASSERT_OK(RunClock(e, m, c));
  ASSERT_OK(Drain(e, m, kWarmup + kWindow - 1));
  out->to_device = device->to_device.load() - in_before;
  out->to_host = device->to_host.load() - out_before;
  const EngineStats stats = e->Stats();
  out->predicted_to_device = stats.predicted_bytes_to_device_per_clock;
  out->predicted_to_host = stats.predicted_bytes_to_host_per_clock;
  out->host_store_bytes = stats.host_store_bytes;
  out->plan = e->DescribePlan();
  ASSERT_OK(cluster->Shutdown());
}

void CheckPredictionsAtEveryBudget(bool mapped) {
  Measured unlimited;
  Measure(0, mapped, &unlimited);
  EXPECT_EQ(unlimited.to_device, int64_t{0});
  EXPECT_EQ(unlimited.to_host, int64_t{0});
  EXPECT_EQ(unlimited.predicted_to_device + unlimited.predicted_to_host, int64_t{0});
  // Stores: layer0 2 x 16 x 64, layer1 2 x 16 x 32, acts 24 x 64 = 4608 B.
  constexpr int64_t kStores = 2 * 16 * 64 + 2 * 16 * 32 + 24 * 64;
  int64_t pool_min = 0;
  {
    Measured tight;
    Measure(1 << 30, mapped, &tight);  // learn the least pool from the plan
    const auto at = tight.plan.find("least ");
    ASSERT_TRUE(at != std::string::npos);
    pool_min = std::stoll(tight.plan.substr(at + 6));
  }
  bool split_local = false;
  for (int64_t extra = 0; extra <= kStores; extra += 256) {
    Measured run;
    Measure(pool_min + extra, mapped, &run);
    const std::string what = std::string(mapped ? "mapped" : "copies") + ", budget least pool + " +
                             std::to_string(extra) + ": " + run.plan;
    if (run.to_device != kWindow * run.predicted_to_device || run.to_host != kWindow * run.predicted_to_host) {
      ::mltuner::testing::ReportFailure(
          __FILE__, __LINE__,
          what + "\nmeasured " + std::to_string(run.to_device) + " B in, " + std::to_string(run.to_host) +
              " B out over " + std::to_string(kWindow) + " clocks; predicted per clock " +
              std::to_string(run.predicted_to_device) + " B in, " + std::to_string(run.predicted_to_host) + " B out");
    }
    if (extra == 0) EXPECT_TRUE(run.predicted_to_device > 0 && run.predicted_to_host > 0);
    if (run.plan.find("local data: 1 entries on the device") != std::string::npos) split_local = true;
  }
  EXPECT_TRUE(split_local);  // some budget splits the two activations
}

}  // namespace

TEST(PredictedBytesPerClockEqualMeasuredWithMappedSwaps) { CheckPredictionsAtEveryBudget(true); }
TEST(PredictedBytesPerClockEqualMeasuredWithCopies) { CheckPredictionsAtEveryBudget(false); }

MLT_TEST_MAIN
