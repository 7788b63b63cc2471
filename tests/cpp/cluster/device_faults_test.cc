// A device error on any engine thread, or in the shard, fails the engine at
// once: the application's next call (even one already blocked) returns the
// error, naming the thread and the operation, well within a second, instead
// of a wait timeout that blames a slow worker. The errors are injected by a
// Device that wraps the CPU backend.
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "mltuner/cluster.h"
#include "mltuner/device.h"
#include "mltuner/engine.h"
#include "forwarding_device.h"
#include "test_util.h"

using namespace mltuner;

namespace {

// Fails one Status-returning call once armed: the first call of `method` on
// `stream`, from the thread that first called `marker` ("Fill" or
// "CopyDeviceToDevice") on that stream when a marker is given: that tells the
// allocator (which zeroes update buffers) from the receive thread (which
// copies rows in), both of which use the prefetch stream.
class FaultyDevice final : public ForwardingDevice {
 public:
  FaultyDevice(std::string method, Stream stream, std::string marker)
      : method_(std::move(method)), stream_(stream), marker_(std::move(marker)) {}

  void Arm() { armed_ = true; }
  bool fired() const { return fired_; }

  std::string name() const override { return "faulty-cpu"; }
  void CopyDeviceToDevice(void* d, const void* s, size_t b, Stream st) override {
    Mark("CopyDeviceToDevice", st);
    ForwardingDevice::CopyDeviceToDevice(d, s, b, st);
  }
  void Fill(float* d, float v, size_t n, Stream st) override {
    Mark("Fill", st);
    ForwardingDevice::Fill(d, v, n, st);
  }
  Status Synchronize(Stream s) override { return Inject("Synchronize", s); }
  Status TakeError() override { return Status::Ok(); }
  Status RecordEvent(Stream s, DeviceEvent* out) override {
    out->reset();
    return Inject("RecordEvent", s);
  }
  Status WaitEvent(Stream s, const DeviceEvent&) override { return Inject("WaitEvent", s); }
  Status WaitOnAppStream(uintptr_t, const DeviceEvent&) override { return Status::Ok(); }
  Status WaitEventDone(const DeviceEvent&) override { return Status::Ok(); }

 private:
  void Mark(const char* method, Stream s) {
    if (s != stream_ || marker_ != method) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (marked_thread_ == std::thread::id()) marked_thread_ = std::this_thread::get_id();
  }

  Status Inject(const char* method, Stream s) {
    if (!armed_ || fired_ || method_ != method || s != stream_) return Status::Ok();
    if (!marker_.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (std::this_thread::get_id() != marked_thread_) return Status::Ok();
    }
    fired_ = true;
    return Status::Internal("CUDA error in " + std::string(method) + " on stream " +
                            std::to_string(static_cast<int>(s)) + ": injected");
  }

  const std::string method_;
  const Stream stream_;
  const std::string marker_;
  std::atomic<bool> armed_{false};
  std::atomic<bool> fired_{false};
  std::mutex mu_;
  std::thread::id marked_thread_;
};

// One worker trains a table (read, update) until the fault, armed at clock 3,
// fails a call; returns that call's Status and how long after arming it came.
void ExpectFailureNamed(const std::string& method, Stream stream, const std::string& marker,
                        const std::string& where) {
  FaultyDevice* faulty = nullptr;
  DeviceFactory factory = [&](int, std::unique_ptr<Device>* out) {
    auto device = std::make_unique<FaultyDevice>(method, stream, marker);
    faulty = device.get();
    *out = std::move(device);
    return Status::Ok();
  };
  Config config;
  config.wait_timeout_ms = 20000;  // far longer than the 1 s the failure may take
  config.update_rule.kind = UpdateRuleKind::kSgd;
  std::unique_ptr<LocalCluster> cluster;
  ASSERT_OK(LocalCluster::Create(config, 1, &cluster, factory));
  Engine* e = cluster->worker(0);
  TableId t = -1;
  Handle read = -1, update = -1;
  ASSERT_OK(e->CreateTable("w", 16, 8, false, &t));
  ASSERT_OK(e->VirtualRead(t, {0, 1, 2, 3, 4, 5, 6, 7}, 0, &read));
  ASSERT_OK(e->VirtualPreUpdate(t, {0, 1, 2, 3, 4, 5, 6, 7}, &update));
  ASSERT_OK(e->VirtualUpdate(update));
  ASSERT_OK(e->VirtualPostRead(read));
  ASSERT_OK(e->VirtualClock());
  ASSERT_OK(e->FinishVirtualIteration());
  ASSERT_OK(e->StartIterations());

  Status failed;
  auto armed_at = std::chrono::steady_clock::now();
  for (int clock = 0; clock < 200 && failed.ok(); ++clock) {
    if (clock == 3) {
      armed_at = std::chrono::steady_clock::now();
      faulty->Arm();
    }
    AccessBuffer r, u;
    failed = e->Read(read, &r);
    if (failed.ok()) failed = e->PreUpdate(update, &u);
    if (failed.ok()) failed = e->Update(update);
    if (failed.ok()) failed = e->PostRead(read);
    if (failed.ok()) failed = e->Clock();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - armed_at).count();
  EXPECT_TRUE(faulty->fired());
  EXPECT_CODE(failed, StatusCode::kInternal);
  EXPECT_TRUE(failed.message().find(where) != std::string::npos);
  EXPECT_TRUE(failed.message().find("CUDA error in " + method) != std::string::npos);
  EXPECT_TRUE(seconds < 1.0);
  // Every later call fails with the same cause.
  AccessBuffer r;
  EXPECT_CODE(e->Read(read, &r), StatusCode::kInternal);
  cluster->Shutdown();
}

}  // namespace

TEST(AllocatorThreadErrorFailsTheEngine) {
  ExpectFailureNamed("RecordEvent", Stream::kPrefetch, "Fill", "worker 0's allocator thread");
}
TEST(ReclaimerThreadErrorFailsTheEngine) {
  ExpectFailureNamed("RecordEvent", Stream::kWriteback, "", "worker 0's reclaimer thread");
}
TEST(ReceiveThreadErrorFailsTheEngine) {
  ExpectFailureNamed("WaitEvent", Stream::kInstall, "CopyDeviceToDevice", "worker 0's receive thread");
}
TEST(ShardErrorFailsTheEngine) { ExpectFailureNamed("RecordEvent", Stream::kServer, "", "shard 0"); }

MLT_TEST_MAIN
