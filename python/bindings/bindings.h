// Shared by the binding files: the exception that carries a Status out of a
// binding, and the register_* functions module.cc calls. Bindings hold no
// engine logic: they convert arguments, release the GIL, and raise.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>

#include <string>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/status.h"

namespace mltuner::python {

// Thrown by Check(); translated to the mltuner.exceptions class of its code.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(Status status) : std::runtime_error(status.message()), status_(std::move(status)) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void Check(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

// The device factory for a device name ("cpu": the CPU backend, with
// Config::cpu_device_capacity; "cuda": worker r on visible GPU r mod
// count). Throws StatusError.
DeviceFactory FactoryFor(const std::string& device, const Config& config);

void RegisterErrors(pybind11::module_& m);
void RegisterConfig(pybind11::module_& m);
void RegisterEngine(pybind11::module_& m);
void RegisterCluster(pybind11::module_& m);
void RegisterBuffers(pybind11::module_& m);
void RegisterNode(pybind11::module_& m);
void RegisterSockets(pybind11::module_& m);

}  // namespace mltuner::python
