// ByteRanges: which byte ranges of one fixed region are in use. The sender
// of CUDA IPC payloads places each in a free range of its slice of the
// receiver's landing region (FindFree, Claim) and frees it when the
// receiver's release comes back; the receiver claims the range a notice
// names, which refuses a range outside the slice or one still in use, and
// frees it once the payload is read. Releases may come in any order (a
// shard keeps updates until every worker's are in; the installer takes rows
// at once), so this is a first-fit set of ranges, not a ring.
//
// Threading: none of its own; callers hold a lock.
#pragma once

#include <cstdint>
#include <map>

#include "mltuner/status.h"

namespace mltuner {

class ByteRanges {
 public:
  explicit ByteRanges(uint64_t capacity) : capacity_(capacity) {}

  // The lowest offset, a multiple of `alignment` (> 0), where `bytes` (> 0)
  // fit between the ranges in use; false when nowhere.
  bool FindFree(uint64_t bytes, uint64_t alignment, uint64_t* offset) const;
  // Marks [offset, offset + bytes) used. kCorruptMessage naming the problem
  // when it is empty, reaches past the capacity (overflow included), or
  // overlaps a range in use.
  Status Claim(uint64_t offset, uint64_t bytes);
  // Frees exactly a range claimed before; kCorruptMessage for any other.
  Status Free(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  size_t ranges() const { return used_ranges_.size(); }

 private:
  const uint64_t capacity_;
  std::map<uint64_t, uint64_t> used_ranges_;  // offset -> bytes, disjoint
  uint64_t used_ = 0;
};

}  // namespace mltuner
