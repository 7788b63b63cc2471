// The extension module mltuner._core. Each concept binds itself in its own
// file; this one only names them.
#include "bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "mltuner engine (C++). Use the wrappers in the mltuner package, not this module.";
  mltuner::python::RegisterErrors(m);
  mltuner::python::RegisterConfig(m);
  mltuner::python::RegisterBuffers(m);
  mltuner::python::RegisterEngine(m);
  mltuner::python::RegisterCluster(m);
  mltuner::python::RegisterNode(m);
  mltuner::python::RegisterSockets(m);
}
