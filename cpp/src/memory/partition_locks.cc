// PartitionLocks: shared/exclusive locks over contiguous row partitions
// (see partition_locks.h).
#include "memory/partition_locks.h"

#include <algorithm>
#include <cassert>

namespace mltuner {

PartitionLocks::PartitionLocks(int64_t num_rows, int num_partitions) : num_rows_(num_rows) {
  assert(num_rows >= 0 && num_partitions >= 1);
  if (num_partitions < 1) num_partitions = 1;
  // Ceil division so the partitions cover every row; at least one row each so
  // an empty table still maps every row id to partition 0.
  rows_per_partition_ = std::max<int64_t>(1, (std::max<int64_t>(num_rows_, 0) + num_partitions - 1) / num_partitions);
  mutexes_.reserve(num_partitions);
  for (int i = 0; i < num_partitions; ++i) mutexes_.push_back(std::make_unique<std::shared_mutex>());
}

int PartitionLocks::PartitionOf(int64_t row) const {
  // Clamp rather than index out of range: a row id past the end (or a table
  // with fewer rows than partitions) still lands on a real mutex.
  if (row <= 0) return 0;
  const int64_t partition = row / rows_per_partition_;
  return static_cast<int>(std::min<int64_t>(partition, num_partitions() - 1));
}

PartitionLocks::Guard PartitionLocks::LockShared(int64_t begin, int64_t count) {
  if (count <= 0) return Guard(this, 0, -1, false);
  return Guard(this, PartitionOf(begin), PartitionOf(begin + (count - 1)), false);
}

PartitionLocks::Guard PartitionLocks::LockExclusive(int64_t begin, int64_t count) {
  if (count <= 0) return Guard(this, 0, -1, true);
  return Guard(this, PartitionOf(begin), PartitionOf(begin + (count - 1)), true);
}

// Locks in ascending partition order: any two guards then acquire their
// common partitions in the same order, which rules out deadlock.
PartitionLocks::Guard::Guard(PartitionLocks* owner, int first, int last, bool exclusive)
    : owner_(owner), first_(first), last_(last), exclusive_(exclusive) {
  for (int p = first_; p <= last_; ++p) {
    std::shared_mutex& mu = *owner_->mutexes_[p];
    if (exclusive_) {
      mu.lock();
    } else {
      mu.lock_shared();
    }
  }
}

PartitionLocks::Guard::Guard(Guard&& other) noexcept
    : owner_(other.owner_), first_(other.first_), last_(other.last_), exclusive_(other.exclusive_) {
  // The moved-from guard holds nothing, so its destructor unlocks nothing.
  other.owner_ = nullptr;
  other.first_ = 0;
  other.last_ = -1;
}

PartitionLocks::Guard::~Guard() {
  if (owner_ == nullptr) return;
  for (int p = last_; p >= first_; --p) {
    std::shared_mutex& mu = *owner_->mutexes_[p];
    if (exclusive_) {
      mu.unlock();
    } else {
      mu.unlock_shared();
    }
  }
}

}  // namespace mltuner
