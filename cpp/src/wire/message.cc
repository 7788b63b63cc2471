// Encoding and validating decoding of wire messages (see message.h).
//
// Frame 0 is: the 64-byte packed MessageHeader, then num_spans RowSpan
// structs (16 bytes each: int64 begin, int64 count), then text_bytes of text.
// Frame 1 is the payload of float32 values. The decoder treats both frames as
// hostile: it checks every size before reading, copies with memcpy (frames
// need not be aligned) and never allocates more than the frames can fill.
#include "wire/message.h"

#include "memory/device_block.h"

#include <cstring>
#include <limits>
#include <sstream>

namespace mltuner {

size_t Message::num_values() const {
  if (device_values) return device_values->count;
  if (host_frame) return host_frame->count;
  return values.size();
}

const float* Message::host_values() const {
  if (device_values) return nullptr;
  return host_frame ? host_frame->data : values.data();
}

// The wire format is defined as little-endian and the codec copies integers
// as they lie in memory, so a big-endian build would silently misread.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "mltuner's wire format assumes a little-endian host");
static_assert(sizeof(RowSpan) == 16, "RowSpan must be two int64 on the wire");

namespace {

constexpr size_t kHeaderBytes = sizeof(MessageHeader);
constexpr size_t kSpanBytes = sizeof(RowSpan);
// No sane message carries a terabyte; the cap keeps every product below
// int64 range, so later arithmetic on validated sizes cannot overflow.
constexpr int64_t kMaxPayloadBytes = int64_t{1} << 40;

std::string Describe(const char* what, int64_t value) {
  return std::string(what) + " " + std::to_string(value);
}

Status CheckHeaderIdentity(const MessageHeader& h) {
  if (h.magic != kWireMagic) return Status::CorruptMessage("not an mltuner message (bad magic)");
  if (h.version != kWireVersion) {
    return Status::CorruptMessage("wire version " + std::to_string(h.version) + ", expected " +
                                  std::to_string(kWireVersion));
  }
  if (h.type == 0 || h.type > kMaxMessageType) {
    return Status::CorruptMessage(Describe("unknown message type", h.type));
  }
  if (h.row_width < 0) return Status::CorruptMessage(Describe("negative row_width", h.row_width));
  if ((h.flags & ~kKnownMessageFlags) != 0) return Status::CorruptMessage(Describe("unknown flags", h.flags));
  if ((h.flags & kSkipStep) != 0 && static_cast<MessageType>(h.type) != MessageType::kClockUpdate) {
    return Status::CorruptMessage("a skipped step on a message that is not a clock update");
  }
  if ((h.flags & kNewLearningRate) != 0) {
    if (static_cast<MessageType>(h.type) != MessageType::kClockUpdate) {
      return Status::CorruptMessage("a learning rate on a message that is not a clock update");
    }
    if (!(h.learning_rate >= 0 && h.learning_rate <= 3.0e38f)) {  // also refuses NaN and inf
      return Status::CorruptMessage("learning rate " + std::to_string(h.learning_rate) +
                                    " is not a finite number >= 0");
    }
  }
  return Status::Ok();
}

Status CheckFrame0Size(const MessageHeader& h, size_t frame0_bytes) {
  // num_spans and text_bytes are uint32, so this sum fits in uint64.
  const uint64_t want = kHeaderBytes + uint64_t{h.num_spans} * kSpanBytes + uint64_t{h.text_bytes};
  if (want != frame0_bytes) {
    std::ostringstream msg;
    msg << "frame 0 is " << frame0_bytes << " bytes, but num_spans=" << h.num_spans
        << " and text_bytes=" << h.text_bytes << " need " << want;
    return Status::CorruptMessage(msg.str());
  }
  return Status::Ok();
}

// Copies the spans out of frame 0 and checks each one; *total_rows is the sum
// of their counts, proven not to overflow.
Status ReadSpans(const unsigned char* bytes, uint32_t num_spans, std::vector<RowSpan>* spans,
                 int64_t* total_rows) {
  spans->resize(num_spans);
  if (num_spans > 0) std::memcpy(spans->data(), bytes, size_t{num_spans} * kSpanBytes);
  int64_t total = 0;
  for (uint32_t i = 0; i < num_spans; ++i) {
    const RowSpan& span = (*spans)[i];
    if (span.begin < 0 || span.count < 0) {
      return Status::CorruptMessage("span " + std::to_string(i) + " has begin " + std::to_string(span.begin) +
                                    " and count " + std::to_string(span.count) + "; both must be >= 0");
    }
    int64_t end = 0;
    if (__builtin_add_overflow(span.begin, span.count, &end)) {
      return Status::CorruptMessage("span " + std::to_string(i) + " runs past the row-id range");
    }
    if (__builtin_add_overflow(total, span.count, &total)) {
      return Status::CorruptMessage("span counts overflow when summed");
    }
  }
  *total_rows = total;
  return Status::Ok();
}

// The payload must hold exactly total_rows * row_width floats. A kFetch is a
// request: its spans name the rows wanted, so it may also come with no payload.
Status CheckPayloadSize(const MessageHeader& h, int64_t total_rows, size_t payload_bytes) {
  if (payload_bytes > 0 && h.row_width <= 0) {
    return Status::CorruptMessage(Describe("payload present but row_width is", h.row_width));
  }
  int64_t floats = 0;
  int64_t want = 0;
  if (__builtin_mul_overflow(total_rows, h.row_width, &floats) ||
      __builtin_mul_overflow(floats, int64_t{sizeof(float)}, &want) || want > kMaxPayloadBytes) {
    return Status::CorruptMessage("payload of " + std::to_string(total_rows) + " rows x " +
                                  std::to_string(h.row_width) + " floats is implausibly large");
  }
  const bool bare_fetch = static_cast<MessageType>(h.type) == MessageType::kFetch && payload_bytes == 0;
  if (static_cast<uint64_t>(want) != payload_bytes && !bare_fetch) {
    std::ostringstream msg;
    msg << "payload is " << payload_bytes << " bytes, expected " << want << " (" << total_rows << " rows x "
        << h.row_width << " floats x 4)";
    return Status::CorruptMessage(msg.str());
  }
  return Status::Ok();
}

}  // namespace

Message NewMessage(MessageType type, int sender, int receiver, TableId table) {
  Message message;
  message.header.type = static_cast<uint16_t>(type);
  message.header.sender = sender;
  message.header.receiver = receiver;
  message.header.table = table;
  return message;
}

Message RefusalMessage(int sender, int receiver, TableId table, const Status& why) {
  Message refusal = NewMessage(MessageType::kError, sender, receiver, table);
  refusal.header.clock = static_cast<int64_t>(why.code());
  refusal.text = why.message();
  refusal.header.text_bytes = static_cast<uint32_t>(refusal.text.size());
  return refusal;
}

Status ErrorOf(const Message& error) {
  const int64_t code = error.header.clock;
  const bool fits = code > 0 && code <= std::numeric_limits<int>::max();
  return Status::FromCode(fits ? static_cast<StatusCode>(code) : StatusCode::kInternal, error.text);
}

const char* MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kClockUpdate: return "ClockUpdate";
    case MessageType::kStart: return "Start";
    case MessageType::kRows: return "Rows";
    case MessageType::kFetch: return "Fetch";
    case MessageType::kFetchReply: return "FetchReply";
    case MessageType::kInitAdd: return "InitAdd";
    case MessageType::kAck: return "Ack";
    case MessageType::kError: return "Error";
    case MessageType::kReady: return "Ready";
    case MessageType::kFork: return "Fork";
    case MessageType::kFreeBranch: return "FreeBranch";
    case MessageType::kBranchRows: return "BranchRows";
    case MessageType::kBatch: return "Batch";
    case MessageType::kIpcNotice: return "IpcNotice";
    case MessageType::kIpcRelease: return "IpcRelease";
    case MessageType::kEmptyClock: return "EmptyClock";
  }
  return "Unknown";
}

