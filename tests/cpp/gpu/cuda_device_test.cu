// CudaDevice: the Device contract (tests/cpp/device/device_contract.h) on
// every visible GPU, bit-equality with the CPU backend, and the CUDA-specific
// failure paths (bad ordinals, an allocation larger than the GPU, errors from
// void methods surfacing at Synchronize). Exits 77 (CTest: skipped) without
// a CUDA device.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_device.h"
#include "device/device_contract.h"
#include "mltuner/device.h"
#include "gpu_test_main.h"
#include "test_util.h"

namespace mltuner {
namespace {

using contract::internal::DeviceFloats;
using contract::internal::Download;
using contract::internal::Layouts;
using contract::internal::RandomNonZero;
using contract::internal::Upload;

// Spins for `cycles` clock ticks (about 0.1 s at H100 clocks), then copies:
// long enough that a copy on another stream which failed to wait would
// certainly read dst before this writes it.
__global__ void SlowCopyKernel(float* dst, const float* src, size_t n, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

contract::AppWorkHooks MakeHooks(cudaStream_t created) {
  contract::AppWorkHooks hooks;
  // A stream of the application's own, and the legacy default stream (0),
  // which the engine's non-blocking streams do not implicitly wait for.
  hooks.app_streams = {reinterpret_cast<uintptr_t>(created), 0};
  hooks.slow_copy = [](uintptr_t stream, float* dst, const float* src, size_t n) {
    SlowCopyKernel<<<264, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(dst, src, n, 200000000LL);
  };
  hooks.sync_stream = [](uintptr_t stream) { cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)); };
  return hooks;
}

TEST(ContractOnEveryDevice) {
  const int count = CudaDeviceCount();
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    std::unique_ptr<Device> device;
    ASSERT_OK(NewCudaDevice(ordinal, &device));
    const std::string prefix = "cuda:" + std::to_string(ordinal) + " ";
    std::fprintf(stderr, "  device: %s\n", device->name().c_str());
    EXPECT_EQ(device->name().compare(0, prefix.size(), prefix), 0);
    EXPECT_TRUE(device->name().size() > prefix.size());
    EXPECT_TRUE(!device->host_addressable());
    EXPECT_EQ(device->ordinal(), ordinal);

    // The application's stream is made on this device; the hooks' kernels
    // run on whatever device is current, so make it this one.
    ASSERT_TRUE(cudaSetDevice(ordinal) == cudaSuccess);
    cudaStream_t app = nullptr;
    ASSERT_TRUE(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking) == cudaSuccess);
    const contract::AppWorkHooks hooks = MakeHooks(app);
    contract::RunDeviceContract(*device, device->name().c_str(), &hooks);
    cudaStreamDestroy(app);
  }
}

// The control for the contract's ticket check: without WaitEvent, a copy
// on an engine stream races the slow application kernel and reads stale
// data, so the contract's check could catch a missing or broken wait. Only
// reported, not asserted: a tool that serializes the GPU (compute-sanitizer)
// removes the race.
TEST(TicketCheckWouldCatchAMissingWait) {
  std::unique_ptr<Device> device;
  ASSERT_OK(NewCudaDevice(0, &device));
  std::mt19937_64 rng(24);
  const size_t n = size_t{1} << 22;
  DeviceFloats src(*device, n), dst(*device, n);
  ASSERT_OK(src.status());
  ASSERT_OK(dst.status());
  const std::vector<float> final_data = RandomNonZero(n, rng), stale = RandomNonZero(n, rng);
  ASSERT_OK(Upload(*device, src.data(), final_data, Stream::kReceive));
  ASSERT_OK(Upload(*device, dst.data(), stale, Stream::kReceive));
  cudaStream_t app = nullptr;
  ASSERT_TRUE(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking) == cudaSuccess);
  const contract::AppWorkHooks hooks = MakeHooks(app);
  hooks.slow_copy(reinterpret_cast<uintptr_t>(app), dst.data(), src.data(), n);
  std::vector<float> got(n);
  device->CopyDeviceToHost(got.data(), dst.data(), n * sizeof(float), Stream::kWriteback);
  ASSERT_OK(device->Synchronize(Stream::kWriteback));
  size_t stale_values = 0;
  for (size_t i = 0; i < n; ++i) stale_values += std::memcmp(&got[i], &stale[i], sizeof(float)) == 0;
  std::fprintf(stderr, "  without WaitEvent, %zu of %zu values read were stale\n", stale_values, n);
  cudaStreamSynchronize(app);
  cudaStreamDestroy(app);
}

