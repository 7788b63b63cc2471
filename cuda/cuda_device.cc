// CudaDevice: the CUDA backend of Device. See cuda_device.h for the error
// model; this file is plain C++ against the CUDA runtime, and the kernels it
// launches live in cuda/kernels.
#include "cuda_device.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/fill.h"
#include "kernels/finite.h"
#include "kernels/kernels.h"
#include "cuda_ipc.h"
#include "stream_ticket.h"

namespace mltuner {
namespace {

using cuda_detail::ErrorText;
using cuda_detail::EventPool;
using cuda_detail::StreamTicket;
using cuda_detail::TicketOf;

// Threads: any method from any thread (each calls cudaSetDevice first).
// Ownership: owns its streams, its upload stream and (shared) its event pool;
// the memory and index copies it hands out belong to the caller until Free /
// FreeHost / ReleaseIndex.
class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal)
      : ordinal_(ordinal),
        events_(std::make_shared<EventPool>(ordinal, cudaEventDisableTiming)),
        waits_(std::make_shared<EventPool>(ordinal, cudaEventDisableTiming | cudaEventBlockingSync)) {}

  // Streams are made here rather than in the constructor so that a failure
  // becomes a Status.
  Status Init() {
    MLT_RETURN_IF_ERROR(MakeCurrent("NewCudaDevice"));
    cudaDeviceProp props{};
    cudaError_t err = cudaGetDeviceProperties(&props, ordinal_);
    if (err != cudaSuccess) return Fail("NewCudaDevice (cudaGetDeviceProperties)", err);
    name_ = "cuda:" + std::to_string(ordinal_) + " " + props.name;
    // Non-blocking: the engine's streams must not serialize with work that
    // the application queues on the legacy default stream.
    // The server stream gets the lowest priority: a shard's sums and rules
    // fill gaps and never hold back the application's kernels.
    int least = 0, greatest = 0;
    err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (err != cudaSuccess) return Fail("NewCudaDevice (cudaDeviceGetStreamPriorityRange)", err);
    // So do the swap streams: a swap moves rows for ops the allocator
    // prepares ahead of time, or (out) rows the application is done with.
    // The pipeline's threads keep streams of their own: on one shared stream
    // a wait for the application's work (the reclaimer's, before it reads an
    // update) held back the allocator's gathers behind it, and a ResNet-18
    // clock got 0.2-0.5 ms slower on an H100, though it made a third fewer
    // driver calls.
    for (int i = 0; i < kNumStreams; ++i) {
      const Stream s = static_cast<Stream>(i);
      const bool low = s == Stream::kServer || s == Stream::kSwapIn || s == Stream::kSwapOut;
      const int priority = low ? least : 0;
      err = cudaStreamCreateWithPriority(&streams_[i], cudaStreamNonBlocking, priority);
      if (err != cudaSuccess) return Fail("NewCudaDevice (cudaStreamCreateWithPriority)", err);
    }
    // Kernels may read and write pinned host memory in place when it is
    // mapped at its host address: unified addressing (every 64-bit Linux
    // system) and the ability to map host memory. Without them the engine
    // swaps with a copy per run (Device::maps_host_memory).
    int unified = 0, can_map = 0;
    err = cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, ordinal_);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, ordinal_);
    if (err != cudaSuccess) return Fail("NewCudaDevice (cudaDeviceGetAttribute)", err);
    maps_host_ = unified != 0 && can_map != 0;
    err = cudaStreamCreateWithFlags(&upload_stream_, cudaStreamNonBlocking);
    if (err != cudaSuccess) return Fail("NewCudaDevice (cudaStreamCreateWithFlags)", err);
    return Status::Ok();
  }

  // Never throws or aborts: every error is ignored, since a device in an
  // error state (or a runtime already unloading at exit) fails these calls.
  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    for (cudaStream_t stream : streams_) {
      if (stream == nullptr) continue;
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (upload_stream_ != nullptr) {
      cudaStreamSynchronize(upload_stream_);
      cudaStreamDestroy(upload_stream_);
    }
    cudaGetLastError();
  }

  std::string name() const override { return name_; }
  bool host_addressable() const override { return false; }
  bool maps_host_memory() const override { return maps_host_; }
  bool swaps_by_kernel() const override { return false; }  // see Device::swaps_by_kernel
  int ordinal() const override { return ordinal_; }

  Status ExportIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) override {
    return NewCudaIpc(ordinal_, region_bytes, out);
  }

  Status MemoryInfo(int64_t* free_bytes, int64_t* total_bytes) override {
    MLT_RETURN_IF_ERROR(MakeCurrent("MemoryInfo"));
    size_t free_now = 0, total = 0;
    const cudaError_t err = cudaMemGetInfo(&free_now, &total);
    if (err != cudaSuccess) return Fail("MemoryInfo (cudaMemGetInfo)", err);
    *free_bytes = static_cast<int64_t>(free_now);
    *total_bytes = static_cast<int64_t>(total);
    return Status::Ok();
  }

  Status Allocate(size_t bytes, void** out) override {
    if (bytes == 0) return Status::InvalidArgument("CudaDevice::Allocate of 0 bytes");
    MLT_RETURN_IF_ERROR(MakeCurrent("Allocate"));
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err != cudaSuccess) return AllocationFailure("Allocate (cudaMalloc)", bytes, err);
    *out = ptr;
    return Status::Ok();
  }

  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    if (!MakeCurrentOrRecord("Free")) return;
    Record("Free (cudaFree)", cudaFree(ptr));
  }

  // Pinned, so that copies from it are true DMA and overlap with kernels;
  // portable (usable from every device of the process); and, when the device
  // maps host memory, mapped, so that the gather and scatter-add kernels read
  // and write it in place at its host address (checked, since the kernels
  // are handed the host pointer).
  Status AllocateHost(size_t bytes, void** out) override {
    if (bytes == 0) return Status::InvalidArgument("CudaDevice::AllocateHost of 0 bytes");
    MLT_RETURN_IF_ERROR(MakeCurrent("AllocateHost"));
    void* ptr = nullptr;
    const unsigned flags = cudaHostAllocPortable | (maps_host_ ? cudaHostAllocMapped : 0u);
    cudaError_t err = cudaHostAlloc(&ptr, bytes, flags);
    if (err != cudaSuccess) return AllocationFailure("AllocateHost (cudaHostAlloc)", bytes, err);
    if (maps_host_) {
      void* mapped = nullptr;
      err = cudaHostGetDevicePointer(&mapped, ptr, 0);
      if (err != cudaSuccess || mapped != ptr) {
        cudaFreeHost(ptr);
        if (err != cudaSuccess) return Fail("AllocateHost (cudaHostGetDevicePointer)", err);
        return Status::Internal("CudaDevice::AllocateHost: pinned memory mapped at a device address other than "
                                "its host address, although the device has unified addressing");
      }
    }
    *out = ptr;
    return Status::Ok();
  }

  void FreeHost(void* ptr) override {
    if (ptr == nullptr) return;
    if (!MakeCurrentOrRecord("FreeHost")) return;
    Record("FreeHost (cudaFreeHost)", cudaFreeHost(ptr));
  }

  // Uploads the runs and waits for the upload, so the copy is usable from
  // every stream at once. Preparing a prepared index replaces its copy; the
  // runs must not change afterwards without preparing again (the kernels read
  // index.runs.size() entries of the device copy).
  Status PrepareIndex(RunIndex* index) override {
    int64_t total = 0;
    MLT_RETURN_IF_ERROR(CountIndexRows(*index, &total));
    MLT_RETURN_IF_ERROR(MakeCurrent("PrepareIndex"));
    ReleaseIndex(index);
    index->total_rows = total;
    if (index->runs.empty()) return Status::Ok();

    const size_t bytes = index->runs.size() * sizeof(RowRun);
    void* copy = nullptr;
    cudaError_t err = cudaMalloc(&copy, bytes);
    if (err != cudaSuccess) return AllocationFailure("PrepareIndex (cudaMalloc)", bytes, err);
    // A private stream rather than cudaMemcpy: the legacy default stream
    // would also wait for whatever the application queued on it.
    err = cudaMemcpyAsync(copy, index->runs.data(), bytes, cudaMemcpyHostToDevice, upload_stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(upload_stream_);
    if (err != cudaSuccess) {
      cudaFree(copy);
      return Fail("PrepareIndex (upload)", err);
    }
    index->device_copy = copy;
    return Status::Ok();
  }

  // REQUIRES: work that used the index has completed (Synchronize).
  void ReleaseIndex(RunIndex* index) override {
    if (index->device_copy == nullptr) return;
    if (MakeCurrentOrRecord("ReleaseIndex")) Record("ReleaseIndex (cudaFree)", cudaFree(index->device_copy));
    index->device_copy = nullptr;
  }

  // Host pointers may be pageable or pinned: cudaMemcpyAsync handles both
  // (pageable ones are staged by the driver, and the call returns only once
  // the source has been read, so the caller may reuse it at once).
  void CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream s) override {
    Copy(dst, src, bytes, maps_host_ ? cudaMemcpyDefault : cudaMemcpyHostToDevice, s, "CopyHostToDevice");
  }
  void CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream s) override {
    Copy(dst, src, bytes, maps_host_ ? cudaMemcpyDefault : cudaMemcpyDeviceToHost, s, "CopyDeviceToHost");
  }
  // A swap's runs in one cudaMemcpyBatchAsync (CUDA 12.8 and later) rather
  // than a cudaMemcpyAsync per run, each of which costs about 2.5 us: runs
  // of 64 rows of 512 B-4 KiB reached 0.19-0.69 of the pinned bandwidth
  // that way (docs/gpu_benchmarks.md). Where the runtime or the driver
  // refuses the batch, this device copies per run from then on.
  void SwapRuns(float* dst, const float* src, const RunIndex& index, int64_t row_width, SwapDirection direction,
                Stream s) override {
    if (index.runs.size() < 2 || !batch_copies_.load(std::memory_order_relaxed) || row_width <= 0) {
      Device::SwapRuns(dst, src, index, row_width, direction, s);
      return;
    }
#if CUDART_VERSION >= 12080
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "SwapRuns", &stream)) return;
    const size_t row_bytes = static_cast<size_t>(row_width) * sizeof(float);
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    dsts.reserve(index.runs.size());
    srcs.reserve(index.runs.size());
    sizes.reserve(index.runs.size());
    for (const RowRun& run : index.runs) {
      if (run.count <= 0) continue;
      dsts.push_back(dst + run.dst * row_width);
      srcs.push_back(src + run.src * row_width);
      sizes.push_back(static_cast<size_t>(run.count) * row_bytes);
    }
    if (dsts.empty()) return;
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // after the swap stream's wait for its caller
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first_copy = 0;  // the attributes apply from the first copy on
#if CUDART_VERSION >= 13000
    const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes,
                                                 &first_copy, 1, stream);
