// cuda_bench: the CUDA backend's data movement, each figure a ratio to a
// ceiling measured on the same GPU in the same run (device_bench --device cuda).
//
// Ceilings (plain cudaMemcpyAsync on a private non-blocking stream):
//   d2d-copy       1 GiB device -> device, counted as bytes read + written;
//   h2d/d2h-pinned 1 GiB between cudaMallocHost memory and the device;
//   h2d/d2h-pageable 256 MiB between malloc'd memory and the device (for reference).
// Measured through the mltuner::Device interface (NewCudaDevice), as the
// engine calls it:
//   gather       Device::Gather table -> access buffer, moved = 2 x payload;
//   scatter-add  Device::ScatterAdd buffer -> table, moved = 3 x payload
//                (read dst, read src, write dst);
//   both over the index shapes of the CPU benchmark: layers (20 runs),
//   rows-seq and rows-shuf (one run per row);
//   swap-h2d / swap-d2h  Device::CopyHostToDevice / CopyDeviceToHost between
//                AllocateHost (pinned) memory and device memory, one call per
//                run, as the engine moves host-resident rows: layers (20 runs
//                of one block each) and runs64 (runs of 64 rows, shuffled).
//   swap-in-batch / swap-out-batch  the same runs as one RunIndex, moved by
//                Device::SwapRuns as the engine swaps on CUDA: one batched
//                copy (cudaMemcpyBatchAsync) per call on the swap streams;
//   swap-in-kernel / swap-out-kernel  the same runs as one RunIndex, moved by
//                one Gather (host -> device) / ScatterAdd (device -> host log)
//                kernel on mapped pinned memory, as the engine swaps where
//                Device::maps_host_memory() (one launch per access);
//   copy         cudaMemcpyAsync D2D at the table size, for reference;
//   recheck      the three ceilings measured again at the end (drift).
//
// Timing: every figure is the median over `reps` batches, after one untimed
// warm-up batch; a batch enqueues k calls (k sized so a batch moves >= 4 GiB
// on the device, >= 1 GiB over PCIe) and waits with a stream synchronize,
// timed by steady_clock, and the figure is batch time / k. The Device's
// streams are private, so events cannot be recorded on them; batching makes
// the host-side sync cost negligible. Consecutive calls alternate between two
// buffer sets so that small sizes are not served from the 50 MB L2.
//
// Correctness: each (op, shape, width) is checked once, at the smallest
// size, against a host reference on random non-zero data, with gather and
// copy outputs poisoned (all-ones bits, a NaN) beforehand.
#include "cuda_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_device.h"
#include "index_shapes.h"
#include "mltuner/device.h"

namespace mltuner_bench {
namespace {

using mltuner::Device;
using mltuner::RowRun;
using mltuner::RunIndex;
using mltuner::Stream;
using mltuner::SwapDirection;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kLayers = 20;
constexpr int64_t kSwapRunRows = 64;

#define CUDA_CHECK(expr)                                                                             \
  do {                                                                                               \
    const cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "cuda_bench: %s failed (%s:%d): %s\n", #expr, __FILE__, __LINE__,         \
                   cudaGetErrorString(err_));                                                        \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

void CheckOk(const mltuner::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

// Everything printed goes to stdout and into `report` (for --out).
std::string report;
void Out(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  std::fputs(buf, stdout);
  report += buf;
}

// Random non-zero floats in [-1, 1), xorshift64 per chunk, several threads.
void FillRandom(float* p, int64_t n, uint64_t seed) {
  const int threads = std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=] {
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(t + 1) * 0xBF58476D1CE4E5B9ull);
      if (x == 0) x = 1;
      for (int64_t i = begin; i < end; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const int32_t v = static_cast<int32_t>(x >> 40) - (1 << 23);  // 24 random bits, centred
        const float f = static_cast<float>(v) * (1.0f / 8388608.0f);
        p[i] = f == 0.0f ? 0.5f : f;
      }
    });
  }
  for (std::thread& th : pool) th.join();
}


struct Timing {
  double median = 0, min = 0, max = 0;  // seconds per call
};

