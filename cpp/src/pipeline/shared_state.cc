#include "pipeline/shared_state.h"

namespace mltuner {

void SharedState::Fail(const Status& status) {
  {
    MutexLock lock(&mu);
    if (background_error.ok()) background_error = status;
    stopping = true;
  }
  cv.NotifyAll();
  age_cv.NotifyAll();
}

mltuner::Clock SharedState::DataAge(TableId table) const {
  MutexLock lock(&age_mu);
  if (table < 0 || table >= static_cast<TableId>(data_age.size())) return kNoClock;
  return data_age[table];
}

std::string ThreadContext(int rank, const char* thread) {
  return "worker " + std::to_string(rank) + "'s " + thread + " thread";
}

}  // namespace mltuner
