// The Device contract: checks that every backend must pass, written against
// the Device interface alone. Data moves in and out only through the
// device's own copies, so the suite runs unchanged on devices whose memory
// the host cannot read (CUDA).
//
//   RunDeviceContract(*NewCpuDevice(), "cpu");
//   RunDeviceContract(*cuda_device, "cuda:0", &hooks);  // hooks: see below
//
// Every input is random and non-zero and every read-back buffer is poisoned
// (a NaN) first, so a missed, doubled or misplaced write shows. Results are
// compared bit for bit with a naive host reference: gather copies values and
// scatter-add does one float addition per value, so nothing may differ.
//
// Threads: RunDeviceContract runs on the calling thread and starts a few
// threads of its own for the concurrency check; failures are reported
// through test_util.h's harness from the calling thread only (its counter is
// not atomic). Ownership: everything the suite allocates it frees before it
// returns; the Device stays the caller's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mltuner/device.h"
#include "test_util.h"

namespace mltuner::contract {

// How the suite queues "application work" on a backend whose application has
// its own asynchronous streams (CUDA). A backend without them passes no
// hooks, and the suite checks only that tickets are accepted.
struct AppWorkHooks {
  // Application stream handles to test (e.g. a created stream and 0).
  std::vector<uintptr_t> app_streams;
  // Queues on `stream` work that runs for tens of milliseconds and ends by
  // writing dst[i] = src[i] for i < n (device pointers); returns at once.
  std::function<void(uintptr_t stream, float* dst, const float* src, size_t n)> slow_copy;
  // Waits for everything queued on `stream`.
  std::function<void(uintptr_t stream)> sync_stream;
};

namespace internal {

// A quiet NaN with a payload no computation produces.
inline float Poison() {
  const uint32_t bits = 0x7FC0DEADu;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Values in +-[0.5, 1.5): never zero, so a dropped write or a doubled
// addition changes the result.
inline std::vector<float> RandomNonZero(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> magnitude(0.5f, 1.5f);
  std::vector<float> v(n);
  for (float& x : v) x = (rng() & 1) ? -magnitude(rng) : magnitude(rng);
  return v;
}

// The first mismatch (bitwise, so -0.0 != +0.0 and NaN poison never
// matches) and how many there were; empty when equal.
inline std::string Mismatch(const float* got, const float* want, size_t n) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return {};
  char text[160];
  std::snprintf(text, sizeof(text), "%zu of %zu values differ; first at %zu: got %.9g want %.9g", bad, n, first,
                static_cast<double>(got[first]), static_cast<double>(want[first]));
  return text;
}

#define MLT_CONTRACT_EXPECT_SAME(got, want, n, what)                                               \
  do {                                                                                             \
    const std::string _m = ::mltuner::contract::internal::Mismatch((got), (want), (n));            \
    if (!_m.empty()) ::mltuner::testing::ReportFailure(__FILE__, __LINE__, std::string(what) + ": " + _m); \
  } while (0)

// Device memory that frees itself; `data` is null when Allocate failed.
class DeviceFloats {
 public:
  DeviceFloats(Device& device, size_t count) : device_(device), count_(count) {
    void* ptr = nullptr;
    status_ = device.Allocate(count * sizeof(float), &ptr);
    if (status_.ok()) data_ = static_cast<float*>(ptr);
  }
  ~DeviceFloats() { device_.Free(data_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  float* data() const { return data_; }
  size_t count() const { return count_; }
  const Status& status() const { return status_; }

 private:
  Device& device_;
  size_t count_;
  float* data_ = nullptr;
  Status status_;
};

// Pinned (on CUDA) host memory that frees itself.
class HostFloats {
 public:
  HostFloats(Device& device, size_t count) : device_(device), count_(count) {
    void* ptr = nullptr;
    status_ = device.AllocateHost(count * sizeof(float), &ptr);
    if (status_.ok()) data_ = static_cast<float*>(ptr);
  }
  ~HostFloats() { device_.FreeHost(data_); }
  HostFloats(const HostFloats&) = delete;
  HostFloats& operator=(const HostFloats&) = delete;
  float* data() const { return data_; }
  size_t count() const { return count_; }
  const Status& status() const { return status_; }

 private:
  Device& device_;
  size_t count_;
  float* data_ = nullptr;
  Status status_;
};

inline Status Upload(Device& device, float* dst, const std::vector<float>& src, Stream s) {
  device.CopyHostToDevice(dst, src.data(), src.size() * sizeof(float), s);
  return device.Synchronize(s);
}

// n floats from device memory into a poisoned host vector.
inline Status Download(Device& device, const float* src, size_t n, std::vector<float>* out, Stream s) {
  out->assign(n, Poison());
  device.CopyDeviceToHost(out->data(), src, n * sizeof(float), s);
  return device.Synchronize(s);
}

inline void ReferenceRuns(bool add, float* dst, const float* src, const std::vector<RowRun>& runs, int64_t width) {
  for (const RowRun& run : runs) {
    for (int64_t r = 0; r < run.count; ++r) {
      for (int64_t c = 0; c < width; ++c) {
        float& d = dst[(run.dst + r) * width + c];
        const float v = src[(run.src + r) * width + c];
        d = add ? d + v : v;
      }
    }
  }
}

struct Layout {
  std::string name;
  std::vector<RowRun> runs;
};

// Index shapes over tables of `rows` rows. No two runs share a dst row, as
// the CUDA scatter-add requires (the engine's indexes never overlap).
inline std::vector<Layout> Layouts(int64_t rows, std::mt19937_64& rng) {
  std::vector<Layout> layouts;
  layouts.push_back({"one long run", {{2, 1, rows - 3}}});

  // Every row once, each its own run, runs in shuffled order: with many
  // rows this is also more runs than CUDA's 65535 grid rows.
  std::vector<int64_t> perm(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) perm[static_cast<size_t>(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<RowRun> singles;
  for (int64_t i = 0; i < rows; ++i) singles.push_back({perm[static_cast<size_t>(i)], i, 1});
  std::shuffle(singles.begin(), singles.end(), rng);
  layouts.push_back({"1-row runs, shuffled", std::move(singles)});

  // Runs of 1..7 rows from random sources, gaps of 0..2 dst rows between
  // them (rows that must stay untouched), empty runs mixed in, shuffled.
  std::vector<RowRun> shorts;
  for (int64_t d = static_cast<int64_t>(rng() % 3); d < rows;) {
    const int64_t count = std::min<int64_t>(1 + static_cast<int64_t>(rng() % 7), rows - d);
    shorts.push_back({static_cast<int64_t>(rng() % static_cast<uint64_t>(rows - count + 1)), d, count});
    if (rng() % 16 == 0) shorts.push_back({static_cast<int64_t>(rng() % static_cast<uint64_t>(rows)), d, 0});
    d += count + static_cast<int64_t>(rng() % 3);
  }
  std::shuffle(shorts.begin(), shorts.end(), rng);
  layouts.push_back({"short runs with gaps, shuffled", std::move(shorts)});
  return layouts;
}

// Runs Gather (add = false) or ScatterAdd (add = true) for one layout on
// buffers of `rows` rows (offset by src_offset / dst_offset floats, which
// breaks 16-byte alignment when not a multiple of 4) and compares with the
// reference. An unprepared index must work too.
inline void CheckRowRuns(Device& device, bool add, const Layout& layout, int64_t rows, int64_t width,
                         size_t src_offset, size_t dst_offset, bool prepare, std::mt19937_64& rng) {
  const size_t n = static_cast<size_t>(rows * width);
  DeviceFloats src(device, n + src_offset), dst(device, n + dst_offset);
  ASSERT_OK(src.status());
  ASSERT_OK(dst.status());
  const std::vector<float> src_host = RandomNonZero(n + src_offset, rng);
  std::vector<float> want = RandomNonZero(n + dst_offset, rng);
  ASSERT_OK(Upload(device, src.data(), src_host, Stream::kReceive));
  ASSERT_OK(Upload(device, dst.data(), want, Stream::kReceive));

  RunIndex index;
  index.runs = layout.runs;
  if (prepare) ASSERT_OK(device.PrepareIndex(&index));
  const Stream s = add ? Stream::kWriteback : Stream::kPrefetch;
  if (add) {
    device.ScatterAdd(dst.data() + dst_offset, src.data() + src_offset, index, width, s);
  } else {
    device.Gather(dst.data() + dst_offset, src.data() + src_offset, index, width, s);
  }
  ASSERT_OK(device.Synchronize(s));
  ReferenceRuns(add, want.data() + dst_offset, src_host.data() + src_offset, layout.runs, width);

  std::vector<float> got;
  ASSERT_OK(Download(device, dst.data(), n + dst_offset, &got, Stream::kApp));
  const std::string what = std::string(add ? "ScatterAdd" : "Gather") + ", " + layout.name + ", width " +
                           std::to_string(width) + ", offsets " + std::to_string(src_offset) + "/" +
                           std::to_string(dst_offset) + (prepare ? "" : ", unprepared index");
  MLT_CONTRACT_EXPECT_SAME(got.data(), want.data(), got.size(), what);
  device.ReleaseIndex(&index);
}

// ---- the checks -------------------------------------------------------------

inline void AllocatesAndRejectsZero(Device& device) {
  std::mt19937_64 rng(11);
  for (size_t bytes : {size_t{1}, size_t{3}, size_t{64}, size_t{4096}, size_t{1} << 20, (size_t{3} << 20) + 5}) {
    // Device memory: the whole range holds what is written through a copy.
    void* ptr = nullptr;
    ASSERT_OK(device.Allocate(bytes, &ptr));
    ASSERT_TRUE(ptr != nullptr);
    std::vector<uint8_t> in(bytes), out(bytes, 0xEE);
    for (uint8_t& b : in) b = static_cast<uint8_t>(1 + rng() % 255);
    device.CopyHostToDevice(ptr, in.data(), bytes, Stream::kPrefetch);
    ASSERT_OK(device.Synchronize(Stream::kPrefetch));
    device.CopyDeviceToHost(out.data(), ptr, bytes, Stream::kWriteback);
    ASSERT_OK(device.Synchronize(Stream::kWriteback));
    EXPECT_TRUE(in == out);
    device.Free(ptr);

    // Host staging is host-addressable on every backend.
    void* host = nullptr;
    ASSERT_OK(device.AllocateHost(bytes, &host));
    ASSERT_TRUE(host != nullptr);
    std::memset(host, 0x5A, bytes);
    EXPECT_EQ(static_cast<uint8_t*>(host)[bytes - 1], uint8_t{0x5A});
    device.FreeHost(host);
  }
  void* ptr = nullptr;
  EXPECT_CODE(device.Allocate(0, &ptr), StatusCode::kInvalidArgument);
  EXPECT_CODE(device.AllocateHost(0, &ptr), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ptr == nullptr);
  device.Free(nullptr);
  device.FreeHost(nullptr);
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device.Synchronize(static_cast<Stream>(s)));
}

// Every copy direction with pageable and with pinned host memory, whole
// buffers and an odd sub-range at odd offsets.
inline void Copies(Device& device) {
  std::mt19937_64 rng(12);
  for (size_t n : {size_t{1}, size_t{1000}, size_t{1} << 20}) {
    DeviceFloats a(device, n), b(device, n);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    const size_t bytes = n * sizeof(float);

    // Pageable.
    const std::vector<float> in = RandomNonZero(n, rng);
    device.CopyHostToDevice(a.data(), in.data(), bytes, Stream::kPrefetch);
    ASSERT_OK(device.Synchronize(Stream::kPrefetch));
    device.CopyDeviceToDevice(b.data(), a.data(), bytes, Stream::kReceive);
    ASSERT_OK(device.Synchronize(Stream::kReceive));
    std::vector<float> out(n, Poison());
    device.CopyDeviceToHost(out.data(), b.data(), bytes, Stream::kWriteback);
    ASSERT_OK(device.Synchronize(Stream::kWriteback));
    MLT_CONTRACT_EXPECT_SAME(out.data(), in.data(), n, "pageable copies of " + std::to_string(n) + " floats");

    // Pinned, both ways, with new data so that stale results cannot pass.
    HostFloats pinned_in(device, n), pinned_out(device, n);
    ASSERT_OK(pinned_in.status());
    ASSERT_OK(pinned_out.status());
    const std::vector<float> in2 = RandomNonZero(n, rng);
    std::copy(in2.begin(), in2.end(), pinned_in.data());
    std::fill_n(pinned_out.data(), n, Poison());
    device.CopyHostToDevice(a.data(), pinned_in.data(), bytes, Stream::kPrefetch);
    ASSERT_OK(device.Synchronize(Stream::kPrefetch));
    device.CopyDeviceToDevice(b.data(), a.data(), bytes, Stream::kApp);
    ASSERT_OK(device.Synchronize(Stream::kApp));
    device.CopyDeviceToHost(pinned_out.data(), b.data(), bytes, Stream::kWriteback);
    ASSERT_OK(device.Synchronize(Stream::kWriteback));
    MLT_CONTRACT_EXPECT_SAME(pinned_out.data(), in2.data(), n, "pinned copies of " + std::to_string(n) + " floats");

    // A sub-range: floats [3, 3 + m) of pinned_in -> a[5...], a -> b[1...],
    // and b back; everything outside must keep in2's values.
    if (n >= 16) {
      const size_t m = n - 9;
      const std::vector<float> in3 = RandomNonZero(n, rng);
      std::copy(in3.begin(), in3.end(), pinned_in.data());
      device.CopyHostToDevice(a.data() + 5, pinned_in.data() + 3, m * sizeof(float), Stream::kReceive);
      device.CopyDeviceToDevice(b.data() + 1, a.data() + 5, m * sizeof(float), Stream::kReceive);
      ASSERT_OK(device.Synchronize(Stream::kReceive));
      std::vector<float> got;
      ASSERT_OK(Download(device, b.data(), n, &got, Stream::kApp));
      std::vector<float> want = in2;
      std::copy(in3.begin() + 3, in3.begin() + 3 + static_cast<std::ptrdiff_t>(m), want.begin() + 1);
      MLT_CONTRACT_EXPECT_SAME(got.data(), want.data(), n, "sub-range copies of " + std::to_string(m) + " floats");
    }
  }
  // Zero bytes is a no-op, even with null pointers.
  device.CopyHostToDevice(nullptr, nullptr, 0, Stream::kApp);
  device.CopyDeviceToHost(nullptr, nullptr, 0, Stream::kApp);
  device.CopyDeviceToDevice(nullptr, nullptr, 0, Stream::kApp);
  EXPECT_OK(device.Synchronize(Stream::kApp));
}

inline void Fills(Device& device) {
  std::mt19937_64 rng(13);
  // Past a million floats, so a CUDA fill needs more than one grid's worth.
  const size_t n = (size_t{3} << 20) + 17;
  DeviceFloats a(device, n);
  ASSERT_OK(a.status());
  std::vector<float> want = RandomNonZero(n, rng);
  ASSERT_OK(Upload(device, a.data(), want, Stream::kApp));

  struct Piece {
    size_t begin, count;
    float value;
  };
  const Piece pieces[] = {{7, 5001, 0.0f}, {6000, 90001, 2.5f}, {96010, 3, -0.0f}, {96100, 1, -7.25e-3f},
                          {200000, n - 200000 - 5, 1.0e30f}, {100, 0, 9.0f}};
  for (const Piece& p : pieces) {
    device.Fill(a.data() + p.begin, p.value, p.count, Stream::kPrefetch);
    std::fill_n(want.begin() + static_cast<std::ptrdiff_t>(p.begin), p.count, p.value);
  }
  ASSERT_OK(device.Synchronize(Stream::kPrefetch));
  std::vector<float> got;
  ASSERT_OK(Download(device, a.data(), n, &got, Stream::kWriteback));
  MLT_CONTRACT_EXPECT_SAME(got.data(), want.data(), n, "Fill with zero, -0 and non-zero values");
}

// NaN (quiet, signalling, negative), both infinities and finite extremes
// (the largest float, denormals, -0) at scattered places past a million
// floats: the count must be exact, and must see work queued before it on
// its stream.
inline void CountsNonFinite(Device& device) {
  std::mt19937_64 rng(29);
  const size_t n = (size_t{3} << 20) + 11;
  DeviceFloats a(device, n);
  ASSERT_OK(a.status());
  std::vector<float> values = RandomNonZero(n, rng);
  auto bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  const float non_finite[] = {bits(0x7FC00000u), bits(0x7F800001u), bits(0xFFC00001u), bits(0x7F800000u),
                              bits(0xFF800000u)};
  const float finite[] = {bits(0x7F7FFFFFu), bits(0xFF7FFFFFu), bits(0x00000001u), bits(0x80000000u)};
  int64_t want = 0;
  for (size_t i = 0; i < n; i += 1 + rng() % 200003) {
    values[i] = non_finite[rng() % 5];
    ++want;
  }
  for (size_t i = 5; i < n; i += 1 + rng() % 100003) {
    if (std::isfinite(values[i])) values[i] = finite[rng() % 4];
  }
  ASSERT_OK(Upload(device, a.data(), values, Stream::kApp));
  int64_t got = -1;
  ASSERT_OK(device.CountNonFinite(a.data(), static_cast<int64_t>(n), Stream::kServer, &got));
  EXPECT_EQ(got, want);
  // Queued on the same stream before the count: a fill of the last values.
  device.Fill(a.data() + n - 1000, bits(0x7F800000u), 1000, Stream::kServer);
  int64_t tail_known_finite = 0;
  for (size_t i = n - 1000; i < n; ++i) tail_known_finite += std::isfinite(values[i]) ? 1 : 0;
  ASSERT_OK(device.CountNonFinite(a.data(), static_cast<int64_t>(n), Stream::kServer, &got));
  EXPECT_EQ(got, want + tail_known_finite);
  ASSERT_OK(device.CountNonFinite(a.data(), 0, Stream::kServer, &got));
  EXPECT_EQ(got, 0);
}

// Zeroed memory, device and host, small and past the CPU backend's mapping
// size: every float reads +0.0 and the block is writable and freed by
// Free / FreeHost.
inline void AllocatesZeroed(Device& device) {
  for (const size_t count : {size_t{3}, (size_t{1} << 20) + 5}) {
    const size_t bytes = count * sizeof(float);
    const std::vector<float> zeros(count, 0.0f);
    void* on_device = nullptr;
    ASSERT_OK(device.AllocateZeroed(bytes, /*host=*/false, &on_device));
    std::vector<float> got;
    ASSERT_OK(Download(device, static_cast<const float*>(on_device), count, &got, Stream::kApp));
    MLT_CONTRACT_EXPECT_SAME(got.data(), zeros.data(), count, "AllocateZeroed (device)");
    device.Fill(static_cast<float*>(on_device), 1.0f, count, Stream::kApp);
    EXPECT_OK(device.Synchronize(Stream::kApp));
    device.Free(on_device);
    void* on_host = nullptr;
    ASSERT_OK(device.AllocateZeroed(bytes, /*host=*/true, &on_host));
    MLT_CONTRACT_EXPECT_SAME(static_cast<const float*>(on_host), zeros.data(), count, "AllocateZeroed (host)");
    std::memset(on_host, 0x7f, bytes);
    device.FreeHost(on_host);
  }
}

inline void Indexes(Device& device) {
  RunIndex index;
  index.runs = {{0, 0, 5}, {10, 5, 3}, {2, 8, 0}};
  ASSERT_OK(device.PrepareIndex(&index));
  EXPECT_EQ(index.total_rows, int64_t{8});
  device.ReleaseIndex(&index);
  EXPECT_TRUE(index.device_copy == nullptr);
  device.ReleaseIndex(&index);  // idempotent
  EXPECT_TRUE(index.device_copy == nullptr);
  ASSERT_OK(device.PrepareIndex(&index));  // again after a release
  ASSERT_OK(device.PrepareIndex(&index));  // and over a prepared one
  EXPECT_EQ(index.total_rows, int64_t{8});
  device.ReleaseIndex(&index);

  RunIndex empty;
  ASSERT_OK(device.PrepareIndex(&empty));
  EXPECT_EQ(empty.total_rows, int64_t{0});
  // Nothing to do, so even null buffers are fine.
  device.Gather(nullptr, nullptr, empty, 4, Stream::kPrefetch);
  device.ScatterAdd(nullptr, nullptr, empty, 4, Stream::kWriteback);
  device.ReleaseIndex(&empty);

  RunIndex bad;
  bad.runs = {{0, 0, 2}, {0, 0, -1}};
  EXPECT_CODE(device.PrepareIndex(&bad), StatusCode::kInvalidArgument);
  EXPECT_TRUE(bad.device_copy == nullptr);
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device.Synchronize(static_cast<Stream>(s)));
}

inline void GatherAndScatterAdd(Device& device) {
  std::mt19937_64 rng(14);
  // Row widths with their row counts: up to 4 MB a buffer, and 100000 1-row
  // runs for width 1.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 100000}, {3, 40000}, {4, 50000}, {128, 4000}, {1000, 1000}};
  for (const auto& [width, rows] : shapes) {
    const std::vector<Layout> layouts = Layouts(rows, rng);
    for (const Layout& layout : layouts) {
      for (bool add : {false, true}) CheckRowRuns(device, add, layout, rows, width, 0, 0, true, rng);
    }
    // Misaligned rows (the float path of a vectorizing kernel) and an
    // index that was never prepared.
    for (bool add : {false, true}) {
      CheckRowRuns(device, add, layouts[0], rows, width, 3, 1, true, rng);
      CheckRowRuns(device, add, layouts[2], rows, width, 0, 0, false, rng);
    }
  }
}

// Host-resident rows (Device::maps_host_memory): Gather from AllocateHost
// memory into device memory (a swap in), ScatterAdd from device memory into
// it (an update's rows into a host log) and Gather into it (local data
// written back), on the swap streams, matching the reference bit for bit. The
// host side is read and written on the host only after a Synchronize.
inline void HostResidentRuns(Device& device) {
  if (!device.maps_host_memory()) {
    std::fprintf(stderr, "  (%s does not map host memory: the engine swaps with copies)\n", device.name().c_str());
    return;
  }
  std::mt19937_64 rng(18);
  const std::pair<int64_t, int64_t> shapes[] = {{1, 20000}, {3, 5000}, {64, 3000}, {1000, 500}};
  for (const auto& [width, rows] : shapes) {
    const std::vector<Layout> layouts = Layouts(rows, rng);
    const size_t n = static_cast<size_t>(rows * width);
    for (size_t li = 0; li < layouts.size(); ++li) {
      const Layout& layout = layouts[li];
      for (int mode = 0; mode < 3; ++mode) {  // 0: host -> device gather, 1: scatter-add into host, 2: gather into host
        const bool add = mode == 1, host_dst = mode != 0;
        const size_t offset = li == 0 ? 1 : 0;  // one misaligned case per shape
        DeviceFloats device_side(device, n + offset);
        HostFloats host_side(device, n + offset);
        ASSERT_OK(device_side.status());
        ASSERT_OK(host_side.status());
        const std::vector<float> src = RandomNonZero(n + offset, rng);
        std::vector<float> want = RandomNonZero(n + offset, rng);
        float* dst = nullptr;
        const float* srcp = nullptr;
        if (host_dst) {
          ASSERT_OK(Upload(device, device_side.data(), src, Stream::kReceive));
          std::memcpy(host_side.data(), want.data(), want.size() * sizeof(float));
          dst = host_side.data() + offset;
          srcp = device_side.data() + offset;
        } else {
          ASSERT_OK(Upload(device, device_side.data(), want, Stream::kReceive));
          std::memcpy(host_side.data(), src.data(), src.size() * sizeof(float));
          dst = device_side.data() + offset;
          srcp = host_side.data() + offset;
        }
        RunIndex index;
        index.runs = layout.runs;
        const bool prepare = li != 2;  // an unprepared index must work too
        if (prepare) ASSERT_OK(device.PrepareIndex(&index));
        const Stream s = host_dst ? Stream::kSwapOut : Stream::kSwapIn;
        if (add) {
          device.ScatterAdd(dst, srcp, index, width, s);
        } else {
          device.Gather(dst, srcp, index, width, s);
        }
        ASSERT_OK(device.Synchronize(s));
        ReferenceRuns(add, want.data() + offset, src.data() + offset, layout.runs, width);
        std::vector<float> got;
        if (host_dst) {
          got.assign(host_side.data(), host_side.data() + want.size());
        } else {
          ASSERT_OK(Download(device, device_side.data(), want.size(), &got, Stream::kApp));
        }
        const char* names[] = {"Gather from host memory", "ScatterAdd into host memory", "Gather into host memory"};
        MLT_CONTRACT_EXPECT_SAME(got.data(), want.data(), got.size(),
                                 std::string(names[mode]) + ", " + layout.name + ", width " + std::to_string(width) +
                                     (prepare ? "" : ", unprepared index"));
        device.ReleaseIndex(&index);
      }
    }
  }
}

// Swaps (Device::SwapRuns): rows between AllocateHost memory and device
// memory, in and out, over every layout (thousands of 1-row runs, empty
// runs, gaps that must stay untouched) and an unprepared index, matching the
// reference bit for bit. Every backend, whatever it maps: the engine swaps
// through this call.
inline void Swaps(Device& device) {
  std::mt19937_64 rng(21);
  const std::pair<int64_t, int64_t> shapes[] = {{1, 20000}, {64, 3000}, {1000, 300}};
  for (const auto& [width, rows] : shapes) {
    const std::vector<Layout> layouts = Layouts(rows, rng);
    const size_t n = static_cast<size_t>(rows * width);
    for (size_t li = 0; li < layouts.size(); ++li) {
      const Layout& layout = layouts[li];
      for (const SwapDirection direction : {SwapDirection::kIn, SwapDirection::kOut}) {
        const bool in = direction == SwapDirection::kIn;
        DeviceFloats device_side(device, n);
        HostFloats host_side(device, n);
        ASSERT_OK(device_side.status());
        ASSERT_OK(host_side.status());
        const std::vector<float> src = RandomNonZero(n, rng);
        std::vector<float> want = RandomNonZero(n, rng);
        ASSERT_OK(Upload(device, device_side.data(), in ? want : src, Stream::kReceive));
        std::memcpy(host_side.data(), (in ? src : want).data(), n * sizeof(float));
        RunIndex index;
        index.runs = layout.runs;
        const bool prepare = li != 1;  // an unprepared index must work too
        if (prepare) ASSERT_OK(device.PrepareIndex(&index));
        const Stream s = in ? Stream::kSwapIn : Stream::kSwapOut;
        if (in) {
          device.SwapRuns(device_side.data(), host_side.data(), index, width, direction, s);
        } else {
          device.SwapRuns(host_side.data(), device_side.data(), index, width, direction, s);
        }
        ASSERT_OK(device.Synchronize(s));
        ReferenceRuns(false, want.data(), src.data(), layout.runs, width);
        std::vector<float> got;
        if (in) {
          ASSERT_OK(Download(device, device_side.data(), n, &got, Stream::kApp));
        } else {
          got.assign(host_side.data(), host_side.data() + n);
        }
        MLT_CONTRACT_EXPECT_SAME(got.data(), want.data(), n,
                                 std::string(in ? "SwapRuns in, " : "SwapRuns out, ") + layout.name + ", width " +
                                     std::to_string(width) + (prepare ? "" : ", unprepared index"));
        device.ReleaseIndex(&index);
      }
    }
  }
}

// Work issued on one stream runs in issue order: a chain of dependent steps
// with a single Synchronize at the end gives the right result.
inline void StreamOrder(Device& device) {
  std::mt19937_64 rng(15);
  const int64_t rows = 3000, width = 36;
  const size_t n = static_cast<size_t>(rows * width);
  const Layout layout = Layouts(rows, rng)[2];
  RunIndex index;
  index.runs = layout.runs;
  ASSERT_OK(device.PrepareIndex(&index));
  for (int si = 0; si < kNumStreams; ++si) {
    const Stream s = static_cast<Stream>(si);
    DeviceFloats a(device, n), b(device, n), c(device, n);
    HostFloats staging(device, n), back(device, n);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    ASSERT_OK(c.status());
    ASSERT_OK(staging.status());
    ASSERT_OK(back.status());
    const std::vector<float> in = RandomNonZero(n, rng), c_init = RandomNonZero(n, rng);
    ASSERT_OK(Upload(device, c.data(), c_init, Stream::kApp));
    std::copy(in.begin(), in.end(), staging.data());
    std::fill_n(back.data(), n, Poison());

    device.CopyHostToDevice(a.data(), staging.data(), n * sizeof(float), s);
    device.CopyDeviceToDevice(b.data(), a.data(), n * sizeof(float), s);
    device.ScatterAdd(c.data(), b.data(), index, width, s);
    device.Fill(a.data(), 0.0f, n, s);  // rows the gather skips must read 0, not b's copy
    device.Gather(a.data(), c.data(), index, width, s);
    device.CopyDeviceToHost(back.data(), a.data(), n * sizeof(float), s);
    ASSERT_OK(device.Synchronize(s));

    std::vector<float> c_want = c_init, want(n, 0.0f);
    ReferenceRuns(true, c_want.data(), in.data(), layout.runs, width);
    ReferenceRuns(false, want.data(), c_want.data(), layout.runs, width);
    MLT_CONTRACT_EXPECT_SAME(back.data(), want.data(), n, "a dependent chain on stream " + std::to_string(si));
  }
  device.ReleaseIndex(&index);
}

// Engine threads call from many threads at once, one stream each.
inline void ConcurrentThreads(Device& device) {
  const int64_t rows = 2000, width = 20;
  const size_t n = static_cast<size_t>(rows * width);
  std::vector<std::string> errors(kNumStreams);
  std::vector<std::thread> threads;
  for (int t = 0; t < kNumStreams; ++t) {
    threads.emplace_back([&device, &errors, t, n, rows, width] {
      std::mt19937_64 rng(100 + static_cast<uint64_t>(t));
      const Stream s = static_cast<Stream>(t);
      const Layout layout = Layouts(rows, rng)[1];
      RunIndex index;
      index.runs = layout.runs;
      Status status = device.PrepareIndex(&index);
      DeviceFloats src(device, n), dst(device, n);
      if (status.ok()) status = src.status().ok() ? dst.status() : src.status();
      for (int round = 0; status.ok() && round < 5; ++round) {
        const std::vector<float> in = RandomNonZero(n, rng);
        std::vector<float> want = RandomNonZero(n, rng), got(n, Poison());
        device.CopyHostToDevice(src.data(), in.data(), n * sizeof(float), s);
        device.CopyHostToDevice(dst.data(), want.data(), n * sizeof(float), s);
        device.ScatterAdd(dst.data(), src.data(), index, width, s);
        device.CopyDeviceToHost(got.data(), dst.data(), n * sizeof(float), s);
        status = device.Synchronize(s);
        ReferenceRuns(true, want.data(), in.data(), layout.runs, width);
        const std::string m = Mismatch(got.data(), want.data(), n);
        if (status.ok() && !m.empty()) errors[static_cast<size_t>(t)] = "round " + std::to_string(round) + ": " + m;
        if (!errors[static_cast<size_t>(t)].empty()) break;
      }
      if (!status.ok()) errors[static_cast<size_t>(t)] = status.ToString();
      device.ReleaseIndex(&index);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kNumStreams; ++t) {
    if (!errors[static_cast<size_t>(t)].empty()) {
      ::mltuner::testing::ReportFailure(__FILE__, __LINE__,
                                        "thread on stream " + std::to_string(t) + ": " + errors[static_cast<size_t>(t)]);
    }
  }
}

// Tickets: a null ticket is "done"; with hooks, an engine stream made to
// wait for a ticket sees everything the application queued before it.
inline void AppWorkTickets(Device& device, const AppWorkHooks* hooks) {
  DeviceEvent ticket;
  ASSERT_OK(device.RecordAppWork(0, &ticket));
  EXPECT_OK(device.WaitEvent(Stream::kWriteback, ticket));
  EXPECT_OK(device.WaitEvent(Stream::kPrefetch, DeviceEvent()));
  ticket.reset();
  EXPECT_OK(device.Synchronize(Stream::kWriteback));
  EXPECT_OK(device.Synchronize(Stream::kPrefetch));
  if (hooks == nullptr) return;

  std::mt19937_64 rng(16);
  const size_t n = size_t{1} << 22;  // 16 MB
  DeviceFloats src(device, n), dst(device, n);
  ASSERT_OK(src.status());
  ASSERT_OK(dst.status());
  for (uintptr_t app : hooks->app_streams) {
    // Two rounds, so that the second may reuse a pooled event.
    for (int round = 0; round < 2; ++round) {
      const std::vector<float> final_data = RandomNonZero(n, rng), stale = RandomNonZero(n, rng);
      ASSERT_OK(Upload(device, src.data(), final_data, Stream::kReceive));
      ASSERT_OK(Upload(device, dst.data(), stale, Stream::kReceive));
      hooks->slow_copy(app, dst.data(), src.data(), n);
      DeviceEvent t;
      ASSERT_OK(device.RecordAppWork(app, &t));
      ASSERT_TRUE(t != nullptr);
      ASSERT_OK(device.WaitEvent(Stream::kWriteback, t));
      t.reset();  // the wait is already queued; dropping the ticket must not undo it
      std::vector<float> got(n, Poison());
      device.CopyDeviceToHost(got.data(), dst.data(), n * sizeof(float), Stream::kWriteback);
      ASSERT_OK(device.Synchronize(Stream::kWriteback));
      MLT_CONTRACT_EXPECT_SAME(got.data(), final_data.data(), n,
                               "a copy ordered after application stream " + std::to_string(app) + ", round " +
                                   std::to_string(round));
      hooks->sync_stream(app);
    }
  }
}

}  // namespace internal

// Runs every check on `device`, naming each on stderr with `label`.
inline void RunDeviceContract(Device& device, const char* label, const AppWorkHooks* hooks = nullptr) {
  using namespace internal;
  const std::pair<const char*, std::function<void()>> checks[] = {
      {"AllocatesAndRejectsZero", [&] { AllocatesAndRejectsZero(device); }},
      {"Copies", [&] { Copies(device); }},
      {"Fills", [&] { Fills(device); }},
      {"CountsNonFinite", [&] { CountsNonFinite(device); }},
      {"AllocatesZeroed", [&] { AllocatesZeroed(device); }},
      {"Indexes", [&] { Indexes(device); }},
      {"GatherAndScatterAdd", [&] { GatherAndScatterAdd(device); }},
      {"HostResidentRuns", [&] { HostResidentRuns(device); }},
      {"Swaps", [&] { Swaps(device); }},
      {"StreamOrder", [&] { StreamOrder(device); }},
      {"ConcurrentThreads", [&] { ConcurrentThreads(device); }},
      {"AppWorkTickets", [&] { AppWorkTickets(device, hooks); }},
  };
  for (const auto& [name, check] : checks) {
    const int before = ::mltuner::testing::Failures();
    check();
    std::fprintf(stderr, "  [contract %s] %s %s\n", label, name,
                 ::mltuner::testing::Failures() == before ? "ok" : "FAILED");
  }
  // No error may be left over for a later Synchronize.
  for (int s = 0; s < kNumStreams; ++s) EXPECT_OK(device.Synchronize(static_cast<Stream>(s)));
}

}  // namespace mltuner::contract
