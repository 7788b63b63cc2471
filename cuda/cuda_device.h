// The CUDA backend of Device (cpp/include/mltuner/device.h): device memory
// from cudaMalloc, pinned host memory from cudaHostAlloc (portable, and
// mapped at its host address when the GPU has unified addressing, so that the
// row-run kernels of cuda/kernels gather from and scatter-add into it in
// place), one non-blocking CUDA stream per mltuner::Stream (the server and
// swap streams at the lowest priority).
//
// Threads: every method may be called from any thread; each first makes its
// GPU current on the calling thread (cudaSetDevice), so engine threads need
// no setup of their own.
//
// Errors: the void methods (copies, kernels, Fill) cannot return a Status.
// The first CUDA error one of them meets is remembered and returned, once, by
// the next Synchronize of ANY stream as Status::Internal("CUDA error in
// <what>: <cudaGetErrorString>"). A sticky error (an illegal address in a
// kernel) leaves the whole CUDA context unusable; every later call fails too.
//
// Ownership: the caller owns the Device (unique_ptr) and must Free/FreeHost
// what it allocated and ReleaseIndex what it prepared before destroying it.
// DeviceEvents from RecordAppWork may outlive the Device.
#pragma once

#include <memory>

#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner {

// Makes the Device of GPU `ordinal`. InvalidArgument when there is no CUDA
// device or `ordinal` is not in [0, CudaDeviceCount()).
Status NewCudaDevice(int ordinal, std::unique_ptr<Device>* out);

// The number of visible CUDA devices; 0 when there is no driver or no device.
// Never throws or aborts, so callers may probe with it on any machine.
int CudaDeviceCount();

// The calling thread's current GPU, for a caller that must leave it as it
// found it (the methods of a CUDA Device make theirs current and keep it):
// -1 until this process has counted a GPU or made a CUDA Device (before,
// nothing of ours can have changed it, and asking would start the CUDA
// runtime on machines without a GPU). RestoreCurrentCudaDevice(-1) does nothing.
int CurrentCudaDeviceOnceSeen();
void RestoreCurrentCudaDevice(int ordinal);

}  // namespace mltuner
