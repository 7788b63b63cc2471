// PlanSite: where a plan runs — which shard is this worker's, and whether the
// device's memory is host memory (Device::host_addressable). The host-memory
// count (plan/host_memory.h) and the swap-traffic prediction
// (plan/swap_traffic.h) both depend on it.
#pragma once

namespace mltuner {

struct PlanSite {
  int rank = 0;
  int num_workers = 1;
  bool device_is_host = true;
};

}  // namespace mltuner
