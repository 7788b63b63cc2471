// Tests for cuda/kernels: each kernel against a CPU reference on random,
// non-zero data. Gather and scatter-add must match exactly (one copy or one
// float add per value); the update rules within a relative 1e-5, since the
// GPU may fuse multiply-adds. Exits 77 (CTest: skipped) without a device.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/kernels.h"
#include "rule_reference.h"
#include "gpu_test_main.h"
#include "test_util.h"

namespace mltuner {
namespace {

using kernels::LaunchGatherRuns;
using kernels::LaunchScatterAddRuns;

#define CUDA_ASSERT(expr)                                                                   \
  do {                                                                                      \
    cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) {                                                                \
      ::mltuner::testing::ReportFailure(__FILE__, __LINE__,                                 \
                                        std::string(#expr ": ") + cudaGetErrorString(_e));  \
      return;                                                                               \
    }                                                                                       \
  } while (0)

// Device memory that frees itself.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    if (cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  bool ok() const { return ptr_ != nullptr; }
  cudaError_t Upload(const std::vector<T>& v) {
    return cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>* v) const {
    v->resize(n_);
    return cudaMemcpy(v->data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

// Values in +-[0.5, 1.5): never zero, so a missed or doubled write shows.
std::vector<float> RandomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mag(0.5f, 1.5f);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = neg(rng) ? -mag(rng) : mag(rng);
  return v;
}

// Runs covering dst rows [0, dst_rows) in pieces of 0..max_len rows (zero-row
// runs included), each from a random src start, in shuffled order. No two
// runs share a dst row, as scatter-add requires.
std::vector<RowRun> RandomRuns(int64_t src_rows, int64_t dst_rows, int64_t max_len,
                               uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<RowRun> runs;
  for (int64_t d = 0; d < dst_rows;) {
    const int64_t len = std::min<int64_t>(
        std::uniform_int_distribution<int64_t>(0, max_len)(rng), dst_rows - d);
    const int64_t s = std::uniform_int_distribution<int64_t>(0, src_rows - len)(rng);
    runs.push_back({s, d, len});
    d += len;
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  return runs;
}

int64_t TotalRows(const std::vector<RowRun>& runs) {
  int64_t total = 0;
  for (const RowRun& r : runs) total += r.count;
  return total;
}

// Runs gather (add=false) or scatter-add (add=true) on the GPU and on the CPU
// and compares every value of dst, covered or not. `offset` shifts both
// arrays by that many floats to break 16-byte alignment.
void CheckRowRuns(bool add, int64_t src_rows, int64_t dst_rows, int64_t width,
                  const std::vector<RowRun>& runs, size_t offset, uint32_t seed) {
  const std::vector<float> src = RandomValues(src_rows * width + offset, seed);
  std::vector<float> want = RandomValues(dst_rows * width + offset, seed + 1);
  DeviceArray<float> d_src(src.size()), d_dst(want.size());
  DeviceArray<RowRun> d_runs(runs.size());
  ASSERT_TRUE(d_src.ok() && d_dst.ok() && d_runs.ok());
  CUDA_ASSERT(d_src.Upload(src));
  CUDA_ASSERT(d_dst.Upload(want));
  CUDA_ASSERT(d_runs.Upload(runs));

  cudaStream_t stream;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  float* dst = d_dst.get() + offset;
  const float* srcp = d_src.get() + offset;
  if (add) {
    LaunchScatterAddRuns(dst, srcp, d_runs.get(), runs.size(), TotalRows(runs), width, stream);
  } else {
    LaunchGatherRuns(dst, srcp, d_runs.get(), runs.size(), TotalRows(runs), width, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t synced = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  CUDA_ASSERT(launched);
  CUDA_ASSERT(synced);

  for (const RowRun& r : runs) {
    for (int64_t i = 0; i < r.count * width; ++i) {
      float& d = want[offset + r.dst * width + i];
      const float s = src[offset + r.src * width + i];
      d = add ? d + s : s;
    }
  }
  std::vector<float> got;
  CUDA_ASSERT(d_dst.Download(&got));
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && wrong++ < 5) EXPECT_EQ(got[i], want[i]);
  }
  EXPECT_EQ(wrong, int64_t{0});
}

// --- gather ---------------------------------------------------------------

TEST(GatherSingleRunVectorised) {
  CheckRowRuns(false, 1000, 600, 16, {{100, 50, 500}}, 0, 1);
}
TEST(GatherManyRunsVectorised) {
  CheckRowRuns(false, 3000, 2000, 32, RandomRuns(3000, 2000, 7, 2), 0, 3);
}
TEST(GatherOddWidthScalar) {
  CheckRowRuns(false, 3000, 2000, 5, RandomRuns(3000, 2000, 7, 4), 0, 5);
}
TEST(GatherMisalignedScalar) {
  CheckRowRuns(false, 3000, 2000, 8, RandomRuns(3000, 2000, 7, 6), 1, 7);
}
TEST(GatherMoreRunsThanGridY) {  // 70000 one-row runs: blockIdx.y must stride
  std::vector<RowRun> runs;
  for (int64_t i = 0; i < 70000; ++i) runs.push_back({69999 - i, i, 1});
  CheckRowRuns(false, 70000, 70000, 4, runs, 0, 8);
}
TEST(GatherLongRunGridStride) {  // more float4s than kMaxBlocksPerRun * 256
  CheckRowRuns(false, 20000, 20000, 1024, {{0, 0, 20000}}, 0, 9);
}
TEST(GatherNothingToDo) {
  CheckRowRuns(false, 10, 10, 4, {}, 0, 10);
  CheckRowRuns(false, 10, 10, 4, {{0, 0, 0}, {3, 5, 0}}, 0, 11);
}

// --- scatter-add ------------------------------------------------------------

TEST(ScatterAddSingleRunVectorised) {
  CheckRowRuns(true, 1000, 600, 16, {{100, 50, 500}}, 0, 12);
}
TEST(ScatterAddManyRunsVectorised) {
  CheckRowRuns(true, 3000, 2000, 32, RandomRuns(3000, 2000, 7, 13), 0, 14);
}
TEST(ScatterAddOddWidthScalar) {
  CheckRowRuns(true, 3000, 2000, 3, RandomRuns(3000, 2000, 7, 15), 0, 16);
}
TEST(ScatterAddMisalignedScalar) {
  CheckRowRuns(true, 3000, 2000, 12, RandomRuns(3000, 2000, 7, 17), 3, 18);
}
TEST(ScatterAddMoreRunsThanGridY) {
  std::vector<RowRun> runs;
  for (int64_t i = 0; i < 70000; ++i) runs.push_back({i, 69999 - i, 1});
  CheckRowRuns(true, 70000, 70000, 8, runs, 0, 19);
}
TEST(ScatterAddLongRunGridStride) {
  CheckRowRuns(true, 20000, 20000, 1024, {{0, 0, 20000}}, 0, 20);
}

// --- host-resident rows: one side in mapped pinned memory ----------------------

// Pinned host memory mapped at its host address (as CudaDevice::AllocateHost
// makes it), that frees itself.
class MappedArray {
 public:
  explicit MappedArray(size_t n) : n_(n) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, std::max<size_t>(n, 1) * sizeof(float), cudaHostAllocMapped | cudaHostAllocPortable) ==
        cudaSuccess) {
      ptr_ = static_cast<float*>(p);
    }
  }
  ~MappedArray() { cudaFreeHost(ptr_); }
  MappedArray(const MappedArray&) = delete;
  MappedArray& operator=(const MappedArray&) = delete;
  float* get() const { return ptr_; }
  bool ok() const { return ptr_ != nullptr; }

 private:
  float* ptr_ = nullptr;
  size_t n_;
};

// As CheckRowRuns, with the host side of a swap in mapped pinned memory:
// gather reads a host store into a device buffer (swap in, local fetch),
// scatter-add adds a device buffer into a host log (swap out of an update);
// host_dst gathers a device buffer into a host store (local write-back). The
// kernel is handed the host pointer itself (unified addressing).
void CheckMappedRowRuns(bool add, bool host_dst, int64_t src_rows, int64_t dst_rows, int64_t width,
                        const std::vector<RowRun>& runs, size_t offset, uint32_t seed) {
  int unified = 0;
  CUDA_ASSERT(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, 0));
  if (unified == 0) {
    std::printf("  (no unified addressing: mapped row runs not tested)\n");
    return;
  }
  const std::vector<float> src = RandomValues(src_rows * width + offset, seed);
  std::vector<float> want = RandomValues(dst_rows * width + offset, seed + 1);
  DeviceArray<float> d_side(host_dst ? src.size() : want.size());
  MappedArray h_side(host_dst ? want.size() : src.size());
  DeviceArray<RowRun> d_runs(runs.size());
  ASSERT_TRUE(d_side.ok() && h_side.ok() && d_runs.ok());
  CUDA_ASSERT(d_runs.Upload(runs));
  float* dst = nullptr;
  const float* srcp = nullptr;
  if (host_dst) {
    CUDA_ASSERT(d_side.Upload(src));
    std::memcpy(h_side.get(), want.data(), want.size() * sizeof(float));
    dst = h_side.get() + offset;
    srcp = d_side.get() + offset;
  } else {
    CUDA_ASSERT(d_side.Upload(want));
    std::memcpy(h_side.get(), src.data(), src.size() * sizeof(float));
    dst = d_side.get() + offset;
    srcp = h_side.get() + offset;
  }

