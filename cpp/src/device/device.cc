// What every Device shares: the default AllocateZeroed and SwapRuns, and the
// host-side count of non-finite floats (the CPU backend's, and the shards' check of
// payloads in host memory).
#include <cstring>

#include "mltuner/device.h"
#include "mltuner/device_ipc.h"

namespace mltuner {

// NaN and the infinities are the floats whose exponent bits are all ones.
// Comparing bits keeps the loop free of branches (so it vectorises) and does
// not depend on what a fast-math build assumes about std::isfinite.
int64_t CountNonFiniteHost(const float* data, int64_t count) {
  int64_t found = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, data + i, sizeof(bits));
    found += (bits & 0x7f800000u) == 0x7f800000u ? 1 : 0;
  }
  return found;
}

Status Device::MemoryInfo(int64_t* free_bytes, int64_t* total_bytes) {
  *free_bytes = -1;
  *total_bytes = -1;
  return Status::Ok();
}

Status Device::AllocateZeroed(size_t bytes, bool host, void** out) {
  void* data = nullptr;
  MLT_RETURN_IF_ERROR(host ? AllocateHost(bytes, &data) : Allocate(bytes, &data));
  if (host) {
    std::memset(data, 0, bytes);
  } else {
    // Device memory may not be host-addressable: zero it with the device.
    Fill(static_cast<float*>(data), 0.0f, bytes / sizeof(float), Stream::kApp);
    const Status status = Synchronize(Stream::kApp);
    if (!status.ok()) {
      Free(data);
      return status;
    }
  }
  *out = data;
  return Status::Ok();
}

void Device::SwapRuns(float* dst, const float* src, const RunIndex& index, int64_t row_width,
                      SwapDirection direction, Stream s) {
  if (swaps_by_kernel()) {
    Gather(dst, src, index, row_width, s);
    return;
  }
  const size_t row_bytes = static_cast<size_t>(row_width) * sizeof(float);
  for (const RowRun& run : index.runs) {
    float* to = dst + run.dst * row_width;
    const float* from = src + run.src * row_width;
    const size_t bytes = static_cast<size_t>(run.count) * row_bytes;
    if (direction == SwapDirection::kIn) {
      CopyHostToDevice(to, from, bytes, s);
    } else {
      CopyDeviceToHost(to, from, bytes, s);
    }
  }
}

Status Device::ExportIpc(size_t region_bytes, std::unique_ptr<DeviceIpc>* out) {
  (void)region_bytes;
  out->reset();
  return Status::InvalidArgument("the " + name() + " device shares no memory with other processes (CUDA IPC needs a CUDA engine)");
}

}  // namespace mltuner