#else
    size_t failed = 0;
    const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                                 dsts.size(), &attributes, &first_copy, 1, &failed, stream);
#endif
    if (err == cudaSuccess) return;
    cudaGetLastError();  // not an error of the device: the copies go one by one instead
    batch_copies_.store(false, std::memory_order_relaxed);
#endif
    Device::SwapRuns(dst, src, index, row_width, direction, s);
  }

  // "Device memory" may be mapped pinned memory from AllocateHost where the
  // device maps host memory (the server shard's state when the device cannot
  // hold it): with unified addressing cudaMemcpyDefault takes the direction
  // from the pointers, where a fixed kind would not match.
  void CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream s) override {
    Copy(dst, src, bytes, maps_host_ ? cudaMemcpyDefault : cudaMemcpyDeviceToDevice, s, "CopyDeviceToDevice");
  }

  // Either pointer may be mapped pinned memory from AllocateHost (when
  // maps_host_): the same kernel then reads or writes host memory over PCIe,
  // many runs in one launch, instead of a cudaMemcpyAsync per run.
  void Gather(float* dst, const float* src, const RunIndex& index, int64_t row_width, Stream s) override {
    RowRuns(&kernels::LaunchGatherRuns, "Gather", dst, src, index, row_width, s);
  }

  // REQUIRES (unlike the CPU backend): no two runs write the same dst row;
  // the kernel adds without atomics.
  void ScatterAdd(float* dst, const float* src, const RunIndex& index, int64_t row_width, Stream s) override {
    RowRuns(&kernels::LaunchScatterAddRuns, "ScatterAdd", dst, src, index, row_width, s);
  }

  void Fill(float* dst, float value, size_t count, Stream s) override {
    if (count == 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "Fill", &stream)) return;
    // Only +0.0f is all-zero bits; -0.0f must keep its sign, so compare bits.
    uint32_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    if (bits == 0) {
      Record("Fill (cudaMemsetAsync)", cudaMemsetAsync(dst, 0, count * sizeof(float), stream));
    } else {
      kernels::LaunchFill(dst, value, static_cast<int64_t>(count), stream);
      Record("Fill (kernel launch)", cudaGetLastError());
    }
  }

  Status Synchronize(Stream s) override {
    if (!ValidStream(s)) return Status::InvalidArgument("CudaDevice::Synchronize: no stream " + std::to_string(static_cast<int>(s)));
    if (MakeCurrentOrRecord("Synchronize")) {
      // Through a blocking-sync event: the engine's threads sleep while they
      // wait instead of spinning on a core (a default stream synchronize
      // spins), which would compete with the training thread's launches.
      cudaEvent_t event = nullptr;
      cudaError_t err = waits_->Take(&event);
      if (err != cudaSuccess) {
        Record("Synchronize (cudaEventCreateWithFlags)", err);
      } else {
        err = cudaEventRecord(event, streams_[static_cast<int>(s)]);
        if (err == cudaSuccess) err = cudaEventSynchronize(event);
        Record("Synchronize (blocking event)", err);
        waits_->Return(event);
      }
      // Anything else this thread's CUDA calls left behind.
      Record("Synchronize (cudaGetLastError)", cudaGetLastError());
    }
    std::lock_guard<std::mutex> lock(error_mu_);
    return std::exchange(first_error_, Status::Ok());
  }

  Status RecordAppWork(uintptr_t app_stream, DeviceEvent* out) override {
    MLT_RETURN_IF_ERROR(MakeCurrent("RecordAppWork"));
    const cudaError_t err = Ticket(AppStream(app_stream), out);
    return err == cudaSuccess ? Status::Ok() : AppStreamError("RecordAppWork", app_stream, err);
  }

  Status CopyToHostOnAppStream(uintptr_t app_stream, void* host, const void* src, size_t bytes) override {
    MLT_RETURN_IF_ERROR(MakeCurrent("CopyToHostOnAppStream"));
    const cudaError_t err = cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, AppStream(app_stream));
    return err == cudaSuccess ? Status::Ok() : AppStreamError("CopyToHostOnAppStream", app_stream, err);
  }

  Status CopyPiecesOnAppStream(uintptr_t app_stream, float* buffer, const std::vector<CopyPiece>& pieces,
                               CopyDirection direction, const float* zero_if) override {
    if (pieces.empty()) return Status::Ok();
    MLT_RETURN_IF_ERROR(MakeCurrent("CopyPiecesOnAppStream"));
    kernels::LaunchCopyPieces(buffer, pieces.data(), static_cast<int>(pieces.size()),
                              direction == CopyDirection::kIntoBuffer, zero_if, AppStream(app_stream));
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? Status::Ok() : AppStreamError("CopyPiecesOnAppStream", app_stream, err);
  }

  Status TakeError() override {
    std::lock_guard<std::mutex> lock(error_mu_);
    return std::exchange(first_error_, Status::Ok());
  }

  Status RecordEvent(Stream s, DeviceEvent* out) override {
    if (!ValidStream(s)) return Status::InvalidArgument("CudaDevice::RecordEvent: no stream " + std::to_string(static_cast<int>(s)));
    MLT_RETURN_IF_ERROR(MakeCurrent("RecordEvent"));
    const cudaError_t err = Ticket(streams_[static_cast<int>(s)], out);
    return err == cudaSuccess ? Status::Ok() : Fail("RecordEvent (cudaEventRecord)", err);
  }

  Status WaitEvent(Stream s, const DeviceEvent& event) override {
    if (!event) return Status::Ok();
    if (!ValidStream(s)) return Status::InvalidArgument("CudaDevice::WaitEvent: no stream " + std::to_string(static_cast<int>(s)));
    const StreamTicket& ticket = TicketOf(event);
    const cudaStream_t stream = streams_[static_cast<int>(s)];
    if (ticket.stream() == stream) return Status::Ok();  // the stream's order already waits
    MLT_RETURN_IF_ERROR(MakeCurrent("WaitEvent"));
    const cudaError_t err = cudaStreamWaitEvent(stream, ticket.event(), 0);
    if (err != cudaSuccess) return Fail("WaitEvent (cudaStreamWaitEvent)", err);
    return Status::Ok();
  }

  Status WaitOnAppStream(uintptr_t app_stream, const DeviceEvent& event) override {
    if (!event) return Status::Ok();
    const StreamTicket& ticket = TicketOf(event);
    const cudaStream_t stream = AppStream(app_stream);
    if (ticket.stream() == stream) return Status::Ok();
    MLT_RETURN_IF_ERROR(MakeCurrent("WaitOnAppStream"));
    const cudaError_t err = cudaStreamWaitEvent(stream, ticket.event(), 0);
    return err == cudaSuccess ? Status::Ok() : AppStreamError("WaitOnAppStream", app_stream, err);
  }

  Status WaitEventDone(const DeviceEvent& event) override {
    if (!event) return Status::Ok();
    MLT_RETURN_IF_ERROR(MakeCurrent("WaitEventDone"));
    const cudaError_t err = cudaEventSynchronize(TicketOf(event).event());
    if (err != cudaSuccess) return Fail("WaitEventDone (cudaEventSynchronize)", err);
    return Status::Ok();
  }

  Status QueryEvent(const DeviceEvent& event, bool* done) override {
    *done = true;
    if (!event) return Status::Ok();
    MLT_RETURN_IF_ERROR(MakeCurrent("QueryEvent"));
    const cudaError_t err = cudaEventQuery(TicketOf(event).event());
    if (err == cudaErrorNotReady) {
      *done = false;
      return Status::Ok();
    }
    if (err != cudaSuccess) return Fail("QueryEvent (cudaEventQuery)", err);
    return Status::Ok();
  }

  void AddInto(float* dst, const float* src, int64_t count, Stream s) override {
    if (count <= 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "AddInto", &stream)) return;
    kernels::LaunchAddInto(dst, src, count, stream);
    Record("AddInto (kernel launch)", cudaGetLastError());
  }

  void ApplyUpdate(const UpdateStep& step, float* params, float* state, const float* update_sum, int64_t count,
                   int64_t state_stride, Stream s) override {
    if (count <= 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "ApplyUpdate", &stream)) return;
    kernels::LaunchApplyUpdate(step, params, state, update_sum, count, state_stride, stream);
    Record("ApplyUpdate (kernel launch)", cudaGetLastError());
  }

  void OwnStep(const UpdateStep& step, float momentum, float* own_step, float* state, const float* update,
               float* cache, float* drift, int64_t count, int64_t state_stride, Stream s) override {
    if (count <= 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "OwnStep", &stream)) return;
    kernels::LaunchOwnStep(step, momentum, own_step, state, update, cache, drift, count, state_stride, stream);
    Record("OwnStep (kernel launch)", cudaGetLastError());
  }

  void Carry(float ahead, float next, float* cache, float* raw, float* drift, const float* own_step_d, int64_t count,
             Stream s) override {
    if (count <= 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, "Carry", &stream)) return;
    kernels::LaunchCarry(ahead, next, cache, raw, drift, own_step_d, count, stream);
    Record("Carry (kernel launch)", cudaGetLastError());
  }

  // The counter is a stream-ordered temporary (cheap from the stream's pool),
  // so concurrent calls on different streams need no shared scratch. The
  // wait is Synchronize's blocking event: the server thread sleeps, it does
  // not spin beside the application's launches.
  Status CountNonFinite(const float* data, int64_t count, Stream s, int64_t* out) override {
    *out = 0;
    if (!ValidStream(s)) {
      return Status::InvalidArgument("CudaDevice::CountNonFinite: no stream " + std::to_string(static_cast<int>(s)));
    }
    if (count <= 0) return Status::Ok();
    MLT_RETURN_IF_ERROR(MakeCurrent("CountNonFinite"));
    cudaStream_t stream = streams_[static_cast<int>(s)];
    unsigned long long* counter = nullptr;
    cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&counter), sizeof(*counter), stream);
    if (err != cudaSuccess) return Fail("CountNonFinite (cudaMallocAsync)", err);
    unsigned long long found = 0;
    err = cudaMemsetAsync(counter, 0, sizeof(*counter), stream);
    if (err == cudaSuccess) {
      kernels::LaunchCountNonFinite(data, count, counter, stream);
      err = cudaGetLastError();
    }
    // A pageable destination: the copy is staged and done once the stream is.
    if (err == cudaSuccess) err = cudaMemcpyAsync(&found, counter, sizeof(found), cudaMemcpyDeviceToHost, stream);
    const cudaError_t freed = cudaFreeAsync(counter, stream);
    if (err == cudaSuccess) err = freed;
    if (err != cudaSuccess) return Fail("CountNonFinite", err);
    MLT_RETURN_IF_ERROR(Synchronize(s));
    *out = static_cast<int64_t>(found);
    return Status::Ok();
  }

 private:
  // 0 names the legacy default stream explicitly, so the meaning holds even
  // if this file were built with a per-thread default stream.
  static cudaStream_t AppStream(uintptr_t app_stream) {
    return app_stream == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(app_stream);
  }

  // A failed call on the application's stream: a bad handle (or one of
  // another device) is the caller's mistake, anything else a CUDA error.
  static Status AppStreamError(const char* what, uintptr_t app_stream, cudaError_t err) {
    cudaGetLastError();
    const std::string text = std::string(what) + " on stream " + std::to_string(app_stream) + ": " + ErrorText(err);
    if (err == cudaErrorInvalidResourceHandle || err == cudaErrorInvalidValue) return Status::InvalidArgument(text);
    return Status::Internal("CUDA error in " + text);
  }

  // A pooled event recorded on `stream`, handed out as a ticket that returns
  // the event to the pool. On an error nothing is handed out, and the event,
  // its state unknown, is destroyed rather than pooled.
  cudaError_t Ticket(cudaStream_t stream, DeviceEvent* out) {
    cudaEvent_t event = nullptr;
    cudaError_t err = events_->Take(&event);
    if (err != cudaSuccess) return err;
    err = cudaEventRecord(event, stream);
    if (err != cudaSuccess) {
      cudaEventDestroy(event);
      return err;
    }
    *out = std::make_shared<StreamTicket>(event, stream, events_);
    return cudaSuccess;
  }

  using RowRunsLauncher = void (*)(float*, const float*, const RowRun*, int64_t, int64_t, int64_t, cudaStream_t);

  static bool ValidStream(Stream s) {
    const int i = static_cast<int>(s);
    return i >= 0 && i < kNumStreams;
  }

  // Clears the thread's last error too, so that a failure is reported once.
  static Status Fail(const std::string& what, cudaError_t err) {
    cudaGetLastError();
    return Status::Internal("CUDA error in " + what + ": " + ErrorText(err));
  }

  Status AllocationFailure(const char* what, size_t bytes, cudaError_t err) const {
    cudaGetLastError();
    // Only running out of memory is ResourceExhausted; anything else (a
    // device in an error state) is not cured by a smaller request.
    if (err != cudaErrorMemoryAllocation) return Fail(what, err);
    return Status::ResourceExhausted(std::string("CudaDevice::") + what + " of " + std::to_string(bytes) +
                                     " bytes on " + name_ + " failed: " + ErrorText(err));
  }

  // Engine threads are arbitrary threads; the current device is per thread.
  // cudaSetDevice only when another device is current: the engine makes
  // hundreds of calls per clock, and asking costs less than setting.
  cudaError_t SetCurrent() const {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == ordinal_) return cudaSuccess;
    return cudaSetDevice(ordinal_);
  }

  Status MakeCurrent(const char* what) const {
    const cudaError_t err = SetCurrent();
    if (err != cudaSuccess) return Fail(std::string(what) + " (cudaSetDevice)", err);
    return Status::Ok();
  }

  bool MakeCurrentOrRecord(const char* what) {
    const cudaError_t err = SetCurrent();
    if (err == cudaSuccess) return true;
    Record((std::string(what) + " (cudaSetDevice)").c_str(), err);
    return false;
  }

  // The common start of every asynchronous void method.
  bool Prepare(Stream s, const char* what, cudaStream_t* stream) {
    if (!ValidStream(s)) {
      RecordStatus(Status::InvalidArgument(std::string("CudaDevice::") + what + ": no stream " +
                                           std::to_string(static_cast<int>(s))));
      return false;
    }
    if (!MakeCurrentOrRecord(what)) return false;
    *stream = streams_[static_cast<int>(s)];
    return true;
  }

  void Record(const std::string& what, cudaError_t err) {
    if (err == cudaSuccess) return;
    cudaGetLastError();  // reported here; keep Synchronize from seeing it twice
    RecordStatus(Status::Internal("CUDA error in " + what + ": " + ErrorText(err)));
  }

  void RecordStatus(Status status) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (first_error_.ok()) first_error_ = std::move(status);
  }

  void Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, Stream s, const char* what) {
    if (bytes == 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, what, &stream)) return;
    Record(std::string(what) + " (cudaMemcpyAsync)", cudaMemcpyAsync(dst, src, bytes, kind, stream));
  }

  // An unprepared index (runs but no device copy) still works: its runs are
  // uploaded to a stream-ordered temporary (cudaMallocAsync / cudaFreeAsync
  // on the same stream), so the calling thread does not block. That costs an
  // allocation and a small copy per call; the engine prepares its indexes.
  void RowRuns(RowRunsLauncher launch, const char* what, float* dst, const float* src, const RunIndex& index,
               int64_t row_width, Stream s) {
    if (index.runs.empty() || row_width <= 0) return;
    cudaStream_t stream = nullptr;
    if (!Prepare(s, what, &stream)) return;
    const int64_t num_runs = static_cast<int64_t>(index.runs.size());
    const RowRun* runs = static_cast<const RowRun*>(index.device_copy);
    int64_t total_rows = index.total_rows;
    void* temporary = nullptr;
    if (runs == nullptr) {
      total_rows = 0;
      for (const RowRun& run : index.runs) total_rows += run.count;
      const size_t bytes = index.runs.size() * sizeof(RowRun);
      cudaError_t err = cudaMallocAsync(&temporary, bytes, stream);
      if (err != cudaSuccess) {
        Record(std::string(what) + " (cudaMallocAsync of an unprepared index)", err);
        return;
      }
      err = cudaMemcpyAsync(temporary, index.runs.data(), bytes, cudaMemcpyHostToDevice, stream);
      if (err != cudaSuccess) {
        Record(std::string(what) + " (upload of an unprepared index)", err);
        cudaFreeAsync(temporary, stream);
        return;
      }
      runs = static_cast<const RowRun*>(temporary);
    }
    launch(dst, src, runs, num_runs, total_rows, row_width, stream);
    Record(std::string(what) + " (kernel launch)", cudaGetLastError());
    if (temporary != nullptr) Record(std::string(what) + " (cudaFreeAsync)", cudaFreeAsync(temporary, stream));
  }

  const int ordinal_;
  std::string name_;
  bool maps_host_ = false;  // set by Init, constant afterwards
  std::atomic<bool> batch_copies_{true};  // false once a cudaMemcpyBatchAsync was refused (SwapRuns)
  std::array<cudaStream_t, kNumStreams> streams_{};
  cudaStream_t upload_stream_ = nullptr;  // PrepareIndex's uploads only
  std::shared_ptr<EventPool> events_;
  std::shared_ptr<EventPool> waits_;  // blocking-sync events for Synchronize

  std::mutex error_mu_;
  Status first_error_;  // guarded by error_mu_; the first unreported error
};

}  // namespace