bool IsServerBound(MessageType type) {
  switch (type) {
    case MessageType::kClockUpdate:
    case MessageType::kStart:
    case MessageType::kFetch:
    case MessageType::kInitAdd:
    case MessageType::kReady:
    case MessageType::kFork:
    case MessageType::kFreeBranch:
    case MessageType::kBranchRows:
    case MessageType::kEmptyClock:
      return true;
    default:
      return false;
  }
}

int64_t Message::total_rows() const {
  int64_t total = 0;
  for (const RowSpan& span : spans) total += span.count;
  return total;
}

std::string Message::DebugString() const {
  std::ostringstream out;
  out << MessageTypeName(type()) << " " << header.sender << " -> " << header.receiver << " table=" << header.table
      << " branch=" << header.branch << " clock=" << header.clock << " request=" << header.request_id
      << " spans=" << spans.size() << " rows=" << total_rows() << " width=" << header.row_width
      << " bytes=" << num_values() * sizeof(float);
  if ((header.flags & kNewLearningRate) != 0) out << " new_lr=" << header.learning_rate;
  if ((header.flags & kSkipStep) != 0) out << " skip_step";
  // Only kError's text is words; kReady and kFork carry fixed structs.
  if (!text.empty() && type() == MessageType::kError) out << " text=\"" << text << "\"";
  if (!text.empty() && type() != MessageType::kError) out << " text_bytes=" << text.size();
  return out.str();
}