// Runs Gather or ScatterAdd on both backends with the same inputs and
// returns each backend's dst.
void RunBoth(Device& cpu, Device& gpu, bool add, const std::vector<RowRun>& runs, int64_t width,
             const std::vector<float>& src_host, const std::vector<float>& dst_host, std::vector<float>* cpu_out,
             std::vector<float>* gpu_out) {
  for (Device* device : {&cpu, &gpu}) {
    DeviceFloats src(*device, src_host.size()), dst(*device, dst_host.size());
    ASSERT_OK(src.status());
    ASSERT_OK(dst.status());
    ASSERT_OK(Upload(*device, src.data(), src_host, Stream::kReceive));
    ASSERT_OK(Upload(*device, dst.data(), dst_host, Stream::kReceive));
    RunIndex index;
    index.runs = runs;
    ASSERT_OK(device->PrepareIndex(&index));
    if (add) {
      device->ScatterAdd(dst.data(), src.data(), index, width, Stream::kWriteback);
    } else {
      device->Gather(dst.data(), src.data(), index, width, Stream::kWriteback);
    }
    ASSERT_OK(device->Synchronize(Stream::kWriteback));
    ASSERT_OK(Download(*device, dst.data(), dst_host.size(), device == &cpu ? cpu_out : gpu_out, Stream::kApp));
    device->ReleaseIndex(&index);
  }
}

TEST(MatchesCpuBackendBitForBit) {
  std::unique_ptr<Device> gpu;
  ASSERT_OK(NewCudaDevice(0, &gpu));
  std::unique_ptr<Device> cpu = NewCpuDevice();
  std::mt19937_64 rng(21);
  // Integer-valued floats for scatter-add: every sum is exact, so the two
  // backends must agree whatever order or fusion either one used.
  auto integers = [&rng](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) {
      const int k = 1 + static_cast<int>(rng() % 1000);
      x = static_cast<float>((rng() & 1) ? -k : k);
    }
    return v;
  };
  for (int64_t width : {1, 3, 4, 128, 1000}) {
    const int64_t rows = width >= 128 ? 1500 : 20000;
    const size_t n = static_cast<size_t>(rows * width);
    for (const contract::internal::Layout& layout : Layouts(rows, rng)) {
      std::vector<float> cpu_out, gpu_out;
      const std::vector<float> src = RandomNonZero(n, rng), dst = RandomNonZero(n, rng);
      RunBoth(*cpu, *gpu, false, layout.runs, width, src, dst, &cpu_out, &gpu_out);
      ASSERT_EQ(cpu_out.size(), n);
      ASSERT_EQ(gpu_out.size(), n);
      MLT_CONTRACT_EXPECT_SAME(gpu_out.data(), cpu_out.data(), n,
                               "Gather vs CPU, " + layout.name + ", width " + std::to_string(width));

      const std::vector<float> isrc = integers(n), idst = integers(n);
      RunBoth(*cpu, *gpu, true, layout.runs, width, isrc, idst, &cpu_out, &gpu_out);
      ASSERT_EQ(cpu_out.size(), n);
      ASSERT_EQ(gpu_out.size(), n);
      MLT_CONTRACT_EXPECT_SAME(gpu_out.data(), cpu_out.data(), n,
                               "ScatterAdd vs CPU, " + layout.name + ", width " + std::to_string(width));
    }
  }
}

// Host stores are mapped pinned memory at their host address, so the engine
// swaps host-resident rows with one kernel per access (every GPU of a 64-bit
// Linux host has unified addressing).
TEST(MapsHostMemoryAtItsHostAddress) {
  std::unique_ptr<Device> device;
  ASSERT_OK(NewCudaDevice(0, &device));
  int unified = 0;
  cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, 0);
  EXPECT_EQ(device->maps_host_memory(), unified != 0);
  void* host = nullptr;
  ASSERT_OK(device->AllocateHost(4096, &host));
  cudaPointerAttributes attributes{};
  EXPECT_EQ(cudaPointerGetAttributes(&attributes, host), cudaSuccess);
  EXPECT_TRUE(attributes.type == cudaMemoryTypeHost);
  if (device->maps_host_memory()) EXPECT_TRUE(attributes.devicePointer == host);
  device->FreeHost(host);
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device->Synchronize(static_cast<Stream>(s)));
}

TEST(RejectsBadOrdinals) {
  const int count = CudaDeviceCount();
  for (int ordinal : {-1, count, count + 7}) {
    std::unique_ptr<Device> device;
    const Status status = NewCudaDevice(ordinal, &device);
    EXPECT_CODE(status, StatusCode::kInvalidArgument);
    EXPECT_TRUE(device == nullptr);
    EXPECT_TRUE(status.message().find("no CUDA device") != std::string::npos);
  }
}

