// SwapTraffic: the bytes a placement moves between host and device memory in
// one steady-state clock, by cause — what host residence costs. Placement
// (plan/placement.h) uses the same rules to value each entry, and
// Placement::Describe prints the prediction; tests/cpp/engine/swap_traffic_test.cc
// checks it against the bytes a counting device sees.
//
// A row that lives in host memory moves once per clock for each of:
//  - a read of it: host store -> read buffer (parameters in);
//  - an update of it, when its table has two or more updates a clock: buffer
//    -> host update log (updates out). A table with one update a clock sends
//    the buffer straight to the shards and never touches its log;
//  - at such a table's clock, if its shard is this worker's own (whose
//    payloads are device buffers): host log -> the payload (sends in);
//  - every push of the worker's own shard (one a clock): the payload -> the
//    host store (installs out);
//  - a local fetch of it: host store -> buffer (local in);
//  - a local keep of it: buffer -> host store (local out).
// Other shards' payloads travel in host frames: their bytes cross anyway and
// are not counted. Only shard == rank is taken to share the device (one
// worker per process, ProcessNode); workers of a LocalCluster that share one
// memory also exchange device payloads with the other shards, so their
// host-resident rows move more than predicted (those shards' sends and
// installs).
//
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mltuner/types.h"
#include "plan/plan_site.h"
#include "plan/row_layout.h"
#include "record/recorder.h"

namespace mltuner {

struct TablePlacement;

enum class SwapCause { kParamIn, kUpdateOut, kSendIn, kInstallOut, kLocalIn, kLocalOut };

bool IsHostToDevice(SwapCause cause);

struct SwapTraffic {
  int64_t params_in = 0;     // host-resident parameter rows gathered into read buffers
  int64_t updates_out = 0;   // update buffers' host-resident rows added into the host log
  int64_t sends_in = 0;      // host log rows copied into the own shard's device payload
  int64_t installs_out = 0;  // rows the own shard pushes, copied into the host store
  int64_t local_in = 0;      // host-resident local data fetched
  int64_t local_out = 0;     // host-resident local data written back

  int64_t host_to_device() const { return params_in + sends_in + local_in; }
  int64_t device_to_host() const { return updates_out + installs_out + local_out; }
  void Add(SwapCause cause, int64_t bytes);
  // "host->device 123 B (parameters in 100 B, ...), device->host 45 B (...)"
  std::string Describe() const;
};

// Calls visit(cause, position) once for every row transfer one clock of
// `recording` would make if `table`'s row at layout `position` lived in host
// memory (the rules above).
void ForEachHostTransfer(const TableInfo& table, const RowLayout& layout, const Recording& recording,
                         const PlanSite& site, const std::function<void(SwapCause, int64_t)>& visit);

// The bytes one steady-state clock moves under `placement` (by table id).
SwapTraffic PredictSwapTraffic(const std::vector<TableInfo>& tables, const std::vector<RowLayout>& layouts,
                               const Recording& recording, const std::vector<TablePlacement>& placement,
                               const PlanSite& site);

}  // namespace mltuner
