// The CPU backend: "device" memory is ordinary host memory and every
// operation is done when its call returns (a large pass split over helper
// threads too: pass_split.h), so streams impose no ordering beyond program
// order and Synchronize has nothing to wait for.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>

#include <sys/mman.h>

#include "common/mutex.h"
#include "device/cpu/pass_split.h"
#include "device/cpu/shared_memory_ipc.h"
#include "mltuner/device.h"
#include "mltuner/device_ipc.h"
#include "mltuner/own_step.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace mltuner {
namespace {

// Cache-line alignment: vector loads never split lines, and two buffers
// never share a line (no false sharing between threads filling them).
constexpr size_t kAlignment = 64;

Status AlignedAllocate(size_t bytes, const char* what, void** out) {
  if (bytes == 0) return Status::InvalidArgument(std::string(what) + " of 0 bytes");
  // No object may exceed PTRDIFF_MAX (pointer differences would overflow);
  // refusing here also keeps the rounding below from wrapping.
  if (bytes > static_cast<size_t>(PTRDIFF_MAX)) {
    return Status::ResourceExhausted(std::string(what) + " of " + std::to_string(bytes) + " bytes is too large");
  }
  // aligned_alloc needs a size that is a multiple of the alignment.
  const size_t rounded = (bytes + kAlignment - 1) & ~(kAlignment - 1);
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  if (ptr == nullptr) {
    return Status::ResourceExhausted(std::string(what) + " of " + std::to_string(bytes) +
                                     " bytes failed: out of host memory");
  }
  *out = ptr;
  return Status::Ok();
}

// One rule's loop for one combination of its choices: with the kind and
// the flags constants, UpdateValue has no branch left, and the compiler
// vectorizes the element-wise arithmetic (each value's operations are the
// same in a vector lane: same bits). This file is built with
// -fno-math-errno, so that Adam's sqrtf is the instruction, not a call that
// may set errno. Before, a step over 10 MiB of values took 1.9 ms with sgd
// and momentum and 6.6 ms with Adam on one core, 7 and 24x the time of
// "add"; now 0.67 and 1.6 ms (benchmarks/device_bench.cc, rule rows).
template <UpdateRuleKind Kind, bool Decay, bool Momentum, bool Nesterov, bool FirstStep, bool Amsgrad>
void ApplyRuleLoop(const UpdateStep& step, float* __restrict params, float* __restrict state,
                   const float* __restrict update_sum, int64_t begin, int64_t end, int64_t stride) {
  UpdateStep fixed = step;
  fixed.kind = Kind;
  fixed.with_decay = Decay;
  fixed.with_momentum = Momentum;
  fixed.nesterov = Nesterov;
  fixed.first_step = FirstStep;
  fixed.amsgrad = Amsgrad;
  for (int64_t i = begin; i < end; ++i) UpdateValue(fixed, params, state, update_sum, stride, i);
}

// Picks the loop of `step`'s choices, one flag at a time: F... are the flags
// fixed so far, in ApplyRuleLoop's order. Flags a kind never reads are
// fixed false, so each kind compiles only the loops it can use.
// Values are independent of each other (the state of value i is at
// i + k * stride), so large steps split into ranges (PassSplit).
template <UpdateRuleKind Kind, bool... F>
void ApplyRule(const UpdateStep& step, float* params, float* state, const float* update_sum, int64_t count,
               int64_t stride) {
  constexpr size_t kFixed = sizeof...(F);
  if constexpr (kFixed == 5) {
    PassSplit::Shared().For(count, kSplitChunkBytes / sizeof(float), 16, [&](int64_t begin, int64_t end) {
      ApplyRuleLoop<Kind, F...>(step, params, state, update_sum, begin, end, stride);
    });
  } else {
    constexpr bool sgd = Kind == UpdateRuleKind::kSgd;
    constexpr bool adam = Kind == UpdateRuleKind::kAdam || Kind == UpdateRuleKind::kAdamW;
    constexpr bool kRead[5] = {sgd || adam, sgd, sgd, sgd, adam};  // decay, momentum, nesterov, first, amsgrad
    const bool flags[5] = {step.with_decay, step.with_momentum, step.nesterov, step.first_step, step.amsgrad};
    if constexpr (kRead[kFixed]) {
      if (flags[kFixed]) return ApplyRule<Kind, F..., true>(step, params, state, update_sum, count, stride);
    }
    ApplyRule<Kind, F..., false>(step, params, state, update_sum, count, stride);
  }
}

// dst[i] += src[i] for n floats. The fixed 16-float inner block has a trip
// count GCC can vectorise even under -O2's "very cheap" cost model (no
// epilogue or alias check needed: __restrict promises no overlap), and a
// 64-byte block matches a cache line.
void AddFloats(float* __restrict dst, const float* __restrict src, int64_t n) {
  constexpr int64_t kBlock = 16;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
#pragma GCC unroll 16
    for (int64_t j = 0; j < kBlock; ++j) dst[i + j] += src[i + j];
  }
  for (; i < n; ++i) dst[i] += src[i];
}

