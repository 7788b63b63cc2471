#include "cluster/byte_ranges.h"

#include <iterator>
#include <string>

namespace mltuner {

namespace {

uint64_t RoundUp(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }

std::string Range(uint64_t offset, uint64_t bytes) {
  return "bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ")";
}

}  // namespace

bool ByteRanges::FindFree(uint64_t bytes, uint64_t alignment, uint64_t* offset) const {
  if (bytes == 0 || alignment == 0 || bytes > capacity_) return false;
  uint64_t candidate = 0;
  for (const auto& [begin, size] : used_ranges_) {
    if (begin >= candidate && begin - candidate >= bytes) break;
    candidate = RoundUp(begin + size, alignment);
    if (candidate > capacity_) return false;
  }
  if (capacity_ - candidate < bytes) return false;
  *offset = candidate;
  return true;
}

Status ByteRanges::Claim(uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return Status::CorruptMessage("an empty range at byte " + std::to_string(offset));
  if (offset > capacity_ || bytes > capacity_ - offset) {
    return Status::CorruptMessage(Range(offset, bytes) + " reach past the region's " + std::to_string(capacity_) +
                                  " bytes");
  }
  auto next = used_ranges_.lower_bound(offset);
  if (next != used_ranges_.end() && next->first < offset + bytes) {
    return Status::CorruptMessage(Range(offset, bytes) + " overlap " + Range(next->first, next->second) +
                                  ", still in use");
  }
  if (next != used_ranges_.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second > offset) {
      return Status::CorruptMessage(Range(offset, bytes) + " overlap " + Range(before->first, before->second) +
                                    ", still in use");
    }
  }
  used_ranges_.emplace_hint(next, offset, bytes);
  used_ += bytes;
  return Status::Ok();
}

Status ByteRanges::Free(uint64_t offset, uint64_t bytes) {
  auto found = used_ranges_.find(offset);
  if (found == used_ranges_.end() || found->second != bytes) {
    return Status::CorruptMessage(Range(offset, bytes) + " are not a range in use");
  }
  used_ranges_.erase(found);
  used_ -= bytes;
  return Status::Ok();
}

}  // namespace mltuner