std::string EncodeHeaderFrame(const Message& message) {
  // The counts in the header always describe the frame actually built, so a
  // caller cannot produce a frame its own decoder would reject for size.
  MessageHeader header = message.header;
  header.num_spans = static_cast<uint32_t>(message.spans.size());
  header.text_bytes = static_cast<uint32_t>(message.text.size());

  std::string frame(kHeaderBytes + message.spans.size() * kSpanBytes + message.text.size(), '\0');
  char* cursor = &frame[0];
  std::memcpy(cursor, &header, kHeaderBytes);
  cursor += kHeaderBytes;
  if (!message.spans.empty()) {
    std::memcpy(cursor, message.spans.data(), message.spans.size() * kSpanBytes);
    cursor += message.spans.size() * kSpanBytes;
  }
  if (!message.text.empty()) std::memcpy(cursor, message.text.data(), message.text.size());
  return frame;
}

Status DecodeMessage(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                     Message* out, std::vector<float> storage) {
  auto* kept = &storage;
  return DecodeMessage(frame0, frame0_bytes, payload, payload_bytes, out,
                       [kept](Message* message, size_t count, float** destination) {
                         message->values = std::move(*kept);
                         message->values.resize(count);
                         *destination = message->values.data();
                         return Status::Ok();
                       });
}

Status DecodeMessage(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                     Message* out, const PayloadPlacer& place) {
  if (frame0 == nullptr || frame0_bytes < kHeaderBytes) {
    return Status::CorruptMessage("frame 0 is " + std::to_string(frame0_bytes) + " bytes, shorter than the " +
                                  std::to_string(kHeaderBytes) + "-byte header");
  }
  if (payload == nullptr && payload_bytes > 0) return Status::CorruptMessage("payload frame is missing");
  const auto* bytes = static_cast<const unsigned char*>(frame0);

  // Decode into a local so a rejected message leaves *out untouched.
  Message message;
  std::memcpy(&message.header, bytes, kHeaderBytes);
  const MessageHeader& h = message.header;
  MLT_RETURN_IF_ERROR(CheckHeaderIdentity(h));
  if (static_cast<MessageType>(h.type) == MessageType::kBatch) {
    return Status::CorruptMessage("a batch envelope where one message belongs (batches do not nest)");
  }
  if (static_cast<MessageType>(h.type) == MessageType::kIpcNotice ||
      static_cast<MessageType>(h.type) == MessageType::kIpcRelease) {
    return Status::CorruptMessage("a CUDA IPC envelope where one message belongs (envelopes do not nest)");
  }
  MLT_RETURN_IF_ERROR(CheckFrame0Size(h, frame0_bytes));

  int64_t total_rows = 0;
  MLT_RETURN_IF_ERROR(ReadSpans(bytes + kHeaderBytes, h.num_spans, &message.spans, &total_rows));
  MLT_RETURN_IF_ERROR(CheckPayloadSize(h, total_rows, payload_bytes));

  const size_t text_offset = kHeaderBytes + size_t{h.num_spans} * kSpanBytes;
  message.text.assign(reinterpret_cast<const char*>(bytes + text_offset), h.text_bytes);
  float* destination = nullptr;
  MLT_RETURN_IF_ERROR(place(&message, payload_bytes / sizeof(float), &destination));
  if (payload_bytes > 0 && destination != nullptr) std::memcpy(destination, payload, payload_bytes);
  *out = std::move(message);
  return Status::Ok();
}

}  // namespace mltuner