// Gathers larger than this write with streaming (non-temporal) stores: the
// destination will not be read back from cache soon, and skipping the
// read-for-ownership of every destination line cuts memory traffic by a
// third. glibc's memcpy does the same for large copies, which is why a gather
// of many short runs fell to about half of memcpy's bandwidth without it.
constexpr int64_t kStreamingGatherBytes = int64_t{4} << 20;

#if defined(__SSE2__)
// dst[0, n) = src[0, n) with streaming stores. REQUIRES: dst is 16-byte
// aligned and n % 4 == 0. The caller issues the store fence.
void StreamCopy(float* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128 a = _mm_loadu_ps(src + i), b = _mm_loadu_ps(src + i + 4);
    const __m128 c = _mm_loadu_ps(src + i + 8), d = _mm_loadu_ps(src + i + 12);
    _mm_stream_ps(dst + i, a);
    _mm_stream_ps(dst + i + 4, b);
    _mm_stream_ps(dst + i + 8, c);
    _mm_stream_ps(dst + i + 12, d);
  }
  for (; i < n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
}

// Whether a gather may stream: every destination row starts 16-byte aligned.
bool CanStreamGather(const float* dst, int64_t row_width) {
  return row_width % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
}
void StoreFence() { _mm_sfence(); }
#else
bool CanStreamGather(const float*, int64_t) { return false; }
void StreamCopy(float*, const float*, int64_t) {}
void StoreFence() {}
#endif

