// The wire format between clients and server shards.
//
// A message is a fixed 64-byte header, a list of row spans, and a payload of
// float32 values: the rows of every span in order, row_width values each.
// On the wire it is two frames: frame 0 = header + spans, frame 1 = payload
// (raw floats, sent and received without copies by the transport). Nothing is
// ever serialised as an object; decoding validates every field so a
// malformed, truncated or foreign message is rejected with kCorruptMessage.
//
// All integers are little-endian (checked at compile time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

constexpr uint32_t kWireMagic = 0x4E544C4Du;  // "MLTN" in little-endian bytes
constexpr uint16_t kWireVersion = 1;

enum class MessageType : uint16_t {
  kClockUpdate = 1,  // client -> shard: the client's updates of `table` for `clock`
                     //   (zero spans = a bare clock) and "I finished clock"
  kStart = 2,        // client -> shard: initialisation is done (clock -1 ends)
  kRows = 3,         // shard -> client: fresh rows; clock = their data age
  kFetch = 4,        // client -> shard: send me the current values of spans
  kFetchReply = 5,   // shard -> client: values for request_id
  kInitAdd = 6,      // client -> shard: add values directly (initialisation)
  kAck = 7,          // shard -> client: request_id done
  kError = 8,        // shard -> client: request_id failed; payload is empty,
                     //   the reason is in the spans-free text frame (see below)
  kReady = 9,        // client -> shard: my tables are created; text = their
                     //   schema (wire/table_schema.h). Each shard acks once every worker is ready,
                     //   so no message can reach a shard before its tables.
  kFork = 10,        // client -> shard: fork `branch` (text = its settings,
                     //   wire/branch_settings.h); done and acked to everyone
                     //   once every worker asked
  kFreeBranch = 11,  // client -> shard: free `branch`; done and acked once
                     //   every worker asked
  kBranchRows = 12,  // client -> shard: push me every table's rows of `branch`
                     //   (after a branch switch emptied my cache)
  kBatch = 13,       // process -> process: several messages in one pair of
                     //   frames (wire/batch.h); the transport's envelope,
                     //   opened on arrival, never seen by engine or shard
  kIpcNotice = 14,   // process -> process of one host: a message whose payload
                     //   the sender copied into the receiver's CUDA IPC
                     //   landing region (wire/ipc_envelope.h); an envelope
  kIpcRelease = 15,  // the receiver is done with a landed payload: the sender
                     //   may write those bytes again; an envelope
  kEmptyClock = 16,  // client -> shard: worker `request_id`'s `clock` of
                     //   `branch` computes nothing (batch stealing): count
                     //   it in every table now, drop that worker's own update
                     //   of it (server/vector_clock.h); no reply
};
constexpr uint16_t kMaxMessageType = 16;

const char* MessageTypeName(MessageType type);

// Server-bound messages go to a process's shard, the rest to its client.
bool IsServerBound(MessageType type);

struct RowSpan {
  int64_t begin = 0;  // first row id, in the table's row-id space
  int64_t count = 0;
};

// Bits of MessageHeader::flags.
enum MessageFlags : uint32_t {
  // A kClockUpdate whose sender's application set the table's learning rate
  // for this clock: from this clock on, the table's rule on the branch uses
  // header.learning_rate. Every worker must send the same rate with the
  // same clock (the shard checks).
  kNewLearningRate = 1u << 0,
  // A kClockUpdate of a clock its sender skips (a mixed-precision scaler's
  // overflow, where torch skips optimizer.step()): the shard applies no
  // rule to any table for that clock if any worker's update says so; the
  // clock still advances and its rows are pushed.
  kSkipStep = 1u << 1,
};
constexpr uint32_t kKnownMessageFlags = kNewLearningRate | kSkipStep;