  cudaStream_t stream;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (add) {
    LaunchScatterAddRuns(dst, srcp, d_runs.get(), runs.size(), TotalRows(runs), width, stream);
  } else {
    LaunchGatherRuns(dst, srcp, d_runs.get(), runs.size(), TotalRows(runs), width, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t synced = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  CUDA_ASSERT(launched);
  CUDA_ASSERT(synced);

  for (const RowRun& r : runs) {
    for (int64_t i = 0; i < r.count * width; ++i) {
      float& d = want[offset + r.dst * width + i];
      const float s = src[offset + r.src * width + i];
      d = add ? d + s : s;
    }
  }
  std::vector<float> got;
  if (host_dst) {
    got.assign(h_side.get(), h_side.get() + want.size());
  } else {
    CUDA_ASSERT(d_side.Download(&got));
  }
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && wrong++ < 5) EXPECT_EQ(got[i], want[i]);
  }
  EXPECT_EQ(wrong, int64_t{0});
}

TEST(GatherFromMappedHostVectorised) {
  CheckMappedRowRuns(false, false, 3000, 2000, 64, RandomRuns(3000, 2000, 64, 40), 0, 41);
}
TEST(GatherFromMappedHostScalar) {
  CheckMappedRowRuns(false, false, 3000, 2000, 5, RandomRuns(3000, 2000, 7, 42), 0, 43);
  CheckMappedRowRuns(false, false, 3000, 2000, 8, RandomRuns(3000, 2000, 7, 44), 1, 45);
}
TEST(GatherFromMappedHostLongRun) {  // 80 MB over PCIe: grid-stride loop
  CheckMappedRowRuns(false, false, 20000, 20000, 1024, {{0, 0, 20000}}, 0, 46);
}
TEST(GatherFromMappedHostManyOneRowRuns) {
  std::vector<RowRun> runs;
  for (int64_t i = 0; i < 70000; ++i) runs.push_back({69999 - i, i, 1});
  CheckMappedRowRuns(false, false, 70000, 70000, 4, runs, 0, 47);
}
TEST(GatherIntoMappedHost) {  // local data written back to a host store
  CheckMappedRowRuns(false, true, 3000, 2000, 32, RandomRuns(3000, 2000, 64, 48), 0, 49);
  CheckMappedRowRuns(false, true, 3000, 2000, 7, RandomRuns(3000, 2000, 7, 50), 3, 51);
}
TEST(ScatterAddIntoMappedHostVectorised) {
  CheckMappedRowRuns(true, true, 3000, 2000, 64, RandomRuns(3000, 2000, 64, 52), 0, 53);
  CheckMappedRowRuns(true, true, 20000, 20000, 1024, {{0, 0, 20000}}, 0, 54);
}
TEST(ScatterAddIntoMappedHostScalar) {
  CheckMappedRowRuns(true, true, 3000, 2000, 3, RandomRuns(3000, 2000, 7, 55), 0, 56);
  CheckMappedRowRuns(true, true, 3000, 2000, 12, RandomRuns(3000, 2000, 7, 57), 3, 58);
}
TEST(ScatterAddIntoMappedHostManyOneRowRuns) {
  std::vector<RowRun> runs;
  for (int64_t i = 0; i < 70000; ++i) runs.push_back({i, 69999 - i, 1});
  CheckMappedRowRuns(true, true, 70000, 70000, 8, runs, 0, 59);
}

// --- update rules -------------------------------------------------------------

// Applies `steps` clocks of `rule` to `count` values, each clock with a fresh
// random update sum of `workers` workers: on the GPU, with the CPU backend's
// loop over UpdateValue (which must agree bit for bit), and in double
// (rule_reference.h, which must agree within rounding).
void CheckRule(const UpdateRuleConfig& rule, int64_t count, int workers, int steps) {
  constexpr int kArrays = 3;  // the most any rule keeps (adam with amsgrad)
  const std::vector<float> w0 = RandomValues(count, 100);
  testing::ReferenceRule reference(rule, w0);
  std::vector<float> cpu_w = w0, cpu_state(kArrays * count, 0.0f);
  DeviceArray<float> d_w(count), d_state(kArrays * count), d_sum(count);
  ASSERT_TRUE(d_w.ok() && d_state.ok() && d_sum.ok());
  CUDA_ASSERT(d_w.Upload(w0));
  CUDA_ASSERT(cudaMemset(d_state.get(), 0, kArrays * count * sizeof(float)));

  for (int t = 1; t <= steps; ++t) {
    std::vector<float> sum = RandomValues(count, 200 + t);
    for (float& x : sum) x *= static_cast<float>(workers);  // a sum of N updates
    CUDA_ASSERT(d_sum.Upload(sum));
    const UpdateStep step = MakeUpdateStep(rule, workers, t);
    kernels::LaunchApplyUpdate(step, d_w.get(), d_state.get(), d_sum.get(), count, count, nullptr);
    CUDA_ASSERT(cudaGetLastError());
    CUDA_ASSERT(cudaDeviceSynchronize());
    for (int64_t i = 0; i < count; ++i) UpdateValue(step, cpu_w.data(), cpu_state.data(), sum.data(), count, i);
    reference.Step(sum, workers);
  }

  std::vector<float> got_w, got_state;
  CUDA_ASSERT(d_w.Download(&got_w));
  CUDA_ASSERT(d_state.Download(&got_state));
  EXPECT_EQ(std::memcmp(got_w.data(), cpu_w.data(), count * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got_state.data(), cpu_state.data(), kArrays * count * sizeof(float)), 0);
  int64_t wrong = 0;
  const std::vector<double>& w = reference.values();
  for (int64_t i = 0; i < count; ++i) {
    const double tol = 1e-5 * std::max(1.0, std::fabs(w[i]));
    if (std::fabs(got_w[i] - w[i]) > tol && wrong++ < 5) EXPECT_NEAR(got_w[i], w[i], tol);
  }
  EXPECT_EQ(wrong, int64_t{0});
}

UpdateRuleConfig Rule(UpdateRuleKind kind) {
  UpdateRuleConfig rule;
  rule.kind = kind;
  rule.learning_rate = 0.05f;
  rule.momentum = kind == UpdateRuleKind::kSgd ? 0.0f : 0.9f;
  return rule;
}

UpdateRuleConfig TorchSgd(bool nesterov) {
  UpdateRuleConfig rule = Rule(UpdateRuleKind::kSgd);
  rule.momentum = 0.9f;
  rule.dampening = nesterov ? 0.0f : 0.1f;
  rule.nesterov = nesterov;
  rule.weight_decay = 0.01f;
  return rule;
}

UpdateRuleConfig TorchAdam(UpdateRuleKind kind, bool amsgrad) {
  UpdateRuleConfig rule = Rule(kind);
  rule.learning_rate = 0.01f;
  rule.weight_decay = 0.05f;
  rule.amsgrad = amsgrad;
  return rule;
}

TEST(AddUpdate) { CheckRule(Rule(UpdateRuleKind::kAdd), 10007, 3, 4); }
TEST(SgdUpdateAveragesWorkers) { CheckRule(Rule(UpdateRuleKind::kSgd), 10007, 3, 4); }
TEST(SgdMomentumDampeningWeightDecay) { CheckRule(TorchSgd(false), 10007, 3, 5); }
TEST(SgdNesterov) { CheckRule(TorchSgd(true), 10007, 3, 5); }
TEST(DampedMomentumUpdate) { CheckRule(Rule(UpdateRuleKind::kDampedMomentum), 10007, 3, 5); }
TEST(AdamUpdateWithBiasCorrection) { CheckRule(Rule(UpdateRuleKind::kAdam), 10007, 3, 5); }
TEST(AdamWeightDecayAmsgrad) { CheckRule(TorchAdam(UpdateRuleKind::kAdam, true), 10007, 3, 5); }
TEST(AdamWDecoupledDecay) { CheckRule(TorchAdam(UpdateRuleKind::kAdamW, false), 10007, 3, 5); }
TEST(AdamWAmsgrad) { CheckRule(TorchAdam(UpdateRuleKind::kAdamW, true), 10007, 3, 5); }
TEST(AdamUpdateGridStride) { CheckRule(Rule(UpdateRuleKind::kAdam), 2500001, 2, 2); }  // > 8192 * 256

// --- copy pieces ------------------------------------------------------------

// `num_pieces` pieces of lengths 0..max_len: spans of one buffer, back to
// back with gaps, and spans of one application array, back to back. Copied
// into the buffer or out of it; untouched floats must stay. With a flag (a
// device float holding `*flag`), a copy into the buffer writes zeros when
// it is nonzero; a copy out of it ignores it.
void CheckCopyPieces(int num_pieces, int64_t max_len, uint32_t seed, bool into_buffer,
                     std::optional<float> flag = std::nullopt) {
  std::mt19937 rng(seed);
  std::vector<CopyPiece> pieces;
  int64_t memory_total = 0, buffer_end = 0;
  std::vector<std::pair<int64_t, int64_t>> memory_at;  // (offset in the application array, count)
  for (int i = 0; i < num_pieces; ++i) {
    const int64_t count = static_cast<int64_t>(rng() % (max_len + 1));
    buffer_end += static_cast<int64_t>(rng() % 5);  // a gap
    memory_at.push_back({memory_total, count});
    pieces.push_back({nullptr, buffer_end, count});
    memory_total += count;
    buffer_end += count;
  }
  std::vector<float> memory = RandomValues(memory_total + 1, seed);
  std::vector<float> buffer = RandomValues(buffer_end + 1, seed + 1);
  DeviceArray<float> d_memory(memory.size()), d_buffer(buffer.size());
  ASSERT_TRUE(d_memory.ok() && d_buffer.ok());
  CUDA_ASSERT(d_memory.Upload(memory));
  CUDA_ASSERT(d_buffer.Upload(buffer));
  for (int i = 0; i < num_pieces; ++i) pieces[i].memory = d_memory.get() + memory_at[i].first;
  DeviceArray<float> d_flag(1);
  ASSERT_TRUE(d_flag.ok());
  if (flag) CUDA_ASSERT(d_flag.Upload(std::vector<float>{*flag}));
  kernels::LaunchCopyPieces(d_buffer.get(), pieces.data(), num_pieces, into_buffer, flag ? d_flag.get() : nullptr,
                            nullptr);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const bool zeros = into_buffer && flag && *flag != 0.0f;
  std::vector<float>& want = into_buffer ? buffer : memory;
  for (int i = 0; i < num_pieces; ++i) {
    for (int64_t k = 0; k < memory_at[i].second; ++k) {
      float& buffer_value = buffer[pieces[i].offset + k];
      float& memory_value = memory[memory_at[i].first + k];
      (into_buffer ? buffer_value : memory_value) = zeros ? 0.0f : into_buffer ? memory_value : buffer_value;
    }
  }
  std::vector<float> got;
  CUDA_ASSERT((into_buffer ? d_buffer : d_memory).Download(&got));
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && wrong++ < 5) EXPECT_EQ(got[i], want[i]);
  }
  EXPECT_EQ(wrong, int64_t{0});
}

