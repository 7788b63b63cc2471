// Shared by the binding files: the exception that carries a Status out of a
// binding, and the register_* functions module.cc calls. Bindings hold no
// engine logic: they convert arguments, release the GIL, and raise.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>
#include <stdexcept>

#include <string>

#include "mltuner/config.h"
#include "mltuner/device.h"
#include "mltuner/interrupt.h"
#include "mltuner/status.h"

namespace mltuner {
class Engine;
}  // namespace mltuner

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

// What ends a blocked engine call early. On Python's main thread (the only
// one Python runs signal handlers on) a signal: check() takes the GIL for a
// moment and runs the pending handlers (PyErr_CheckSignals); when one raises
// (Ctrl-C: KeyboardInterrupt) it keeps the exception and ends the engine's
// wait, and every later wait of the same call. On any thread, the engine's
// wait watcher (SetWaitWatcher), called with the seconds the call has been
// blocked: when it raises, the same. With neither check() is empty, and the
// engine's waits ask nothing. REQUIRES: the GIL held when made, raised and
// destroyed.
class PendingSignal {
 public:
  explicit PendingSignal(const Engine* engine = nullptr);
  PendingSignal(const PendingSignal&) = delete;
  PendingSignal& operator=(const PendingSignal&) = delete;

  const InterruptCheck& check() const { return check_; }
  // Raises the exception a signal handler or the watcher raised during the
  // call, whatever `status` says (the user asked to stop); else Check(status).
  void Raise(const Status& status);

 private:
  bool Ask();  // the check's body; REQUIRES: the GIL held

  std::unique_ptr<pybind11::error_already_set> raised_;
  pybind11::object watcher_;
  std::chrono::steady_clock::time_point started_;
  bool signals_ = false;
  InterruptCheck check_;
};

// A Python callable that decides, while a call of `engine` is blocked,
// whether the wait is hopeless: called every kInterruptPollInterval with the
// seconds blocked so far, on the calling thread, it raises to end the call
// with that exception (Job's: a rank that closed the job during a tuning
// session). None removes it; so does the engine's shutdown. REQUIRES: the GIL
// held.
void SetWaitWatcher(const Engine& engine, pybind11::object watcher);

// Runs `call` (returning a Status) with the GIL released, Ctrl-C (and the
// wait watcher of `engine`, when given) ending its waits (PendingSignal), and
// raises what it returned. REQUIRES: the GIL held.
template <typename Call>
void CheckInterruptibly(const Engine* engine, Call&& call) {
  PendingSignal signal(engine);
  Status status;
  {
    ScopedInterruptCheck interruptible(signal.check());
    pybind11::gil_scoped_release release;
    status = call();
  }
  signal.Raise(status);
}

template <typename Call>
void CheckInterruptibly(Call&& call) {
  CheckInterruptibly(nullptr, std::forward<Call>(call));
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
