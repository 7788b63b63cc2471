// Host memory of a worker's plan: what FinishVirtualIteration will hold in
// host memory, counted from the placement, and the check of that against
// the host's limit before anything is allocated (issue 16), so that a plan
// too large for the machine is a clear error naming the sizes rather than
// the kernel killing the process at a later clock.
//
// Counted (HostMemoryNeed): host-resident parameter rows with their update
// logs and host-resident local data (the placement's host stores); the
// staging buffer (the largest access buffer; pinned on CUDA); the update
// payloads of the clocks in flight that live in host memory; and, when the
// device's memory is host memory (the CPU backend), the access-buffer pool
// and the device-resident stores; and the server shard's state of branch 0
// (its rows of each table with the rule's optimizer state) when it will live
// in host memory: on the CPU backend, or where the device has too little
// room left after the plan (plan/device_budget.h). The shard allocates it
// once every worker has planned, after this check. Branch forks add a copy
// each, not counted here (the shard checks each fork: ServerShard::Fork).
// Pure functions but CheckHostMemory, which asks HostMemoryHeadroom
// (mltuner/host_headroom.h).
#pragma once

#include <string>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/host_headroom.h"
#include "mltuner/status.h"
#include "mltuner/types.h"
#include "plan/placement.h"
#include "plan/plan_site.h"
#include "record/recorder.h"

namespace mltuner {

HostMemoryNeed CountHostMemory(const Config& config, const std::vector<TableInfo>& tables,
                               const Recording& recording, const Placement& placement, const PlanSite& site);

// ResourceExhausted naming the need, its parts and the limit when
// need.total() exceeds `limit_bytes`; `limit_source` says where the limit
// comes from ("Config.host_memory_limit").
Status CheckHostMemoryAgainst(const HostMemoryNeed& need, int64_t limit_bytes, const std::string& limit_source);
// The check against Config::host_memory_limit, or, when that is 0, against
// the process's headroom (MemAvailable, its cgroups' limits, RLIMIT_AS; no
// check when none can be read). `freed_during_init`: host memory the
// application frees while the shard's state in host memory is allocated
// (Engine::ReleaseHostMemoryDuringInit); up to that much of the state may
// lie beyond the headroom (not beyond Config::host_memory_limit, which
// counts the engine's memory alone).
Status CheckHostMemory(const HostMemoryNeed& need, int64_t host_memory_limit, int64_t freed_during_init = 0);
// Its check against a known headroom.
Status CheckHostMemoryAvailable(const HostMemoryNeed& need, const HostHeadroom& headroom,
                                int64_t freed_during_init);

}  // namespace mltuner
