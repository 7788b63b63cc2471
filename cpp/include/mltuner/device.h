// Device: the memory and data-movement interface the engine is written
// against. The CPU backend (always built) implements it with host memory and
// a budget, so every piece of engine logic — swapping, prefetch, buffer-pool
// pressure — runs and is tested on a machine without a GPU. The CUDA backend
// implements the same interface with device memory, pinned staging, copy
// streams and kernels.
//
// Thread safety: every method may be called from any thread. Work issued on
// one stream runs in issue order; Synchronize(stream) waits for all of it.
// Work on different streams is unordered unless the caller synchronizes.
//
// Ownership: memory from Allocate/AllocateHost belongs to the caller, who
// must return it with Free/FreeHost before the Device is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mltuner/status.h"
#include "mltuner/types.h"
#include "mltuner/update_step.h"

namespace mltuner {

class DeviceIpc;  // mltuner/device_ipc.h

// The engine's streams. The CPU backend runs everything synchronously.
enum class Stream : int {
  kApp = 0,        // the application's own work (init-phase accesses)
  kPrefetch = 1,   // allocator thread: gathers and host->device copies
  kWriteback = 2,  // reclaimer thread: scatter-adds and device->host copies
  kReceive = 3,    // synchronous requests (fetch replies, branch switches)
  kServer = 4,     // the process's server shard: sums, update rules, pushed rows
                   // (low priority on CUDA: it must not delay the application)
  kSwapIn = 5,     // allocator thread: host-resident rows into access buffers
  kSwapOut = 6,    // reclaimer thread: access buffers into host-resident rows
                   // (both low priority on CUDA, and apart from each other, so a
                   // swap-out waiting for the application never holds back a
                   // swap-in queued behind it)
  kInstall = 7,    // receive thread: fresh rows into the parameter cache (its
                   // own stream: behind the allocator's, which waits for the
                   // application, a clock's rows arrived a clock late at slack 1)
};
constexpr int kNumStreams = 8;

// A ticket for work queued on a stream; null means "already complete".
using DeviceEvent = std::shared_ptr<void>;

// A prebuilt list of row runs, made once at the end of the virtual
// iteration. The device may keep its own copy (the CUDA backend uploads it).
struct RunIndex {
  std::vector<RowRun> runs;
  int64_t total_rows = 0;
  void* device_copy = nullptr;  // owned by the Device; see ReleaseIndex
};

// A piece of the application's memory and a span of an engine buffer, in
// floats: copied into the buffer (buffer[offset, offset + count) =
// memory[0, count)) or out of it (the other way), see CopyDirection.
struct CopyPiece {
  float* memory = nullptr;
  int64_t offset = 0;
  int64_t count = 0;
};

enum class CopyDirection { kIntoBuffer, kOutOfBuffer };

// Which way a swap moves host-resident rows: from AllocateHost memory into
// device memory, or out of device memory into it.
enum class SwapDirection { kIn, kOut };

// The rows an index moves (the sum of its runs' counts); InvalidArgument for a
// run with a negative field. Every backend's PrepareIndex starts with it.
Status CountIndexRows(const RunIndex& index, int64_t* total_rows);

// How many of the `count` floats at `data` (host memory) are NaN or
// infinite. The CPU backend's CountNonFinite, and the check of payloads that
// arrive in host memory.
int64_t CountNonFiniteHost(const float* data, int64_t count);

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual std::string name() const = 0;
  // True when device memory is ordinary host memory (numpy can view it); then
  // any host memory may be passed where device memory is read (a received
  // frame is used where it lies, memory/borrowed_frames.h).
  virtual bool host_addressable() const = 0;

  // Device memory. REQUIRES: bytes > 0.
  virtual Status Allocate(size_t bytes, void** out) = 0;
  virtual void Free(void* ptr) = 0;
  // Host staging memory (pinned on CUDA, and mapped into the device's address
  // space at the same address when maps_host_memory()).
  virtual Status AllocateHost(size_t bytes, void** out) = 0;
  virtual void FreeHost(void* ptr) = 0;
  // As Allocate (host: AllocateHost), every byte zero; freed as such. The
  // default allocates, then zeroes with Fill (REQUIRES: bytes a multiple of
  // 4 for device memory). The CPU backend maps fresh pages for large blocks:
  // the kernel zeroes a page when it is first touched, so memory that is not
  // yet written takes no RAM (a plan's stores fill as training touches them).
  virtual Status AllocateZeroed(size_t bytes, bool host, void** out);

