// Encoding and checking of batches (see batch.h). The decoder treats both
// frames as hostile, as DecodeMessage does: every size is checked before it
// is used, and entries are copied out with memcpy (frames need not be
// aligned).
#include "wire/batch.h"

#include <cstring>

#include "wire/message.h"

namespace mltuner {

namespace {

constexpr size_t kHeaderBytes = sizeof(MessageHeader);
constexpr size_t kEntryBytes = sizeof(BatchEntry);

}  // namespace

Status EncodeBatch(int sender, int receiver, const std::vector<FramePair>& parts, std::string* frame0,
                   std::vector<float>* payload) {
  if (parts.empty() || parts.size() > kMaxBatchParts) {
    return Status::InvalidArgument("a batch holds 1 to " + std::to_string(kMaxBatchParts) + " messages, not " +
                                   std::to_string(parts.size()));
  }
  size_t text_bytes = 0;
  size_t payload_bytes = 0;
  for (const FramePair& part : parts) {
    if (part.payload_bytes % sizeof(float) != 0) {
      return Status::InvalidArgument("a batch part's payload of " + std::to_string(part.payload_bytes) +
                                     " bytes is not a whole number of floats");
    }
    text_bytes += kEntryBytes + part.frame0_bytes;
    payload_bytes += part.payload_bytes;
  }
  if (text_bytes > UINT32_MAX) return Status::InvalidArgument("a batch's frame 0 would pass 4 GiB");
  MessageHeader header;
  header.type = static_cast<uint16_t>(MessageType::kBatch);
  header.sender = sender;
  header.receiver = receiver;
  header.text_bytes = static_cast<uint32_t>(text_bytes);
  frame0->assign(kHeaderBytes + text_bytes, '\0');
  char* cursor = &(*frame0)[0];
  std::memcpy(cursor, &header, kHeaderBytes);
  cursor += kHeaderBytes;
  payload->resize(payload_bytes / sizeof(float));
  char* values = reinterpret_cast<char*>(payload->data());
  for (const FramePair& part : parts) {
    const BatchEntry entry{part.frame0_bytes, part.payload_bytes};
    std::memcpy(cursor, &entry, kEntryBytes);
    cursor += kEntryBytes;
    if (part.frame0_bytes > 0) std::memcpy(cursor, part.frame0, part.frame0_bytes);
    cursor += part.frame0_bytes;
    if (part.payload_bytes > 0) std::memcpy(values, part.payload, part.payload_bytes);
    values += part.payload_bytes;
  }
  return Status::Ok();
}

bool IsBatch(const void* frame0, size_t frame0_bytes) {
  if (frame0 == nullptr || frame0_bytes < kHeaderBytes) return false;
  MessageHeader header;
  std::memcpy(&header, frame0, kHeaderBytes);
  return header.magic == kWireMagic && header.version == kWireVersion &&
         header.type == static_cast<uint16_t>(MessageType::kBatch);
}

Status DecodeBatch(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                   std::vector<FramePair>* parts, int* sender, int* receiver) {
  if (!IsBatch(frame0, frame0_bytes)) return Status::CorruptMessage("not a batch envelope");
  if (payload == nullptr && payload_bytes > 0) return Status::CorruptMessage("the batch's payload frame is missing");
  const auto* bytes = static_cast<const unsigned char*>(frame0);
  MessageHeader header;
  std::memcpy(&header, bytes, kHeaderBytes);
  if (header.num_spans != 0 || header.flags != 0 || header.row_width != 0) {
    return Status::CorruptMessage("a batch envelope with spans, flags or a row width");
  }
  if (uint64_t{kHeaderBytes} + header.text_bytes != frame0_bytes) {
    return Status::CorruptMessage("batch frame 0 is " + std::to_string(frame0_bytes) + " bytes, but its header says " +
                                  std::to_string(kHeaderBytes + uint64_t{header.text_bytes}));
  }
  std::vector<FramePair> found;
  size_t at = kHeaderBytes;
  size_t used = 0;  // payload bytes claimed so far
  const auto* values = static_cast<const unsigned char*>(payload);
  while (at < frame0_bytes) {
    if (found.size() == kMaxBatchParts) {
      return Status::CorruptMessage("a batch of more than " + std::to_string(kMaxBatchParts) + " messages");
    }
    if (frame0_bytes - at < kEntryBytes) return Status::CorruptMessage("a batch entry cut short");
    BatchEntry entry;
    std::memcpy(&entry, bytes + at, kEntryBytes);
    at += kEntryBytes;
    if (entry.frame0_bytes > frame0_bytes - at) {
      return Status::CorruptMessage("batch part " + std::to_string(found.size()) + " claims " +
                                    std::to_string(entry.frame0_bytes) + " bytes of frame 0, past its end");
    }
    if (entry.payload_bytes % sizeof(float) != 0 || entry.payload_bytes > payload_bytes - used) {
      return Status::CorruptMessage("batch part " + std::to_string(found.size()) + " claims " +
                                    std::to_string(entry.payload_bytes) + " payload bytes, of " +
                                    std::to_string(payload_bytes - used) + " left");
    }
    FramePair part;
    part.frame0 = bytes + at;
    part.frame0_bytes = static_cast<size_t>(entry.frame0_bytes);
    part.payload = entry.payload_bytes > 0 ? values + used : nullptr;
    part.payload_bytes = static_cast<size_t>(entry.payload_bytes);
    at += part.frame0_bytes;
    used += part.payload_bytes;
    found.push_back(part);
  }
  if (found.empty()) return Status::CorruptMessage("an empty batch");
  if (used != payload_bytes) {
    return Status::CorruptMessage("the batch's parts claim " + std::to_string(used) + " of its " +
                                  std::to_string(payload_bytes) + " payload bytes");
  }
  *parts = std::move(found);
  *sender = header.sender;
  *receiver = header.receiver;
  return Status::Ok();
}

}  // namespace mltuner
