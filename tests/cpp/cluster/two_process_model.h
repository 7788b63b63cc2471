// Test helpers for payloads between processes: Wire, which moves the
// outgoing messages of two ProcessNodes to each other as the socket
// transport does (NextOutgoing on one, Deliver on the other), and
// TrainModel, a two-table model whose payloads take every send and receive
// path. Shared by cluster/process_node_test and gpu/remote_frames_test.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "memory/device_block.h"
#include "mltuner/cluster.h"
#include "mltuner/engine.h"
#include "mltuner/process_node.h"
#include "test_util.h"
#include "wire/batch.h"

namespace mltuner {
namespace testing {

// Moves every outgoing message of each node to the other until stopped.
// With `lend`, it does what the socket transport does on the CPU backend:
// each payload is received into memory of the wire's own (a ZeroMQ frame
// there), delivered with a token, and kept until the receiver hands the
// token back; the wire then checks that nobody wrote into it. With
// `batches`, it takes what waits as the socket transport does
// (NextOutgoingBatch), after 2 ms, as a busy send thread would, so that a
// clock's messages queue up and leave joined.
class Wire {
 public:
  Wire(ProcessNode* a, ProcessNode* b, bool lend = false, bool batches = false) {
    for (const auto& ends : {std::pair{a, b}, std::pair{b, a}}) {
      ProcessNode* from = ends.first;
      ProcessNode* to = ends.second;
      threads_.emplace_back([this, from, to, lend, batches] {
        std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> kept;  // token: (lent, original)
        int64_t next_token = 0;
        std::vector<OutgoingMessage> taken;
        while (!stop_) {
          if (lend) TakeBack(to, &kept);
          OutgoingMessage message;
          if (batches) {
            if (taken.empty()) {
              if (from->outbox_messages() == 0) {
                // Nothing queued; messages held for their frames' tickets
                // still leave once the device is done with them.
                taken = from->NextOutgoingBatch(1, 64, size_t{1} << 20);
                if (taken.empty()) continue;
              } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(2));
                taken = from->NextOutgoingBatch(20, 64, size_t{1} << 20);
                if (taken.empty()) continue;
              }
            }
            message = std::move(taken.front());
            taken.erase(taken.begin());
            if (IsBatch(message.header.data(), message.header.size())) ++batches_;
          } else if (!from->NextOutgoing(20, &message)) {
            continue;
          }
          if (!lend) {
            const Status status = to->Deliver(message.header.data(), message.header.size(),
                                              message.payload_values(), message.payload_bytes());
            if (!status.ok()) ++refused_;
            continue;
          }
          const float* values = message.payload_values();
          std::vector<float> received(values, values + message.payload_bytes() / sizeof(float));
          const int64_t token = next_token++;
          auto& entry = kept[token];
          entry.second = received;
          entry.first = std::move(received);  // the vector's heap block does not move
          const Status status = to->Deliver(message.header.data(), message.header.size(), entry.first.data(),
                                            entry.first.size() * sizeof(float), token);
          if (!status.ok()) ++refused_;
        }
        // What the receiver still holds comes back once it is done (at the
        // latest when its node shuts down, after this wire is gone).
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (lend && !kept.empty() && std::chrono::steady_clock::now() < deadline) {
          TakeBack(to, &kept);
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        unreturned_ += static_cast<int>(kept.size());
      });
    }
  }
  ~Wire() { Stop(); }
  void Stop() {
    stop_ = true;
    for (auto& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }
  int refused() const { return refused_; }
  int written() const { return written_; }        // lent payloads changed by the receiver
  int returned() const { return returned_; }      // tokens handed back
  int unreturned() const { return unreturned_; }  // tokens still out when the wire stopped
  int batches() const { return batches_; }        // socket messages that were batches

 private:
  void TakeBack(ProcessNode* to, std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>>* kept) {
    std::vector<int64_t> tokens;
    if (!to->TakeReleasedPayloads(&tokens).ok()) ++refused_;
    for (int64_t token : tokens) {
      auto found = kept->find(token);
      if (found == kept->end()) continue;
      if (found->second.first != found->second.second) ++written_;
      ++returned_;
      kept->erase(found);
    }
  }
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0};
  std::atomic<int> written_{0};
  std::atomic<int> returned_{0};
  std::atomic<int> unreturned_{0};
  std::atomic<int> batches_{0};
  std::vector<std::thread> threads_;
};

// A model whose payloads take every send and receive path: table "a" has two
// updates per clock (the update log; rows recorded out of id order, so a
// shard's rows make several segments), table "b" one (sent straight from its
// buffer). Updates are a deterministic function of the rows read, the rank
// and the clock, so BSP gives the same bits however the payloads travel.
// `at_clock` runs after each clock's Clock().
struct ModelHandles {
  TableId a = -1, b = -1;
  Handle read_a = -1, read_b = -1, up_a1 = -1, up_a2 = -1, up_b = -1;
  std::vector<RowId> all_a, first_a, second_a, all_b;
};

// Creates the tables and records one iteration.
inline Status RecordModel(Engine* engine, ModelHandles* m) {
  MLT_RETURN_IF_ERROR(engine->CreateTable("a", 40, 7, false, &m->a));
  MLT_RETURN_IF_ERROR(engine->CreateTable("b", 13, 5, false, &m->b));
  for (RowId row = 0; row < 40; ++row) m->all_a.push_back((row * 17) % 40);  // a permutation
  for (RowId row = 0; row < 40; row += 3) m->first_a.push_back(row);
  for (RowId row = 39; row >= 0; row -= 2) m->second_a.push_back(row);
  for (RowId row = 0; row < 13; ++row) m->all_b.push_back(row);
  MLT_RETURN_IF_ERROR(engine->VirtualRead(m->a, m->all_a, 0, &m->read_a));
  MLT_RETURN_IF_ERROR(engine->VirtualRead(m->b, m->all_b, 0, &m->read_b));
  MLT_RETURN_IF_ERROR(engine->VirtualPostRead(m->read_a));
  MLT_RETURN_IF_ERROR(engine->VirtualPostRead(m->read_b));
  MLT_RETURN_IF_ERROR(engine->VirtualPreUpdate(m->a, m->first_a, &m->up_a1));
  MLT_RETURN_IF_ERROR(engine->VirtualUpdate(m->up_a1));
  MLT_RETURN_IF_ERROR(engine->VirtualPreUpdate(m->b, m->all_b, &m->up_b));
  MLT_RETURN_IF_ERROR(engine->VirtualUpdate(m->up_b));
  MLT_RETURN_IF_ERROR(engine->VirtualPreUpdate(m->a, m->second_a, &m->up_a2));
  MLT_RETURN_IF_ERROR(engine->VirtualUpdate(m->up_a2));
  return engine->VirtualClock();
}

// The model's plan under `config` for one of two workers: pool_min_bytes
// is its least device budget; above it by less than the tables' cache and
// update log, some rows are host-resident (host_store_bytes > 0).
inline PlanPreview ModelPreview(const Config& config) {
  PlanPreview preview;
  preview.pool_min_bytes = -1;
  std::unique_ptr<LocalCluster> cluster;
  if (!LocalCluster::Create(config, 2, &cluster).ok()) return preview;
  ModelHandles m;
  if (!RecordModel(cluster->worker(0), &m).ok() || !cluster->worker(0)->PreviewPlan(&preview).ok()) {
    preview.pool_min_bytes = -1;
  }
  return preview;
}

// How the test reaches a buffer's memory: memcpy for host-addressable
// devices (the default); the GPU tests pass a cudaMemcpy.
using BufferCopy = std::function<void(void* dst, const void* src, size_t bytes)>;

// One clock of the model: reads both tables, then updates a (twice) and b
// with values made from what it read, the rank and the clock.
inline Status TrainClock(Engine* engine, const ModelHandles& m, int rank, int clock, const BufferCopy& copy) {
  AccessBuffer ra, rb, ua1, ub, ua2;
  MLT_RETURN_IF_ERROR(engine->Read(m.read_a, &ra));
  MLT_RETURN_IF_ERROR(engine->Read(m.read_b, &rb));
  std::vector<float> va(40 * 7), vb(13 * 5);
  copy(va.data(), ra.data, va.size() * sizeof(float));
  copy(vb.data(), rb.data, vb.size() * sizeof(float));
  MLT_RETURN_IF_ERROR(engine->PostRead(m.read_a));
  MLT_RETURN_IF_ERROR(engine->PostRead(m.read_b));
  const auto grad = [&](float x, size_t i) {
    return static_cast<float>(std::sin(x * 0.37 + 0.01 * static_cast<double>(i) + rank + 0.1 * clock) * 0.01);
  };
  std::vector<float> g;
  MLT_RETURN_IF_ERROR(engine->PreUpdate(m.up_a1, &ua1));
  g.resize(m.first_a.size() * 7);
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad(va[i % va.size()], i);
  copy(ua1.data, g.data(), g.size() * sizeof(float));
  MLT_RETURN_IF_ERROR(engine->Update(m.up_a1));
  MLT_RETURN_IF_ERROR(engine->PreUpdate(m.up_b, &ub));
  g.resize(vb.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad(vb[i], i + 1000);
  copy(ub.data, g.data(), g.size() * sizeof(float));
  MLT_RETURN_IF_ERROR(engine->Update(m.up_b));
  MLT_RETURN_IF_ERROR(engine->PreUpdate(m.up_a2, &ua2));
  g.resize(m.second_a.size() * 7);
  for (size_t i = 0; i < g.size(); ++i) g[i] = grad(va[(i * 3) % va.size()], i + 2000);
  copy(ua2.data, g.data(), g.size() * sizeof(float));
  MLT_RETURN_IF_ERROR(engine->Update(m.up_a2));
  return engine->Clock();
}

// Both tables' values (a then b), of `branch` (-1: the one the cache holds).
inline Status FetchModel(Engine* engine, const ModelHandles& m, std::vector<float>* out, BranchId branch = -1) {
  std::vector<RowId> ids_a(40), ids_b(13);
  for (RowId row = 0; row < 40; ++row) ids_a[row] = row;
  for (RowId row = 0; row < 13; ++row) ids_b[row] = row;
  out->assign(40 * 7 + 13 * 5, 0.0f);
  MLT_RETURN_IF_ERROR(engine->Fetch(m.a, ids_a, out->data(), branch));
  return engine->Fetch(m.b, ids_b, out->data() + 40 * 7, branch);
}

// Same length and the same bits (NaN payloads included).
inline void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_TRUE(got.size() == want.size());
  EXPECT_TRUE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
}

inline BufferCopy Memcpy() {
  return [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
}

inline void TrainModel(Engine* engine, int rank, int clocks, std::vector<float>* out,
                       const std::function<void(int clock)>& at_clock, const BufferCopy& copy_buffer = {}) {
  const BufferCopy copy = copy_buffer ? copy_buffer : Memcpy();
  ModelHandles m;
  ASSERT_OK(RecordModel(engine, &m));
  ASSERT_OK(engine->FinishVirtualIteration());
  ASSERT_OK(engine->StartIterations());
  for (int clock = 0; clock < clocks; ++clock) {
    ASSERT_OK(TrainClock(engine, m, rank, clock, copy));
    if (at_clock) at_clock(clock);
  }
  ASSERT_OK(engine->Flush());
  ASSERT_OK(engine->WaitForDataAge(m.a, clocks - 1));
  ASSERT_OK(engine->WaitForDataAge(m.b, clocks - 1));
  ASSERT_OK(FetchModel(engine, m, out));
}


// Trains the model for `clocks` clocks on a LocalCluster of two workers
// (payloads as device buffers: every shard shares the device's memory), on
// the CPU backend unless `make_device` makes the devices.
inline void TrainInOneProcess(const Config& config, int clocks, std::vector<float> out[2],
                              const DeviceFactory& make_device = nullptr) {
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 2, &cluster, make_device));
  std::thread other([&] { TrainModel(cluster->worker(1), 1, clocks, &out[1], nullptr); });
  TrainModel(cluster->worker(0), 0, clocks, &out[0], nullptr);
  other.join();
  ASSERT_OK(cluster->Shutdown());
}

