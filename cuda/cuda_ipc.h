// The CUDA backend of DeviceIpc (mltuner/device_ipc.h): a landing region
// from cudaMalloc exported with cudaIpcGetMemHandle, an event made with
// cudaEventInterprocess exported with cudaIpcGetEventHandle, and two
// streams of its own (copies to peers; waits for peers' events), so IPC
// traffic never queues behind the engine's streams.
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
