// SocketPump: a process's data-plane threads, in C++. The send thread takes
// a ProcessNode's outgoing messages and writes them to the peers' sockets;
// the receive thread reads the bound sockets and delivers what comes in.
// Neither thread ever holds Python's GIL, so a clock's many small messages
// (notices, rows, releases of every table) cost microseconds each instead
// of Python rounds that contend with the training thread.
//
// The sockets are ZeroMQ sockets that Python (pyzmq) created, configured,
// secured and connected; the pump gets their libzmq handles and uses them
// from its two threads only (each socket from one thread), until Stop. The
// calls go through the libzmq that pyzmq loaded (sockets/zmq_api.h).
//
// What the threads do is what python/mltuner/transport/_sockets.py's
// Python threads do (the fallback where no libzmq can be found):
// - send: one wake-up takes every message waiting (NextOutgoingBatch, which
//   joins small ones per peer into batches); a payload of 64 KiB or more
//   goes without a copy (ZeroMQ holds the message until the bytes are out,
//   then the pump's free callback drops it, returning a host frame to its
//   pool); the payload bytes handed to ZeroMQ for one peer and not yet out
//   are bounded (SetQueueLimit), a send waits for room up to the wait
//   timeout, and a peer that takes nothing for that long is declared stuck
//   (the node is aborted naming it);
// - receive: each message must be two frames (a header and a payload;
//   others are refused and counted); a payload of 8 KiB or more is used in
//   place where the node lends (the CPU backend): the pump keeps the
//   ZeroMQ message by token until the node hands the token back.
//
// Thread safety: every method from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mltuner/process_node.h"
#include "mltuner/status.h"

namespace mltuner {

struct SocketPumpOptions {
  std::string zmq_library;     // the path of the libzmq that made the sockets
  std::map<int, void*> peers;  // rank -> PUSH socket to that peer's data socket
  std::vector<void*> inboxes;  // bound PULL sockets
  int64_t wait_timeout_ms = 0;
  int64_t queue_limit_bytes = 0;  // per peer; 0: no bound
};

// The pump's counters, for tests and logs.
struct SocketPumpStats {
  std::map<int, int64_t> queued_bytes;  // per peer: handed to ZeroMQ, not yet out
  std::map<int, int64_t> peak_queued_bytes;
  int64_t lent_payloads = 0;      // received payloads the node still reads in place
  int64_t refused_messages = 0;   // messages of other than two frames
  int64_t sent_messages = 0;
  int64_t received_messages = 0;
  int64_t stalls = 0;             // StallNextDelivery's stalls done
};

class SocketPump {
 public:
  // Starts both threads over `node` (which must outlive the pump).
  // InvalidArgument when the library cannot be used or a handle is null.
  static Status Start(ProcessNode* node, SocketPumpOptions options, std::unique_ptr<SocketPump>* out);
  ~SocketPump();  // Stop
  SocketPump(const SocketPump&) = delete;
  SocketPump& operator=(const SocketPump&) = delete;

  // Joins both threads (within about 50 ms of the node's outbox being
  // closed and drained, or at once when the node is aborted). The sockets
  // are the caller's again afterwards. Idempotent.
  void Stop();

  void SetQueueLimit(int64_t bytes);
  SocketPumpStats stats() const;
  // Reasons of refused input since the last call (at most the latest 16;
  // Deliver's refusals and the pump's own), for the caller's rate-limited log.
  std::vector<std::string> TakeRefusals();
  // Why a peer was declared stuck, or empty.
  std::string stuck() const;
  // For tests of back-pressure and liveness: the next received message with
  // a payload of at least `min_payload_bytes` waits `milliseconds` before
  // it is delivered (the receive thread reads nothing meanwhile), as a
  // receiver far slower than its sender would. A stop ends the wait.
  void StallNextDelivery(int64_t min_payload_bytes, int64_t milliseconds);

  class Impl;

 private:
  explicit SocketPump(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mltuner
