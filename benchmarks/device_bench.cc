// device_bench: the CPU backend's Gather and ScatterAdd kernels and its
// update rules (ApplyUpdate), timed against std::memcpy and a plain
// "a += b" loop over the same bytes in the same run. No Python, no engine
// threads: just Device calls over prebuilt RunIndex lists, the way the
// allocator (reads) and the reclaimer (updates) issue them, and the rule
// steps a shard takes (once per table size, at the first width).
//
// For each table size and row width three index shapes are timed:
//   layers    one run per "layer": the rows cut into 20 equal blocks, taken
//             from the table in reverse block order (a real gather, but each
//             run is one long memcpy);
//   rows-seq  one run per row, rows in order: the per-run overhead alone;
//   rows-shuf one run per row, rows in a random order: per-run overhead plus
//             the lost hardware prefetch of a scattered access pattern.
//
// Build:  cmake -S benchmarks -B build/bench -DCMAKE_BUILD_TYPE=Release
//         cmake --build build/bench
// Run:    build/bench/device_bench [--sizes 1,16,64,256] [--widths 128,512,1024,4096]
//                                  [--min-time 0.25] [--csv PATH]
//
// --device cuda (built when the CUDA backend is, see CMakeLists.txt) times
// the CUDA backend instead, against the GPU's own measured copy ceilings:
//         build/bench/device_bench --device cuda [--sizes 64,256,1024] [--widths ...]
//                                  [--reps 7] [--gpu 0] [--verify-all] [--out PATH] [--csv PATH]
// (see cuda_bench.cc).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "index_shapes.h"
#include "mltuner/device.h"
#include "mltuner/update_step.h"

#ifdef MLTUNER_WITH_CUDA
#include "cuda_bench.h"
#endif