// One untimed warm-up batch, then `reps` timed batches of `k` calls each.
// enqueue(i) issues call i (i % 2 picks the buffer set); wait() blocks until
// the batch is done.
Timing TimeBatches(int reps, int64_t k, const std::function<void(int64_t)>& enqueue,
                   const std::function<void()>& wait) {
  for (int64_t i = 0; i < k; ++i) enqueue(i);
  wait();
  std::vector<double> per_call;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < k; ++i) enqueue(i);
    wait();
    per_call.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / k);
  }
  std::sort(per_call.begin(), per_call.end());
  Timing t;
  t.median = per_call.size() % 2 ? per_call[per_call.size() / 2]
                                 : 0.5 * (per_call[per_call.size() / 2 - 1] + per_call[per_call.size() / 2]);
  t.min = per_call.front();
  t.max = per_call.back();
  return t;
}

// Calls per batch so that a batch moves at least `target` bytes.
int64_t BatchCalls(double bytes_per_call, double target, int64_t min_calls) {
  return std::max<int64_t>(min_calls, static_cast<int64_t>(std::ceil(target / bytes_per_call)));
}

struct Row {
  std::string op, index;
  double mb = 0;
  int64_t width = 0;  // floats; 0 = not applicable
  int64_t runs = 0;
  Timing t;
  double moved = 0;    // bytes counted per call
  double ceiling = 0;  // GB/s; 0 = this row is a ceiling / reference only
  double goal = 0;     // 0 = no goal
  double gbps() const { return moved / t.median / 1e9; }
  double ratio() const { return ceiling > 0 ? gbps() / ceiling : 0; }
};

Row MakeRow(std::string op, std::string index, double mb, int64_t width, int64_t runs) {
  Row r;
  r.op = std::move(op);
  r.index = std::move(index);
  r.mb = mb;
  r.width = width;
  r.runs = runs;
  return r;
}

// A result that does not match the reference: print the first few and fail.
bool Report(const char* what, int64_t bad, int64_t first, float got, float want) {
  if (bad == 0) return true;
  std::fprintf(stderr, "cuda_bench: VERIFY FAILED %s: %lld wrong values, first at %lld: got %a want %a\n", what,
               static_cast<long long>(bad), static_cast<long long>(first), got, want);
  return false;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

std::string Now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

}  // namespace

