// Fresh rows are installed into the parameter cache on their own stream
// (Stream::kInstall) and gathered out of it on the allocator's, so the
// engine orders the two on the device with per-table tickets
// (cache/table_store.h, CacheTickets). On a GPU a missing ticket is a rare
// race; here a device that keeps, for every operation, which operations of
// every stream a GPU would have finished before it (a stream's own order,
// and the tickets its stream waited for) checks the order on the CPU:
// every gather of a table comes after every install of it queued before
// (it reads the rows of its data age), and every install after every
// gather of it queued before (a gather reads whole rows of one clock).
#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "forwarding_device.h"
#include "mltuner/cluster.h"
#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "test_util.h"

using namespace mltuner;

namespace {

// Per stream, how many of its operations are ordered before a point.
using Seen = std::array<int64_t, kNumStreams>;

// The ordering a GPU would give, kept on the host: a ticket is what its
// stream had seen when recorded; a wait makes the waiting stream see it.
class StreamOrderDevice final : public ForwardingDevice {
 public:
  struct Op {
    int64_t host_order;  // the order the calls were made in
    Stream stream;
    int block;           // the allocation the operation reads (gathers) or writes (installs), -1: none
    Seen seen;           // per stream: its operations ordered before this one
  };

  Status Allocate(size_t bytes, void** out) override {
    MLT_RETURN_IF_ERROR(ForwardingDevice::Allocate(bytes, out));
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[static_cast<const char*>(*out)] = {bytes, next_block_++};  // addresses come back after a Free
    return Status::Ok();
  }
  void Free(void* p) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.erase(static_cast<const char*>(p));
    }
    ForwardingDevice::Free(p);
  }
  void CopyHostToDevice(void* d, const void* s, size_t b, Stream st) override {
    Note(st, d, &installs_);
    ForwardingDevice::CopyHostToDevice(d, s, b, st);
  }
  void CopyDeviceToDevice(void* d, const void* s, size_t b, Stream st) override {
    Note(st, d, &installs_);
    ForwardingDevice::CopyDeviceToDevice(d, s, b, st);
  }
  void Gather(float* dst, const float* src, const RunIndex& index, int64_t width, Stream st) override {
    if (st == Stream::kInstall) {
      Note(st, dst, &installs_);  // a frame's rows scattered into the cache
    } else {
      Note(st, src, &gathers_);
    }
    ForwardingDevice::Gather(dst, src, index, width, st);
  }
  void Fill(float* d, float v, size_t n, Stream st) override {
    Note(st, nullptr, nullptr);
    ForwardingDevice::Fill(d, v, n, st);
  }
  void ScatterAdd(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    Note(st, nullptr, nullptr);
    ForwardingDevice::ScatterAdd(d, s, i, w, st);
  }
  Status RecordEvent(Stream s, DeviceEvent* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    *out = std::make_shared<Seen>(seen_[static_cast<int>(s)]);
    return Status::Ok();
  }
  Status WaitEvent(Stream s, const DeviceEvent& event) override {
    if (!event) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    const Seen& ticket = *std::static_pointer_cast<Seen>(event);
    Seen& seen = seen_[static_cast<int>(s)];
    for (int t = 0; t < kNumStreams; ++t) seen[t] = std::max(seen[t], ticket[t]);
    return Status::Ok();
  }
  Status WaitEventDone(const DeviceEvent&) override { return Status::Ok(); }
  Status RecordAppWork(uintptr_t, DeviceEvent* out) override { return RecordEvent(Stream::kApp, out); }
  Status WaitOnAppStream(uintptr_t, const DeviceEvent& event) override { return WaitEvent(Stream::kApp, event); }

  std::vector<Op> installs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return installs_;
  }
  std::vector<Op> gathers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return gathers_;
  }

 private:
  // Queues one operation on `stream`; `into`: where to keep it, with the
  // allocation `address` lies in.
  void Note(Stream stream, const void* address, std::vector<Op>* into) {
    std::lock_guard<std::mutex> lock(mu_);
    Seen& seen = seen_[static_cast<int>(stream)];
    if (into != nullptr) into->push_back({next_order_, stream, BlockOf(address), seen});
    ++next_order_;
    ++seen[static_cast<int>(stream)];  // later operations of the stream come after this one
  }
  int BlockOf(const void* address) const {
    const char* at = static_cast<const char*>(address);
    auto after = blocks_.upper_bound(at);
    if (after == blocks_.begin()) return -1;
    const auto block = std::prev(after);
    return at < block->first + block->second.bytes ? block->second.id : -1;
  }

  struct Block {
    size_t bytes;
    int id;
  };
  mutable std::mutex mu_;
  std::map<const char*, Block> blocks_;  // by address, the allocations not freed
  int next_block_ = 0;
  std::array<Seen, kNumStreams> seen_{};
  int64_t next_order_ = 0;
  std::vector<Op> installs_;
  std::vector<Op> gathers_;
};

}  // namespace

