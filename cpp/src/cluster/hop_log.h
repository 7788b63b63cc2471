// HopLog: an opt-in timeline of the hops messages take through a process
// (queued by the thread that sends, put on the socket by the send thread,
// admitted by the receive thread, delivered to the shard or the engine), to
// find where a message waits between threads and processes: waits that a
// GPU or Python profiler does not show (docs/results.md, stop 43).
//
// On when MLTUNER_HOP_LOG names a folder when the first hop is recorded:
// each process then writes hops-<pid>.tsv there, one line per hop, tab
// separated: microseconds on the steady clock (one clock for the processes
// of a host), rank, thread name, hop, message type, table, clock, sender,
// receiver, payload bytes. Lines are buffered and written every few hundred
// hops and at exit. Off, a hop costs one test of a flag.
// benchmarks/hop_timeline.py reads the files of a job.
//
// Thread safety: any thread.
#pragma once

#include <cstddef>

#include "wire/message.h"

namespace mltuner {

class HopLog {
 public:
  static bool on();
  // `hop` of `message` at rank `rank`.
  static void Record(int rank, const char* hop, const Message& message);
  static void Record(int rank, const char* hop, const MessageHeader& header, size_t bytes);
  // A hop that is not one message's (a socket send of a batch, a wait).
  static void Record(int rank, const char* hop, int receiver, size_t bytes);
};

}  // namespace mltuner