TEST(AllocationLargerThanTheGpuIsResourceExhausted) {
  std::unique_ptr<Device> device;
  ASSERT_OK(NewCudaDevice(0, &device));
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_TRUE(cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess);
  for (size_t bytes : {total_bytes * 2, size_t{1} << 50}) {
    void* ptr = nullptr;
    const Status status = device->Allocate(bytes, &ptr);
    EXPECT_CODE(status, StatusCode::kResourceExhausted);
    EXPECT_TRUE(ptr == nullptr);
    EXPECT_TRUE(status.message().find(std::to_string(bytes)) != std::string::npos);
  }
  // The failure is not left behind for a later Synchronize, and the device
  // still works.
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device->Synchronize(static_cast<Stream>(s)));
  std::mt19937_64 rng(22);
  DeviceFloats buffer(*device, 1000);
  ASSERT_OK(buffer.status());
  const std::vector<float> in = RandomNonZero(1000, rng);
  ASSERT_OK(Upload(*device, buffer.data(), in, Stream::kApp));
  std::vector<float> out;
  ASSERT_OK(Download(*device, buffer.data(), 1000, &out, Stream::kApp));
  EXPECT_TRUE(out == in);
}

// A ticket may outlive its device, and a device destroyed with work still
// queued on its streams waits for that work instead of crashing.
TEST(TicketsAndQueuedWorkOutliveTheDevice) {
  // Raw buffers, so that they outlive the device and the queued work is
  // still running when the device's destructor starts.
  const size_t n = size_t{1} << 26;  // 256 MB each
  float* a = nullptr;
  float* b = nullptr;
  ASSERT_TRUE(cudaSetDevice(0) == cudaSuccess);
  ASSERT_TRUE(cudaMalloc(&a, n * sizeof(float)) == cudaSuccess);
  ASSERT_TRUE(cudaMalloc(&b, n * sizeof(float)) == cudaSuccess);
  DeviceEvent ticket;
  {
    std::unique_ptr<Device> device;
    ASSERT_OK(NewCudaDevice(0, &device));
    ASSERT_OK(device->RecordAppWork(0, &ticket));
    EXPECT_TRUE(ticket != nullptr);
    for (int i = 0; i < 8; ++i) {
      device->Fill(a, 3.0f + static_cast<float>(i), n, Stream::kPrefetch);
      device->CopyDeviceToDevice(b, a, n * sizeof(float), Stream::kPrefetch);
    }
  }
  ticket.reset();
  float last = 0.0f;
  EXPECT_TRUE(cudaMemcpy(&last, b + n - 1, sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  EXPECT_EQ(last, 10.0f);
  cudaFree(a);
  cudaFree(b);
}

// Errors from void methods are remembered and returned once, by the next
// Synchronize of any stream. Last in this file: if the error were sticky, it
// would poison the CUDA context for every test after it.
TEST(ErrorsSurfaceAtTheNextSynchronize) {
  std::unique_ptr<Device> device;
  ASSERT_OK(NewCudaDevice(0, &device));
  DeviceFloats buffer(*device, 16);
  ASSERT_OK(buffer.status());

  device->CopyDeviceToDevice(buffer.data(), nullptr, 16 * sizeof(float), Stream::kApp);  // rejected by CUDA
  device->CopyDeviceToDevice(buffer.data(), nullptr, 8, Stream::kPrefetch);              // a second error
  const Status first = device->Synchronize(Stream::kReceive);
  EXPECT_CODE(first, StatusCode::kInternal);
  EXPECT_TRUE(first.message().find("CUDA error in CopyDeviceToDevice") != std::string::npos);
  std::fprintf(stderr, "  surfaced: %s\n", first.ToString().c_str());
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device->Synchronize(static_cast<Stream>(s)));

  // A stream value outside the enum is the caller's mistake.
  device->Fill(buffer.data(), 1.0f, 16, static_cast<Stream>(kNumStreams));
  EXPECT_CODE(device->Synchronize(Stream::kApp), StatusCode::kInvalidArgument);
  EXPECT_CODE(device->Synchronize(static_cast<Stream>(-1)), StatusCode::kInvalidArgument);

  // The device is still usable.
  std::mt19937_64 rng(23);
  const std::vector<float> in = RandomNonZero(16, rng);
  ASSERT_OK(Upload(*device, buffer.data(), in, Stream::kApp));
  std::vector<float> out;
  ASSERT_OK(Download(*device, buffer.data(), 16, &out, Stream::kWriteback));
  EXPECT_TRUE(out == in);
}

}  // namespace
}  // namespace mltuner

MLT_GPU_TEST_MAIN
