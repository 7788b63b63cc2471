// Swaps: moving host-resident rows between their host stores (pinned memory
// on CUDA) and access buffers. The allocator swaps rows in (a read's host
// rows, a local fetch), the reclaimer swaps them out (an update's host rows
// added into the host log, kept local data written back).
//
// A swap runs on its own low-priority stream (Stream::kSwapIn / kSwapOut),
// joined to the caller's stream with two tickets: it starts after everything
// queued on the caller's stream so far, and the caller's stream waits for it,
// so work queued there afterwards (and a Synchronize of it, and a ticket
// taken on it) covers the swap as if it had been queued there. On a device
// that swaps by kernel (Device::swaps_by_kernel: the CPU backend) one Gather
// or ScatterAdd moves every run of an access; otherwise (CUDA, whose copy
// engines keep their bandwidth beside the application's kernels) the copy
// engines do, all runs of an access in one batched copy (Device::SwapRuns).
//
// Threads: stateless; the caller's stream is the caller's (allocator thread:
// prefetch; reclaimer thread: writeback; the init phase: the app stream).
#pragma once

#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner {

// Runs `work(swap)` on stream `swap`, ordered after the work queued on `on`
// so far, and makes `on` wait for it. REQUIRES: `work` queues work on `swap`
// only.
template <typename Work>
Status OnSwapStream(Device& device, Stream on, Stream swap, Work&& work) {
  DeviceEvent before;
  MLT_RETURN_IF_ERROR(device.RecordEvent(on, &before));
  MLT_RETURN_IF_ERROR(device.WaitEvent(swap, before));
  work(swap);
  DeviceEvent after;
  MLT_RETURN_IF_ERROR(device.RecordEvent(swap, &after));
  return device.WaitEvent(on, after);
}

}  // namespace mltuner
