// The device-memory budget a plan is made under (issue 16): the one set in
// Config::device_memory_budget, or, when none is set and the plan would not
// fit the device, an automatic one: the device's free memory when the plan
// is made, less Config::device_memory_reserve. Also the rule that places
// the server shard's state (values and optimizer state) on the device or in
// host memory, shared by the shard (server/shard.h), which decides, and the
// plan's host-memory count (plan/host_memory.h), which predicts it.
// Pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "mltuner/config.h"

namespace mltuner {

struct BudgetChoice {
  int64_t budget = 0;        // the budget the plan was made under; 0: none (everything on the device)
  bool automatic = false;    // chosen here, not set in Config
  int64_t device_free = -1;  // the device's free memory when the plan was made; -1: no fixed capacity
  int64_t device_total = -1;
  int64_t reserve = 0;       // left free for the framework (device_memory_reserve, resolved)
  // Device memory the application holds beside the engine
  // (Engine::ReserveDeviceMemory), already left out of `budget` and
  // `device_free`: for Describe.
  int64_t application_bytes = 0;
  // "budget 123 B set by hand" / "no budget: ..." / "automatic budget ...".
  std::string Describe() const;
};

// Config::device_memory_reserve in bytes: as set, or (-1) a tenth of the
// device's total memory; 0 for a device of unknown capacity.
int64_t DeviceReserve(const Config& config, int64_t device_total);

// The budget for a plan that needs `device_need` bytes of device memory
// without one (its pool and device-resident stores): Config's when set;
// else none when the device's capacity is unknown or `device_free` less the
// reserve holds the need; else that room (at least 1 byte, so that the
// placement's error names the least budget).
BudgetChoice ChooseBudget(const Config& config, int64_t device_free, int64_t device_total, int64_t device_need);

// Whether a shard's state of `state_bytes` goes to host memory: when the
// device can map host memory for its kernels (Device::maps_host_memory) and
// `device_free` (-1: unknown capacity, never) less `reserve` cannot hold it.
bool ShardStateInHostMemory(int64_t state_bytes, int64_t device_free, int64_t reserve, bool maps_host_memory);

}  // namespace mltuner
