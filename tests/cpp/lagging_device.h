// A CPU device whose streams run late, as a GPU's do: each stream's work
// goes to a thread of its own and runs after a random delay, ordered only by
// the stream's own order and by the events it was told to wait for. The
// CPU backend runs every copy at once on the calling thread, so a missing
// ticket between two streams (or a host read without a Synchronize) can
// never show on it; here it shows as wrong values, as on a GPU.
//
// The application's streams lag too: a test queues its own work on buffers
// with OnAppStream, as a GPU application queues kernels, and RecordAppWork,
// WaitOnAppStream and CopyPiecesOnAppStream go on the stream they name (a
// lane per stream handle modulo kAppLanes, each lagging on its own); FinishApp
// waits for them all. Memory is host memory, but the device reports itself
// GPU-like, so the engine never reads it on the host without a copy. Free,
// FreeHost and ReleaseIndex wait for every stream first, as cudaFree does.
// Made `synchronous`, the device runs everything at once on the calling
// thread instead: the reference, as the CPU backend would run it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "forwarding_device.h"

namespace mltuner {

class LaggingDevice final : public ForwardingDevice {
 public:
  // `max_delay_us`: each piece of stream work waits up to this long first.
  explicit LaggingDevice(uint32_t seed, int max_delay_us = 300, bool synchronous = false)
      : max_delay_us_(max_delay_us), synchronous_(synchronous) {
    for (int s = 0; s < kStreams; ++s) lanes_.push_back(std::make_unique<Lane>(seed * 31u + static_cast<uint32_t>(s)));
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      l->thread = std::thread([this, l] { Run(l); });
    }
  }
  ~LaggingDevice() override {
    DrainAll();
    for (auto& lane : lanes_) {
      {
        std::lock_guard<std::mutex> lock(lane->mu);
        lane->stopping = true;
      }
      lane->cv.notify_all();
      lane->thread.join();
    }
  }

  std::string name() const override { return "lagging " + ForwardingDevice::name(); }
  bool host_addressable() const override { return false; }
  bool maps_host_memory() const override { return true; }
  bool swaps_by_kernel() const override { return false; }  // copies per run, as the CUDA backend

  void Free(void* p) override {
    DrainAll();
    ForwardingDevice::Free(p);
  }
  void FreeHost(void* p) override {
    DrainAll();
    ForwardingDevice::FreeHost(p);
  }
  void ReleaseIndex(RunIndex* i) override {
    DrainAll();
    ForwardingDevice::ReleaseIndex(i);
  }

  void CopyHostToDevice(void* d, const void* s, size_t b, Stream st) override {
    Later(st, [=] { inner().CopyHostToDevice(d, s, b, Stream::kApp); });
  }
  void CopyDeviceToHost(void* d, const void* s, size_t b, Stream st) override {
    Later(st, [=] { inner().CopyDeviceToHost(d, s, b, Stream::kApp); });
  }
  void CopyDeviceToDevice(void* d, const void* s, size_t b, Stream st) override {
    Later(st, [=] { inner().CopyDeviceToDevice(d, s, b, Stream::kApp); });
  }
  void Gather(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    const RunIndex* index = &i;  // the plan's: it outlives the work (ReleaseIndex drains)
    Later(st, [=] { inner().Gather(d, s, *index, w, Stream::kApp); });
  }
  void ScatterAdd(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    const RunIndex* index = &i;
    Later(st, [=] { inner().ScatterAdd(d, s, *index, w, Stream::kApp); });
  }
  void Fill(float* d, float v, size_t n, Stream st) override {
    Later(st, [=] { inner().Fill(d, v, n, Stream::kApp); });
  }
  void AddInto(float* d, const float* s, int64_t n, Stream st) override {
    Later(st, [=] { inner().AddInto(d, s, n, Stream::kApp); });
  }
  void OwnStep(const UpdateStep& step, float m, float* own, float* state, const float* update, float* cache,
               float* drift, int64_t n, int64_t stride, Stream st) override {
    Later(st, [=] { inner().OwnStep(step, m, own, state, update, cache, drift, n, stride, Stream::kApp); });
  }
  void Carry(float ahead, float next, float* cache, float* raw, float* drift, const float* own, int64_t n,
             Stream st) override {
    Later(st, [=] { inner().Carry(ahead, next, cache, raw, drift, own, n, Stream::kApp); });
  }
  void ApplyUpdate(const UpdateStep& step, float* p, float* state, const float* sum, int64_t n, int64_t stride,
                   Stream st) override {
    Later(st, [=] { inner().ApplyUpdate(step, p, state, sum, n, stride, Stream::kApp); });
  }
  Status CountNonFinite(const float* d, int64_t n, Stream st, int64_t* out) override {
    MLT_RETURN_IF_ERROR(Synchronize(st));  // the count is read on the host
    return inner().CountNonFinite(d, n, Stream::kApp, out);
  }
  Status Synchronize(Stream s) override {
    DeviceEvent done;
    MLT_RETURN_IF_ERROR(RecordEvent(s, &done));
    return WaitEventDone(done);
  }

