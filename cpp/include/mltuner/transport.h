// Transport: how engines and server shards reach each other.
//
// Every process runs one worker engine and one server shard with the same
// rank. A transport delivers a message to process header.receiver: to its
// shard when the type is server-bound, to its engine otherwise. Messages
// between two processes arrive in the order they were sent.
//
// Thread safety: Send may be called from any thread. It queues the message
// and returns; it never waits for the receiver, only (ProcessNode) for room
// in a bounded outbox, for at most the wait timeout.
#pragma once

#include <cstddef>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

struct Message;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual Status Send(Message&& message) = 0;
  // Sends messages built together (a burst of small tables' updates) in
  // order; a transport may hand them on as one, so that the burst costs one
  // wake-up of each thread on its way instead of one per message. Stops at
  // the first failure.
  virtual Status SendAll(std::vector<Message>&& messages);
  // Registers a communicated table with the shard of process `rank`.
  virtual Status AddTableToShard(int rank, const TableInfo& info) = 0;
  // Unregisters one again, before any worker is ready (Engine::DropTables).
  virtual Status DropTableFromShard(int rank, TableId table) = 0;
  // Whether a message from process `sender` to process `receiver` may carry
  // its values as a device buffer (Message::device_values): true when both
  // run in this process on memory the same device can address directly, or
  // (ProcessNode) the receiver is a process of this host reached by CUDA
  // IPC, where the transport copies them device -> device.
  virtual bool SharesDevice(int sender, int receiver) const {
    (void)sender;
    (void)receiver;
    return false;
  }
};

// Messages for other processes held to leave together (Transport::SendAll):
// a thread that builds many small ones (a clock's updates of many tables, a
// shard's replies) sends them as one burst once it has nothing more to do,
// or once their payloads pass `flush_bytes`, so the burst costs each thread
// on its way one wake-up rather than one per message. Not thread-safe: one
// owner thread.
class HeldMessages {
 public:
  explicit HeldMessages(size_t flush_bytes);
  ~HeldMessages();  // in transport.cc, where Message is complete
  // Holds `message`; true once the held payloads reach flush_bytes (time to Flush).
  bool Hold(Message&& message);
  // Sends what is held, in order, as one burst (nothing when none is);
  // *sent, when given, is the number of messages handed on.
  Status Flush(Transport* transport, int64_t* sent = nullptr);

 private:
  const size_t flush_bytes_;
  std::vector<Message> messages_;
  size_t bytes_ = 0;
};

}  // namespace mltuner
