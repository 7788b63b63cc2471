// Status codes become the exception classes of mltuner.exceptions.
#include "bindings.h"

#include <unordered_map>

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

// The engines' wait watchers (SetWaitWatcher), by engine. Never destroyed:
// a Python object must not be released after the interpreter finalizes.
std::unordered_map<const Engine*, py::object>& WaitWatchers() {
  static auto* watchers = new std::unordered_map<const Engine*, py::object>();
  return *watchers;
}

}  // namespace

void SetWaitWatcher(const Engine& engine, py::object watcher) {
  if (watcher.is_none()) {
    WaitWatchers().erase(&engine);
  } else {
    WaitWatchers()[&engine] = std::move(watcher);
  }
}

PendingSignal::PendingSignal(const Engine* engine) : started_(std::chrono::steady_clock::now()) {
  signals_ = OnPythonMainThread();
  if (engine != nullptr) {
    auto found = WaitWatchers().find(engine);
    if (found != WaitWatchers().end()) watcher_ = found->second;
  }
  if (!signals_ && !watcher_) return;
  check_ = [this] {
    py::gil_scoped_acquire acquire;
    return Ask();
  };
}

bool PendingSignal::Ask() {
  if (raised_) return true;
  try {
    if (signals_ && PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (watcher_) {
      watcher_(std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    }
  } catch (py::error_already_set& raised) {
    raised_ = std::make_unique<py::error_already_set>(std::move(raised));  // the handler's or watcher's exception
    return true;
  }
  return false;
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
