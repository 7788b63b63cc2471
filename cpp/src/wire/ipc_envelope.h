// CUDA IPC envelopes: what travels over the socket when a payload went
// device -> device into the receiver's landing region (cluster/ipc_links.h).
//
// kIpcNotice, sender -> receiver: frame 0 is a kIpcNotice header (sender,
// receiver; no spans, flags or row width) whose text is an IpcSpan (where in
// the sender's slice of the receiver's landing region the payload lies, and
// which of the sender's copy events to wait on before reading it) followed
// by the message's own frame 0; the payload frame is empty. The
// receiver validates the span against its region before anything reads it.
// kIpcRelease, receiver -> sender: the same header whose text is exactly the
// IpcSpan of a landed payload the receiver no longer reads.
//
// Threading: pure functions. The decoder treats frame 0 as hostile: every
// size is checked before use, and nothing is read past the frame.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mltuner/status.h"
#include "wire/message.h"

namespace mltuner {

#pragma pack(push, 1)
struct IpcSpan {
  uint64_t offset = 0;  // bytes from the start of the sender's slice
  uint64_t bytes = 0;   // payload bytes there
  uint64_t event = 0;   // the sender's copy event recorded after the copy (DeviceIpc::kCopyEvents)
};
#pragma pack(pop)
static_assert(sizeof(IpcSpan) == 24, "IpcSpan must stay 24 bytes");

// A decoded envelope; `inner` points into the frame it came from (a
// notice's message frame 0; empty for a release).
struct IpcEnvelope {
  MessageType type = MessageType::kIpcNotice;
  int sender = -1;
  int receiver = -1;
  IpcSpan span;
  const void* inner = nullptr;
  size_t inner_bytes = 0;
};

std::string EncodeIpcNotice(int sender, int receiver, const IpcSpan& span, const std::string& message_frame0);
std::string EncodeIpcRelease(int sender, int receiver, const IpcSpan& span);

// Whether frame 0 starts with a kIpcNotice or kIpcRelease header (magic and
// version checked).
bool IsIpcEnvelope(const void* frame0, size_t frame0_bytes);

// Checks the envelope (header fields, frame-0 size, an empty payload frame:
// `payload_bytes` must be 0) and splits it; kCorruptMessage with the reason
// otherwise. The span is not checked here: only the receiver's region knows
// its bounds (IpcLinks::Land does).
Status DecodeIpcEnvelope(const void* frame0, size_t frame0_bytes, size_t payload_bytes, IpcEnvelope* out);

}  // namespace mltuner
