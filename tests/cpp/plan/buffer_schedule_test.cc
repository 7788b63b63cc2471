// BufferSchedule: a hand-computed example, then properties over random
// recorded access sequences, region counts and lookaheads:
//   - buffers whose lifetimes overlap never share addresses in a region;
//   - every buffer waits for an op before its own open (never a later one);
//   - the wait covers every earlier user of its addresses, in any clock;
//   - a simulated pipeline (allocator at most regions - 1 clocks ahead,
//     application, reclaimer, in random interleavings) never stalls for
//     good, and the buffers it holds never overlap in the pool;
//   - on the device, where reads are released by the application's ticket
//     and updates by the writeback stream's, the tickets each fill waits for
//     cover every earlier user of its addresses.
#include "plan/buffer_schedule.h"

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

using namespace mltuner;

namespace {

// A recording from a list of (open?, handle) events; appends the clock.
Recording FromEvents(const std::vector<std::pair<bool, Handle>>& events, int handles) {
  Recording recording;
  recording.accesses.resize(handles);
  for (Handle h = 0; h < handles; ++h) recording.accesses[h].handle = h;
  for (const auto& [opens, h] : events) {
    const int op = static_cast<int>(recording.ops.size());
    recording.ops.push_back({opens ? OpKind::kRead : OpKind::kPostRead, h});
    (opens ? recording.accesses[h].open_op : recording.accesses[h].close_op) = op;
  }
  recording.ops.push_back({OpKind::kClock, -1});
  return recording;
}

// `handles` accesses opened in order, closed in a random order interleaved
// with later opens (nesting, chains and long-lived buffers all occur).
Recording RandomRecording(std::mt19937& rng, int handles) {
  std::vector<std::pair<bool, Handle>> events;
  std::vector<Handle> open;
  Handle next = 0;
  while (next < handles || !open.empty()) {
    const bool do_open = next < handles && (open.empty() || rng() % 100 < 55);
    if (do_open) {
      events.push_back({true, next});
      open.push_back(next++);
    } else {
      const size_t k = rng() % open.size();
      events.push_back({false, open[k]});
      open.erase(open.begin() + static_cast<long>(k));
    }
  }
  return FromEvents(events, handles);
}

bool Opens(OpKind kind) { return kind == OpKind::kRead || kind == OpKind::kPreUpdate || kind == OpKind::kLocalAccess; }

// Makes about one access in three an update (pre_update ... update).
void MixInUpdates(std::mt19937& rng, Recording* recording) {
  for (AccessRecord& access : recording->accesses) access.kind = rng() % 3 == 0 ? OpKind::kPreUpdate : OpKind::kRead;
  for (RecordedOp& op : recording->ops) {
    if (op.kind == OpKind::kClock) continue;
    const OpKind kind = recording->accesses[op.handle].kind;
    op.kind = Opens(op.kind) ? kind : PostKindOf(kind);
  }
}

bool AddressesOverlap(const BufferAddress& a, const BufferAddress& b) {
  return a.bytes > 0 && b.bytes > 0 && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
}

int64_t PeakOpenBytes(const Recording& recording, const BufferSchedule& schedule) {
  int64_t open = 0, peak = 0;
  for (const RecordedOp& op : recording.ops) {
    if (op.kind == OpKind::kClock) continue;
    open += (Opens(op.kind) ? 1 : -1) * schedule.buffers[op.handle].bytes;
    peak = std::max(peak, open);
  }
  return peak;
}

std::string Where(int trial, int regions, int lookahead) {
  return "trial " + std::to_string(trial) + " regions " + std::to_string(regions) + " lookahead " +
         std::to_string(lookahead);
}

void CheckStaticProperties(const Recording& recording, const std::vector<int64_t>& bytes,
                           const BufferSchedule& s, const std::string& where) {
  const int n = static_cast<int>(recording.ops.size());
  const int count = static_cast<int>(recording.accesses.size());
  ASSERT_EQ(static_cast<int>(s.buffers.size()), count);
  int64_t sum = 0;
  for (Handle h = 0; h < count; ++h) {
    const BufferAddress& b = s.buffers[h];
    EXPECT_EQ(b.bytes, (bytes[h] + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment);
    EXPECT_EQ(b.offset % kBufferAlignment, int64_t{0});
    EXPECT_TRUE(b.offset >= 0 && b.offset + b.bytes <= s.region_bytes);
    sum += b.bytes;
  }
  EXPECT_TRUE(s.region_bytes % kBufferAlignment == 0);
  EXPECT_TRUE(s.region_bytes >= PeakOpenBytes(recording, s));
  EXPECT_TRUE(s.region_bytes <= sum);
  if (s.lookahead_ops >= n) EXPECT_EQ(s.region_bytes, sum);  // no reuse within a clock

  // Overlapping lifetimes (with the lookahead) never share addresses.
  for (Handle a = 0; a < count; ++a) {
    for (Handle b = a + 1; b < count; ++b) {
      const AccessRecord& x = recording.accesses[a];
      const AccessRecord& y = recording.accesses[b];
      const int x_begin = std::max(0, x.open_op - s.buffers[a].lookahead_ops);
      const int y_begin = std::max(0, y.open_op - s.buffers[b].lookahead_ops);
      if (x_begin <= y.close_op && y_begin <= x.close_op && AddressesOverlap(s.buffers[a], s.buffers[b])) {
        ::mltuner::testing::ReportFailure(__FILE__, __LINE__,
                                          where + ": handles " + std::to_string(a) + " and " +
                                              std::to_string(b) + " are open together and share addresses");
        return;
      }
    }
  }

  // Over a few rounds of the regions: every wait is for an op before the
  // buffer's own open, and covers every earlier user of its addresses.
  const int clocks = 2 * s.regions + 2;
  for (int c2 = 0; c2 < clocks; ++c2) {
    for (Handle h2 = 0; h2 < count; ++h2) {
      const int64_t open2 = int64_t{c2} * n + recording.accesses[h2].open_op;
      const int64_t wait = s.WaitSeq(h2, c2);
      if (wait > open2) {
        ::mltuner::testing::ReportFailure(__FILE__, __LINE__,
                                          where + ": handle " + std::to_string(h2) + " at clock " +
                                              std::to_string(c2) + " waits for seq " + std::to_string(wait) +
                                              " after its own open " + std::to_string(open2));
        return;
      }
      for (int c1 = std::max(0, c2 - 2 * s.regions); c1 <= c2; ++c1) {
        if (c1 % s.regions != c2 % s.regions) continue;
        for (Handle h1 = 0; h1 < count; ++h1) {
          const int64_t open1 = int64_t{c1} * n + recording.accesses[h1].open_op;
          if (open1 >= open2 || !AddressesOverlap(s.buffers[h1], s.buffers[h2])) continue;
          const int64_t close1 = int64_t{c1} * n + recording.accesses[h1].close_op;
          if (close1 + 1 > wait) {
            ::mltuner::testing::ReportFailure(
                __FILE__, __LINE__,
                where + ": handle " + std::to_string(h2) + " at clock " + std::to_string(c2) + " waits for seq " +
                    std::to_string(wait) + " but handle " + std::to_string(h1) + " of clock " +
                    std::to_string(c1) + " holds its addresses until seq " + std::to_string(close1));
            return;
          }
        }
      }
    }
  }
}

// The engine's pipeline in miniature: the allocator prepares open ops in seq
// order, at most regions - 1 clocks ahead of the application, once
// reclaimed >= WaitSeq; the application needs each buffer prepared at its
// open; the reclaimer follows the application. A random actor moves each
// step. Fails on a stall or on two held buffers overlapping in the pool.
void SimulatePipeline(const Recording& recording, const BufferSchedule& s, std::mt19937& rng, int clocks,
                      const std::string& where) {
  const int64_t n = static_cast<int64_t>(recording.ops.size());
  const int64_t end = clocks * n;
  const int prefetch = s.regions - 1;
  struct Held {
    Handle handle;
    int64_t clock;
  };
  std::vector<Held> held;  // prepared and not yet reclaimed
  std::vector<std::vector<int64_t>> prepared_clock(recording.accesses.size(), std::vector<int64_t>(s.regions, -1));
  int64_t alloc_seq = 0, app_seq = 0, reclaimed = 0;
  while (reclaimed < end) {
    // What each actor could do now.
    bool alloc_can = false;
    if (alloc_seq < end) {
      const RecordedOp& op = recording.ops[alloc_seq % n];
      const int64_t clock = alloc_seq / n;
      alloc_can = !Opens(op.kind) ||
                  (clock <= app_seq / n + prefetch && reclaimed >= s.WaitSeq(op.handle, clock));
    }
    bool app_can = false;
    if (app_seq < end) {
      const RecordedOp& op = recording.ops[app_seq % n];
      app_can = !Opens(op.kind) || prepared_clock[op.handle][(app_seq / n) % s.regions] == app_seq / n;
    }
    const bool reclaim_can = reclaimed < app_seq;
    std::vector<int> actors;
    if (alloc_can) actors.push_back(0);
    if (app_can) actors.push_back(1);
    if (reclaim_can) actors.push_back(2);
    if (actors.empty()) {
      ::mltuner::testing::ReportFailure(__FILE__, __LINE__,
                                        where + ": the pipeline stalls at allocator seq " + std::to_string(alloc_seq) +
                                            ", application seq " + std::to_string(app_seq) + ", reclaimed " +
                                            std::to_string(reclaimed));
      return;
    }
    switch (actors[rng() % actors.size()]) {
      case 0: {
        const RecordedOp& op = recording.ops[alloc_seq % n];
        const int64_t clock = alloc_seq / n;
        if (Opens(op.kind)) {
          const BufferAddress& mine = s.buffers[op.handle];
          const int64_t base = s.PoolOffset(op.handle, clock);
          for (const Held& other : held) {
            const int64_t other_base = s.PoolOffset(other.handle, other.clock);
            const int64_t other_bytes = s.buffers[other.handle].bytes;
            if (mine.bytes > 0 && other_bytes > 0 && base < other_base + other_bytes &&
                other_base < base + mine.bytes) {
              ::mltuner::testing::ReportFailure(
                  __FILE__, __LINE__,
                  where + ": handle " + std::to_string(op.handle) + " of clock " + std::to_string(clock) +
                      " overlaps the held handle " + std::to_string(other.handle) + " of clock " +
                      std::to_string(other.clock));
              return;
            }
          }
          held.push_back({op.handle, clock});
          prepared_clock[op.handle][clock % s.regions] = clock;
        }
        ++alloc_seq;
        break;
      }
      case 1:
        ++app_seq;
        break;
      default: {
        const RecordedOp& op = recording.ops[reclaimed % n];
        if (!Opens(op.kind)) {
          const int64_t clock = reclaimed / n;
          held.erase(std::remove_if(held.begin(), held.end(),
                                    [&](const Held& x) { return x.handle == op.handle && x.clock == clock; }),
                     held.end());
        }
        ++reclaimed;
      }
    }
  }
}

// The device's side of the waits, in the order of the ops: each fill waits
// for the release tickets the schedule names; the application waits for the
// fill of each buffer it opens; a read is released by the application's
// ticket at its post, an update by the writeback stream's, which waits for
// the application's ticket first. Each stream knows the releases done before
// its next work (a ticket knows what its stream knew); every fill must know
// every earlier user of its addresses released.
void CheckDeviceTickets(const Recording& recording, const BufferSchedule& s, int clocks, const std::string& where) {
  const int64_t n = static_cast<int64_t>(recording.ops.size());
  const int64_t count = static_cast<int64_t>(recording.accesses.size());
  auto id = [count](Handle h, int64_t clock) { return clock * count + h; };
  std::vector<std::set<int64_t>> release_knows(static_cast<size_t>(clocks * count));
  std::set<int64_t> app, writeback, prefetch;
  for (int64_t seq = 0; seq < clocks * n; ++seq) {
    const RecordedOp& op = recording.ops[seq % n];
    const int64_t clock = seq / n;
    if (op.kind == OpKind::kClock) continue;
    const Handle h = op.handle;
    const BufferAddress& mine = s.buffers[h];
    if (!Opens(op.kind)) {
      if (recording.accesses[h].kind == OpKind::kRead) {
        app.insert(id(h, clock));
        release_knows[id(h, clock)] = app;
      } else {
        writeback.insert(app.begin(), app.end());
        writeback.insert(id(h, clock));
        release_knows[id(h, clock)] = writeback;
      }
      continue;
    }
    if (mine.bytes == 0) continue;
    for (const auto& [waited, back] : {std::pair<Handle, int>{mine.wait_handle, mine.wait_clocks_back},
                                       std::pair<Handle, int>{mine.writeback_wait_handle,
                                                              mine.writeback_wait_clocks_back}}) {
      if (waited >= 0 && clock - back >= 0) {
        const std::set<int64_t>& known = release_knows[id(waited, clock - back)];
        prefetch.insert(known.begin(), known.end());
      }
    }
    for (int64_t c1 = std::max<int64_t>(0, clock - 2 * s.regions); c1 <= clock; ++c1) {
      if (c1 % s.regions != clock % s.regions) continue;
      for (Handle h1 = 0; h1 < count; ++h1) {
        if (c1 * n + recording.accesses[h1].open_op >= seq || !AddressesOverlap(mine, s.buffers[h1])) continue;
        if (prefetch.count(id(h1, c1)) == 0) {
          ::mltuner::testing::ReportFailure(
              __FILE__, __LINE__,
              where + ": the fill of handle " + std::to_string(h) + " at clock " + std::to_string(clock) +
                  " may run before the release of handle " + std::to_string(h1) + " of clock " +
                  std::to_string(c1) + ", an earlier user of its addresses");
          return;
        }
      }
    }
    app.insert(prefetch.begin(), prefetch.end());  // the application waits for the fill
  }
}

}  // namespace

TEST(AFillOverAnUpdateAndALaterReadWaitsForBoth) {
  // op 0 open r0 (1024)   op 1 close r0   op 2 open r1 (512)   op 3 open u (256)
  // op 4 close u          op 5 close r1   op 6 open r2 (1024)  op 7 close r2
  // At lookahead 0 r2 takes r0's addresses, which r1 and u took side by side
  // before it: r1 closed last, but its ticket (the application's) does not
  // cover the writeback stream's copies out of u's buffer.
  Recording recording = FromEvents(
      {{true, 0}, {false, 0}, {true, 1}, {true, 2}, {false, 2}, {false, 1}, {true, 3}, {false, 3}}, 4);
  recording.accesses[2].kind = OpKind::kPreUpdate;
  recording.ops[3].kind = OpKind::kPreUpdate;
  recording.ops[4].kind = OpKind::kUpdate;
  const BufferSchedule s = ScheduleBuffers(recording, {1024, 512, 256, 1024}, 1, 0);
  EXPECT_EQ(s.buffers[1].offset, int64_t{0});
  EXPECT_EQ(s.buffers[2].offset, int64_t{512});
  EXPECT_EQ(s.buffers[3].offset, int64_t{0});
  EXPECT_EQ(s.buffers[3].wait_handle, Handle{1});
  EXPECT_EQ(s.buffers[3].writeback_wait_handle, Handle{2});
  EXPECT_EQ(s.buffers[3].writeback_wait_clocks_back, 0);
  // r1 shares only with r0 and the earlier clock's r2 and r1, all reads.
  EXPECT_EQ(s.buffers[1].writeback_wait_handle, Handle{-1});
  CheckDeviceTickets(recording, s, 4, "the example");
}

TEST(HandComputedExample) {
  // op 0 open r0 (256)   op 1 open r1 (256)   op 2 open u (512)   op 3 close u
  // op 4 open l (256)    op 5 close l         op 6 close r1       op 7 close r0
  // Largest first: u at 0; r0 clears u: 512; r1 clears u and r0: 768; l is
  // open with r0 and r1 only: 0, where u was. Region 1024 = the peak.
  const Recording recording =
      FromEvents({{true, 0}, {true, 1}, {true, 2}, {false, 2}, {true, 3}, {false, 3}, {false, 1}, {false, 0}}, 4);
  const BufferSchedule s = ScheduleBuffers(recording, {192, 200, 320 + 192, 128}, 2, 0);
  EXPECT_EQ(s.region_bytes, int64_t{1024});
  EXPECT_EQ(s.pool_bytes(), int64_t{2048});
  EXPECT_EQ(s.buffers[2].offset, int64_t{0});
  EXPECT_EQ(s.buffers[0].offset, int64_t{512});
  EXPECT_EQ(s.buffers[1].offset, int64_t{768});
  EXPECT_EQ(s.buffers[3].offset, int64_t{0});
  // l waits for u's close in the same clock: seq 9c + 3 reclaimed.
  EXPECT_EQ(s.buffers[3].wait_handle, Handle{2});
  EXPECT_EQ(s.buffers[3].wait_clocks_back, 0);
  EXPECT_EQ(s.WaitSeq(3, 0), int64_t{4});
  EXPECT_EQ(s.WaitSeq(3, 5), int64_t{5 * 9 + 4});
  // u's addresses were last used by l of the region's previous clock.
  EXPECT_EQ(s.buffers[2].wait_handle, Handle{3});
  EXPECT_EQ(s.buffers[2].wait_clocks_back, 2);
  EXPECT_EQ(s.WaitSeq(2, 1), int64_t{0});  // no clock -1
  EXPECT_EQ(s.WaitSeq(2, 3), int64_t{1 * 9 + 6});
  // r0 and r1 share with nobody but themselves.
  EXPECT_EQ(s.buffers[0].wait_handle, Handle{0});
  EXPECT_EQ(s.WaitSeq(0, 2), int64_t{0 * 9 + 8});
  EXPECT_EQ(s.PoolOffset(1, 3), int64_t{1024 + 768});

  // A lookahead of 2 ops keeps l off u's addresses (u closes at op 3, l's
  // lifetime starts at op 2): the region grows by l.
  const BufferSchedule ahead = ScheduleBuffers(recording, {192, 200, 320 + 192, 128}, 2, 2);
  EXPECT_EQ(ahead.region_bytes, int64_t{1280});
  EXPECT_EQ(ahead.buffers[3].wait_clocks_back, 2);
}

TEST(EmptyAndZeroByteBuffers) {
  const Recording none = FromEvents({}, 0);
  const BufferSchedule empty = ScheduleBuffers(none, {}, 3, 0);
  EXPECT_EQ(empty.region_bytes, int64_t{0});
  EXPECT_EQ(empty.pool_bytes(), int64_t{0});
  const Recording one = FromEvents({{true, 0}, {false, 0}, {true, 1}, {false, 1}}, 2);
  const BufferSchedule s = ScheduleBuffers(one, {0, 100}, 2, 0);
  EXPECT_EQ(s.buffers[0].bytes, int64_t{0});
  EXPECT_EQ(s.buffers[0].wait_handle, Handle{-1});
  EXPECT_EQ(s.WaitSeq(0, 7), int64_t{0});
  EXPECT_EQ(s.region_bytes, int64_t{256});
}

TEST(RandomRecordingsNeverShareLiveAddressesOrWaitOnLaterBuffers) {
  std::mt19937 rng(20240614);
  const int failed_before = ::mltuner::testing::Failures();
  for (int trial = 0; trial < 400; ++trial) {
    const int handles = 1 + static_cast<int>(rng() % 14);
    Recording recording = RandomRecording(rng, handles);
    MixInUpdates(rng, &recording);
    std::vector<int64_t> bytes(handles);
    for (int64_t& b : bytes) b = 1 + static_cast<int64_t>(rng() % 2000);
    const int regions = 1 + static_cast<int>(rng() % 4);
    const int n = static_cast<int>(recording.ops.size());
    for (int lookahead : {0, 1 + static_cast<int>(rng() % n), n}) {
      const BufferSchedule uniform = ScheduleBuffers(recording, bytes, regions, lookahead);
      // The same with single buffers raised within a limit between the pool
      // and twice it.
      const int64_t limit = uniform.pool_bytes() + static_cast<int64_t>(rng() % (uniform.pool_bytes() + 1));
      const BufferSchedule wide = WidenLookahead(recording, uniform, limit, n);
      EXPECT_TRUE(wide.pool_bytes() <= std::max(limit, uniform.pool_bytes()));
      for (const BufferSchedule* s : {&uniform, &wide}) {
        const std::string where = Where(trial, regions, lookahead) + (s == &wide ? " widened" : "");
        CheckStaticProperties(recording, bytes, *s, where);
        SimulatePipeline(recording, *s, rng, 3 * regions + 3, where);
        CheckDeviceTickets(recording, *s, 3 * regions + 3, where);
      }
      if (::mltuner::testing::Failures() > failed_before) return;  // one counterexample is enough
    }
  }
}

TEST(ManySmallBuffersPackNearThePeak) {
  // A forward chain (each layer's read closes before the next opens) under
  // one long-lived buffer packs into the peak: the chain reuses one slot.
  std::vector<std::pair<bool, Handle>> events = {{true, 0}};
  for (Handle h = 1; h <= 20; ++h) {
    events.push_back({true, h});
    events.push_back({false, h});
  }
  events.push_back({false, 0});
  const Recording recording = FromEvents(events, 21);
  std::vector<int64_t> bytes(21, 1024);
  bytes[0] = 4096;
  const BufferSchedule tight = ScheduleBuffers(recording, bytes, 2, 0);
  EXPECT_EQ(tight.region_bytes, int64_t{4096 + 1024});
  // Each chain buffer then waits for the previous one of the same clock.
  EXPECT_EQ(tight.buffers[5].wait_handle, Handle{4});
  EXPECT_EQ(tight.buffers[5].wait_clocks_back, 0);
  // A lookahead of 4 ops keeps the chain's reuse 2 layers apart.
  const BufferSchedule ahead = ScheduleBuffers(recording, bytes, 2, 4);
  EXPECT_EQ(ahead.region_bytes, int64_t{4096 + 3 * 1024});
  EXPECT_TRUE(ahead.buffers[5].offset != ahead.buffers[4].offset);
  EXPECT_TRUE(ahead.buffers[5].offset != ahead.buffers[3].offset);
}

MLT_TEST_MAIN

TEST(SingleBuffersLookAheadWhereTheClocksPeakLeavesNoRoomForAll) {
  // A chain of small reads, then one large read, in a pool of the large
  // one's size: a uniform lookahead of 1 would keep the large buffer apart
  // from the last small one, above the limit, so it stays at 0; raised one
  // by one, the small buffers get up to 4 ops (as far as the clock's start
  // allows) and the large one none, within the same pool.
  std::vector<std::pair<bool, Handle>> events;
  for (Handle h = 0; h < 10; ++h) {
    events.push_back({true, h});
    events.push_back({false, h});
  }
  events.push_back({true, 10});
  events.push_back({false, 10});
  const Recording recording = FromEvents(events, 11);
  std::vector<int64_t> bytes(11, 1024);
  bytes[10] = 8192;
  const BufferSchedule tight = ScheduleBuffers(recording, bytes, 1, 0);
  const int64_t limit = tight.pool_bytes();
  EXPECT_EQ(limit, int64_t{8192});
  EXPECT_TRUE(ScheduleBuffers(recording, bytes, 1, 1).pool_bytes() > limit);
  const BufferSchedule wide = WidenLookahead(recording, tight, limit, 4);
  EXPECT_EQ(wide.pool_bytes(), limit);
  EXPECT_EQ(wide.lookahead_ops, 0);
  EXPECT_EQ(wide.widest_lookahead_ops, 4);
  EXPECT_EQ(wide.buffers[0].lookahead_ops, 0);  // opens at the clock's first op
  EXPECT_EQ(wide.buffers[1].lookahead_ops, 2);
  for (Handle h = 2; h < 10; ++h) EXPECT_EQ(wide.buffers[h].lookahead_ops, 4);
  EXPECT_EQ(wide.buffers[10].lookahead_ops, 0);
  // A small buffer no longer takes the addresses its predecessor just left.
  EXPECT_TRUE(wide.buffers[5].offset != wide.buffers[4].offset);
  EXPECT_TRUE(tight.buffers[5].offset == tight.buffers[4].offset);

  // A chain alone in its least pool: every raise needs more, so the
  // schedule comes back as it was.
  const Recording chain = FromEvents(std::vector<std::pair<bool, Handle>>(events.begin(), events.end() - 2), 10);
  const std::vector<int64_t> small(10, 1024);
  const BufferSchedule least = ScheduleBuffers(chain, small, 1, 0);
  const BufferSchedule same = WidenLookahead(chain, least, least.pool_bytes(), 4);
  EXPECT_EQ(same.widest_lookahead_ops, 0);
  EXPECT_EQ(same.region_bytes, int64_t{1024});
}
