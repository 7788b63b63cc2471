#include "cluster/shard_host.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cluster/hop_log.h"
#include "common/thread_name.h"

namespace mltuner {

void Inbox::Start(const char* thread_name, std::function<void(Message&&)> deliver,
                  std::function<void()> drained) {
  thread_ = std::thread([this, thread_name, deliver = std::move(deliver), drained = std::move(drained)] {
    NameThisThread(thread_name);
    bool delivered = false;  // since `drained` last ran
    for (;;) {
      Message message;
      if (delivered && drained) {
        bool idle;
        {
          MutexLock lock(&mu_);
          idle = queue_.empty();
        }
        if (idle) {
          drained();
          delivered = false;
        }
      }
      {
        MutexLock lock(&mu_);
        while (!stopping_ && queue_.empty()) ready_.Wait();
        if (queue_.empty()) return;  // stopping and drained
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      // Counted until delivered: the payload is held until then.
      const auto bytes = static_cast<int64_t>(message.num_values() * sizeof(float));
      deliver(std::move(message));
      delivered = true;
      {
        MutexLock lock(&mu_);
        bytes_.Remove(bytes);
      }
      room_.NotifyAll();
    }
  });
}

void Inbox::Queue(Message&& message, int64_t bytes) {
  bytes_.Add(bytes);
  queue_.push_back(std::move(message));
}

void Inbox::Push(Message&& message) {
  const auto bytes = static_cast<int64_t>(message.num_values() * sizeof(float));
  {
    MutexLock lock(&mu_);
    Queue(std::move(message), bytes);
  }
  ready_.NotifyAll();
}

Status Inbox::PushBounded(Message&& message, int64_t timeout_ms) {
  const auto bytes = static_cast<int64_t>(message.num_values() * sizeof(float));
  {
    MutexLock lock(&mu_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
    bool has_room = stopping_ || no_waiting_ || bytes_.HasRoom(bytes);
    while (!has_room) {
      const bool woken = room_.WaitUntil(deadline);
      has_room = stopping_ || no_waiting_ || bytes_.HasRoom(bytes);
      if (!woken) break;
    }
    if (!has_room) {
      return Status::Timeout("has held " + std::to_string(bytes_.held) + " bytes (its limit is " +
                             std::to_string(bytes_.limit) + ") for " + std::to_string(timeout_ms) + " ms");
    }
    Queue(std::move(message), bytes);
  }
  ready_.NotifyAll();
  return Status::Ok();
}

void Inbox::SetLimit(int64_t bytes) {
  {
    MutexLock lock(&mu_);
    bytes_.SetLimit(bytes);
  }
  room_.NotifyAll();
}

void Inbox::StopWaiting() {
  {
    MutexLock lock(&mu_);
    no_waiting_ = true;
  }
  room_.NotifyAll();
}

int64_t Inbox::queued_bytes() const {
  MutexLock lock(&mu_);
  return bytes_.held;
}

int64_t Inbox::peak_bytes() const {
  MutexLock lock(&mu_);
  return bytes_.peak;
}

void Inbox::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  ready_.NotifyAll();
  room_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

ShardHost::ShardHost(int rank, int num_workers, const Config& config, std::shared_ptr<Device> device,
                     std::function<RowsRoute(int worker)> rows_route)
    : rank_(rank),
      num_workers_(num_workers),
      shard_(rank, num_workers, config.update_rule, config.max_branches, std::move(device)) {
  shard_.set_check_finite(config.check_finite);
  shard_.set_rows_routes(std::move(rows_route));
  shard_.PlaceStateWhenReady(config);  // after the workers' plans: on the device if it has room (issue 16)
}

void ShardHost::Start(Engine* engine, Transport* transport) {
  server_inbox_.Start("mlt-shard", [this, transport, engine](Message&& message) {
    const MessageHeader header = message.header;
    const size_t bytes = message.num_values() * sizeof(float);
    HopLog::Record(rank_, "shard", header, bytes);
    std::vector<Message> replies;
    // A host frame from a worker of this process on another GPU may still
    // be filling; one from another process is complete.
    Status status = WaitReady(message.host_frame.get());
    if (status.ok()) {
      MutexLock lock(&shard_mu_);
      status = shard_.Handle(std::move(message), &replies);
    }
    if (!status.ok()) {
      // A request answered with its error needs no line on stderr: its caller raises it.
      Reject(status, message, /*log=*/header.request_id == 0 || replies.empty());
      // Requests got their error reply from the shard. A refused message
      // without a reply (a clock's updates, a start) stops that clock for
      // every worker, which would wait for rows that never come: every
      // worker learns at once, with the status code (a NaN update is a
      // NonFinite error everywhere), and this process's own worker fails too.
      if (status.code() != StatusCode::kShutdown && message.header.request_id == 0) {
        const Status context = status.WithContext("shard " + std::to_string(rank_) +
                                                  " refused a message from worker " +
                                                  std::to_string(message.header.sender));
        // Sent before this worker fails: a process whose worker failed may
        // exit, and the others must hear why rather than only that it left.
        for (int worker = 0; worker < num_workers_; ++worker) {
          if (worker == rank_) continue;
          const Status sent = transport->Send(RefusalMessage(rank_, worker, message.header.table, context));
          if (!sent.ok()) Reject(sent, Message());
        }
        engine->Abort(context);
      }
    }
    // Replies to other ranks leave once the inbox is drained (or past
    // kHeldReplyBytes), as one burst: the rows of a clock's tables then take
    // one hand-off to the send thread and one socket message per worker
    // instead of one per table. This rank's engine gets its rows at once
    // (its next read may be waiting for them).
    // Rows lent from the shard's state to a process reached by shared
    // memory leave at once too: their send copies them into its region, and
    // the shard's next apply to the table waits for that (ServerShard::
    // WaitForLoans). What was held leaves before them, in order.
    bool full = false;
    for (Message& reply : replies) {
      const bool own = reply.header.receiver == rank_;
      const bool lent = reply.device_values && reply.device_values->borrowed;
      if (own || lent) {
        if (!own) SendHeldReplies(transport);
        const Status sent = transport->Send(std::move(reply));
        if (!sent.ok()) Reject(sent, Message());
        continue;
      }
      full = held_replies_.Hold(std::move(reply)) || full;
    }
    if (full) SendHeldReplies(transport);
    HopLog::Record(rank_, "shard-done", header, bytes);
  }, [this, transport] { SendHeldReplies(transport); });
  client_inbox_.Start("mlt-installer", [this, engine](Message&& message) {
    const MessageHeader header = message.header;
    const size_t bytes = message.num_values() * sizeof(float);
    HopLog::Record(rank_, "engine", header, bytes);
    // The same for rows from a shard of this process on another GPU.
    Status status = WaitReady(message.host_frame.get());
    if (status.ok()) status = engine->HandleMessage(std::move(message));
    if (!status.ok()) Reject(status, Message());
    HopLog::Record(rank_, "engine-done", header, bytes);
  });
}

void ShardHost::SendHeldReplies(Transport* transport) {
  const Status sent = held_replies_.Flush(transport);
  if (!sent.ok()) Reject(sent, Message());
}

void ShardHost::Push(Message&& message) {
  if (IsServerBound(message.type())) {
    server_inbox_.Push(std::move(message));
  } else {
    client_inbox_.Push(std::move(message));
  }
}

Status ShardHost::PushBounded(Message&& message, int64_t timeout_ms) {
  const bool to_shard = IsServerBound(message.type());
  const std::string what = message.DebugString();
  Status status = (to_shard ? server_inbox_ : client_inbox_).PushBounded(std::move(message), timeout_ms);
  if (status.ok()) return status;
  return Status::Timeout(std::string("the ") + (to_shard ? "shard's" : "engine's") + " inbox of worker " +
                         std::to_string(rank_) + " " + status.message() + ": its " +
                         (to_shard ? "shard" : "row installer") + " is stuck or far slower than the engines send (" +
                         what + " waited)");
}

void ShardHost::SetInboxLimit(int64_t bytes) {
  server_inbox_.SetLimit(bytes);
  client_inbox_.SetLimit(bytes);
}

void ShardHost::StopWaiting() {
  server_inbox_.StopWaiting();
  client_inbox_.StopWaiting();
}

int64_t ShardHost::inbox_bytes() const { return server_inbox_.queued_bytes() + client_inbox_.queued_bytes(); }

int64_t ShardHost::peak_inbox_bytes() const {
  return std::max(server_inbox_.peak_bytes(), client_inbox_.peak_bytes());
}

void ShardHost::StopShard() { server_inbox_.Stop(); }

void ShardHost::Stop() {
  server_inbox_.Stop();
  client_inbox_.Stop();
}

Status ShardHost::AddTable(const TableInfo& info) {
  MutexLock lock(&shard_mu_);
  return shard_.AddTable(info);
}

Status ShardHost::DropTable(TableId table) {
  MutexLock lock(&shard_mu_);
  return shard_.DropTable(table);
}

Status ShardHost::ExportTable(TableId table, ShardSlice* out, BranchId branch) {
  MutexLock lock(&shard_mu_);
  return shard_.ExportTable(table, out, branch);
}

Status ShardHost::ImportTable(TableId table, const float* values, size_t num_values, const float* state,
                              size_t num_state) {
  MutexLock lock(&shard_mu_);
  return shard_.ImportTable(table, values, num_values, state, num_state);
}

void ShardHost::Reject(const Status& status, const Message& message, bool log) {
  const int64_t count = ++rejected_;
  // Messages arriving after this engine or shard shut down are expected at
  // the end of a job: counted, not logged. Anything else is a bug or a bad
  // peer and is logged (a silent refusal of rows once hid a lost-rows race).
  if (status.code() == StatusCode::kShutdown || !log) return;
  if (count <= 10) {
    std::fprintf(stderr, "mltuner: rejected a message: %s %s\n", status.ToString().c_str(),
                 message.header.type ? message.DebugString().c_str() : "");
  }
}

}  // namespace mltuner
