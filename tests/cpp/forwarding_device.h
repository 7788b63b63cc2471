// A Device that hands every call to another one (the CPU backend unless
// given): tests derive from it and override only the calls they count, fake
// or fail. The calls with a default in Device (AllocateZeroed,
// maps_host_memory, swaps_by_kernel) keep that default, so a derived device
// cannot map host memory unless it says so.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mltuner/device.h"

namespace mltuner {

class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(std::unique_ptr<Device> inner = NewCpuDevice()) : inner_(std::move(inner)) {}

  std::string name() const override { return "forwarding " + inner_->name(); }
  bool host_addressable() const override { return inner_->host_addressable(); }
  int ordinal() const override { return inner_->ordinal(); }
  Status Allocate(size_t b, void** out) override { return inner_->Allocate(b, out); }
  void Free(void* p) override { inner_->Free(p); }
  Status AllocateHost(size_t b, void** out) override { return inner_->AllocateHost(b, out); }
  void FreeHost(void* p) override { inner_->FreeHost(p); }
  Status PrepareIndex(RunIndex* i) override { return inner_->PrepareIndex(i); }
  void ReleaseIndex(RunIndex* i) override { inner_->ReleaseIndex(i); }
  void CopyHostToDevice(void* d, const void* s, size_t b, Stream st) override { inner_->CopyHostToDevice(d, s, b, st); }
  void CopyDeviceToHost(void* d, const void* s, size_t b, Stream st) override { inner_->CopyDeviceToHost(d, s, b, st); }
  void CopyDeviceToDevice(void* d, const void* s, size_t b, Stream st) override {
    inner_->CopyDeviceToDevice(d, s, b, st);
  }
  void Gather(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    inner_->Gather(d, s, i, w, st);
  }
  void ScatterAdd(float* d, const float* s, const RunIndex& i, int64_t w, Stream st) override {
    inner_->ScatterAdd(d, s, i, w, st);
  }
  void Fill(float* d, float v, size_t n, Stream st) override { inner_->Fill(d, v, n, st); }
  void AddInto(float* d, const float* s, int64_t n, Stream st) override { inner_->AddInto(d, s, n, st); }
  void OwnStep(const UpdateStep& step, float m, float* own, float* state, const float* update, float* cache,
               float* drift, int64_t n, int64_t stride, Stream st) override {
    inner_->OwnStep(step, m, own, state, update, cache, drift, n, stride, st);
  }
  void Carry(float ahead, float next, float* cache, float* raw, float* drift, const float* own, int64_t n,
             Stream st) override {
    inner_->Carry(ahead, next, cache, raw, drift, own, n, st);
  }
  void ApplyUpdate(const UpdateStep& step, float* p, float* state, const float* sum, int64_t n, int64_t stride,
                   Stream st) override {
    inner_->ApplyUpdate(step, p, state, sum, n, stride, st);
  }
  Status CountNonFinite(const float* d, int64_t n, Stream st, int64_t* out) override {
    return inner_->CountNonFinite(d, n, st, out);
  }
  Status Synchronize(Stream s) override { return inner_->Synchronize(s); }
  Status TakeError() override { return inner_->TakeError(); }
  Status RecordEvent(Stream s, DeviceEvent* out) override { return inner_->RecordEvent(s, out); }
  Status WaitEvent(Stream s, const DeviceEvent& e) override { return inner_->WaitEvent(s, e); }
  Status WaitOnAppStream(uintptr_t a, const DeviceEvent& e) override { return inner_->WaitOnAppStream(a, e); }
  Status WaitEventDone(const DeviceEvent& e) override { return inner_->WaitEventDone(e); }
  Status QueryEvent(const DeviceEvent& e, bool* done) override { return inner_->QueryEvent(e, done); }
  Status RecordAppWork(uintptr_t a, DeviceEvent* out) override { return inner_->RecordAppWork(a, out); }
  Status CopyToHostOnAppStream(uintptr_t a, void* host, const void* src, size_t bytes) override {
    return inner_->CopyToHostOnAppStream(a, host, src, bytes);
  }
  Status CopyPiecesOnAppStream(uintptr_t a, float* buffer, const std::vector<CopyPiece>& pieces,
                               CopyDirection direction, const float* zero_if) override {
    return inner_->CopyPiecesOnAppStream(a, buffer, pieces, direction, zero_if);
  }

 protected:
  Device& inner() { return *inner_; }

 private:
  std::unique_ptr<Device> inner_;
};

}  // namespace mltuner
