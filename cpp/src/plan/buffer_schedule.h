// BufferSchedule: a static address for every access buffer of every clock,
// and the one earlier op each buffer must wait for (issue 14, item 5).
//
// The access-buffer pool is `regions` equal regions; clock c uses region
// c mod regions. Inside a region each access (handle) has a fixed offset,
// found by interval packing of the recorded iteration: buffers whose
// lifetimes overlap get disjoint addresses. A buffer's lifetime is
// [open op - lookahead_ops, close op] (clamped at op 0): with lookahead 0 a
// buffer may take the addresses another one released just before it opens;
// a larger lookahead keeps such reuse at least that many ops apart, so the
// allocator can prepare a buffer that far ahead of the application; with
// lookahead >= the op count no two buffers of one clock share addresses.
//
// Waits. Every (clock c, op i) has the sequence number seq = c * num_ops + i
// and the reclaimer finishes ops in that order. Before the buffer of handle h
// at clock c is filled, every earlier user of its addresses must be
// reclaimed: the latest buffer of the same clock that shares addresses and
// closed before h opens, or else the region's previous clock (c - regions),
// all of whose overlapping buffers closed before. WaitSeq names that one
// sequence number; it is always <= the seq of h's own open op, so a buffer
// never waits for anything the application does after needing it: the
// schedule cannot deadlock, whatever the timing, and cannot fragment.
//
// On the device a fill waits for release tickets, which come from two
// streams: a read is released by the application's ticket at its post; an
// update or a local access by the writeback stream's, after the copies that
// read its buffer. A later ticket of either stream covers the earlier ones
// of that stream, and a writeback ticket covers every application ticket
// before it (the writeback stream waited for it) but not the reverse. So
// when the latest earlier user of h's addresses is a read, h also waits for
// the latest writeback-released user of any of its bytes: a buffer over two
// earlier ones that lived side by side, an update and a read that closed
// after it, must not be filled while the update's rows are still being
// copied out.
//
// Lookahead per buffer. ScheduleBuffers gives every buffer the same one;
// WidenLookahead then raises single buffers' further where the pool still
// fits a limit: under a tight budget the clock's largest buffers (the peak)
// leave no room for a uniform lookahead, while the small ones elsewhere in
// the clock have room to be filled several ops early.
//
// A pure function of the recording and the buffer sizes; the engine keeps
// the result constant from the end of the virtual iteration.
#pragma once

#include <cstdint>
#include <vector>

#include "mltuner/types.h"
#include "record/recorder.h"

namespace mltuner {

constexpr int64_t kBufferAlignment = 256;  // bytes; every offset and size is a multiple

struct BufferAddress {
  int64_t offset = 0;  // bytes from the base of its clock's region
  int64_t bytes = 0;   // rounded up to kBufferAlignment
  // Ops before its open op from which no other buffer of the clock uses
  // these addresses (its lifetime is [open op - lookahead_ops, close op]).
  int lookahead_ops = 0;
  // The buffer that last uses these addresses before this one, and how many
  // clocks back it is: 0 (same clock) or `regions` (the region's previous
  // clock, where the handle itself is one of the earlier users). wait_handle
  // is -1 only for a buffer of 0 bytes, which waits for nothing.
  Handle wait_handle = -1;
  int wait_op = -1;  // wait_handle's close op
  int wait_clocks_back = 0;
  // When wait_handle is a read: the latest earlier user of any of these
  // bytes that the writeback stream releases (an update or a local access),
  // which the read's ticket does not cover; -1 when there is none. Its
  // close op is never after wait_handle's, so WaitSeq covers it on the host.
  Handle writeback_wait_handle = -1;
  int writeback_wait_clocks_back = 0;
};

struct BufferSchedule {
  int regions = 1;
  int lookahead_ops = 0;                // the least of any buffer's (all of them: ScheduleBuffers)
  int widest_lookahead_ops = 0;         // the largest
  int64_t num_ops = 0;
  int64_t region_bytes = 0;             // the largest offset + bytes, aligned
  std::vector<BufferAddress> buffers;   // by handle

  int64_t pool_bytes() const { return regions * region_bytes; }
  // Byte offset in the pool of `handle`'s buffer at `clock`.
  int64_t PoolOffset(Handle handle, int64_t clock) const;
  // The reclaimer must have finished ops [0, WaitSeq) — i.e. reclaimed_seq
  // >= WaitSeq — before the buffer of `handle` at `clock` may be filled.
  // 0 when nothing earlier uses its addresses.
  int64_t WaitSeq(Handle handle, int64_t clock) const;
};

// The schedule of `recording` with `bytes[h]` bytes for the buffer of handle h
// (rounded up to kBufferAlignment here). REQUIRES: regions >= 1,
// lookahead_ops >= 0, bytes.size() == recording.accesses.size(), every access
// has its open_op and close_op set (Recorder::Finish guarantees it).
BufferSchedule ScheduleBuffers(const Recording& recording, const std::vector<int64_t>& bytes, int regions,
                               int lookahead_ops);

// `schedule` (of `recording`, as ScheduleBuffers made it) with
// single buffers' lookahead raised, in rounds of one op up to `most_ops`,
// each round in open order, wherever the pool (all regions) stays within
// `pool_limit`. Returns `schedule` itself when nothing can be raised, or
// when the clock has more than kMostWidenedBuffers buffers (each raise
// tried packs the clock again).
constexpr int kMostWidenedBuffers = 512;
BufferSchedule WidenLookahead(const Recording& recording, const BufferSchedule& schedule, int64_t pool_limit,
                              int most_ops);

}  // namespace mltuner
