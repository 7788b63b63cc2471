// Arena: next-fit sub-allocation over one region (see arena.h).
//
// Live blocks sit in an ordered map offset -> size; holes are the gaps
// between them. A search first looks for a hole at or after next_ (the end of
// the last allocation), then wraps once to offset 0. Because the engine
// allocates and frees access buffers in the same order every clock, this
// walks the region like a ring: the hole just ahead is usually the one the
// oldest buffer left.
#include "memory/arena.h"

#include <algorithm>
#include <cassert>
#include <iterator>
#include <string>

namespace mltuner {

namespace {

// First offset >= start where `bytes` fit between the live blocks and the end
// of the region; false when there is none. `start` and every block boundary
// are multiples of the alignment, so the result is too.
bool FirstFitFrom(const std::map<size_t, size_t>& blocks, size_t capacity, size_t start, size_t bytes,
                  size_t* offset) {
  size_t pos = start;
  auto it = blocks.upper_bound(pos);
  if (it != blocks.begin()) {
    // The block before `start` may cover it; the hole begins at its end.
    auto prev = std::prev(it);
    if (prev->first + prev->second > pos) pos = prev->first + prev->second;
  }
  for (;; ++it) {
    const size_t hole_end = it == blocks.end() ? capacity : it->first;
    if (hole_end >= pos && hole_end - pos >= bytes) {
      *offset = pos;
      return true;
    }
    if (it == blocks.end()) return false;
    if (it->first + it->second > pos) pos = it->first + it->second;
  }
}

}  // namespace

Arena::Arena(size_t capacity, size_t alignment) : capacity_(capacity), alignment_(alignment) {
  assert(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0 && "alignment must be a power of two");
}

// Finds room for `bytes` (already rounded) and reserves it. Called with mu_
// held, hence the name.
bool Arena::FindLocked(size_t bytes, size_t* offset) {
  size_t found = 0;
  const bool fits = FirstFitFrom(blocks_, capacity_, next_, bytes, &found) ||
                    (next_ != 0 && FirstFitFrom(blocks_, capacity_, 0, bytes, &found));
  if (!fits) return false;
  blocks_.emplace(found, bytes);
  used_ += bytes;
  next_ = found + bytes;
  *offset = found;
  return true;
}

Status Arena::Allocate(size_t bytes, std::chrono::milliseconds timeout, size_t* offset) {
  if (bytes == 0) return Status::InvalidArgument("Arena::Allocate of 0 bytes");
  // Compare before rounding so a huge request cannot overflow the rounding.
  const size_t rounded = bytes > capacity_ ? 0 : (bytes + alignment_ - 1) & ~(alignment_ - 1);
  if (bytes > capacity_ || rounded > capacity_) {
    return Status::ResourceExhausted("Arena::Allocate of " + std::to_string(bytes) +
                                     " bytes can never fit an arena of " + std::to_string(capacity_) +
                                     " bytes (alignment " + std::to_string(alignment_) + ")");
  }
  // Clamp so that "wait forever" (milliseconds::max()) cannot overflow the
  // clock's nanosecond count; ten years is forever enough.
  const auto wait = std::min<std::chrono::milliseconds>(timeout, std::chrono::hours(24 * 365 * 10));
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (closed_) return Status::Shutdown("the arena is closed");
    if (FindLocked(rounded, offset)) return Status::Ok();
    if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      // A Free may have landed just as the wait ran out: look once more.
      if (closed_) return Status::Shutdown("the arena is closed");
      if (FindLocked(rounded, offset)) return Status::Ok();
      return Status::Timeout("no room for " + std::to_string(rounded) + " bytes in the arena after " +
                             std::to_string(timeout.count()) + " ms (" + std::to_string(used_) + " of " +
                             std::to_string(capacity_) + " bytes in use, " + std::to_string(blocks_.size()) +
                             " blocks)");
    }
  }
}

bool Arena::TryAllocate(size_t bytes, size_t* offset) {
  if (bytes == 0 || bytes > capacity_) return false;
  const size_t rounded = (bytes + alignment_ - 1) & ~(alignment_ - 1);
  if (rounded > capacity_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return false;
  return FindLocked(rounded, offset);
}

void Arena::Free(size_t offset) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(offset);
    // Freeing an unknown offset breaks the caller's contract; in release
    // builds it is ignored rather than corrupting the bookkeeping.
    assert(it != blocks_.end() && "Arena::Free of an offset that is not allocated");
    if (it == blocks_.end()) return;
    used_ -= it->second;
    blocks_.erase(it);
  }
  // Waiters want different sizes, so wake them all; each re-checks for room.
  freed_.notify_all();
}

void Arena::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  freed_.notify_all();
}

size_t Arena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

size_t Arena::num_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocks_.size();
}

}  // namespace mltuner