struct TwoNodeRun {
  std::vector<float> values[2];
  int64_t frames_at[2][2] = {{-1, -1}, {-1, -1}};  // [rank]: received frames allocated after clock 8, the last
  int refused = 0;
  int64_t rejected = 0;
  int lent_returned = 0, lent_written = 0, lent_unreturned = 0;  // Wire's counts with `lend`
  int batches = 0;                                               // Wire's count with `batches`
  IpcStats ipc[2];                                               // each node's CUDA IPC counts
  int64_t by_host[2] = {0, 0};                                   // device payload bytes sent by host frames
};

// Called with both nodes once they exist, before any traffic (the IPC test
// sets up its links there).
using NodesSetup = std::function<void(std::unique_ptr<ProcessNode>* nodes)>;

// The same on two ProcessNodes joined by a Wire (payloads in host frames,
// or lent to the receiver with `lend`), each with a device from
// `make_device` (null: the CPU backend).
inline void TrainInTwoProcesses(const Config& config, const DeviceFactory& make_device, int clocks, TwoNodeRun* out,
                                const BufferCopy& copy = {}, bool lend = false, bool batches = false,
                                const NodesSetup& setup = {}) {
  std::unique_ptr<ProcessNode> nodes[2];
  for (int rank = 0; rank < 2; ++rank) {
    std::unique_ptr<Device> device;
    if (make_device) ASSERT_OK(make_device(rank, &device));
    ASSERT_OK(ProcessNode::Create(config, rank, 2, std::move(device), &nodes[rank]));
  }
  if (setup) setup(nodes);
  {
    Wire wire(nodes[0].get(), nodes[1].get(), lend, batches);
    const auto run = [&](int rank) {
      ProcessNode* node = nodes[rank].get();
      TrainModel(node->engine(), rank, clocks, &out->values[rank], [&](int clock) {
        if (clock == 8) out->frames_at[rank][0] = node->receive_frames().allocations();
        if (clock == clocks - 1) out->frames_at[rank][1] = node->receive_frames().allocations();
      }, copy);
    };
    std::thread other(run, 1);
    run(0);
    other.join();
    wire.Stop();
    out->refused = wire.refused();
    out->lent_returned = wire.returned();
    out->lent_written = wire.written();
    out->lent_unreturned = wire.unreturned();
    out->batches = wire.batches();
  }
  out->rejected = nodes[0]->rejected_messages() + nodes[1]->rejected_messages();
  for (int rank = 0; rank < 2; ++rank) {
    out->ipc[rank] = nodes[rank]->cuda_ipc_stats();
    out->by_host[rank] = nodes[rank]->device_payload_bytes_by_host();
  }
}

}  // namespace testing
}  // namespace mltuner
