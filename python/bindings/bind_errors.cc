// Status codes become the exception classes of mltuner.exceptions.
#include "bindings.h"

namespace py = pybind11;

namespace mltuner::python {

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