namespace {
// A GPU was counted or a CUDA Device made: see CurrentCudaDeviceOnceSeen.
std::atomic<bool> g_cuda_seen{false};
}  // namespace

int CudaDeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (count > 0) g_cuda_seen.store(true, std::memory_order_relaxed);
  return count;
}

int CurrentCudaDeviceOnceSeen() {
  int current = -1;
  if (!g_cuda_seen.load(std::memory_order_relaxed)) return -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return current;
}

void RestoreCurrentCudaDevice(int ordinal) {
  int current = -1;
  if (ordinal < 0 || (cudaGetDevice(&current) == cudaSuccess && current == ordinal)) return;
  if (cudaSetDevice(ordinal) != cudaSuccess) cudaGetLastError();
}

Status NewCudaDevice(int ordinal, std::unique_ptr<Device>* out) {
  g_cuda_seen.store(true, std::memory_order_relaxed);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::InvalidArgument("no CUDA device for cuda:" + std::to_string(ordinal) +
                                   " (cudaGetDeviceCount: " + cudaGetErrorString(err) + ")");
  }
  if (count == 0) {
    return Status::InvalidArgument("no CUDA device for cuda:" + std::to_string(ordinal) +
                                   " (cudaGetDeviceCount: 0 devices visible)");
  }
  if (ordinal < 0 || ordinal >= count) {
    return Status::InvalidArgument("no CUDA device cuda:" + std::to_string(ordinal) + ": ordinal out of range, " +
                                   std::to_string(count) + " device(s) visible (cudaGetDeviceCount)");
  }
  auto device = std::make_unique<CudaDevice>(ordinal);
  MLT_RETURN_IF_ERROR(device->Init());
  *out = std::move(device);
  return Status::Ok();
}

}  // namespace mltuner
