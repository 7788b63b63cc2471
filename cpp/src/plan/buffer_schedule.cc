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
#include <utility>
#include <vector>

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

// A read's buffer is released by the application's ticket at its post;
// every other access's by the writeback stream, after its copies out.
bool ReleasedByApplication(OpKind kind) { return kind == OpKind::kRead; }

struct EarlierUser {
  Handle handle = -1;
  int clocks_back = 0;  // 0: this clock; `regions`: the region's previous clock
};

// For each byte of h's buffer, its latest user before h opens: a buffer of
// the same clock that closed before h opens, or else one of the region's
// previous clock (h itself there, at the least). Each such user once,
// latest first.
std::vector<EarlierUser> LatestUsersByByte(const Recording& recording, const BufferSchedule& schedule, Handle h) {
  const BufferAddress& mine = schedule.buffers[h];
  const int open = recording.accesses[h].open_op;
  const int num_ops = static_cast<int>(recording.ops.size());
  struct Candidate {
    int at;  // close op, counted from the start of h's clock (negative: the previous one)
    EarlierUser user;
  };
  std::vector<Candidate> candidates;
  for (Handle other = 0; other < static_cast<Handle>(schedule.buffers.size()); ++other) {
    if (!SharesAddresses(mine, schedule.buffers[other])) continue;
    const int close = recording.accesses[other].close_op;
    if (close < open) {
      candidates.push_back({close, {other, 0}});
    } else {
      candidates.push_back({close - num_ops, {other, schedule.regions}});
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) { return a.at > b.at; });
  // Bytes of h not yet claimed by a later user, as sorted disjoint ranges.
  std::vector<std::pair<int64_t, int64_t>> unclaimed = {{mine.offset, mine.offset + mine.bytes}};
  std::vector<EarlierUser> users;
  for (const Candidate& candidate : candidates) {
    const BufferAddress& theirs = schedule.buffers[candidate.user.handle];
    const int64_t begin = theirs.offset, end = theirs.offset + theirs.bytes;
    std::vector<std::pair<int64_t, int64_t>> left;
    bool claims = false;
    for (const auto& [from, to] : unclaimed) {
      if (to <= begin || end <= from) {
        left.push_back({from, to});
        continue;
      }
      claims = true;
      if (from < begin) left.push_back({from, begin});
      if (end < to) left.push_back({end, to});
    }
    if (claims) users.push_back(candidate.user);
    unclaimed = std::move(left);
    if (unclaimed.empty()) break;
  }
  return users;
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

namespace {

std::vector<Lifetime> Lifetimes(const Recording& recording, const std::vector<BufferAddress>& buffers) {
  std::vector<Lifetime> life(buffers.size());
  for (size_t h = 0; h < buffers.size(); ++h) {
    const AccessRecord& access = recording.accesses[h];
    life[h] = {std::max(0, access.open_op - buffers[h].lookahead_ops), access.close_op};
  }
  return life;
}

// Largest first; ties in open order, so the result is deterministic.
std::vector<int> PackingOrder(const Recording& recording, const std::vector<BufferAddress>& buffers) {
  std::vector<int> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (buffers[a].bytes != buffers[b].bytes) return buffers[a].bytes > buffers[b].bytes;
    return recording.accesses[a].open_op < recording.accesses[b].open_op;
  });
  return order;
}

// Sets each buffer's offset (in `order`, the lowest that clears every placed
// buffer whose lifetime overlaps its own) and returns the region's bytes.
int64_t PackOffsets(const std::vector<Lifetime>& life, const std::vector<int>& order,
                    std::vector<BufferAddress>* buffers) {
  int64_t region_bytes = 0;
  std::vector<int> placed;
  std::vector<int> conflicts;
  for (int h : order) {
    BufferAddress& buffer = (*buffers)[h];
    if (buffer.bytes == 0) continue;
    conflicts.clear();
    for (int other : placed) {
      if (Overlap(life[h], life[other])) conflicts.push_back(other);
    }
    std::sort(conflicts.begin(), conflicts.end(),
              [&](int a, int b) { return (*buffers)[a].offset < (*buffers)[b].offset; });
    int64_t offset = 0;
    for (int other : conflicts) {
      const BufferAddress& taken = (*buffers)[other];
      if (offset + buffer.bytes <= taken.offset) break;  // fits in the gap before it
      offset = std::max(offset, taken.offset + taken.bytes);
    }
    buffer.offset = offset;
    region_bytes = std::max(region_bytes, offset + buffer.bytes);
    placed.push_back(h);
  }
  return region_bytes;
}

