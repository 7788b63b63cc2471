#include "wire/branch_settings.h"

#include <cstdio>
#include <cstring>

namespace mltuner {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire structs are copied as they lie in memory");

std::string EncodeBranchSettings(BranchId parent, const BranchSettings& settings) {
  BranchSettingsWire wire;
  wire.parent = parent;
  wire.learning_rate = settings.learning_rate;
  wire.momentum = settings.momentum;
  wire.slack = settings.slack;
  wire.training = settings.training ? 1 : 0;
  wire.keep_rate_ratios = settings.keep_rate_ratios ? 1 : 0;
  return std::string(reinterpret_cast<const char*>(&wire), sizeof(wire));
}

Status DecodeBranchSettings(const std::string& bytes, BranchId* parent, BranchSettings* settings) {
  if (bytes.size() < 4) {
    return Status::CorruptMessage("branch settings of " + std::to_string(bytes.size()) +
                                  " bytes: too short for their version and size");
  }
  // Version and size first: a payload of another layout names its version.
  uint16_t version = 0, size = 0;
  std::memcpy(&version, bytes.data(), sizeof(version));
  std::memcpy(&size, bytes.data() + 2, sizeof(size));
  if (version != kBranchSettingsWireVersion) {
    return Status::CorruptMessage("branch settings of version " + std::to_string(version) + ", expected " +
                                  std::to_string(kBranchSettingsWireVersion));
  }
  if (size != sizeof(BranchSettingsWire) || bytes.size() != sizeof(BranchSettingsWire)) {
    return Status::CorruptMessage("branch settings of " + std::to_string(bytes.size()) + " bytes (size field " +
                                  std::to_string(size) + "), expected " + std::to_string(sizeof(BranchSettingsWire)));
  }
  BranchSettingsWire wire;
  std::memcpy(static_cast<void*>(&wire), bytes.data(), sizeof(wire));
  if (wire.training > 1 || wire.keep_rate_ratios > 1 || wire.reserved[0] != 0 || wire.reserved[1] != 0) {
    return Status::CorruptMessage("branch settings with a training flag of " + std::to_string(wire.training) +
                                  ", a keep_rate_ratios flag of " + std::to_string(wire.keep_rate_ratios) +
                                  " or nonzero reserved bytes");
  }
  const float keep = BranchSettings::kKeepParent;
  // Comparisons are false for NaN, so NaN is refused with the rest.
  const bool lr_ok = wire.learning_rate >= 0 || wire.learning_rate == keep;
  const bool momentum_ok = (wire.momentum >= 0 && wire.momentum < 1) || wire.momentum == keep;
  BranchSettings decoded;
  decoded.learning_rate = wire.learning_rate;
  decoded.momentum = wire.momentum;
  decoded.training = wire.training == 1;
  decoded.slack = wire.slack;
  decoded.keep_rate_ratios = wire.keep_rate_ratios == 1;
  if (wire.parent < 0 || wire.slack < -1 || !lr_ok || !momentum_ok) {
    return Status::InvalidArgument("invalid branch settings (" + DescribeBranchSettings(wire.parent, decoded) +
                                   "): needs parent >= 0, learning_rate >= 0, momentum in [0, 1) (or -1 for the "
                                   "parent's) and slack >= -1");
  }
  *parent = wire.parent;
  *settings = decoded;
  return Status::Ok();
}

std::string DescribeBranchSettings(BranchId parent, const BranchSettings& settings) {
  char text[160];
  std::snprintf(text, sizeof(text), "parent=%d lr=%.9g momentum=%.9g training=%d slack=%d ratios=%d", parent,
                static_cast<double>(settings.learning_rate), static_cast<double>(settings.momentum),
                settings.training ? 1 : 0, settings.slack, settings.keep_rate_ratios ? 1 : 0);
  return text;
}

}  // namespace mltuner
