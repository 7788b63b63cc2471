// Reclaimer: the reclaimer thread (geeps.md §2). It runs behind the
// application along the op list: frees each finished buffer, scatter-adds an
// update into its table's update log, writes kept local data back, and — at
// a table's last update of the clock — ships the log to the shards at once.
//
// Threading: Start() runs the thread; it ends when SharedState::stopping is
// set or on a failure (SharedState::Fail). WriteBackLocal may also be called
// by the application thread before Start (the initialisation phase).
// Ownership: owns its thread, the device buffers of update payloads to
// shards that share this device and the host frames of those to other
// processes; the plan, state, device and transport are
// the engine's and outlive it.
#pragma once

#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "memory/device_block.h"
#include "memory/payload_bound.h"
#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/transport.h"
#include "pipeline/plan.h"
#include "pipeline/shared_state.h"

namespace mltuner {

class Reclaimer {
 public:
  Reclaimer(const Config& config, int rank, int num_workers, std::shared_ptr<Device> device, Transport* transport,
            const PipelinePlan* plan, SharedState* state);
  ~Reclaimer() { Join(); }
  Reclaimer(const Reclaimer&) = delete;
  Reclaimer& operator=(const Reclaimer&) = delete;

  void Start();
  // Waits for the thread to end. REQUIRES: stopping set (or the thread failed).
  void Join();

  // Queues the copies of a kept local access's buffer back into its table's
  // store on the writeback stream (host-resident rows on the swap-out stream
  // joined to it, memory/swap.h).
  Status WriteBackLocal(const AccessRecord& access, const float* buffer) EXCLUDES(state_->mu);

 private:
  void Loop();
  Status ReclaimOp(int64_t seq);
  Status ScatterAddUpdate(const AccessRecord& access, const float* buffer) EXCLUDES(state_->mu);
  // Before this thread reads or zeroes a table's host log on the host: waits
  // for the scatter-adds queued into it on the device, if any.
  Status FinishHostLog(TableId table);
  Status ApplyOwnStep(const AccessRecord& access, const float* buffer, mltuner::Clock clock) EXCLUDES(state_->mu);
  // The learning rate the application set for `table` from `clock` on
  // (Engine::SetLearningRate), if it set one.
  std::optional<float> RateSetFor(TableId table, mltuner::Clock clock) const REQUIRES(state_->mu);
  Status BuildTableClock(TableId table, mltuner::Clock clock, std::vector<Message>* messages);
  Status BuildDirectUpdate(const AccessRecord& access, const float* buffer, mltuner::Clock clock,
                           std::vector<Message>* messages) EXCLUDES(state_->mu);
  // Engine::SkipStep with a flag: before the clock's first message, reads
  // the verdict the application copied on its stream (once that copy's
  // ticket is done) and leaves the clock skipped or not.
  Status ResolveSkip(mltuner::Clock clock) EXCLUDES(state_->mu);
  // Whether the clock is a skipped step (once resolved).
  bool SkipsStep(mltuner::Clock clock) const REQUIRES(state_->mu);
  // A kClockUpdate to `shard` with `values` floats of payload, in device
  // memory when the shard shares this device (then its data is *device).
  // It carries the table's new learning rate when the application set one
  // for this clock, and kSkipStep when the clock is a skipped step.
  Status NewUpdateMessage(TableId table, int shard, mltuner::Clock clock, size_t values, Message* out,
                          float** data, bool* on_device) EXCLUDES(state_->mu);
  Status MarkReady(DeviceEvent ready, std::vector<Message>* messages);
  // Whether the table's clock moves its shards' rows in parts (more pieces
  // than shards).
  bool InParts(const TableIndex& index) const;
  // A part of a large table's clock leaves as soon as it is built, with a
  // ticket of its own, so that its copy, its trip and the shard's apply of
  // it overlap the packing of the next part. Empties *messages.
  Status SendPart(std::vector<Message>* messages);
  // Sends this rank's own shard its messages; holds those for other ranks'
  // shards to leave with the next ones (see held_).
  Status Ship(std::vector<Message> messages);
  // Sends the held messages, if any, as one burst.
  Status Flush();
  // Frees the slot; `released` is the ticket after which the device no
  // longer touches its addresses (the next user's fill waits for it).
  void ReleaseSlot(Slot* slot, DeviceEvent released) EXCLUDES(state_->mu);

  const Config& config_;
  const int rank_;
  const int num_workers_;
  const std::shared_ptr<Device> device_;
  Transport* const transport_;
  const PipelinePlan* const plan_;
  SharedState* const state_;
  // The bytes of update payloads to other processes' shards that may be
  // alive at once (the bound of idle frames).
  int64_t RemotePayloadBytesInFlight() const;
  // Floats of the largest update payload to one of those shards: the size
  // of the device staging buffer every pack kernel fills.
  size_t LargestRemotePayloadValues() const;
  // Bytes of the largest update one table sends this device's shards in a
  // clock, and the bound of those payloads in flight (at least that).
  int64_t LargestLocalUpdateBytes() const;
  int64_t LocalPayloadLimit() const;
  size_t staging_values_ = 0;  // set in Start
  // Device buffers for update payloads to shards that share this device, and
  // the staging payloads packed for the others.
  DeviceBufferPool payloads_;
  // The bytes of those to this device's shards alive at once (set in Start).
  std::unique_ptr<PayloadBound> local_payloads_;
  // Per table: a scatter-add into its host log is queued on the device and
  // not yet waited for. This thread's only (and the init phase's, before it).
  std::vector<bool> host_log_pending_;
  // ScatterAddUpdate's runs into staging (each run to its place in the
  // buffer), reused so that a clock allocates nothing.
  RunIndex to_staging_;
  // Host frames (pinned on CUDA) of update payloads to other processes'
  // shards, recycled; idle ones bounded by RemotePayloadBytesInFlight.
  DeviceBufferPool frames_;
  // Updates for other ranks' shards built while the application had already
  // posted the next op: they leave together (Transport::SendAll) once this
  // thread catches up with the application, at the clock's end, or past
  // kHeldBytes, as DDP's buckets do, so a burst of small tables costs each
  // thread on the way one wake-up rather than one per table. Never held
  // across a wait of this thread (before the payload bound's wait for the
  // shards, they are sent).
  static constexpr size_t kHeldBytes = size_t{4} << 20;
  HeldMessages held_{kHeldBytes};
  std::thread thread_;
};

}  // namespace mltuner
