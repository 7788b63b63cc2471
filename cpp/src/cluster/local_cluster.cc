// LocalCluster and its in-process transport (the Hub).
#include "mltuner/cluster.h"

#include "cluster/shard_host.h"
#include "mltuner/transport.h"
#include "wire/message.h"

namespace mltuner {

class LocalCluster::Hub : public Transport {
 public:
  // Every rank's shard keeps its state on its worker's device; all of them
  // share one process, so rows travel to every worker as device buffers.
  Hub(const Config& config, const std::vector<std::shared_ptr<Device>>& devices) : devices_(devices) {
    const int num_workers = static_cast<int>(devices.size());
    for (int rank = 0; rank < num_workers; ++rank) {
      hosts_.push_back(std::make_unique<ShardHost>(rank, num_workers, config, devices[rank],
                                                   [this, rank](int worker) {
                                                     return SameMemory(rank, worker) ? RowsRoute::kDeviceBuffer
                                                                                     : RowsRoute::kHostFrame;
                                                   }));
    }
  }

  // Host memory is shared by every CPU device; a GPU's memory only by users
  // of the same GPU (kernels may not read another GPU's memory without peer
  // access).
  bool SameMemory(int a, int b) const {
    const Device& x = *devices_[a];
    const Device& y = *devices_[b];
    if (x.host_addressable() || y.host_addressable()) return x.host_addressable() && y.host_addressable();
    return x.ordinal() == y.ordinal();
  }
  ~Hub() override { Stop(); }

  void Start(const std::vector<std::unique_ptr<Engine>>& engines) {
    for (size_t rank = 0; rank < hosts_.size(); ++rank) hosts_[rank]->Start(engines[rank].get(), this);
  }

  // Shards first: their last replies may still be queued for the engines.
  void Stop() {
    for (auto& host : hosts_) host->StopShard();
    for (auto& host : hosts_) host->Stop();
  }

  Status Send(Message&& message) override {
    const int receiver = message.header.receiver;
    if (receiver < 0 || receiver >= static_cast<int>(hosts_.size())) {
      return Status::InvalidArgument("message to unknown process " + std::to_string(receiver) + ": " +
                                     message.DebugString());
    }
    hosts_[receiver]->Push(std::move(message));
    return Status::Ok();
  }

  Status AddTableToShard(int rank, const TableInfo& info) override { return hosts_[rank]->AddTable(info); }
  Status DropTableFromShard(int rank, TableId table) override { return hosts_[rank]->DropTable(table); }

  bool SharesDevice(int sender, int receiver) const override { return SameMemory(sender, receiver); }

  int64_t rejected() const {
    int64_t total = 0;
    for (const auto& host : hosts_) total += host->rejected();
    return total;
  }

 private:
  std::vector<std::shared_ptr<Device>> devices_;
  std::vector<std::unique_ptr<ShardHost>> hosts_;
};

Status LocalCluster::Create(const Config& config, int num_workers, std::unique_ptr<LocalCluster>* out,
                            const DeviceFactory& make_device) {
  if (num_workers < 1) return Status::InvalidArgument("a cluster needs at least one worker");
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  std::vector<std::shared_ptr<Device>> devices;
  for (int rank = 0; rank < num_workers; ++rank) {
    std::unique_ptr<Device> device;
    if (make_device) {
      MLT_RETURN_IF_ERROR(make_device(rank, &device));
    } else {
      device = NewCpuDevice();
    }
    devices.push_back(std::move(device));
  }
  cluster->hub_ = std::make_unique<Hub>(config, devices);
  for (int rank = 0; rank < num_workers; ++rank) {
    std::unique_ptr<Engine> engine;
    MLT_RETURN_IF_ERROR(Engine::Create(config, rank, num_workers, devices[rank], cluster->hub_.get(), &engine));
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
  std::lock_guard<std::mutex> one_at_a_time(shutdown_mu_);
  Status first;
  for (auto& engine : engines_) {
    const Status status = engine->Shutdown();
    if (first.ok()) first = status;
  }
  if (hub_) hub_->Stop();
  return first;
}

}  // namespace mltuner
