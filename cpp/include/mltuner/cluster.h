// LocalCluster: N workers and N server shards inside one process, joined by
// an in-process transport (no sockets, no copies of the wire encoding).
//
// Each rank has an inbox for its shard and one for its engine, each drained
// by its own thread, so a shard applying updates never blocks an engine
// installing rows. The cluster owns the engines; worker(i) stays valid until
// Shutdown or destruction.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "mltuner/status.h"

namespace mltuner {

class LocalCluster {
 public:
  // `make_device` makes each worker's Device; null means the CPU backend.
  static Status Create(const Config& config, int num_workers, std::unique_ptr<LocalCluster>* out,
                       const DeviceFactory& make_device = nullptr);
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  int num_workers() const;
  // REQUIRES: 0 <= rank < num_workers().
  Engine* worker(int rank);
  // Messages the transport rejected (invalid for their receiver), for tests.
  int64_t rejected_messages() const;
  // Safe from several threads at once (each worker's, on an error): a call
  // returns once the first has stopped everything.
  Status Shutdown();

  class Hub;

 private:
  LocalCluster() = default;
  std::mutex shutdown_mu_;  // serializes Shutdown: the hub's threads are joined once
  std::unique_ptr<Hub> hub_;
  std::vector<std::unique_ptr<Engine>> engines_;
};

}  // namespace mltuner
