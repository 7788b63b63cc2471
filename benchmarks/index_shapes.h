// The index shapes both device benchmarks time (device_bench.cc for the CPU
// backend, cuda_bench.cc for CUDA), so their figures compare like with like.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace mltuner_bench {

// (table row, buffer row, count): one run of an index.
struct Triple {
  int64_t table_row, buffer_row, count;
};

using IndexShapes = std::vector<std::pair<std::string, std::vector<Triple>>>;

// "layers": the rows cut into `layers` blocks, buffer block l taken from table
// block n-1-l (long runs, as the first-use row layout gives); "rows-seq": one
// run per row in order; "rows-shuf": one run per row in random order.
inline IndexShapes MakeIndexShapes(int64_t num_rows, int64_t layers, std::mt19937_64& rng) {
  IndexShapes shapes;
  {
    std::vector<Triple> blocks;
    const int64_t n = std::min(layers, num_rows);
    std::vector<int64_t> begin(n + 1);
    for (int64_t l = 0; l <= n; ++l) begin[l] = num_rows * l / n;
    int64_t buffer_row = 0;
    for (int64_t l = n - 1; l >= 0; --l) {
      const int64_t count = begin[l + 1] - begin[l];
      blocks.push_back({begin[l], buffer_row, count});
      buffer_row += count;
    }
    shapes.emplace_back("layers", std::move(blocks));
  }
  {
    std::vector<Triple> seq(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) seq[r] = {r, r, 1};
    shapes.emplace_back("rows-seq", std::move(seq));
  }
  {
    std::vector<int64_t> perm(num_rows);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<Triple> shuf(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) shuf[r] = {perm[r], r, 1};
    shapes.emplace_back("rows-shuf", std::move(shuf));
  }
  return shapes;
}

}  // namespace mltuner_bench
