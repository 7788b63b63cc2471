#include <string>

#include "mltuner/device.h"

namespace mltuner {

Status CountIndexRows(const RunIndex& index, int64_t* total_rows) {
  int64_t total = 0;
  for (const RowRun& run : index.runs) {
    if (run.src < 0 || run.dst < 0 || run.count < 0) {
      return Status::InvalidArgument("row run {src " + std::to_string(run.src) + ", dst " + std::to_string(run.dst) +
                                     ", count " + std::to_string(run.count) + "} has a negative field");
    }
    total += run.count;
  }
  *total_rows = total;
  return Status::Ok();
}

}  // namespace mltuner
