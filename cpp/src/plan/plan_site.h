// PlanSite: where a plan runs — which shard is this worker's, and whether the
// device's memory is host memory (Device::host_addressable). The host-memory
// count (plan/host_memory.h) and the swap-traffic prediction
// (plan/swap_traffic.h) both depend on it.
#pragma once

#include <cstdint>

namespace mltuner {

struct PlanSite {
  int rank = 0;
  int num_workers = 1;
  bool device_is_host = true;
  // The device's memory when the plan is made (Device::MemoryInfo; -1: no
  // fixed capacity), for the automatic budget and the prediction of where
  // the server shard's state goes (plan/device_budget.h).
  int64_t device_free = -1;
  int64_t device_total = -1;
  bool maps_host_memory = false;  // Device::maps_host_memory
  // Device memory the application holds beside the engine
  // (Engine::ReserveDeviceMemory), already left out of device_free.
  int64_t application_bytes = 0;
};

}  // namespace mltuner
