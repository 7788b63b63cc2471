// A fork's settings on the wire: the text frame of a kFork message holds one
// fixed 24-byte struct, little-endian, packed. The engine validates the
// settings the application gave (ForkBranch); the shard decodes them once,
// here, and a short, foreign or malformed payload is a Status, never a crash.
//
// Layout (byte offset: field):
//   0: uint16 version (kBranchSettingsWireVersion)   2: uint16 size (24)
//   4: int32 parent   8: float32 learning_rate   12: float32 momentum
//  16: int32 slack   20: uint8 training (0 or 1)   21: uint8 keep_rate_ratios (0 or 1)
//  22: 2 reserved bytes (0)
// A learning rate or momentum of -1 (BranchSettings::kKeepParent) keeps the
// parent's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mltuner/config.h"
#include "mltuner/status.h"
#include "mltuner/types.h"

namespace mltuner {

constexpr uint16_t kBranchSettingsWireVersion = 2;

#pragma pack(push, 1)
struct BranchSettingsWire {
  uint16_t version = kBranchSettingsWireVersion;
  uint16_t size = 24;  // sizeof(BranchSettingsWire): a peer with another layout is refused
  int32_t parent = 0;
  float learning_rate = BranchSettings::kKeepParent;
  float momentum = BranchSettings::kKeepParent;
  int32_t slack = -1;
  uint8_t training = 1;
  uint8_t keep_rate_ratios = 0;
  uint8_t reserved[2] = {0, 0};
};
#pragma pack(pop)
static_assert(sizeof(BranchSettingsWire) == 24, "BranchSettingsWire must stay 24 bytes");
static_assert(offsetof(BranchSettingsWire, learning_rate) == 8 && offsetof(BranchSettingsWire, slack) == 16 &&
                  offsetof(BranchSettingsWire, training) == 20 && offsetof(BranchSettingsWire, keep_rate_ratios) == 21,
              "BranchSettingsWire's layout is the wire format");

// The bytes of a kFork's text frame.
std::string EncodeBranchSettings(BranchId parent, const BranchSettings& settings);

// Parses and checks `bytes`: kCorruptMessage for a wrong size, version or
// reserved byte, or a training or keep_rate_ratios flag other than 0 or 1; kInvalidArgument for
// a negative parent, a learning rate < 0, a momentum outside [0, 1) (both
// but -1), or a slack < -1. Writes the outputs only on success.
Status DecodeBranchSettings(const std::string& bytes, BranchId* parent, BranchSettings* settings);

// One line for messages: "parent=0 lr=0.100000001 momentum=-1 training=1 slack=-1 ratios=0".
std::string DescribeBranchSettings(BranchId parent, const BranchSettings& settings);

}  // namespace mltuner
