// CpuDevice: the Device contract (device_contract.h, shared with the CUDA
// backend), then CPU-specific checks against a naive per-element reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <vector>

#include "device/device_contract.h"
#include "gpu_like_device.h"
#include "mltuner/device.h"
#include "mltuner/update_step.h"
#include "test_util.h"

namespace mltuner {
namespace {

// Device memory that frees itself.
struct DeviceBuffer {
  Device* device = nullptr;
  float* data = nullptr;
  size_t count = 0;
  DeviceBuffer(Device* d, size_t n) : device(d), count(n) {
    void* ptr = nullptr;
    if (d->Allocate(n * sizeof(float), &ptr).ok()) data = static_cast<float*>(ptr);
  }
  ~DeviceBuffer() { device->Free(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void FillRandom(float* data, size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-10.f, 10.f);
  for (size_t i = 0; i < n; ++i) data[i] = value(rng);
}

void ReferenceGather(float* dst, const float* src, const std::vector<RowRun>& runs, int64_t width) {
  for (const RowRun& run : runs) {
    for (int64_t r = 0; r < run.count; ++r) {
      for (int64_t c = 0; c < width; ++c) dst[(run.dst + r) * width + c] = src[(run.src + r) * width + c];
    }
  }
}

void ReferenceScatterAdd(float* dst, const float* src, const std::vector<RowRun>& runs, int64_t width) {
  for (const RowRun& run : runs) {
    for (int64_t r = 0; r < run.count; ++r) {
      for (int64_t c = 0; c < width; ++c) dst[(run.dst + r) * width + c] += src[(run.src + r) * width + c];
    }
  }
}

// Layouts over tables of `rows` rows: one run of everything, many short runs
// in shuffled order, and (for scatter-add) runs whose dst rows overlap.
std::vector<std::vector<RowRun>> Layouts(int64_t rows, std::mt19937_64& rng) {
  std::vector<std::vector<RowRun>> layouts;
  layouts.push_back({{0, 0, rows}});
  layouts.push_back({{3, 1, rows - 5}});

  std::vector<RowRun> shorts;  // a permutation of the rows in runs of 1..4
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < rows;) {
    const int64_t count = std::min<int64_t>(1 + static_cast<int64_t>(rng() % 4), rows - r);
    shorts.push_back({r, 0, count});
    r += count;
  }
  std::shuffle(shorts.begin(), shorts.end(), rng);
  int64_t dst = 0;
  for (RowRun& run : shorts) {
    run.dst = dst;
    dst += run.count;
  }
  layouts.push_back(shorts);

  layouts.push_back({{0, 0, 0}, {5, 7, 1}});  // an empty run is a no-op
  return layouts;
}

std::vector<RowRun> OverlappingDst(int64_t rows, std::mt19937_64& rng) {
  std::vector<RowRun> runs;
  for (int i = 0; i < 50; ++i) {
    const int64_t count = 1 + static_cast<int64_t>(rng() % 6);
    runs.push_back({static_cast<int64_t>(rng() % (rows - count)), static_cast<int64_t>(rng() % (rows - count)),
                    count});
  }
  runs.push_back({0, 10, 8});
  runs.push_back({20, 10, 8});  // the same dst rows twice
  return runs;
}

TEST(PassesDeviceContract) {
  auto device = NewCpuDevice();
  contract::RunDeviceContract(*device, "cpu");
}

// The CPU backend swaps with one Gather; a device that swaps with its copy
// engines (as CUDA does) takes the default SwapRuns, a copy per run.
TEST(SwapsByCopiesMatchTheReference) {
  GpuLikeDevice device;
  contract::internal::Swaps(device);
}

TEST(Identity) {
  auto device = NewCpuDevice();
  EXPECT_EQ(device->name(), std::string("cpu"));
  EXPECT_TRUE(device->host_addressable());
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device->Synchronize(static_cast<Stream>(s)));
}

TEST(AllocatesAligned) {
  auto device = NewCpuDevice();
  for (size_t bytes : {1, 3, 64, 100, 4096, 1 << 20}) {
    void* ptr = nullptr;
    ASSERT_OK(device->Allocate(bytes, &ptr));
    ASSERT_TRUE(ptr != nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % 64, uintptr_t{0});
    std::memset(ptr, 0xAB, bytes);  // the whole range is usable (ASan checks)
    device->Free(ptr);
    ASSERT_OK(device->AllocateHost(bytes, &ptr));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(ptr) % 64, uintptr_t{0});
    std::memset(ptr, 0xCD, bytes);
    device->FreeHost(ptr);
  }
  device->Free(nullptr);
  device->FreeHost(nullptr);
}

TEST(RefusesZeroAndImpossibleSizes) {
  auto device = NewCpuDevice();
  void* ptr = nullptr;
  EXPECT_CODE(device->Allocate(0, &ptr), StatusCode::kInvalidArgument);
  EXPECT_CODE(device->AllocateHost(0, &ptr), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ptr == nullptr);
  EXPECT_CODE(device->Allocate(SIZE_MAX, &ptr), StatusCode::kResourceExhausted);
  EXPECT_CODE(device->AllocateHost(SIZE_MAX / 2 + 1, &ptr), StatusCode::kResourceExhausted);
}

TEST(CopiesAndFill) {
  auto device = NewCpuDevice();
  std::mt19937_64 rng(1);
  const size_t n = 1000;
  DeviceBuffer a(device.get(), n), b(device.get(), n);
  ASSERT_TRUE(a.data != nullptr && b.data != nullptr);
  std::vector<float> host(n), back(n);
  FillRandom(host.data(), n, rng);
  device->CopyHostToDevice(a.data, host.data(), n * sizeof(float), Stream::kPrefetch);
  device->CopyDeviceToDevice(b.data, a.data, n * sizeof(float), Stream::kApp);
  device->CopyDeviceToHost(back.data(), b.data, n * sizeof(float), Stream::kWriteback);
  EXPECT_TRUE(back == host);
  device->CopyHostToDevice(a.data, nullptr, 0, Stream::kApp);  // zero bytes: a no-op

  device->Fill(a.data + 10, 2.5f, 100, Stream::kApp);
  device->CopyDeviceToHost(back.data(), a.data, n * sizeof(float), Stream::kApp);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(back[i], (i >= 10 && i < 110) ? 2.5f : host[i]);
}

TEST(PrepareIndexCountsRows) {
  auto device = NewCpuDevice();
  RunIndex index;
  index.runs = {{0, 0, 5}, {10, 5, 3}, {2, 8, 0}};
  ASSERT_OK(device->PrepareIndex(&index));
  EXPECT_EQ(index.total_rows, int64_t{8});
  device->ReleaseIndex(&index);
  EXPECT_TRUE(index.device_copy == nullptr);
  index.runs.push_back({0, 0, -1});
  EXPECT_CODE(device->PrepareIndex(&index), StatusCode::kInvalidArgument);
}

TEST(GatherMatchesReference) {
  auto device = NewCpuDevice();
  std::mt19937_64 rng(2);
  const int64_t rows = 200;
  for (int64_t width : {1, 3, 16, 17, 128}) {
    for (const std::vector<RowRun>& runs : Layouts(rows, rng)) {
      RunIndex index;
      index.runs = runs;
      ASSERT_OK(device->PrepareIndex(&index));
      DeviceBuffer src(device.get(), rows * width), dst(device.get(), rows * width);
      FillRandom(src.data, src.count, rng);
      FillRandom(dst.data, dst.count, rng);
      std::vector<float> want(dst.data, dst.data + dst.count);
      ReferenceGather(want.data(), src.data, runs, width);
      device->Gather(dst.data, src.data, index, width, Stream::kPrefetch);
      EXPECT_TRUE(std::vector<float>(dst.data, dst.data + dst.count) == want);
      device->ReleaseIndex(&index);
    }
  }
}

// Gathers above a few MiB take a streaming-store path when rows are 16-byte
// multiples; check it, and the fallback for odd widths, on shuffled runs.
TEST(LargeGatherMatchesReference) {
  auto device = NewCpuDevice();
  std::mt19937_64 rng(4);
  const int64_t rows = 20000;
  for (int64_t width : {64, 63, 4}) {
    const std::vector<std::vector<RowRun>> layouts = Layouts(rows, rng);
    const std::vector<RowRun>& runs = layouts[2];  // shuffled short runs
    RunIndex index;
    index.runs = runs;
    ASSERT_OK(device->PrepareIndex(&index));
    DeviceBuffer src(device.get(), rows * width), dst(device.get(), rows * width);
    FillRandom(src.data, src.count, rng);
    FillRandom(dst.data, dst.count, rng);
    std::vector<float> want(dst.data, dst.data + dst.count);
    ReferenceGather(want.data(), src.data, runs, width);
    device->Gather(dst.data, src.data, index, width, Stream::kPrefetch);
    EXPECT_TRUE(std::vector<float>(dst.data, dst.data + dst.count) == want);
  }
}

TEST(ScatterAddMatchesReference) {
  auto device = NewCpuDevice();
  std::mt19937_64 rng(3);
  const int64_t rows = 200;
  for (int64_t width : {1, 3, 16, 17, 128}) {
    std::vector<std::vector<RowRun>> layouts = Layouts(rows, rng);
    layouts.push_back(OverlappingDst(rows, rng));
    for (const std::vector<RowRun>& runs : layouts) {
      RunIndex index;
      index.runs = runs;
      ASSERT_OK(device->PrepareIndex(&index));
      DeviceBuffer src(device.get(), rows * width), dst(device.get(), rows * width);
      FillRandom(src.data, src.count, rng);
      FillRandom(dst.data, dst.count, rng);
      std::vector<float> want(dst.data, dst.data + dst.count);
      ReferenceScatterAdd(want.data(), src.data, runs, width);
      device->ScatterAdd(dst.data, src.data, index, width, Stream::kWriteback);
      // Same additions in the same order: bit-identical results.
      EXPECT_TRUE(std::vector<float>(dst.data, dst.data + dst.count) == want);
      device->ReleaseIndex(&index);
    }
  }
}


// The vectorized rule loops (one per combination of the step's flags) give
// the bits of UpdateValue applied value by value, for every rule and
// combination, lengths that leave a remainder past the vector width, a
// state stride past the count (a part's slice of the state), and values
// that are NaN, infinite, signed zeros or subnormal.
TEST(ApplyUpdateMatchesUpdateValueForEveryChoice) {
  auto device = NewCpuDevice();
  std::mt19937_64 rng(5);
  const float specials[] = {std::nanf(""), INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, -3.0f};
  const auto values = [&](int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    std::uniform_real_distribution<float> real(-2.0f, 2.0f);
    for (float& v : out) v = real(rng);
    for (size_t i = 0; i < std::size(specials) && 7 * i < out.size(); ++i) out[7 * i] = specials[i];
    return out;
  };
  int cases = 0;
  for (UpdateRuleKind kind : {UpdateRuleKind::kAdd, UpdateRuleKind::kSgd, UpdateRuleKind::kDampedMomentum,
                              UpdateRuleKind::kAdam, UpdateRuleKind::kAdamW}) {
    for (int choice = 0; choice < 16; ++choice) {
      UpdateRuleConfig rule;
      rule.kind = kind;
      rule.learning_rate = 0.03f;
      rule.weight_decay = (choice & 1) ? 0.01f : 0.0f;
      rule.momentum = (choice & 2) ? 0.9f : 0.0f;
      rule.nesterov = (choice & 4) != 0 && rule.momentum != 0.0f;
      rule.dampening = rule.nesterov ? 0.0f : 0.1f;
      rule.amsgrad = (choice & 8) != 0;
      for (int64_t step_number : {1, 4}) {
        const UpdateStep step = MakeUpdateStep(rule, 3, step_number);
        for (int64_t count : {1, 5, 67}) {
          const int64_t stride = count + 3;
          const std::vector<float> params = values(count), sum = values(count), state = values(3 * stride);
          std::vector<float> want_params = params, want_state = state, got_params = params, got_state = state;
          for (int64_t i = 0; i < count; ++i) {
            UpdateValue(step, want_params.data(), want_state.data(), sum.data(), stride, i);
          }
          device->ApplyUpdate(step, got_params.data(), got_state.data(), sum.data(), count, stride, Stream::kServer);
          EXPECT_TRUE(std::memcmp(got_params.data(), want_params.data(), params.size() * sizeof(float)) == 0);
          EXPECT_TRUE(std::memcmp(got_state.data(), want_state.data(), state.size() * sizeof(float)) == 0);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 16 * 2 * 3);
}

TEST(FillWritesEveryValueAndTheSignOfZero) {
  auto device = NewCpuDevice();
  for (float value : {0.0f, -0.0f, 1.5f}) {
    std::vector<float> dst(37, 7.0f);
    device->Fill(dst.data(), value, 36, Stream::kServer);
    for (size_t i = 0; i < 36; ++i) EXPECT_TRUE(std::memcmp(&dst[i], &value, sizeof(float)) == 0);
    EXPECT_EQ(dst[36], 7.0f);  // nothing past the count
  }
}

}  // namespace
}  // namespace mltuner

MLT_TEST_MAIN