  // True when Gather, ScatterAdd and Fill may take memory from AllocateHost
  // (not arbitrary host memory) in place of device memory, for either
  // pointer: the device reads and writes it where it lies (on CUDA, a kernel
  // over PCIe on pinned memory mapped at the same address, which needs
  // unified addressing). The engine then moves host-resident rows with one
  // launch per access when swaps_by_kernel(); otherwise with a copy per run
  // through staging. The CPU backend's memory is all host memory: true. The
  // default is false.
  virtual bool maps_host_memory() const { return false; }
  // Whether the engine should move host-resident rows that way (REQUIRES
  // maps_host_memory()), or with the device's copy engines, a copy per run.
  // CUDA: copies. A kernel reading pinned memory over PCIe reached 0.84-0.92
  // of the pinned copy's bandwidth alone, but beside the application's
  // kernels, at the lowest priority, about 21 GB/s where the copy engines
  // keep about 52: a ResNet-18 under a quarter budget trained 2.7x slower.
  virtual bool swaps_by_kernel() const { return maps_host_memory(); }

  virtual Status PrepareIndex(RunIndex* index) = 0;
  virtual void ReleaseIndex(RunIndex* index) = 0;

  virtual void CopyHostToDevice(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual void CopyDeviceToHost(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual void CopyDeviceToDevice(void* dst, const void* src, size_t bytes, Stream s) = 0;
  // For each run: dst rows [run.dst, run.dst+count) = src rows [run.src, ...).
  // Both pointers are device memory, or either is AllocateHost memory when
  // maps_host_memory() (see there).
  virtual void Gather(float* dst, const float* src, const RunIndex& index, int64_t row_width,
                      Stream s) = 0;
  // For each run: dst rows [run.dst, ...) += src rows [run.src, ...).
  // Pointers as for Gather. REQUIRES: no two runs write the same dst row.
  virtual void ScatterAdd(float* dst, const float* src, const RunIndex& index, int64_t row_width,
                          Stream s) = 0;
  // A swap: for each run, dst rows [run.dst, run.dst+count) = src rows
  // [run.src, ...), between AllocateHost memory and device memory (which is
  // which: `direction`). The default moves the runs with one Gather where
  // swaps_by_kernel(), else with a CopyHostToDevice / CopyDeviceToHost per
  // run; CUDA puts the runs of a swap in one batched copy on the copy
  // engines.
  virtual void SwapRuns(float* dst, const float* src, const RunIndex& index, int64_t row_width,
                        SwapDirection direction, Stream s);
  virtual void Fill(float* dst, float value, size_t count, Stream s) = 0;
  // dst[i] += src[i] for i < count. Both pointers are device memory.
  virtual void AddInto(float* dst, const float* src, int64_t count, Stream s) = 0;
  // One step of an update rule over `count` values (see update_step.h):
  // params, state and update_sum are device memory; the rule's state arrays
  // lie `state_stride` floats apart (>= count: a part of a larger slice).
  virtual void ApplyUpdate(const UpdateStep& step, float* params, float* state, const float* update_sum,
                           int64_t count, int64_t state_stride, Stream s) = 0;
  // Read-my-writes, one pass each (mltuner/own_step.h): OwnStepValue and
  // CarryValue for i < count. All pointers are device memory; `drift` and
  // `own_step_d` may be null as there.
  virtual void OwnStep(const UpdateStep& step, float momentum, float* own_step, float* state, const float* update,
                       float* cache, float* drift, int64_t count, int64_t state_stride, Stream s) = 0;
  virtual void Carry(float ahead, float next, float* cache, float* raw, float* drift, const float* own_step_d,
                     int64_t count, Stream s) = 0;
  // *out = how many of the `count` floats at `data` (device memory) are NaN
  // or infinite, counted after the work queued on `s` so far. Blocks the
  // calling thread until the count is known (on CUDA: a synchronize of `s`),
  // so it belongs only where a check was asked for (Config::check_finite).
  virtual Status CountNonFinite(const float* data, int64_t count, Stream s, int64_t* out) = 0;
  virtual Status Synchronize(Stream s) = 0;
  // The first error of asynchronous work seen so far and not yet reported
  // (by this or Synchronize), without waiting for anything.
  virtual Status TakeError() = 0;

  // Ordering between streams without blocking a thread. RecordEvent takes a
  // ticket for everything queued so far on engine stream `s`; WaitEvent makes
  // stream `s` wait for a ticket (from any stream of this device); a null
  // ticket is complete. WaitOnAppStream makes the application's stream wait,
  // so a buffer prepared on an engine stream is complete before the
  // application's kernels touch it. WaitEventDone blocks the calling thread;
  // QueryEvent only says whether the ticket is complete.
  virtual Status RecordEvent(Stream s, DeviceEvent* out) = 0;
  virtual Status WaitEvent(Stream s, const DeviceEvent& event) = 0;
  virtual Status WaitOnAppStream(uintptr_t app_stream, const DeviceEvent& event) = 0;
  virtual Status WaitEventDone(const DeviceEvent& event) = 0;
  virtual Status QueryEvent(const DeviceEvent& event, bool* done) = 0;

  // The application hands buffers back (post calls) while its own kernels
  // may still be using them on its own stream. RecordAppWork takes a ticket
  // for everything queued so far on `app_stream` (a CUDA stream handle as an
  // integer, 0 = the legacy default stream); WaitEvent makes an engine
  // stream wait for it. The CPU backend has no asynchronous work at all: its
  // tickets are null.
  virtual Status RecordAppWork(uintptr_t app_stream, DeviceEvent* out) = 0;
  // Queues on the application's stream, after its own work there, the copy
  // of each piece into `buffer` (device memory) or out of it into the
  // piece's memory (memory of this device that the application uses on that
  // stream: a PyTorch gradient in, a saved activation out). One launch for
  // many pieces: the adapter's way to move a layer's gradients or a stored
  // activation without a framework call per tensor. `zero_if`, when not
  // null, is a float of the application's memory read by the copy on the
  // stream: nonzero then, the copy into the buffer writes zeros instead of
  // the pieces (a mixed-precision clock whose gradients overflowed adds
  // nothing, without a host sync or a zeroing kernel per gradient). The CPU
  // backend copies at once. REQUIRES: pieces in bounds (the engine checks).
  virtual Status CopyPiecesOnAppStream(uintptr_t app_stream, float* buffer, const std::vector<CopyPiece>& pieces,
                                       CopyDirection direction, const float* zero_if) = 0;
  // Queues on the application's stream, after its own work there, a copy of
  // `bytes` of this device's memory at `src` into `host` (pinned memory of
  // AllocateHost): a value the application computes on the device, read by
  // an engine thread once a later RecordAppWork ticket is done. The CPU
  // backend copies at once.
  virtual Status CopyToHostOnAppStream(uintptr_t app_stream, void* host, const void* src, size_t bytes) = 0;
  // The index of the accelerator (DLPack device id); 0 for the CPU.
  virtual int ordinal() const = 0;

  // Memory and an event shared with other processes of this host
  // (mltuner/device_ipc.h): exports a landing region of `region_bytes`.
  // The default (the CPU backend) has none: InvalidArgument naming the
  // device.
  virtual Status ExportIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out);

  // Device memory free now and in all (CUDA: cudaMemGetInfo), for the
  // automatic budget (Config::device_memory_reserve) and the placement of the
  // server shard's state. Both -1 where the device has no fixed capacity:
  // the CPU backend unless it was given one (NewCpuDevice). The default: -1.
  virtual Status MemoryInfo(int64_t* free_bytes, int64_t* total_bytes);

 protected:
  Device() = default;
};

// The reference backend: "device" memory is host memory. With a capacity
// (bytes > 0) it behaves as a device of that size: Allocate (and
// AllocateZeroed of device memory) fails with ResourceExhausted past it, as
// cudaMalloc does, and MemoryInfo reports what is left, so that a model
// larger than the device is testable without a GPU (Config::cpu_device_capacity).
std::unique_ptr<Device> NewCpuDevice(int64_t capacity_bytes = 0);

// Makes the Device of worker `rank`. LocalCluster takes one so that the
// layer that knows which backends were built (the Python module) chooses.
using DeviceFactory = std::function<Status(int rank, std::unique_ptr<Device>* out)>;

}  // namespace mltuner
