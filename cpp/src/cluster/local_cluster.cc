// LocalCluster and its in-process transport (the Hub).
#include "mltuner/cluster.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "memory/buffer_pool.h"
#include "mltuner/transport.h"
#include "server/shard.h"
#include "wire/message.h"

namespace mltuner {

namespace {

// A queue drained by one thread that hands each message to `deliver`.
class Inbox {
 public:
  template <typename Deliver>
  void Start(Deliver deliver) {
    thread_ = std::thread([this, deliver] {
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
  void Push(Message&& message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(message));
    }
    ready_.notify_one();
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    ready_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Message> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace

class LocalCluster::Hub : public Transport {
 public:
  Hub(int num_workers, const UpdateRuleConfig& rule) : nodes_(num_workers) {
    for (int rank = 0; rank < num_workers; ++rank) {
      nodes_[rank].shard = std::make_unique<ServerShard>(rank, num_workers, rule);
      nodes_[rank].shard->set_buffer_pool(&pool_);
    }
  }
  ~Hub() override { Stop(); }

  void Start(const std::vector<std::unique_ptr<Engine>>& engines) {
    for (int rank = 0; rank < static_cast<int>(nodes_.size()); ++rank) {
      Node& node = nodes_[rank];
      node.engine = engines[rank].get();
      node.server_inbox.Start([this, &node](Message&& message) {
        std::vector<Message> replies;
        Status status;
        {
          std::lock_guard<std::mutex> lock(node.shard_mu);
          status = node.shard->Handle(std::move(message), &replies);
        }
        if (!status.ok()) Reject(status, message);
        pool_.Release(std::move(message.values));
        for (Message& reply : replies) Send(std::move(reply));
      });
      node.client_inbox.Start([this, &node](Message&& message) {
        const Status status = node.engine->HandleMessage(std::move(message));
        if (!status.ok()) Reject(status, Message());
        // Unless the engine kept the message (a request reply), its payload
        // is still here (moved-from vectors are empty and ignored).
        pool_.Release(std::move(message.values));
      });
    }
  }

  void Stop() {
    for (Node& node : nodes_) node.server_inbox.Stop();
    for (Node& node : nodes_) node.client_inbox.Stop();
  }

  Status Send(Message&& message) override {
    const int receiver = message.header.receiver;
    if (receiver < 0 || receiver >= static_cast<int>(nodes_.size())) {
      return Status::InvalidArgument("message to unknown process " + std::to_string(receiver) + ": " +
                                     message.DebugString());
    }
    Node& node = nodes_[receiver];
    if (IsServerBound(message.type())) {
      node.server_inbox.Push(std::move(message));
    } else {
      node.client_inbox.Push(std::move(message));
    }
    return Status::Ok();
  }

  Status AddTableToShard(int rank, const TableInfo& info) override {
    Node& node = nodes_[rank];
    std::lock_guard<std::mutex> lock(node.shard_mu);
    return node.shard->AddTable(info);
  }

  std::vector<float> NewPayload(size_t count) override { return pool_.Acquire(count); }

  int64_t rejected() const { return rejected_; }

 private:
  struct Node {
    std::unique_ptr<ServerShard> shard;
    std::mutex shard_mu;  // AddTable (application thread) vs Handle (inbox thread)
    Engine* engine = nullptr;
    Inbox server_inbox;
    Inbox client_inbox;
  };

  // A rejected message is dropped and logged; it never stops the receiver.
  void Reject(const Status& status, const Message& message) {
    const int64_t count = ++rejected_;
    if (status.code() == StatusCode::kOutOfOrder && message.header.type == 0) return;  // late after shutdown
    if (count <= 10) {
      std::fprintf(stderr, "mltuner: rejected a message: %s %s\n", status.ToString().c_str(),
                   message.header.type ? message.DebugString().c_str() : "");
    }
  }

  // Recycled payloads; 1 GiB bounds what idle buffers may hold.
  BufferPool pool_{size_t{1} << 30};
  std::vector<Node> nodes_;
  std::atomic<int64_t> rejected_{0};
};

Status LocalCluster::Create(const Config& config, int num_workers, std::unique_ptr<LocalCluster>* out,
                            const DeviceFactory& make_device) {
  if (num_workers < 1) return Status::InvalidArgument("a cluster needs at least one worker");
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  cluster->hub_ = std::make_unique<Hub>(num_workers, config.update_rule);
  for (int rank = 0; rank < num_workers; ++rank) {
    std::unique_ptr<Device> device;
    if (make_device) {
      MLT_RETURN_IF_ERROR(make_device(rank, &device));
    } else {
      device = NewCpuDevice();
    }
    std::unique_ptr<Engine> engine;
    MLT_RETURN_IF_ERROR(Engine::Create(config, rank, num_workers, std::move(device), cluster->hub_.get(), &engine));
    cluster->engines_.push_back(std::move(engine));
  }
  cluster->hub_->Start(cluster->engines_);
  *out = std::move(cluster);
  return Status::Ok();
}

LocalCluster::~LocalCluster() { Shutdown(); }

int LocalCluster::num_workers() const { return static_cast<int>(engines_.size()); }
Engine* LocalCluster::worker(int rank) { return engines_[rank].get(); }
int64_t LocalCluster::rejected_messages() const { return hub_ ? hub_->rejected() : 0; }

Status LocalCluster::Shutdown() {
  Status first;
  for (auto& engine : engines_) {
    const Status status = engine->Shutdown();
    if (first.ok()) first = status;
  }
  if (hub_) hub_->Stop();
  return first;
}

}  // namespace mltuner
