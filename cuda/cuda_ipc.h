// The CUDA backend of DeviceIpc (mltuner/device_ipc.h): a landing region
// from cudaMalloc exported with cudaIpcGetMemHandle, kCopyEvents events made
// with cudaEventInterprocess exported with cudaIpcGetEventHandle, and
// streams of its own, so IPC traffic never queues behind the engine's
// streams: one for copies to peers, and one per peer for waits on its
// events (a late copy from one peer holds back no other's landings).
#pragma once

#include <cstddef>
#include <memory>

#include "mltuner/device_ipc.h"
#include "mltuner/status.h"

namespace mltuner {

// Exports a region of `region_bytes` on GPU `ordinal`. Fails with the
// driver's reason (Internal) where it cannot: no IPC support, out of memory.
Status NewCudaIpc(int ordinal, size_t region_bytes, std::unique_ptr<DeviceIpc>* out);

}  // namespace mltuner