TEST(CopyPiecesFew) { CheckCopyPieces(7, 1000, 11, true); }
TEST(CopyPiecesMoreThanOneLaunch) { CheckCopyPieces(300, 50, 12, true); }  // > kMaxPiecesPerLaunch
TEST(CopyPiecesGridStride) { CheckCopyPieces(3, 600000, 13, true); }      // > 1024 blocks * 256
TEST(CopyPiecesOutFew) { CheckCopyPieces(7, 1000, 14, false); }
TEST(CopyPiecesOutMoreThanOneLaunch) { CheckCopyPieces(300, 50, 15, false); }
TEST(CopyPiecesOutGridStride) { CheckCopyPieces(3, 600000, 16, false); }
TEST(CopyPiecesFlagClearCopies) { CheckCopyPieces(300, 50, 17, true, 0.0f); }
TEST(CopyPiecesFlagSetWritesZeros) { CheckCopyPieces(300, 50, 18, true, 1.0f); }
TEST(CopyPiecesFlagInfWritesZeros) { CheckCopyPieces(3, 600000, 19, true, INFINITY); }
TEST(CopyPiecesOutIgnoresFlag) { CheckCopyPieces(7, 1000, 20, false, 1.0f); }

TEST(UpdateNothingToDo) {
  kernels::LaunchApplyUpdate(UpdateStep{}, nullptr, nullptr, nullptr, 0, 0, nullptr);
  kernels::LaunchAddInto(nullptr, nullptr, 0, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace mltuner

MLT_GPU_TEST_MAIN
