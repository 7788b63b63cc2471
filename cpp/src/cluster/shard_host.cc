#include "cluster/shard_host.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "common/thread_name.h"

namespace mltuner {

void Inbox::Start(const char* thread_name, std::function<void(Message&&)> deliver) {
  thread_ = std::thread([this, thread_name, deliver = std::move(deliver)] {
    NameThisThread(thread_name);
    for (;;) {
      Message message;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      deliver(std::move(message));
    }
  });
}

void Inbox::Push(Message&& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(message));
  }
  ready_.notify_one();
}

void Inbox::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_one();
  if (thread_.joinable()) thread_.join();
}

ShardHost::ShardHost(int rank, int num_workers, const Config& config, std::shared_ptr<Device> device,
                     std::function<bool(int worker)> device_receivers)
    : shard_(rank, num_workers, config.update_rule, config.max_branches, std::move(device)) {
  shard_.set_check_finite(config.check_finite);
  shard_.set_device_receivers(std::move(device_receivers));
}

void ShardHost::Start(Engine* engine, Transport* transport) {
  server_inbox_.Start("mlt-shard", [this, transport, engine](Message&& message) {
    std::vector<Message> replies;
    // A host frame from a worker of this process on another GPU may still
    // be filling; one from another process is complete.
    Status status = WaitReady(message.host_frame.get());
    if (status.ok()) {
      std::lock_guard<std::mutex> lock(shard_mu_);
      status = shard_.Handle(std::move(message), &replies);
    }
    if (!status.ok()) {
      Reject(status, message);
      // Requests got their error reply from the shard. A refused message
      // without a reply (a clock's updates, a start) stops that clock for
      // every worker, which would wait for rows that never come: every
      // worker learns at once, with the status code (a NaN update is a
      // NonFinite error everywhere), and this process's own worker fails too.
      if (status.code() != StatusCode::kShutdown && message.header.request_id == 0) {
        const Status context = status.WithContext("shard " + std::to_string(shard_.rank()) +
                                                  " refused a message from worker " +
                                                  std::to_string(message.header.sender));
        // Sent before this worker fails: a process whose worker failed may
        // exit, and the others must hear why rather than only that it left.
        for (int worker = 0; worker < shard_.num_workers(); ++worker) {
          if (worker == shard_.rank()) continue;
          const Status sent = transport->Send(RefusalMessage(shard_.rank(), worker, message.header.table, context));
          if (!sent.ok()) Reject(sent, Message());
        }
        engine->Abort(context);
      }
    }
    for (Message& reply : replies) {
      const Status sent = transport->Send(std::move(reply));
      if (!sent.ok()) Reject(sent, Message());
    }
  });
  client_inbox_.Start("mlt-installer", [this, engine](Message&& message) {
    // The same for rows from a shard of this process on another GPU.
    Status status = WaitReady(message.host_frame.get());
    if (status.ok()) status = engine->HandleMessage(std::move(message));
    if (!status.ok()) Reject(status, Message());
  });
}

void ShardHost::Push(Message&& message) {
  if (IsServerBound(message.type())) {
    server_inbox_.Push(std::move(message));
  } else {
    client_inbox_.Push(std::move(message));
  }
}

void ShardHost::StopShard() { server_inbox_.Stop(); }

void ShardHost::Stop() {
  server_inbox_.Stop();
  client_inbox_.Stop();
}

Status ShardHost::AddTable(const TableInfo& info) {
  std::lock_guard<std::mutex> lock(shard_mu_);
  return shard_.AddTable(info);
}

Status ShardHost::ExportTable(TableId table, ShardSlice* out) {
  std::lock_guard<std::mutex> lock(shard_mu_);
  return shard_.ExportTable(table, out);
}

Status ShardHost::ImportTable(TableId table, const float* values, size_t num_values, const float* state,
                              size_t num_state) {
  std::lock_guard<std::mutex> lock(shard_mu_);
  return shard_.ImportTable(table, values, num_values, state, num_state);
}

void ShardHost::Reject(const Status& status, const Message& message) {
  const int64_t count = ++rejected_;
  // Messages arriving after this engine or shard shut down are expected at
  // the end of a job: counted, not logged. Anything else is a bug or a bad
  // peer and is logged (a silent refusal of rows once hid a lost-rows race).
  if (status.code() == StatusCode::kShutdown) return;
  if (count <= 10) {
    std::fprintf(stderr, "mltuner: rejected a message: %s %s\n", status.ToString().c_str(),
                 message.header.type ? message.DebugString().c_str() : "");
  }
}

}  // namespace mltuner
