// Shared by the binding files: the exception that carries a Status out of a
// binding, and the register_* functions module.cc calls. Bindings hold no
// engine logic: they convert arguments, release the GIL, and raise.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>

#include <string>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/interrupt.h"
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

// A signal that arrives while an engine call blocks with the GIL released.
// On Python's main thread (the only one Python runs signal handlers on),
// check() is an interrupt check (mltuner/interrupt.h) that takes the GIL for
// a moment and runs the pending handlers (PyErr_CheckSignals); when one
// raises (Ctrl-C: KeyboardInterrupt) it keeps the exception and ends the
// engine's wait, and every later wait of the same call. Elsewhere check() is
// empty, and the engine's waits ask nothing. REQUIRES: the GIL held when
// made, raised and destroyed.
class PendingSignal {
 public:
  PendingSignal();
  PendingSignal(const PendingSignal&) = delete;
  PendingSignal& operator=(const PendingSignal&) = delete;

  const InterruptCheck& check() const { return check_; }
  // Raises the exception a signal handler raised during the call, whatever
  // `status` says (the user asked to stop); else Check(status).
  void Raise(const Status& status);

 private:
  std::unique_ptr<pybind11::error_already_set> raised_;
  InterruptCheck check_;
};

// Runs `call` (returning a Status) with the GIL released, Ctrl-C ending its
// waits (PendingSignal), and raises what it returned. REQUIRES: the GIL held.
template <typename Call>
void CheckInterruptibly(Call&& call) {
  PendingSignal signal;
  Status status;
  {
    ScopedInterruptCheck interruptible(signal.check());
    pybind11::gil_scoped_release release;
    status = call();
  }
  signal.Raise(status);
}

// The CUDA backend makes its GPU current on whichever thread calls it, and
// leaves it so (cuda/cuda_device.h). A call from Python must leave the
// caller's current device as it found it: PyTorch resolves "cuda", new
// tensors and torch.cuda.current_stream() by it, so a LocalCluster made on
// the main thread would otherwise move the script's later tensors to the
// last worker's GPU. A no-op without the CUDA backend.
class KeepCallerDevice {
 public:
  KeepCallerDevice();
  ~KeepCallerDevice();
  KeepCallerDevice(const KeepCallerDevice&) = delete;
  KeepCallerDevice& operator=(const KeepCallerDevice&) = delete;

 private:
  int device_;  // -1: nothing to restore
};
using Keep = pybind11::call_guard<KeepCallerDevice>;
// The holder's deleter of what owns devices: Python may free it on any of
// its threads (garbage collection), and freeing device memory makes the GPU
// current there too.
template <typename T>
struct DeleteKeepingCallerDevice {
  void operator()(T* object) const {
    KeepCallerDevice keep;
    delete object;
  }
};
template <typename T>
using KeepingPtr = std::unique_ptr<T, DeleteKeepingCallerDevice<T>>;
using KeepAndRelease = pybind11::call_guard<KeepCallerDevice, pybind11::gil_scoped_release>;

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
