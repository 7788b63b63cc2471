// RowInstaller: the receive side of a worker. It installs fresh rows pushed
// by the shards into the parameter cache under the partition locks, advances
// the table's data age (waking the allocator), and completes the synchronous
// requests of the application thread (fetch, initial values, branches).
//
// Threading: Handle() runs on the engine inbox thread (ShardHost), one message
// at a time. Ownership: owns the device landing buffers of rows from other
// processes; the plan, state and device are the engine's and outlive it.
#pragma once

#include <memory>
#include <vector>

#include "cache/table_store.h"
#include "memory/device_block.h"
#include "mltuner/device.h"
#include "pipeline/plan.h"
#include "pipeline/shared_state.h"
#include "wire/message.h"

namespace mltuner {

class RowInstaller {
 public:
  RowInstaller(int rank, int num_workers, std::shared_ptr<Device> device, const PipelinePlan* plan,
               SharedState* state);
  RowInstaller(const RowInstaller&) = delete;
  RowInstaller& operator=(const RowInstaller&) = delete;

  // A worker-bound message: rows, or the reply to a request.
  Status Handle(Message&& message);

 private:
  Status InstallRows(const Message& message) EXCLUDES(state_->age_mu);
  // `piece` of the table's index (TableIndex::pieces), whose rows are `range`:
  // from a host frame, or from host values or a device payload.
  Status InstallFrame(const Message& message, int piece, const RowSpan& range);
  Status InstallValues(const Message& message, int piece, const RowSpan& range);
  Status WriteHostRows(const TableStore& store, const std::vector<WireSegment>& segments, const RowSpan& range,
                       const float* source);
  Status ReapplyOwnSteps(const Message& message, int piece, const std::vector<WireSegment>& segments);
  Status CompleteRequest(Message&& message) EXCLUDES(state_->age_mu);

  const int rank_;
  const int num_workers_;
  const std::shared_ptr<Device> device_;
  const PipelinePlan* const plan_;
  SharedState* const state_;
  // Device landing buffers for host frames (one whole-frame copy each);
  // idle ones bounded by the most ever in use at once.
  DeviceBufferPool landing_;
};

}  // namespace mltuner
