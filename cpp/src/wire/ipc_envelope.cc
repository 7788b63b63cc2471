// Encoding and checking of CUDA IPC envelopes (see ipc_envelope.h).
#include "wire/ipc_envelope.h"

#include <cstring>

namespace mltuner {

namespace {

constexpr size_t kHeaderBytes = sizeof(MessageHeader);
constexpr size_t kSpanBytes = sizeof(IpcSpan);

std::string Encode(MessageType type, int sender, int receiver, const IpcSpan& span, const std::string& inner) {
  MessageHeader header;
  header.type = static_cast<uint16_t>(type);
  header.sender = sender;
  header.receiver = receiver;
  header.text_bytes = static_cast<uint32_t>(kSpanBytes + inner.size());
  std::string frame0(kHeaderBytes + kSpanBytes + inner.size(), '\0');
  std::memcpy(&frame0[0], &header, kHeaderBytes);
  std::memcpy(&frame0[kHeaderBytes], &span, kSpanBytes);
  if (!inner.empty()) std::memcpy(&frame0[kHeaderBytes + kSpanBytes], inner.data(), inner.size());
  return frame0;
}

}  // namespace

std::string EncodeIpcNotice(int sender, int receiver, const IpcSpan& span, const std::string& message_frame0) {
  return Encode(MessageType::kIpcNotice, sender, receiver, span, message_frame0);
}

std::string EncodeIpcRelease(int sender, int receiver, const IpcSpan& span) {
  return Encode(MessageType::kIpcRelease, sender, receiver, span, std::string());
}

bool IsIpcEnvelope(const void* frame0, size_t frame0_bytes) {
  if (frame0 == nullptr || frame0_bytes < kHeaderBytes) return false;
  MessageHeader header;
  std::memcpy(&header, frame0, kHeaderBytes);
  return header.magic == kWireMagic && header.version == kWireVersion &&
         (header.type == static_cast<uint16_t>(MessageType::kIpcNotice) ||
          header.type == static_cast<uint16_t>(MessageType::kIpcRelease));
}

Status DecodeIpcEnvelope(const void* frame0, size_t frame0_bytes, size_t payload_bytes, IpcEnvelope* out) {
  if (!IsIpcEnvelope(frame0, frame0_bytes)) return Status::CorruptMessage("not a CUDA IPC envelope");
  const auto* bytes = static_cast<const unsigned char*>(frame0);
  MessageHeader header;
  std::memcpy(&header, bytes, kHeaderBytes);
  const auto type = static_cast<MessageType>(header.type);
  const char* name = MessageTypeName(type);
  if (header.num_spans != 0 || header.flags != 0 || header.row_width != 0) {
    return Status::CorruptMessage(std::string("an ") + name + " envelope with spans, flags or a row width");
  }
  if (uint64_t{kHeaderBytes} + header.text_bytes != frame0_bytes) {
    return Status::CorruptMessage(std::string(name) + " frame 0 is " + std::to_string(frame0_bytes) +
                                  " bytes, but its header says " + std::to_string(kHeaderBytes + uint64_t{header.text_bytes}));
  }
  if (header.text_bytes < kSpanBytes) return Status::CorruptMessage(std::string("an ") + name + " without its span");
  // A release carries its span alone; a notice also the message's frame 0.
  if (type == MessageType::kIpcRelease && header.text_bytes != kSpanBytes) {
    return Status::CorruptMessage("an IpcRelease with " + std::to_string(header.text_bytes - kSpanBytes) +
                                  " bytes after its span");
  }
  if (type == MessageType::kIpcNotice && header.text_bytes == kSpanBytes) {
    return Status::CorruptMessage("an IpcNotice without the message it announces");
  }
  if (payload_bytes != 0) {
    return Status::CorruptMessage(std::string("an ") + name + " with a payload frame of " +
                                  std::to_string(payload_bytes) + " bytes (its bytes travel by CUDA IPC)");
  }
  IpcEnvelope envelope;
  envelope.type = type;
  envelope.sender = header.sender;
  envelope.receiver = header.receiver;
  std::memcpy(&envelope.span, bytes + kHeaderBytes, kSpanBytes);
  envelope.inner_bytes = header.text_bytes - kSpanBytes;
  envelope.inner = envelope.inner_bytes > 0 ? bytes + kHeaderBytes + kSpanBytes : nullptr;
  *out = envelope;
  return Status::Ok();
}

}  // namespace mltuner
