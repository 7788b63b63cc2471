// cuda_bench: the `--device cuda` mode of device_bench. Built only when the
// CUDA backend (TARGET mltuner_cuda) is built; device_bench.cc then defines
// MLTUNER_WITH_CUDA and calls RunCudaBench. See cuda_bench.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mltuner_bench {

struct CudaBenchOptions {
  std::vector<int64_t> sizes_mb = {64, 256, 1024};  // table sizes
  std::vector<int64_t> widths = {128, 512, 1024, 4096};  // row widths, floats
  int reps = 7;               // timed batches per figure (the median is reported)
  int ordinal = 0;            // which GPU
  bool verify_all = false;    // verify at every size, not only the smallest
  std::string csv_path;       // optional CSV of every row
  std::string out_path;       // optional copy of the printed report
};

// Returns the process exit code: 0 when every result verified (goals missed
// are reported, not failures), 1 on a CUDA error or a wrong result.
int RunCudaBench(const CudaBenchOptions& options);

}  // namespace mltuner_bench
