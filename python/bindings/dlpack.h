// The DLPack exchange structs (ABI of DLPack 0.8, the unversioned capsule
// "dltensor" that torch, cupy, jax and numpy all accept), written from the
// published specification. Only what mltuner produces is declared.
#pragma once

#include <cstdint>

namespace mltuner::python::dlpack {

enum DeviceType : int32_t { kCpu = 1, kCuda = 2 };
enum TypeCode : uint8_t { kFloat = 2 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

}  // namespace mltuner::python::dlpack