// Waits: the latest earlier user of each buffer's addresses, and the latest
// one released on the writeback stream where that one is a read.
void AssignWaits(const Recording& recording, BufferSchedule* schedule) {
  for (Handle h = 0; h < static_cast<Handle>(schedule->buffers.size()); ++h) {
    BufferAddress& buffer = schedule->buffers[h];
    buffer.wait_handle = buffer.writeback_wait_handle = -1;
    buffer.wait_op = -1;
    buffer.wait_clocks_back = buffer.writeback_wait_clocks_back = 0;
    if (buffer.bytes == 0) continue;
    const std::vector<EarlierUser> users = LatestUsersByByte(recording, *schedule, h);
    const EarlierUser& latest = users.front();  // h itself, a region's clock ago, at the least
    buffer.wait_handle = latest.handle;
    buffer.wait_op = recording.accesses[latest.handle].close_op;
    buffer.wait_clocks_back = latest.clocks_back;
    if (!ReleasedByApplication(recording.accesses[latest.handle].kind)) continue;
    for (const EarlierUser& user : users) {
      if (!ReleasedByApplication(recording.accesses[user.handle].kind)) {
        buffer.writeback_wait_handle = user.handle;
        buffer.writeback_wait_clocks_back = user.clocks_back;
        break;
      }
    }
  }
}

}  // namespace

BufferSchedule ScheduleBuffers(const Recording& recording, const std::vector<int64_t>& bytes, int regions,
                               int lookahead_ops) {
  assert(regions >= 1 && lookahead_ops >= 0 && bytes.size() == recording.accesses.size());
  BufferSchedule schedule;
  schedule.regions = regions;
  schedule.lookahead_ops = schedule.widest_lookahead_ops = lookahead_ops;
  schedule.num_ops = static_cast<int64_t>(recording.ops.size());
  schedule.buffers.resize(recording.accesses.size());
  for (size_t h = 0; h < schedule.buffers.size(); ++h) {
    schedule.buffers[h].bytes = Align(std::max<int64_t>(0, bytes[h]));
    schedule.buffers[h].lookahead_ops = lookahead_ops;
  }
  schedule.region_bytes = PackOffsets(Lifetimes(recording, schedule.buffers),
                                      PackingOrder(recording, schedule.buffers), &schedule.buffers);
  AssignWaits(recording, &schedule);
  return schedule;
}

BufferSchedule WidenLookahead(const Recording& recording, const BufferSchedule& schedule, int64_t pool_limit,
                              int most_ops) {
  const int count = static_cast<int>(schedule.buffers.size());
  if (count > kMostWidenedBuffers) return schedule;
  BufferSchedule wide = schedule;
  const std::vector<int> order = PackingOrder(recording, wide.buffers);
  std::vector<int> by_open(count);
  std::iota(by_open.begin(), by_open.end(), 0);
  std::sort(by_open.begin(), by_open.end(),
            [&](int a, int b) { return recording.accesses[a].open_op < recording.accesses[b].open_op; });
  bool widened = false;
  std::vector<BufferAddress> trial;
  for (int step = schedule.lookahead_ops + 1; step <= most_ops; ++step) {
    bool raised = false;
    for (int h : by_open) {
      const BufferAddress& mine = wide.buffers[h];
      if (mine.bytes == 0 || mine.lookahead_ops >= step || recording.accesses[h].open_op <= mine.lookahead_ops) {
        continue;  // nothing to fill, raised already, or its lifetime starts at the clock's first op
      }
      trial = wide.buffers;
      trial[h].lookahead_ops = step;
      const int64_t region = PackOffsets(Lifetimes(recording, trial), order, &trial);
      if (region * wide.regions > pool_limit) continue;
      wide.buffers.swap(trial);
      wide.region_bytes = region;
      raised = widened = true;
    }
    if (!raised) break;
  }
  if (!widened) return schedule;
  wide.lookahead_ops = most_ops;
  wide.widest_lookahead_ops = 0;
  for (const BufferAddress& buffer : wide.buffers) {
    wide.lookahead_ops = std::min(wide.lookahead_ops, buffer.lookahead_ops);
    wide.widest_lookahead_ops = std::max(wide.widest_lookahead_ops, buffer.lookahead_ops);
  }
  AssignWaits(recording, &wide);
  return wide;
}

}  // namespace mltuner
