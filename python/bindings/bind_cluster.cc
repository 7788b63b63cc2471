// LocalCluster: N workers and shards in this process.
#include "bindings.h"
#include "mltuner/cluster.h"

namespace py = pybind11;

namespace mltuner::python {

void RegisterCluster(py::module_& m) {
  py::class_<LocalCluster>(m, "LocalCluster")
      .def(py::init([](const Config& config, int num_workers) {
             std::unique_ptr<LocalCluster> cluster;
             Check(LocalCluster::Create(config, num_workers, &cluster));
             return cluster;
           }),
           py::arg("config"), py::arg("num_workers"))
      .def_property_readonly("num_workers", &LocalCluster::num_workers)
      .def(
          "worker",
          [](LocalCluster& c, int rank) {
            if (rank < 0 || rank >= c.num_workers()) {
              throw py::index_error("worker rank " + std::to_string(rank) + " is outside 0.." +
                                    std::to_string(c.num_workers() - 1));
            }
            return c.worker(rank);
          },
          py::return_value_policy::reference_internal)
      .def_property_readonly("rejected_messages", &LocalCluster::rejected_messages)
      .def("shutdown", [](LocalCluster& c) { Check(c.Shutdown()); }, py::call_guard<py::gil_scoped_release>());
}

}  // namespace mltuner::python