  Status RecordEvent(Stream s, DeviceEvent* out) override {
    auto event = std::make_shared<Event>();
    *out = event;
    Later(s, [event] { event->Set(); }, /*delay=*/false);
    return Status::Ok();
  }
  Status WaitEvent(Stream s, const DeviceEvent& e) override {
    std::shared_ptr<Event> event = std::static_pointer_cast<Event>(e);
    if (event && !event->done()) Later(s, [event] { event->Wait(); }, /*delay=*/false);
    return Status::Ok();
  }
  Status WaitOnAppStream(uintptr_t app, const DeviceEvent& e) override {
    std::shared_ptr<Event> event = std::static_pointer_cast<Event>(e);
    if (event && !event->done()) OnLane(AppLane(app), [event] { event->Wait(); }, false);
    return Status::Ok();
  }
  Status WaitEventDone(const DeviceEvent& e) override {
    if (auto event = std::static_pointer_cast<Event>(e)) event->Wait();
    return Status::Ok();
  }
  Status QueryEvent(const DeviceEvent& e, bool* done) override {
    auto event = std::static_pointer_cast<Event>(e);
    *done = !event || event->done();
    return Status::Ok();
  }
  Status RecordAppWork(uintptr_t app, DeviceEvent* out) override {
    auto event = std::make_shared<Event>();
    *out = event;
    OnLane(AppLane(app), [event] { event->Set(); }, false);
    return Status::Ok();
  }
  Status CopyPiecesOnAppStream(uintptr_t app, float* buffer, const std::vector<CopyPiece>& pieces,
                               CopyDirection direction, const float* zero_if) override {
    OnLane(AppLane(app), [this, app, buffer, pieces, direction, zero_if] {
      inner().CopyPiecesOnAppStream(app, buffer, pieces, direction, zero_if);
    });
    return Status::Ok();
  }

  // The application's own work on the buffers it opened, queued on stream
  // `app` after everything the engine made that stream wait for.
  void OnAppStream(std::function<void()> work, uintptr_t app = 0) { OnLane(AppLane(app), std::move(work)); }
  // Waits until the application's streams have run everything queued on them.
  void FinishApp() {
    for (int lane = kEngineLanes; lane < kStreams; ++lane) Drain(*lanes_[lane]);
  }

 private:
  static constexpr int kEngineLanes = 15;  // more than Stream has values
  static constexpr int kAppLanes = 3;      // the application's streams
  static constexpr int kStreams = kEngineLanes + kAppLanes;
  static int AppLane(uintptr_t app) { return kEngineLanes + static_cast<int>(app % kAppLanes); }

  class Event {
   public:
    void Set() {
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_ = true;
      }
      cv_.notify_all();
    }
    void Wait() {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return done_; });
    }
    bool done() {
      std::lock_guard<std::mutex> lock(mu_);
      return done_;
    }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
  };

  struct Lane {
    explicit Lane(uint32_t seed) : rng(seed) {}
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<std::function<void()>, bool>> work;  // (work, delayed)
    bool stopping = false;
    std::mt19937 rng;  // the lane's thread only
    std::thread thread;
  };

  void Later(Stream s, std::function<void()> work, bool delay = true) {
    OnLane(static_cast<int>(s) % kEngineLanes, std::move(work), delay);
  }

  void OnLane(int index, std::function<void()> work, bool delay = true) {
    if (synchronous_) {
      work();
      return;
    }
    Lane& lane = *lanes_[static_cast<size_t>(index)];
    {
      std::lock_guard<std::mutex> lock(lane.mu);
      lane.work.emplace_back(std::move(work), delay);
    }
    lane.cv.notify_all();
  }

  void Run(Lane* lane) {
    // The application's streams lag most, as a GPU busy with its kernels.
    bool app = false;
    for (int index = kEngineLanes; index < kStreams; ++index) app = app || lane == lanes_[index].get();
    std::uniform_int_distribution<int> delay_us(0, app ? 4 * max_delay_us_ : max_delay_us_);
    for (;;) {
      std::pair<std::function<void()>, bool> next;
      {
        std::unique_lock<std::mutex> lock(lane->mu);
        lane->cv.wait(lock, [lane] { return lane->stopping || !lane->work.empty(); });
        if (lane->work.empty()) return;  // stopping, and drained
        next = std::move(lane->work.front());
      }
      if (next.second) std::this_thread::sleep_for(std::chrono::microseconds(delay_us(lane->rng)));
      next.first();
      {
        std::lock_guard<std::mutex> lock(lane->mu);
        lane->work.pop_front();
      }
      lane->cv.notify_all();
    }
  }

  static void Drain(Lane& lane) {
    std::unique_lock<std::mutex> lock(lane.mu);
    lane.cv.wait(lock, [&lane] { return lane.work.empty(); });
  }
  void DrainAll() {
    for (auto& lane : lanes_) Drain(*lane);
  }

  const int max_delay_us_;
  const bool synchronous_;
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace mltuner
