// Status codes become the exception classes of mltuner.exceptions.
#include "bindings.h"

namespace py = pybind11;

namespace mltuner::python {

namespace {

// Python's main thread, by the ident threading.get_ident() gives it.
// REQUIRES: the GIL held.
bool OnPythonMainThread() {
  static const unsigned long main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  return PyThread_get_thread_ident() == main_thread;
}

}  // namespace

PendingSignal::PendingSignal() {
  if (!OnPythonMainThread()) return;
  check_ = [this] {
    py::gil_scoped_acquire acquire;
    if (raised_) return true;
    if (PyErr_CheckSignals() == 0) return false;
    raised_ = std::make_unique<py::error_already_set>();  // takes the handler's exception
    return true;
  };
}

void PendingSignal::Raise(const Status& status) {
  if (raised_) {
    py::error_already_set raised = std::move(*raised_);
    raised_.reset();
    throw raised;
  }
  Check(status);
}

void RegisterErrors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const StatusError& error) {
      py::object exceptions = py::module_::import("mltuner.exceptions");
      py::object type = exceptions.attr("error_for_code")(static_cast<int>(error.status().code()));
      PyErr_SetString(type.ptr(), error.status().message().c_str());
    }
  });
  m.def("status_code_name", [](int code) { return StatusCodeName(static_cast<StatusCode>(code)); },
        "The name of a status code.");
}

}  // namespace mltuner::python
