// PartitionLocks: reader/writer locks over contiguous partitions of a row
// range (geeps.md §3 "Locks").
//
// The client cache of a table is split into partitions of equal row counts.
// The allocator thread takes shared locks on the partitions a gather reads;
// the receive thread takes an exclusive lock on the partitions it installs
// fresh rows into. Partitions are always locked in ascending order, so two
// guards can never deadlock. A gather therefore never sees a partition half
// old and half new.
// Thread safety: all methods are safe to call concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <vector>

namespace mltuner {

class PartitionLocks {
 public:
  // REQUIRES: num_rows >= 0, num_partitions >= 1.
  PartitionLocks(int64_t num_rows, int num_partitions);
  PartitionLocks(const PartitionLocks&) = delete;
  PartitionLocks& operator=(const PartitionLocks&) = delete;

  // RAII: releases the partitions it holds when destroyed.
  class Guard {
   public:
    Guard(Guard&& other) noexcept;
    Guard& operator=(Guard&&) = delete;
    Guard(const Guard&) = delete;
    ~Guard();

   private:
    friend class PartitionLocks;
    Guard(PartitionLocks* owner, int first, int last, bool exclusive);
    PartitionLocks* owner_;
    int first_;
    int last_;  // inclusive; first_ > last_ holds nothing
    bool exclusive_;
  };

  // Locks every partition that rows [begin, begin+count) touch.
  Guard LockShared(int64_t begin, int64_t count);
  Guard LockExclusive(int64_t begin, int64_t count);

  int num_partitions() const { return static_cast<int>(mutexes_.size()); }
  int PartitionOf(int64_t row) const;

 private:
  const int64_t num_rows_;
  int64_t rows_per_partition_;
  std::vector<std::unique_ptr<std::shared_mutex>> mutexes_;
};

}  // namespace mltuner
