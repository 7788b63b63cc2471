// BufferSchedule: interval packing of the recorded buffers (see
// buffer_schedule.h).
//
// Packing is greedy by size (the heuristic of TFLite's arena planner):
// largest buffer first, each at the lowest offset that clears every already
// placed buffer whose lifetime overlaps its own. Large buffers placed first
// leave the small ones to fill the gaps, which keeps the region close to the
// peak of bytes open at once (the lower bound).
#include "plan/buffer_schedule.h"

#include <algorithm>
#include <cassert>
#include <numeric>

namespace mltuner {

namespace {

int64_t Align(int64_t bytes) { return (bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment; }

struct Lifetime {
  int begin = 0;  // open op - lookahead, clamped at 0
  int end = 0;    // close op
};

bool Overlap(const Lifetime& a, const Lifetime& b) { return a.begin <= b.end && b.begin <= a.end; }

bool SharesAddresses(const BufferAddress& a, const BufferAddress& b) {
  return a.bytes > 0 && b.bytes > 0 && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

}  // namespace

int64_t BufferSchedule::PoolOffset(Handle handle, int64_t clock) const {
  return (clock % regions) * region_bytes + buffers[handle].offset;
}

int64_t BufferSchedule::WaitSeq(Handle handle, int64_t clock) const {
  const BufferAddress& buffer = buffers[handle];
  const int64_t wait_clock = clock - buffer.wait_clocks_back;
  if (buffer.wait_handle < 0 || wait_clock < 0) return 0;
  return wait_clock * num_ops + buffer.wait_op + 1;
}

BufferSchedule ScheduleBuffers(const Recording& recording, const std::vector<int64_t>& bytes, int regions,
                               int lookahead_ops) {
  assert(regions >= 1 && lookahead_ops >= 0 && bytes.size() == recording.accesses.size());
  const int count = static_cast<int>(recording.accesses.size());
  BufferSchedule schedule;
  schedule.regions = regions;
  schedule.lookahead_ops = lookahead_ops;
  schedule.num_ops = static_cast<int64_t>(recording.ops.size());
  schedule.buffers.resize(count);
  std::vector<Lifetime> life(count);
  for (int h = 0; h < count; ++h) {
    const AccessRecord& access = recording.accesses[h];
    life[h] = {std::max(0, access.open_op - lookahead_ops), access.close_op};
    schedule.buffers[h].bytes = Align(std::max<int64_t>(0, bytes[h]));
  }

  // Offsets: largest first; ties in open order, so the result is deterministic.
  std::vector<int> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (schedule.buffers[a].bytes != schedule.buffers[b].bytes) {
      return schedule.buffers[a].bytes > schedule.buffers[b].bytes;
    }
    return recording.accesses[a].open_op < recording.accesses[b].open_op;
  });
  std::vector<int> placed;
  std::vector<int> conflicts;
  for (int h : order) {
    BufferAddress& buffer = schedule.buffers[h];
    if (buffer.bytes == 0) continue;
    conflicts.clear();
    for (int other : placed) {
      if (Overlap(life[h], life[other])) conflicts.push_back(other);
    }
    std::sort(conflicts.begin(), conflicts.end(),
              [&](int a, int b) { return schedule.buffers[a].offset < schedule.buffers[b].offset; });
    int64_t offset = 0;
    for (int other : conflicts) {
      const BufferAddress& taken = schedule.buffers[other];
      if (offset + buffer.bytes <= taken.offset) break;  // fits in the gap before it
      offset = std::max(offset, taken.offset + taken.bytes);
    }
    buffer.offset = offset;
    schedule.region_bytes = std::max(schedule.region_bytes, offset + buffer.bytes);
    placed.push_back(h);
  }

  // Waits: the latest earlier user of each buffer's addresses.
  for (int h = 0; h < count; ++h) {
    BufferAddress& buffer = schedule.buffers[h];
    if (buffer.bytes == 0) continue;
    const int open = recording.accesses[h].open_op;
    int same_clock = -1;  // the latest same-clock user closed before h opens
    int previous = -1;    // the latest user in the region's previous clock
    for (int other = 0; other < count; ++other) {
      if (!SharesAddresses(buffer, schedule.buffers[other])) continue;
      const int close = recording.accesses[other].close_op;
      if (close < open && (same_clock < 0 || close > recording.accesses[same_clock].close_op)) same_clock = other;
      if (previous < 0 || close > recording.accesses[previous].close_op) previous = other;
    }
    const int wait = same_clock >= 0 ? same_clock : previous;  // previous >= 0: h shares with itself
    buffer.wait_handle = wait;
    buffer.wait_op = recording.accesses[wait].close_op;
    buffer.wait_clocks_back = same_clock >= 0 ? 0 : regions;
  }
  return schedule;
}

}  // namespace mltuner
