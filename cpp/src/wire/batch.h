// Batches: several encoded messages for one process in one pair of frames,
// so that a clock's small messages (one per table and peer) cost the
// transport one socket message per peer instead of one each.
//
// Frame 0 is a kBatch header (sender, receiver; no spans) whose text holds,
// per part in order, a BatchEntry (the sizes of the part's two frames)
// followed by the part's frame 0. Frame 1 holds the parts' payloads back to
// back. Each part is an ordinary message (wire/message.h), validated by
// DecodeMessage when it is delivered; a batch holds no batch.
//
// Threading: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mltuner/status.h"

namespace mltuner {

// The most parts one batch may hold: the decoder refuses more.
constexpr size_t kMaxBatchParts = 1024;

// One message's two frames, as they lie in memory (not owned).
struct FramePair {
  const void* frame0 = nullptr;
  size_t frame0_bytes = 0;
  const void* payload = nullptr;
  size_t payload_bytes = 0;  // a whole number of floats
};

#pragma pack(push, 1)
struct BatchEntry {
  uint64_t frame0_bytes = 0;
  uint64_t payload_bytes = 0;
};
#pragma pack(pop)
static_assert(sizeof(BatchEntry) == 16, "BatchEntry must stay 16 bytes");

// Builds the batch of `parts` (1..kMaxBatchParts, each payload a whole
// number of floats) from `sender` to `receiver`: *frame0 and, copied back to
// back, *payload.
Status EncodeBatch(int sender, int receiver, const std::vector<FramePair>& parts, std::string* frame0,
                   std::vector<float>* payload);

// Splits a received batch into its parts, which point into the two frames.
// Checks the envelope only (a kBatch header with no spans, a text made of
// whole entries and part frames, at most kMaxBatchParts parts, payloads of
// whole floats that fill frame 1 exactly); every part still needs
// DecodeMessage. *sender and *receiver are the envelope's. Never reads past
// either frame; kCorruptMessage with the reason otherwise.
Status DecodeBatch(const void* frame0, size_t frame0_bytes, const void* payload, size_t payload_bytes,
                   std::vector<FramePair>* parts, int* sender, int* receiver);

// Whether frame 0 starts with a kBatch header (magic and version checked).
bool IsBatch(const void* frame0, size_t frame0_bytes);

}  // namespace mltuner