TEST(GathersAndInstallsOfATableAreOrderedOnTheDevice) {
  std::vector<StreamOrderDevice*> devices;
  DeviceFactory factory = [&](int, std::unique_ptr<Device>* out) {
    auto device = std::make_unique<StreamOrderDevice>();
    devices.push_back(device.get());
    *out = std::move(device);
    return Status::Ok();
  };
  Config config;
  config.wait_timeout_ms = 10000;
  config.update_rule.kind = UpdateRuleKind::kSgd;
  constexpr int kWorkers = 2;
  constexpr int kClocks = 12;
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, kWorkers, &cluster, factory));
  std::vector<std::thread> threads;
  std::vector<Status> status(kWorkers);
  for (int k = 0; k < kWorkers; ++k) {
    threads.emplace_back([&, k] {
      Engine* e = cluster->worker(k);
      TableId a = -1, b = -1;
      Handle read_a = -1, read_b = -1, update_a = -1, update_b = -1;
      Status s = e->CreateTable("a", 64, 16, false, &a);
      if (s.ok()) s = e->CreateTable("b", 32, 8, false, &b);
      std::vector<RowId> rows_a(64), rows_b(32);
      for (RowId r = 0; r < 64; ++r) rows_a[r] = r;
      for (RowId r = 0; r < 32; ++r) rows_b[r] = r;
      // Slack 1: the allocator gathers a clock ahead while the other
      // worker's rows of the clock before are still being installed.
      if (s.ok()) s = e->VirtualRead(a, rows_a, 1, &read_a);
      if (s.ok()) s = e->VirtualRead(b, rows_b, 1, &read_b);
      if (s.ok()) s = e->VirtualPreUpdate(b, rows_b, &update_b);
      if (s.ok()) s = e->VirtualUpdate(update_b);
      if (s.ok()) s = e->VirtualPreUpdate(a, rows_a, &update_a);
      if (s.ok()) s = e->VirtualUpdate(update_a);
      if (s.ok()) s = e->VirtualPostRead(read_b);
      if (s.ok()) s = e->VirtualPostRead(read_a);
      if (s.ok()) s = e->VirtualClock();
      if (s.ok()) s = e->FinishVirtualIteration();
      if (s.ok()) s = e->StartIterations();
      for (int c = 0; c < kClocks && s.ok(); ++c) {
        AccessBuffer ra, rb, ua, ub;
        s = e->Read(read_a, &ra);
        if (s.ok()) s = e->Read(read_b, &rb);
        if (s.ok()) s = e->PreUpdate(update_b, &ub);
        if (s.ok()) std::fill(ub.data, ub.data + 32 * 8, 0.01f * static_cast<float>(k + 1));
        if (s.ok()) s = e->Update(update_b);
        if (s.ok()) s = e->PreUpdate(update_a, &ua);
        if (s.ok()) std::fill(ua.data, ua.data + 64 * 16, 0.02f);
        if (s.ok()) s = e->Update(update_a);
        if (s.ok()) s = e->PostRead(read_b);
        if (s.ok()) s = e->PostRead(read_a);
        if (s.ok()) s = e->Clock();
      }
      if (s.ok()) s = e->Flush();
      if (s.ok()) s = e->WaitForDataAge(a, kClocks - 1);
      if (s.ok()) s = e->WaitForDataAge(b, kClocks - 1);
      status[k] = s;
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : status) ASSERT_OK(s);
  ASSERT_EQ(devices.size(), static_cast<size_t>(kWorkers));
  for (const StreamOrderDevice* device : devices) {
    const std::vector<StreamOrderDevice::Op> installs = device->installs();
    const std::vector<StreamOrderDevice::Op> gathers = device->gathers();
    int64_t pairs = 0;
    for (const StreamOrderDevice::Op& install : installs) {
      if (install.stream != Stream::kInstall || install.block < 0) continue;
      for (const StreamOrderDevice::Op& gather : gathers) {
        if (gather.block != install.block || gather.stream == Stream::kInstall) continue;
        ++pairs;
        const int64_t install_position = install.seen[static_cast<int>(Stream::kInstall)];  // ops before it
        const int64_t gather_position = gather.seen[static_cast<int>(gather.stream)];
        if (install.host_order < gather.host_order) {
          EXPECT_TRUE(gather.seen[static_cast<int>(Stream::kInstall)] > install_position);  // after the install
        } else {
          EXPECT_TRUE(install.seen[static_cast<int>(gather.stream)] > gather_position);  // after the gather
        }
      }
    }
    // Both orders occur: rows installed before gathers, and gathers queued
    // before the next rows came.
    EXPECT_TRUE(pairs > 4 * kClocks);
  }
  cluster->Shutdown();
}

MLT_TEST_MAIN