int RunCudaBench(const CudaBenchOptions& options) {
  const int count = mltuner::CudaDeviceCount();
  if (count == 0) {
    std::fprintf(stderr, "cuda_bench: no CUDA device visible\n");
    return 1;
  }
  std::unique_ptr<Device> device;
  CheckOk(mltuner::NewCudaDevice(options.ordinal, &device), "NewCudaDevice");
  CUDA_CHECK(cudaSetDevice(options.ordinal));
  cudaDeviceProp props{};
  CUDA_CHECK(cudaGetDeviceProperties(&props, options.ordinal));
  int driver = 0, runtime = 0;
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));

  std::vector<int64_t> sizes_mb = options.sizes_mb;
  std::sort(sizes_mb.begin(), sizes_mb.end());
  sizes_mb.erase(std::unique(sizes_mb.begin(), sizes_mb.end()), sizes_mb.end());
  if (sizes_mb.empty() || sizes_mb.front() < 1) {
    std::fprintf(stderr, "cuda_bench: --sizes must be >= 1 MB\n");
    return 2;
  }
  const int reps = std::max(options.reps, 1);
  // Every set holds at least the 1 GiB of the ceilings.
  const int64_t set_bytes = std::max(sizes_mb.back() * kMiB, kGiB);
  constexpr int64_t kPageableBytes = 256 * kMiB;

  // Two buffer sets (table + access buffer each) and one pinned host buffer.
  struct Set { float* table = nullptr; float* buffer = nullptr; };
  Set sets[2];
  void* pinned_raw = nullptr;
  CheckOk(device->AllocateHost(static_cast<size_t>(set_bytes), &pinned_raw), "AllocateHost");
  float* pinned = static_cast<float*>(pinned_raw);
  const int64_t set_floats = set_bytes / 4;
  std::fprintf(stderr, "cuda_bench: filling 4 x %lld MiB with random data...\n",
               static_cast<long long>(set_bytes / kMiB));
  uint64_t seed = 1;
  for (Set& s : sets) {
    for (float** p : {&s.table, &s.buffer}) {
      void* raw = nullptr;
      CheckOk(device->Allocate(static_cast<size_t>(set_bytes), &raw), "Allocate");
      *p = static_cast<float*>(raw);
      FillRandom(pinned, set_floats, seed++);
      CUDA_CHECK(cudaMemcpy(*p, pinned, static_cast<size_t>(set_bytes), cudaMemcpyHostToDevice));
    }
  }
  FillRandom(pinned, set_floats, seed++);
  std::vector<float> pageable(kPageableBytes / 4);
  FillRandom(pageable.data(), static_cast<int64_t>(pageable.size()), seed++);
  CUDA_CHECK(cudaDeviceSynchronize());

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto stream_wait = [&] { CUDA_CHECK(cudaStreamSynchronize(stream)); CUDA_CHECK(cudaGetLastError()); };
  auto device_wait = [&](Stream s) { return [&, s] { CheckOk(device->Synchronize(s), "Synchronize"); }; };

  std::vector<Row> rows;
  bool all_verified = true;

  // --- Ceilings --------------------------------------------------------------
  std::fprintf(stderr, "cuda_bench: ceilings...\n");
  auto copy_row = [&](const char* op, const char* index, int64_t bytes, double moved_per_byte, cudaMemcpyKind kind,
                      std::function<std::pair<void*, const void*>(int64_t)> ptrs, double min_batch) {
    Row r = MakeRow(op, index, static_cast<double>(bytes) / kMiB, 0, 1);
    r.moved = moved_per_byte * static_cast<double>(bytes);
    const int64_t k = BatchCalls(r.moved, min_batch, 4);
    r.t = TimeBatches(reps, k, [&](int64_t i) {
      const auto [dst, src] = ptrs(i);
      CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream));
    }, stream_wait);
    return r;
  };
  // Bring the clocks up before the first figure: ~0.5 s of 1 GiB copies.
  {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500); ++i) {
      for (int j = 0; j < 8; ++j) {
        CUDA_CHECK(cudaMemcpyAsync(sets[j % 2].buffer, sets[j % 2].table, kGiB, cudaMemcpyDeviceToDevice, stream));
      }
      stream_wait();
    }
  }
  Row d2d = copy_row("d2d-copy", "ceiling", kGiB, 2, cudaMemcpyDeviceToDevice,
                     [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].buffer, sets[i % 2].table); },
                     4.0 * kGiB);
  Row h2d = copy_row("h2d-pinned", "ceiling", kGiB, 1, cudaMemcpyHostToDevice,
                     [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].table, pinned); },
                     1.0 * kGiB);
  Row d2h = copy_row("d2h-pinned", "ceiling", kGiB, 1, cudaMemcpyDeviceToHost,
                     [&](int64_t i) { return std::pair<void*, const void*>(pinned, sets[i % 2].table); },
                     1.0 * kGiB);
  Row h2d_pageable = copy_row("h2d-pageable", "ceiling", kPageableBytes, 1, cudaMemcpyHostToDevice,
                              [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].table, pageable.data()); },
                              1.0 * kGiB);
  Row d2h_pageable = copy_row("d2h-pageable", "reference", kPageableBytes, 1, cudaMemcpyDeviceToHost,
                              [&](int64_t i) { return std::pair<void*, const void*>(pageable.data(), sets[i % 2].table); },
                              1.0 * kGiB);
  const double d2d_ceiling = d2d.gbps(), h2d_ceiling = h2d.gbps(), d2h_ceiling = d2h.gbps();
  for (Row* r : {&d2d, &h2d, &d2h, &h2d_pageable, &d2h_pageable}) rows.push_back(*r);

  std::mt19937_64 rng(42);
  for (size_t size_i = 0; size_i < sizes_mb.size(); ++size_i) {
    const int64_t mb = sizes_mb[size_i];
    const int64_t bytes = mb * kMiB;
    const bool verify = size_i == 0 || options.verify_all;

    // Reference: the plain D2D copy at this size.
    {
      Row r = copy_row("copy", "memcpy", bytes, 2, cudaMemcpyDeviceToDevice,
                       [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].buffer, sets[i % 2].table); },
                       4.0 * kGiB);
      r.ceiling = d2d_ceiling;
      rows.push_back(r);
    }

    // --- Gather / ScatterAdd through the Device ------------------------------
    for (const int64_t width : options.widths) {
      const int64_t num_rows = bytes / 4 / width;
      if (num_rows < 1) continue;
      const int64_t floats = num_rows * width;
      const double payload = static_cast<double>(floats) * 4;
      std::fprintf(stderr, "cuda_bench: gather/scatter-add %lld MB width %lld...\n", static_cast<long long>(mb),
                   static_cast<long long>(width));
      auto shapes = MakeIndexShapes(num_rows, kLayers, rng);
      for (const auto& shape : shapes) {
        const std::string& shape_name = shape.first;
        const std::vector<Triple>& triples = shape.second;
        RunIndex gather, scatter;
        for (const Triple& t : triples) {
          gather.runs.push_back(RowRun{t.table_row, t.buffer_row, t.count});   // table -> buffer
          scatter.runs.push_back(RowRun{t.buffer_row, t.table_row, t.count});  // buffer -> table
        }
        CheckOk(device->PrepareIndex(&gather), "PrepareIndex");
        CheckOk(device->PrepareIndex(&scatter), "PrepareIndex");
        const int64_t runs = static_cast<int64_t>(triples.size());

        if (verify) {
          std::vector<float> table(floats), buffer(floats), before(floats);
          // Gather into a poisoned buffer.
          CUDA_CHECK(cudaMemset(sets[0].buffer, 0xFF, static_cast<size_t>(payload)));
          CUDA_CHECK(cudaDeviceSynchronize());
          device->Gather(sets[0].buffer, sets[0].table, gather, width, Stream::kPrefetch);
          CheckOk(device->Synchronize(Stream::kPrefetch), "Gather");
          CUDA_CHECK(cudaMemcpy(table.data(), sets[0].table, static_cast<size_t>(payload), cudaMemcpyDeviceToHost));
          CUDA_CHECK(cudaMemcpy(buffer.data(), sets[0].buffer, static_cast<size_t>(payload), cudaMemcpyDeviceToHost));
          int64_t bad = 0, first = -1;
          float got = 0, want = 0;
          for (const Triple& t : triples) {
            for (int64_t j = 0; j < t.count * width; ++j) {
              const float g = buffer[t.buffer_row * width + j], w = table[t.table_row * width + j];
              if (!SameBits(g, w) && bad++ == 0) first = t.buffer_row * width + j, got = g, want = w;
            }
          }
          const std::string what = "gather " + shape_name + " width " + std::to_string(width);
          all_verified &= Report(what.c_str(), bad, first, got, want);
          // ScatterAdd the (random) buffer into the table.
          before = table;
          device->ScatterAdd(sets[0].table, sets[0].buffer, scatter, width, Stream::kWriteback);
          CheckOk(device->Synchronize(Stream::kWriteback), "ScatterAdd");
          CUDA_CHECK(cudaMemcpy(table.data(), sets[0].table, static_cast<size_t>(payload), cudaMemcpyDeviceToHost));
          std::vector<float> want_table = before;
          for (const Triple& t : triples) {
            for (int64_t j = 0; j < t.count * width; ++j) {
              want_table[t.table_row * width + j] = before[t.table_row * width + j] + buffer[t.buffer_row * width + j];
            }
          }
          bad = 0;
          for (int64_t j = 0; j < floats; ++j) {
            if (!SameBits(table[j], want_table[j]) && bad++ == 0) first = j, got = table[j], want = want_table[j];
          }
          const std::string what2 = "scatter-add " + shape_name + " width " + std::to_string(width);
          all_verified &= Report(what2.c_str(), bad, first, got, want);
        }

        Row g = MakeRow("gather", shape_name, static_cast<double>(mb), width, runs);
        g.moved = 2 * payload;
        g.ceiling = d2d_ceiling;
        g.goal = 0.85;
        g.t = TimeBatches(reps, BatchCalls(g.moved, 4.0 * kGiB, 4), [&](int64_t i) {
          device->Gather(sets[i % 2].buffer, sets[i % 2].table, gather, width, Stream::kPrefetch);
        }, device_wait(Stream::kPrefetch));
        rows.push_back(g);

        Row s = MakeRow("scatter-add", shape_name, static_cast<double>(mb), width, runs);
        s.moved = 3 * payload;
        s.ceiling = d2d_ceiling;
        s.goal = 0.80;
        s.t = TimeBatches(reps, BatchCalls(s.moved, 4.0 * kGiB, 4), [&](int64_t i) {
          device->ScatterAdd(sets[i % 2].table, sets[i % 2].buffer, scatter, width, Stream::kWriteback);
        }, device_wait(Stream::kWriteback));
        rows.push_back(s);

        device->ReleaseIndex(&gather);
        device->ReleaseIndex(&scatter);
      }
    }

    // --- Swap traffic: per-run Device copies to/from pinned memory ------------
    // (offset bytes on host, offset bytes on device, length) per copy.
    struct Piece { int64_t host, dev, len; };
    std::vector<std::pair<std::pair<std::string, int64_t>, std::vector<Piece>>> swaps;
    {
      std::vector<Piece> layers;
      const int64_t units = bytes / 16;  // 16-byte aligned blocks
      std::vector<int64_t> begin(kLayers + 1);
      for (int64_t l = 0; l <= kLayers; ++l) begin[l] = units * l / kLayers * 16;
      int64_t dev = 0;
      for (int64_t l = kLayers - 1; l >= 0; --l) {
        const int64_t len = begin[l + 1] - begin[l];
        layers.push_back({begin[l], dev, len});
        dev += len;
      }
      swaps.push_back({{"layers", 0}, std::move(layers)});
    }
    for (const int64_t width : options.widths) {
      const int64_t chunk = kSwapRunRows * width * 4;
      const int64_t chunks = bytes / chunk;
      if (chunks < 1) continue;
      std::vector<int64_t> perm(chunks);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<Piece> pieces(chunks);
      for (int64_t c = 0; c < chunks; ++c) pieces[c] = {c * chunk, perm[c] * chunk, chunk};
      swaps.push_back({{"runs64", width}, std::move(pieces)});
    }
    for (const auto& swap : swaps) {  // no structured bindings: lambdas capture these
      const std::string& shape_name = swap.first.first;
      const int64_t width = swap.first.second;
      const std::vector<Piece>& pieces = swap.second;
      int64_t total = 0;
      for (const Piece& p : pieces) total += p.len;
      std::fprintf(stderr, "cuda_bench: swap %s %lld MB width %lld...\n", shape_name.c_str(),
                   static_cast<long long>(mb), static_cast<long long>(width));
      char* host = reinterpret_cast<char*>(pinned);
      auto h2d_call = [&](int64_t i) {
        char* dev = reinterpret_cast<char*>(sets[i % 2].table);
        for (const Piece& p : pieces) {
          device->CopyHostToDevice(dev + p.dev, host + p.host, static_cast<size_t>(p.len), Stream::kPrefetch);
        }
      };
      auto d2h_call = [&](int64_t i) {
        const char* dev = reinterpret_cast<const char*>(sets[i % 2].table);
        for (const Piece& p : pieces) {
          device->CopyDeviceToHost(host + p.host, dev + p.dev, static_cast<size_t>(p.len), Stream::kWriteback);
        }
      };
      // Verifies (once) and times a pair of calls that move `pieces` in
      // (host -> table of set i % 2) and out (that table -> host).
      const int64_t runs = static_cast<int64_t>(pieces.size());
      auto swap_rows = [&](const char* in_name, const char* out_name, const char* pieces_name,
                           const std::function<void(int64_t)>& in_call, Stream in_stream,
                           const std::function<void(int64_t)>& out_call, Stream out_stream) {
        const std::string where = " " + shape_name + " width " + std::to_string(width) + " (" + pieces_name + ")";
        if (verify) {
          std::vector<char> got(total), want(total);
          // In: into a poisoned table.
          CUDA_CHECK(cudaMemset(sets[0].table, 0xFF, static_cast<size_t>(total)));
          CUDA_CHECK(cudaDeviceSynchronize());
          in_call(0);
          CheckOk(device->Synchronize(in_stream), in_name);
          CUDA_CHECK(cudaMemcpy(got.data(), sets[0].table, static_cast<size_t>(total), cudaMemcpyDeviceToHost));
          int64_t bad = 0;
          for (const Piece& p : pieces) bad += std::memcmp(got.data() + p.dev, host + p.host, p.len) != 0;
          all_verified &= Report((in_name + where).c_str(), bad, 0, 0, 0);
          // Out: into poisoned pinned memory, from a re-randomized table.
          FillRandom(reinterpret_cast<float*>(want.data()), total / 4, seed++);
          CUDA_CHECK(cudaMemcpy(sets[0].table, want.data(), static_cast<size_t>(total), cudaMemcpyHostToDevice));
          std::memset(host, 0xFF, static_cast<size_t>(total));
          out_call(0);
          CheckOk(device->Synchronize(out_stream), out_name);
          bad = 0;
          for (const Piece& p : pieces) bad += std::memcmp(host + p.host, want.data() + p.dev, p.len) != 0;
          all_verified &= Report((out_name + where).c_str(), bad, 0, 0, 0);
        }
        auto timed = [&](const char* name, const std::function<void(int64_t)>& call, Stream stream, double ceiling) {
          Row row = MakeRow(name, shape_name, static_cast<double>(mb), width, runs);
          row.moved = static_cast<double>(total);
          row.ceiling = ceiling;
          row.goal = 0.85;
          row.t = TimeBatches(reps, BatchCalls(row.moved, 1.0 * kGiB, 1), call, device_wait(stream));
          rows.push_back(row);
        };
        timed(in_name, in_call, in_stream, h2d_ceiling);
        timed(out_name, out_call, out_stream, d2h_ceiling);
      };
      swap_rows("swap-h2d", "swap-d2h", "pieces", h2d_call, Stream::kPrefetch, d2h_call, Stream::kWriteback);

      // The same runs as ONE RunIndex, as the engine holds them.
      const int64_t row_floats = width > 0 ? width : 4;  // layers: 16-byte rows
      const int64_t row_bytes = row_floats * 4;
      RunIndex in_index, out_index;
      for (const Piece& p : pieces) {
        in_index.runs.push_back({p.host / row_bytes, p.dev / row_bytes, p.len / row_bytes});
        out_index.runs.push_back({p.dev / row_bytes, p.host / row_bytes, p.len / row_bytes});
      }

      // The engine's swaps: Device::SwapRuns, all runs of a swap in one
      // batched copy on the copy engines, on the low-priority swap streams.
      swap_rows(
          "swap-in-batch", "swap-out-batch", "runs",
          [&](int64_t i) {
            device->SwapRuns(sets[i % 2].table, pinned, in_index, row_floats, SwapDirection::kIn, Stream::kSwapIn);
          },
          Stream::kSwapIn,
          [&](int64_t i) {
            device->SwapRuns(pinned, sets[i % 2].table, out_index, row_floats, SwapDirection::kOut, Stream::kSwapOut);
          },
          Stream::kSwapOut);

      // Where the device maps host memory: the same runs moved by one kernel
      // launch that reads or writes the pinned memory in place (what the
      // CPU backend does; on CUDA it lost to the copy engines beside the
      // application's kernels, Device::swaps_by_kernel).
      // swap-in-kernel: Gather host -> device (a read's host rows);
      // swap-out-kernel: ScatterAdd device -> host (an update into the host
      // log; it also reads the log, so PCIe carries the payload each way).
      if (!device->maps_host_memory()) continue;
      CheckOk(device->PrepareIndex(&in_index), "PrepareIndex");
      CheckOk(device->PrepareIndex(&out_index), "PrepareIndex");
      auto in_call = [&](int64_t i) {
        device->Gather(sets[i % 2].table, pinned, in_index, row_floats, Stream::kSwapIn);
      };
      auto out_call = [&](int64_t i) {
        device->ScatterAdd(pinned, sets[i % 2].table, out_index, row_floats, Stream::kSwapOut);
      };
      if (verify) {
        CUDA_CHECK(cudaMemset(sets[0].table, 0xFF, static_cast<size_t>(total)));
        CUDA_CHECK(cudaDeviceSynchronize());
        in_call(0);
        CheckOk(device->Synchronize(Stream::kSwapIn), "Gather from mapped host memory");
        std::vector<char> got(total);
        CUDA_CHECK(cudaMemcpy(got.data(), sets[0].table, static_cast<size_t>(total), cudaMemcpyDeviceToHost));
        int64_t bad = 0;
        for (const Piece& p : pieces) bad += std::memcmp(got.data() + p.dev, host + p.host, p.len) != 0;
        std::string what = "swap-in-kernel " + shape_name + " width " + std::to_string(width) + " (runs)";
        all_verified &= Report(what.c_str(), bad, 0, 0, 0);
        // host += table, against a host reference of the same float adds.
        std::vector<float> want(static_cast<size_t>(total / 4));
        std::memcpy(want.data(), host, static_cast<size_t>(total));
        std::vector<float> table(static_cast<size_t>(total / 4));
        CUDA_CHECK(cudaMemcpy(table.data(), sets[0].table, static_cast<size_t>(total), cudaMemcpyDeviceToHost));
        for (const Piece& p : pieces) {
          for (int64_t k = 0; k < p.len / 4; ++k) want[p.host / 4 + k] += table[p.dev / 4 + k];
        }
        out_call(0);
        CheckOk(device->Synchronize(Stream::kSwapOut), "ScatterAdd into mapped host memory");
        bad = std::memcmp(want.data(), host, static_cast<size_t>(total)) != 0;
        what = "swap-out-kernel " + shape_name + " width " + std::to_string(width) + " (runs)";
        all_verified &= Report(what.c_str(), bad, 0, 0, 0);
        FillRandom(pinned, total / 4, seed++);  // keep the host values bounded for the timed adds
      }
      Row in = MakeRow("swap-in-kernel", shape_name, static_cast<double>(mb), width, runs);
      in.moved = static_cast<double>(total);
      in.ceiling = h2d_ceiling;
      in.goal = 0.85;
      in.t = TimeBatches(reps, BatchCalls(in.moved, 1.0 * kGiB, 1), in_call, device_wait(Stream::kSwapIn));
      rows.push_back(in);
      Row out = MakeRow("swap-out-kernel", shape_name, static_cast<double>(mb), width, runs);
      out.moved = static_cast<double>(total);
      out.ceiling = d2h_ceiling;
      out.goal = 0.85;
      out.t = TimeBatches(reps, BatchCalls(out.moved, 1.0 * kGiB, 1), out_call, device_wait(Stream::kSwapOut));
      rows.push_back(out);
      device->ReleaseIndex(&in_index);
      device->ReleaseIndex(&out_index);
    }
  }

  // The ceilings again, to show drift over the run (ratio to the first measurement).
  std::fprintf(stderr, "cuda_bench: ceilings again...\n");
  {
    Row again = copy_row("d2d-copy", "recheck", kGiB, 2, cudaMemcpyDeviceToDevice,
                         [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].buffer, sets[i % 2].table); },
                         4.0 * kGiB);
    again.ceiling = d2d_ceiling;
    rows.push_back(again);
    again = copy_row("h2d-pinned", "recheck", kGiB, 1, cudaMemcpyHostToDevice,
                     [&](int64_t i) { return std::pair<void*, const void*>(sets[i % 2].table, pinned); }, 1.0 * kGiB);
    again.ceiling = h2d_ceiling;
    rows.push_back(again);
    again = copy_row("d2h-pinned", "recheck", kGiB, 1, cudaMemcpyDeviceToHost,
                     [&](int64_t i) { return std::pair<void*, const void*>(pinned, sets[i % 2].table); }, 1.0 * kGiB);
    again.ceiling = d2h_ceiling;
    rows.push_back(again);
  }

  // --- Report ----------------------------------------------------------------
  Out("device_bench --device cuda: mltuner CUDA backend vs this GPU's own measured ceilings\n");
  Out("device: %s (cc %d.%d, %d SMs, L2 %.0f MB, %.1f GiB), driver %d.%d, runtime %d.%d\n", props.name, props.major,
      props.minor, props.multiProcessorCount, props.l2CacheSize / 1e6, props.totalGlobalMem / double(kGiB),
      driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
  Out("date: %s\n", Now().c_str());
  Out("GB/s = bytes moved / median time (1 GB = 1e9 B). Moved: d2d copy and gather = read + write = 2 x payload;\n"
      "scatter-add = read dst + read src + write dst = 3 x payload; host<->device = payload.\n"
      "ratio = GB/s / ceiling (gather, scatter-add, copy: d2d-copy 1 GiB; swap-h2d: h2d-pinned; swap-d2h: d2h-pinned).\n"
      "Median of %d timed batches after a warm-up batch; spread = (max - min) / median. Two buffer sets alternate.\n"
      "runs = Device calls' run count (gather/scatter-add/swap-*-kernel: RowRuns of one kernel; swap-h2d/d2h: one cudaMemcpyAsync each; swap-*-batch: one cudaMemcpyBatchAsync).\n",
      reps);
  Out("%-12s %-9s %6s %5s %8s %9s %9s %9s %6s %5s %4s %6s\n", "op", "index", "MB", "width", "runs", "ms", "GB/s",
      "ceil GB/s", "ratio", "goal", "met", "spread");
  for (const Row& r : rows) {
    char width[32] = "-", ceil[32] = "-", ratio[32] = "-", goal[32] = "-";
    if (r.width > 0) std::snprintf(width, sizeof(width), "%lld", static_cast<long long>(r.width));
    if (r.ceiling > 0) {
      std::snprintf(ceil, sizeof(ceil), "%.1f", r.ceiling);
      std::snprintf(ratio, sizeof(ratio), "%.3f", r.ratio());
    }
    if (r.goal > 0) std::snprintf(goal, sizeof(goal), "%.2f", r.goal);
    const char* met = r.goal > 0 ? (r.ratio() >= r.goal ? "yes" : "NO") : "-";
    Out("%-12s %-9s %6.0f %5s %8lld %9.3f %9.1f %9s %6s %5s %4s %5.1f%%\n", r.op.c_str(), r.index.c_str(), r.mb, width,
        static_cast<long long>(r.runs), r.t.median * 1e3, r.gbps(), ceil, ratio, goal, met,
        100 * (r.t.max - r.t.min) / r.t.median);
  }
  // Per (op, index): how many cells met the goal, and the range of ratios.
  Out("\nsummary (per op and index shape, over sizes and widths):\n");
  struct Agg { int met = 0, total = 0; double lo = 1e30, hi = 0; double goal = 0; };
  std::vector<std::pair<std::string, Agg>> aggs;
  for (const Row& r : rows) {
    if (r.goal <= 0) continue;
    const std::string key = r.op + " " + r.index;
    auto it = std::find_if(aggs.begin(), aggs.end(), [&](const auto& a) { return a.first == key; });
    if (it == aggs.end()) it = aggs.insert(aggs.end(), {key, Agg{}});
    Agg& a = it->second;
    a.goal = r.goal;
    a.total++;
    a.met += r.ratio() >= r.goal;
    a.lo = std::min(a.lo, r.ratio());
    a.hi = std::max(a.hi, r.ratio());
  }
  for (const auto& [key, a] : aggs) {
    Out("  %-22s goal %.2f: met %2d/%-2d  ratio %.3f .. %.3f\n", key.c_str(), a.goal, a.met, a.total, a.lo, a.hi);
  }
  Out("results verified against host references: %s\n", all_verified ? "all correct" : "SOME WRONG (see stderr)");

  if (!options.out_path.empty()) {
    std::ofstream out(options.out_path);
    out << report;
  }
  if (!options.csv_path.empty()) {
    std::ofstream csv(options.csv_path);
    csv << "op,index,table_mb,width,runs,median_s,min_s,max_s,moved_bytes,gbps,ceiling_gbps,ratio,goal\n";
    for (const Row& r : rows) {
      csv << r.op << ',' << r.index << ',' << r.mb << ',' << r.width << ',' << r.runs << ',' << r.t.median << ','
          << r.t.min << ',' << r.t.max << ',' << r.moved << ',' << r.gbps() << ',' << r.ceiling << ',' << r.ratio()
          << ',' << r.goal << '\n';
    }
  }

  CUDA_CHECK(cudaStreamDestroy(stream));
  for (Set& s : sets) {
    device->Free(s.table);
    device->Free(s.buffer);
  }
  device->FreeHost(pinned);
  CheckOk(device->Synchronize(Stream::kApp), "teardown");
  return all_verified ? 0 : 1;
}

}  // namespace mltuner_bench