#pragma pack(push, 1)
struct MessageHeader {
  uint32_t magic = kWireMagic;
  uint16_t version = kWireVersion;
  uint16_t type = 0;          // MessageType
  int32_t sender = -1;        // rank of the sending process
  int32_t receiver = -1;      // rank of the receiving process
  int32_t table = -1;         // table id
  int32_t branch = 0;         // branch id (0 until the tuner forks branches)
  int64_t clock = 0;          // clock of updates, data age of rows, or a
                              //   kError's StatusCode (0 from old peers)
  int64_t request_id = 0;     // pairs kFetch/kInitAdd with kFetchReply/kAck/kError
  int64_t row_width = 0;      // floats per row in the payload
  uint32_t num_spans = 0;     // RowSpan entries after the header in frame 0
  uint32_t text_bytes = 0;    // bytes of text after the spans: kError's UTF-8 reason,
                              //   kReady's schema or kFork's settings (fixed structs)
  float learning_rate = 0;    // with kNewLearningRate: the rate (see below)
  uint32_t flags = 0;         // MessageFlags bits; zero when unused (the
                              //   early version-1 field `reserved` was zero)
};
#pragma pack(pop)
static_assert(sizeof(MessageHeader) == 64, "MessageHeader must stay 64 bytes");

struct DeviceBuffer;  // memory/device_block.h

struct Message {
  MessageHeader header;
  std::vector<RowSpan> spans;
  std::vector<float> values;  // sum(span.count) * row_width floats
  std::string text;           // kError's reason, or the bytes of kReady's schema
                              //   or kFork's settings; empty otherwise
  // Between a worker and a shard of one process the values stay in device
  // memory: then they are here and `values` is empty. Never encoded; a
  // transport to another process copies them into `values` first.
  std::shared_ptr<DeviceBuffer> device_values;
  // To and from another process the values travel in a host frame (pinned,
  // recycled; memory/device_block.h): then they are here and `values` is
  // empty. The frame's `ready` is the ticket of the device -> host copy that
  // fills it; whoever reads it on the host waits for it first (WaitReady;
  // the transport does before a frame leaves or is delivered), and a
  // consumer that copies it to the device sets `last_use`.
  std::shared_ptr<DeviceBuffer> host_frame;

  size_t num_values() const;
  // The host values, from the frame or from `values`; null when on device.
  const float* host_values() const;

  MessageType type() const { return static_cast<MessageType>(header.type); }
  int64_t total_rows() const;
  // One line for logs: type, sender -> receiver, table, clock, spans, bytes.
  std::string DebugString() const;
};

// A message with its routing fields set and everything else empty.
Message NewMessage(MessageType type, int sender, int receiver, TableId table);

// A kError telling `receiver` that a message with no reply was refused:
// request id 0, the reason as text, its status code in header.clock.
Message RefusalMessage(int sender, int receiver, TableId table, const Status& why);
// The Status a kError carries: its code (kInternal when unknown) and text.
Status ErrorOf(const Message& error);

// Builds frame 0 (header + spans + text). The payload frame is
// message.values' bytes as they are.
std::string EncodeHeaderFrame(const Message& message);

// Parses and validates both frames into *out. Rejects (kCorruptMessage, with
// the reason) a wrong magic or version, an unknown type or a kBatch
// envelope (wire/batch.h opens those), a frame-0 size that
// does not match num_spans and text_bytes, negative or overflowing spans, a
// payload size that is not sum(count) * row_width * 4, and a non-positive
// row_width when there is payload. Never reads past either frame. The
// payload is copied into `storage` (a recycled buffer, resized as needed).
Status DecodeMessage(const void* frame0, size_t frame0_bytes, const void* payload,
                     size_t payload_bytes, Message* out, std::vector<float> storage = {});
// The same, with the payload copied to where `place` says: it is called once
// the message is valid, with the decoded message and the float count, and
// returns the destination (a host frame it attached, say), or fails. A null
// destination copies nothing: the placer took the payload where it lies
// (it attached a host frame that views it), or there is none.
using PayloadPlacer = std::function<Status(Message* message, size_t count, float** destination)>;
Status DecodeMessage(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                     Message* out, const PayloadPlacer& place);

}  // namespace mltuner