namespace {

using mltuner::Device;
using mltuner::RowRun;
using mltuner::RunIndex;
using mltuner::Stream;

std::vector<int64_t> ParseList(const std::string& text) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(std::stoll(item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// The baseline for scatter-add: dst += src over n floats, a loop the compiler
// vectorises (noinline so it is timed as a call, like the device kernels).
__attribute__((noinline)) void AddLoop(float* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Best (smallest) time of one call of each case, after one untimed warm-up
// call each; cases are called round-robin for at least 3 rounds and until each
// has had about min_time seconds.
template <typename Case>
std::vector<double> BestSecondsRoundRobin(const std::vector<Case>& cases, double min_time) {
  for (const Case& c : cases) c.fn();
  std::vector<double> best(cases.size(), 1e30);
  double total = 0;
  for (int round = 0; round < 3 || (total < min_time * cases.size() && round < 1000); ++round) {
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      cases[i].fn();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best[i] = std::min(best[i], s);
      total += s;
    }
  }
  return best;
}

float* AllocFloats(Device* device, int64_t count, float value) {
  void* p = nullptr;
  const mltuner::Status status = device->Allocate(static_cast<size_t>(count) * sizeof(float), &p);
  if (!status.ok()) {
    std::fprintf(stderr, "device_bench: %s\n", status.ToString().c_str());
    std::exit(1);
  }
  float* f = static_cast<float*>(p);
  std::fill_n(f, count, value);  // touches every page before timing
  return f;
}

struct Row {
  std::string op, variant;
  double table_mb;
  int64_t width, runs;
  double seconds, payload_bytes, moved_bytes, vs_memcpy, vs_memcpy_moved, vs_add;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes_mb = {1, 16, 64, 256};
  std::vector<int64_t> widths = {128, 512, 1024, 4096};
  double min_time = 0.25;
  std::string csv_path;
  // --device cuda only.
  std::string device_kind = "cpu";
  bool sizes_given = false;
  int reps = 7, gpu = 0;
  bool verify_all = false;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "device_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--sizes") {
      sizes_mb = ParseList(value());
      sizes_given = true;
    } else if (arg == "--device") {
      device_kind = value();
    } else if (arg == "--reps") {
      reps = std::stoi(value());
    } else if (arg == "--gpu") {
      gpu = std::stoi(value());
    } else if (arg == "--verify-all") {
      verify_all = true;
    } else if (arg == "--out") {
      out_path = value();
    } else if (arg == "--widths") {
      widths = ParseList(value());
    } else if (arg == "--min-time") {
      min_time = std::stod(value());
    } else if (arg == "--csv") {
      csv_path = value();
    } else {
      std::printf(
          "usage: device_bench [--device cpu|cuda] [--sizes MB,MB,...] [--widths FLOATS,...] [--csv PATH]\n"
          "         cpu:  [--min-time SECONDS]            (default sizes 1,16,64,256)\n"
          "         cuda: [--reps N] [--gpu ORDINAL] [--verify-all] [--out PATH]  (default sizes 64,256,1024)\n"
          "  the cuda mode is %s in this build\n",
#ifdef MLTUNER_WITH_CUDA
          "available"
#else
          "NOT available (no CUDA compiler / MLTUNER_CUDA=OFF)"
#endif
      );
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }

  if (device_kind == "cuda") {
#ifdef MLTUNER_WITH_CUDA
    mltuner_bench::CudaBenchOptions options;
    if (sizes_given) options.sizes_mb = sizes_mb;
    options.widths = widths;
    options.reps = reps;
    options.ordinal = gpu;
    options.verify_all = verify_all;
    options.csv_path = csv_path;
    options.out_path = out_path;
    return mltuner_bench::RunCudaBench(options);
#else
    (void)reps, (void)gpu, (void)verify_all, (void)sizes_given;
    std::fprintf(stderr, "device_bench: built without the CUDA backend; --device cuda is not available\n");
    return 2;
#endif
  }
  if (device_kind != "cpu") {
    std::fprintf(stderr, "device_bench: --device must be cpu or cuda, not '%s'\n", device_kind.c_str());
    return 2;
  }

  std::unique_ptr<Device> device = mltuner::NewCpuDevice();
  std::vector<Row> rows;
  std::mt19937_64 rng(42);
  constexpr int64_t kLayers = 20;

  for (const int64_t mb : sizes_mb) {
    for (const int64_t width : widths) {
      const int64_t table_floats = mb * (int64_t{1} << 20) / 4;
      const int64_t num_rows = table_floats / width;
      if (num_rows < 1) continue;
      const int64_t floats = num_rows * width;
      const double payload = static_cast<double>(floats) * sizeof(float);
      float* table = AllocFloats(device.get(), floats, 1.0f);   // cache values / update log
      float* buffer = AllocFloats(device.get(), floats, 0.5f);  // the access buffer
      const bool rules = width == widths.front();
      float* state = rules ? AllocFloats(device.get(), 2 * floats, 0.0f) : nullptr;  // a rule's arrays

      const mltuner_bench::IndexShapes shapes = mltuner_bench::MakeIndexShapes(num_rows, kLayers, rng);
      std::vector<RunIndex> gathers(shapes.size()), scatters(shapes.size());
      for (size_t k = 0; k < shapes.size(); ++k) {
        for (const mltuner_bench::Triple& t : shapes[k].second) {
          gathers[k].runs.push_back(RowRun{t.table_row, t.buffer_row, t.count});   // table -> buffer
          scatters[k].runs.push_back(RowRun{t.buffer_row, t.table_row, t.count});  // buffer -> log
        }
        if (!device->PrepareIndex(&gathers[k]).ok() || !device->PrepareIndex(&scatters[k]).ok()) {
          std::fprintf(stderr, "device_bench: PrepareIndex failed\n");
          return 1;
        }
      }

      // Every kernel of the cell, timed round-robin so that noise from other
      // processes hits the baselines and the kernels alike.
      struct Case { std::string op, variant; int64_t runs; double passes; std::function<void()> fn; };
      std::vector<Case> cases;
      cases.push_back({"memcpy", "baseline", 1, 2,
                       [&] { std::memcpy(buffer, table, static_cast<size_t>(payload)); }});
      cases.push_back({"a+=b", "baseline", 1, 3, [&] { AddLoop(table, buffer, floats); }});
      for (size_t k = 0; k < shapes.size(); ++k) {
        const int64_t runs = static_cast<int64_t>(shapes[k].second.size());
        cases.push_back({"gather", shapes[k].first, runs, 2, [&, k] {
                           device->Gather(buffer, table, gathers[k], width, Stream::kPrefetch);
                           (void)device->Synchronize(Stream::kPrefetch);
                         }});
        cases.push_back({"scatter-add", shapes[k].first, runs, 3, [&, k] {
                           device->ScatterAdd(table, buffer, scatters[k], width, Stream::kWriteback);
                           (void)device->Synchronize(Stream::kWriteback);
                         }});
      }
      // A shard's step of each rule over the table (buffer = the summed
      // update); passes = arrays read + arrays written.
      struct RuleCase { const char* name; mltuner::UpdateRuleKind kind; float momentum; double passes; };
      const RuleCase rule_cases[] = {{"add", mltuner::UpdateRuleKind::kAdd, 0, 3},
                                     {"sgd+mom", mltuner::UpdateRuleKind::kSgd, 0.9f, 5},
                                     {"damped", mltuner::UpdateRuleKind::kDampedMomentum, 0.9f, 5},
                                     {"adam", mltuner::UpdateRuleKind::kAdam, 0, 7}};
      for (const RuleCase& rc : rule_cases) {
        if (!rules) break;  // timed once per size: at its first width
        mltuner::UpdateRuleConfig config;
        config.kind = rc.kind;
        config.learning_rate = 1e-4f;
        config.momentum = rc.momentum;
        const mltuner::UpdateStep step = mltuner::MakeUpdateStep(config, 2, 3);
        cases.push_back({"rule", rc.name, 1, rc.passes, [&, step] {
                           device->ApplyUpdate(step, table, state, buffer, floats, floats, Stream::kServer);
                         }});
      }
      std::vector<double> best = BestSecondsRoundRobin(cases, min_time);
      const double t_memcpy = best[0], t_add = best[1];
      for (size_t c = 0; c < cases.size(); ++c) {
        const double s = best[c];
        const double passes = cases[c].passes;
        rows.push_back({cases[c].op, cases[c].variant, static_cast<double>(mb), width, cases[c].runs, s, payload,
                        passes * payload, t_memcpy / s, (passes * payload / s) / (2 * payload / t_memcpy),
                        t_add / s});
      }
      for (size_t k = 0; k < shapes.size(); ++k) {
        device->ReleaseIndex(&gathers[k]);
        device->ReleaseIndex(&scatters[k]);
      }
      device->Free(table);
      device->Free(buffer);
      if (state != nullptr) device->Free(state);
    }
  }

  std::printf(
      "device_bench: CPU backend Gather / ScatterAdd vs std::memcpy and an 'a += b' loop, same buffers, same run.\n"
      "  payload GB/s = table bytes / time (the bytes the application asked for).\n"
      "  moved GB/s   = memory traffic / time: memcpy and gather read + write = 2 x payload;\n"
      "                 a+=b and scatter-add read dst + read src + write dst = 3 x payload.\n"
      "  x memcpy     = memcpy time / op time for the same payload (= ratio of payload GB/s).\n"
      "  x memcpy(mv) = ratio of moved GB/s to memcpy's moved GB/s (scatter-add: 1.5 x the payload ratio).\n"
      "  x a+=b       = a+=b loop time / op time for the same payload.\n"
      "  rule rows    = one server step of the rule over the table (ApplyUpdate), at the first width only;\n"
      "                 moved = arrays read + written (add 3, sgd with momentum and damped momentum 5, adam 7).\n"
      "  Times are the best of >= 3 calls (>= %.2f s per figure), single thread.\n",
      min_time);
  std::printf("%-11s %-9s %6s %5s %8s %9s %8s %8s %8s %8s %7s\n", "op", "index", "MB", "width", "runs", "ms",
              "payGB/s", "movGB/s", "x memcpy", "x mc(mv)", "x a+=b");
  for (const Row& r : rows) {
    std::printf("%-11s %-9s %6.0f %5lld %8lld %9.3f %8.2f %8.2f %8.2f %8.2f %7.2f\n", r.op.c_str(),
                r.variant.c_str(), r.table_mb, static_cast<long long>(r.width), static_cast<long long>(r.runs),
                r.seconds * 1e3, r.payload_bytes / r.seconds / 1e9, r.moved_bytes / r.seconds / 1e9, r.vs_memcpy,
                r.vs_memcpy_moved, r.vs_add);
  }
  if (!csv_path.empty()) {
    std::ofstream csv(csv_path);
    csv << "op,index,table_mb,width,runs,seconds,payload_gbps,moved_gbps,x_memcpy,x_memcpy_moved,x_add\n";
    for (const Row& r : rows) {
      csv << r.op << ',' << r.variant << ',' << r.table_mb << ',' << r.width << ',' << r.runs << ',' << r.seconds
          << ',' << r.payload_bytes / r.seconds / 1e9 << ',' << r.moved_bytes / r.seconds / 1e9 << ','
          << r.vs_memcpy << ',' << r.vs_memcpy_moved << ',' << r.vs_add << '\n';
    }
  }
  return 0;
}
