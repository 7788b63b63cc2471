// SharedMemoryIpc: the CPU backend's DeviceIpc. CPU engines of processes
// on one host share their landing regions as memory, so a payload crosses
// with one memcpy into the peer's region instead of two kernel copies
// through a socket (and the ZeroMQ I/O thread's work); the socket carries
// only the notice, as with CUDA IPC.
//
// The region is an anonymous memory file (memfd): it takes RAM only where
// written, and dies with the last process that maps it, so a killed job
// leaves nothing behind in /dev/shm. A peer opens it as
// /proc/<pid>/fd/<fd> of the exporter, which the kernel allows to
// processes of the same user only (and not at all across PID namespaces:
// then the pair uses host frames). The handle also carries a random name
// the peer checks against the file it opened.
//
// Every copy is synchronous, so the interprocess "events" are memory
// fences: the sender's release fence before its notice leaves, the
// receiver's acquire fence before it reads.
#pragma once

#include <cstddef>
#include <memory>

#include "mltuner/device_ipc.h"
#include "mltuner/status.h"

namespace mltuner {

// Linux only; elsewhere an InvalidArgument error (the pair uses host frames).
Status ExportSharedMemoryIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out);

}  // namespace mltuner
