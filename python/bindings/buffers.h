// Access buffers as Python objects (numpy on host memory, DLPack-capable
// DeviceArray on accelerator memory). See bind_buffers.cc.
#pragma once

#include <pybind11/pybind11.h>

#include "bindings.h"
#include "mltuner/engine.h"

namespace mltuner::python {

struct DeviceArray {
  AccessBuffer buffer;
};

pybind11::object BufferToPython(const AccessBuffer& buffer);

}  // namespace mltuner::python
