// ShardHost: what a process runs for its rank beside the engine's own
// threads: the server shard, and two inboxes each drained by its own thread,
// so a shard applying updates never blocks an engine installing rows.
//   server inbox: server-bound messages -> the shard; its replies go to the
//                 transport (which may route them straight back here).
//   client inbox: client-bound messages -> the engine.
// A message its receiver rejects is dropped, counted and logged (the first
// few); it never stops an inbox.
// Inboxes are bounded in payload bytes for what engines send (PushBounded):
// a full inbox makes this process's engine or the transport's receive
// thread wait, so ZeroMQ's and the kernel's flow control push back on the
// sender, whose own outbox then fills and its engine waits. The shard's
// replies are counted but never wait (Push): the shard's thread must keep
// draining its inbox.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "common/byte_bound.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "memory/device_block.h"
#include "mltuner/engine.h"
#include "mltuner/transport.h"
#include "server/shard.h"
#include "wire/message.h"

namespace mltuner {

// A FIFO of messages drained by one thread, bounded in payload bytes.
class Inbox {
 public:
  ~Inbox() { Stop(); }
  // `thread_name`: a string literal (it outlives the thread). `drained`, if
  // given, runs on the thread whenever it has delivered what was queued and
  // finds the inbox empty (before it waits).
  void Start(const char* thread_name, std::function<void(Message&&)> deliver,
             std::function<void()> drained = nullptr);
  // Queues without waiting.
  void Push(Message&& message);
  // Queues once the bytes queued (including the message being delivered)
  // leave room under the limit; an empty inbox always has room, so one
  // larger message goes alone. Waits up to timeout_ms, then kTimeout.
  Status PushBounded(Message&& message, int64_t timeout_ms);
  // Payload bytes PushBounded lets wait; 0: no bound.
  void SetLimit(int64_t bytes);
  // From now on PushBounded queues without waiting (the job is aborted).
  void StopWaiting();
  int64_t queued_bytes() const;
  int64_t peak_bytes() const;
  // Delivers what is queued, then joins the thread.
  void Stop();

 private:
  void Queue(Message&& message, int64_t bytes) REQUIRES(mu_);

  mutable Mutex mu_;
  CondVar ready_{&mu_};  // a message, or stopping
  CondVar room_{&mu_};   // bytes delivered, a new limit, or no more waiting
  std::deque<Message> queue_ GUARDED_BY(mu_);
  ByteBound bytes_ GUARDED_BY(mu_);  // queued and being delivered
  bool stopping_ GUARDED_BY(mu_) = false;
  bool no_waiting_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class ShardHost {
 public:
  // The shard keeps its state in `device`'s memory and sends each worker
  // its rows the way `rows_route` says.
  ShardHost(int rank, int num_workers, const Config& config, std::shared_ptr<Device> device,
            std::function<RowsRoute(int worker)> rows_route);
  ~ShardHost() { Stop(); }
  ShardHost(const ShardHost&) = delete;
  ShardHost& operator=(const ShardHost&) = delete;

  // Starts both inbox threads; `engine` and `transport` must outlive Stop.
  void Start(Engine* engine, Transport* transport);
  // Queues a message for this rank's shard or engine, by its type.
  void Push(Message&& message);
  // The same for a message an engine sent (this process's or another's):
  // waits up to timeout_ms for room in its inbox (see above), then kTimeout
  // naming the inbox.
  Status PushBounded(Message&& message, int64_t timeout_ms);
  // Payload bytes each inbox lets other processes fill; 0: no bound.
  void SetInboxLimit(int64_t bytes);
  // The job is aborted: pushes stop waiting for room.
  void StopWaiting();
  // Payload bytes waiting in both inboxes, and the most each has held.
  int64_t inbox_bytes() const;
  int64_t peak_inbox_bytes() const;
  // Stops the shard's inbox (after handling what is queued), then Stop also
  // the engine's. A cluster stops every shard first, so the replies they
  // send while draining still reach the engines.
  void StopShard();
  void Stop();

  // Shard access from other threads (table registration, checkpoints).
  Status AddTable(const TableInfo& info);
  Status DropTable(TableId table);
  Status ExportTable(TableId table, ShardSlice* out, BranchId branch = 0);
  Status ImportTable(TableId table, const float* values, size_t num_values, const float* state,
                     size_t num_state);

  // Counts and logs a message that was refused (for the transport's own
  // refusals too, so one counter covers the process).
  void Reject(const Status& status, const Message& message, bool log = true);
  int64_t rejected() const { return rejected_; }

 private:
  const int rank_;
  const int num_workers_;
  Mutex shard_mu_;  // Handle (server inbox) vs the calls above
  ServerShard shard_ GUARDED_BY(shard_mu_);
  Inbox server_inbox_;
  Inbox client_inbox_;
  std::atomic<int64_t> rejected_{0};
  // The shard's replies to other ranks not yet sent (its inbox thread's
  // only): they leave together when the inbox is drained, or past
  // kHeldReplyBytes.
  static constexpr size_t kHeldReplyBytes = size_t{4} << 20;
  HeldMessages held_replies_{kHeldReplyBytes};
  void SendHeldReplies(Transport* transport);
};

}  // namespace mltuner