// Zeroed blocks from this size up are fresh anonymous mappings: their pages
// take RAM only once written. Below it, a page or two: malloc and memset.
constexpr size_t kMappedBytes = size_t{1} << 20;

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int64_t capacity) : capacity_(capacity > 0 ? capacity : 0) {}
  std::string name() const override { return "cpu"; }
  bool host_addressable() const override { return true; }
  // Every pointer is host memory, so Gather and ScatterAdd take the host
  // stores as they are.
  bool maps_host_memory() const override { return true; }

  Status Allocate(size_t bytes, void** out) override {
    MLT_RETURN_IF_ERROR(Reserve(bytes, "CpuDevice::Allocate"));
    const Status status = AlignedAllocate(bytes, "CpuDevice::Allocate", out);
    if (status.ok()) {
      Count(*out, bytes);
    } else {
      Unreserve(bytes);
    }
    return status;
  }
  void Free(void* ptr) override {
    Uncount(ptr);
    Release(ptr);
  }

  Status MemoryInfo(int64_t* free_bytes, int64_t* total_bytes) override {
    if (capacity_ == 0) return Device::MemoryInfo(free_bytes, total_bytes);
    MutexLock lock(&capacity_mu_);
    *free_bytes = capacity_ - in_use_;
    *total_bytes = capacity_;
    return Status::Ok();
  }
  Status AllocateHost(size_t bytes, void** out) override {
    return AlignedAllocate(bytes, "CpuDevice::AllocateHost", out);
  }
  void FreeHost(void* ptr) override { Release(ptr); }

  // Host and device memory are the same here.
  Status AllocateZeroed(size_t bytes, bool host, void** out) override {
    if (!host) {
      MLT_RETURN_IF_ERROR(Reserve(bytes, "CpuDevice::AllocateZeroed"));
      const Status status = AllocateZeroedMemory(bytes, out);
      if (status.ok()) {
        Count(*out, bytes);
      } else {
        Unreserve(bytes);
      }
      return status;
    }
    return AllocateZeroedMemory(bytes, out);
  }

  // Processes of one host share landing regions as memory (shared_memory_ipc.h).
  Status ExportIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) override {
    return ExportSharedMemoryIpc(region_bytes, out);
  }

  Status PrepareIndex(RunIndex* index) override {
    int64_t total = 0;
    MLT_RETURN_IF_ERROR(CountIndexRows(*index, &total));
    index->total_rows = total;
    return Status::Ok();
  }
  // Nothing to release: the CPU backend never makes a device copy.
  void ReleaseIndex(RunIndex* index) override { index->device_copy = nullptr; }

  void CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream) override { CopyBytes(dst, src, bytes); }
  void CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream) override { CopyBytes(dst, src, bytes); }
  void CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream) override { CopyBytes(dst, src, bytes); }

  void Gather(float* dst, const float* src, const RunIndex& index, int64_t row_width, Stream) override {
    // Counted here: an index need not be prepared (total_rows).
    int64_t rows = 0;
    for (const RowRun& run : index.runs) rows += std::max<int64_t>(run.count, 0);
    // One run is a single memcpy, which already streams when large.
    const bool large = rows * row_width * static_cast<int64_t>(sizeof(float)) >= kStreamingGatherBytes;
    const bool stream = large && index.runs.size() > 1 && CanStreamGather(dst, row_width);
    // Each range of the gathered rows (runs in order) copies its part of
    // every run that overlaps it.
    PassSplit::Shared().For(
        rows, std::max<int64_t>(kSplitChunkBytes / (row_width * static_cast<int64_t>(sizeof(float))), 1), 1,
        [&](int64_t begin, int64_t end) {
          int64_t at = 0;  // the position of `run` among the gathered rows
          for (const RowRun& run : index.runs) {
            const int64_t count = std::max<int64_t>(run.count, 0);
            const int64_t first = std::max(begin, at), last = std::min(end, at + count);
            if (first < last) {
              float* to = dst + (run.dst + first - at) * row_width;
              const float* from = src + (run.src + first - at) * row_width;
              const int64_t values = (last - first) * row_width;
              if (stream) {
                StreamCopy(to, from, values);
              } else {
                std::memcpy(to, from, static_cast<size_t>(values) * sizeof(float));
              }
            }
            at += count;
            if (at >= end) break;
          }
          // Streaming stores are weakly ordered: fence so that whoever
          // synchronizes with this thread next sees every row.
          if (stream) StoreFence();
        });
  }

  // Runs are applied one after another, so runs whose dst rows overlap
  // accumulate correctly. REQUIRES: src and dst do not overlap.
  void ScatterAdd(float* dst, const float* src, const RunIndex& index, int64_t row_width, Stream) override {
    for (const RowRun& run : index.runs) {
      if (run.count <= 0) continue;
      AddFloats(dst + run.dst * row_width, src + run.src * row_width, run.count * row_width);
    }
  }

  void Fill(float* dst, float value, size_t count, Stream) override {
    // +0.0f is all zero bytes: memset is twice as fast as the float loop
    // (the zeroed update buffer of every clock).
    const bool zero = value == 0.0f && !std::signbit(value);
    PassSplit::Shared().For(static_cast<int64_t>(count), kSplitChunkBytes / sizeof(float), 16,
                            [dst, value, zero](int64_t begin, int64_t end) {
                              if (zero) {
                                std::memset(dst + begin, 0, static_cast<size_t>(end - begin) * sizeof(float));
                              } else {
                                std::fill(dst + begin, dst + end, value);
                              }
                            });
  }
  Status Synchronize(Stream) override { return Status::Ok(); }
  Status TakeError() override { return Status::Ok(); }
  // Application work on the CPU is done by the time it calls a post.
  Status RecordAppWork(uintptr_t, DeviceEvent* out) override {
    out->reset();
    return Status::Ok();
  }
  Status RecordEvent(Stream, DeviceEvent* out) override {
    out->reset();
    return Status::Ok();
  }
  Status WaitEvent(Stream, const DeviceEvent&) override { return Status::Ok(); }
  Status WaitOnAppStream(uintptr_t, const DeviceEvent&) override { return Status::Ok(); }
  Status WaitEventDone(const DeviceEvent&) override { return Status::Ok(); }
  Status QueryEvent(const DeviceEvent&, bool* done) override {
    *done = true;  // the work ran when it was queued
    return Status::Ok();
  }

  Status CopyToHostOnAppStream(uintptr_t, void* host, const void* src, size_t bytes) override {
    std::memcpy(host, src, bytes);
    return Status::Ok();
  }

  Status CopyPiecesOnAppStream(uintptr_t, float* buffer, const std::vector<CopyPiece>& pieces,
                               CopyDirection direction, const float* zero_if) override {
    const bool zeros = direction == CopyDirection::kIntoBuffer && zero_if != nullptr && *zero_if != 0.0f;
    for (const CopyPiece& piece : pieces) {
      const size_t bytes = static_cast<size_t>(piece.count) * sizeof(float);
      if (zeros) {
        std::memset(buffer + piece.offset, 0, bytes);
      } else if (direction == CopyDirection::kIntoBuffer) {
        std::memcpy(buffer + piece.offset, piece.memory, bytes);
      } else {
        std::memcpy(piece.memory, buffer + piece.offset, bytes);
      }
    }
    return Status::Ok();
  }

  void AddInto(float* dst, const float* src, int64_t count, Stream) override {
    PassSplit::Shared().For(count, kSplitChunkBytes / sizeof(float), 16,
                            [dst, src](int64_t begin, int64_t end) { AddFloats(dst + begin, src + begin, end - begin); });
  }
  void ApplyUpdate(const UpdateStep& step, float* params, float* state, const float* update_sum, int64_t count,
                   int64_t stride, Stream) override {
    switch (step.kind) {
      case UpdateRuleKind::kAdd: return ApplyRule<UpdateRuleKind::kAdd>(step, params, state, update_sum, count, stride);
      case UpdateRuleKind::kSgd: return ApplyRule<UpdateRuleKind::kSgd>(step, params, state, update_sum, count, stride);
      case UpdateRuleKind::kDampedMomentum:
        return ApplyRule<UpdateRuleKind::kDampedMomentum>(step, params, state, update_sum, count, stride);
      case UpdateRuleKind::kAdam: return ApplyRule<UpdateRuleKind::kAdam>(step, params, state, update_sum, count, stride);
      case UpdateRuleKind::kAdamW: return ApplyRule<UpdateRuleKind::kAdamW>(step, params, state, update_sum, count, stride);
    }
    for (int64_t i = 0; i < count; ++i) UpdateValue(step, params, state, update_sum, stride, i);
  }
  void OwnStep(const UpdateStep& step, float momentum, float* own_step, float* state, const float* update,
               float* cache, float* drift, int64_t count, int64_t stride, Stream) override {
    for (int64_t i = 0; i < count; ++i) OwnStepValue(step, momentum, own_step, state, update, cache, drift, stride, i);
  }
  void Carry(float ahead, float next, float* cache, float* raw, float* drift, const float* own_step_d, int64_t count,
             Stream) override {
    for (int64_t i = 0; i < count; ++i) CarryValue(ahead, next, cache, raw, drift, own_step_d, i);
  }
  Status CountNonFinite(const float* data, int64_t count, Stream, int64_t* out) override {
    *out = CountNonFiniteHost(data, count);
    return Status::Ok();
  }
  int ordinal() const override { return 0; }

 private:
  // Zeroed memory: small blocks zeroed here, large ones fresh pages.
  Status AllocateZeroedMemory(size_t bytes, void** out) {
    if (bytes < kMappedBytes) {
      MLT_RETURN_IF_ERROR(AlignedAllocate(bytes, "CpuDevice::AllocateZeroed", out));
      std::memset(*out, 0, bytes);
      return Status::Ok();
    }
    void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      return Status::ResourceExhausted("CpuDevice::AllocateZeroed of " + std::to_string(bytes) +
                                       " bytes failed: out of host memory or address space (mmap)");
    }
    MutexLock lock(&mapped_mu_);
    mapped_[ptr] = bytes;
    *out = ptr;
    return Status::Ok();
  }

  // Memory of either allocator: a mapping is unmapped, anything else freed.
  void Release(void* ptr) {
    if (ptr == nullptr) return;
    size_t mapped_bytes = 0;
    {
      MutexLock lock(&mapped_mu_);
      auto found = mapped_.find(ptr);
      if (found != mapped_.end()) {
        mapped_bytes = found->second;
        mapped_.erase(found);
      }
    }
    if (mapped_bytes > 0) {
      munmap(ptr, mapped_bytes);
    } else {
      std::free(ptr);
    }
  }

  // The capacity's account (nothing is counted without one): device bytes
  // taken before the allocation, so two threads cannot both pass the check.
  Status Reserve(size_t bytes, const char* what) {
    if (capacity_ == 0) return Status::Ok();
    MutexLock lock(&capacity_mu_);
    if (static_cast<int64_t>(bytes) > capacity_ - in_use_) {
      return Status::ResourceExhausted(std::string(what) + " of " + std::to_string(bytes) + " bytes: out of memory (" +
                                       std::to_string(capacity_ - in_use_) + " of the device's " +
                                       std::to_string(capacity_) + " bytes free)");
    }
    in_use_ += static_cast<int64_t>(bytes);
    return Status::Ok();
  }
  void Unreserve(size_t bytes) {
    if (capacity_ == 0) return;
    MutexLock lock(&capacity_mu_);
    in_use_ -= static_cast<int64_t>(bytes);
  }
  void Count(void* ptr, size_t bytes) {
    if (capacity_ == 0) return;
    MutexLock lock(&capacity_mu_);
    device_bytes_[ptr] = bytes;
  }
  // Host memory (AllocateHost) is not in the account: nothing to do for it.
  void Uncount(void* ptr) {
    if (capacity_ == 0 || ptr == nullptr) return;
    MutexLock lock(&capacity_mu_);
    auto found = device_bytes_.find(ptr);
    if (found == device_bytes_.end()) return;
    in_use_ -= static_cast<int64_t>(found->second);
    device_bytes_.erase(found);
  }

  Mutex mapped_mu_;
  std::unordered_map<void*, size_t> mapped_ GUARDED_BY(mapped_mu_);  // mappings from AllocateZeroed
  const int64_t capacity_;  // 0: no capacity
  Mutex capacity_mu_;
  int64_t in_use_ GUARDED_BY(capacity_mu_) = 0;
  std::unordered_map<void*, size_t> device_bytes_ GUARDED_BY(capacity_mu_);  // device allocations
};

}  // namespace

std::unique_ptr<Device> NewCpuDevice(int64_t capacity_bytes) { return std::make_unique<CpuDevice>(capacity_bytes); }

}  // namespace mltuner
