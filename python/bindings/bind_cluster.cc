// LocalCluster: N workers and shards in this process, on the CPU backend or,
// when the module was built with the CUDA backend, on the visible GPUs
// (worker r on GPU r mod count).
#include "bindings.h"
#include "mltuner/cluster.h"

#ifdef MLTUNER_WITH_CUDA
#include "cuda_device.h"
#endif

namespace py = pybind11;

namespace mltuner::python {

namespace {

bool CudaBuilt() {
#ifdef MLTUNER_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int CudaCount() {
#ifdef MLTUNER_WITH_CUDA
  return CudaDeviceCount();
#else
  return 0;
#endif
}

}  // namespace

#ifdef MLTUNER_WITH_CUDA
KeepCallerDevice::KeepCallerDevice() : device_(CurrentCudaDeviceOnceSeen()) {}
KeepCallerDevice::~KeepCallerDevice() { RestoreCurrentCudaDevice(device_); }
#else
KeepCallerDevice::KeepCallerDevice() : device_(-1) {}
KeepCallerDevice::~KeepCallerDevice() = default;
#endif

DeviceFactory FactoryFor(const std::string& device, const Config& config) {
  if (device == "cpu") {
    const int64_t capacity = config.cpu_device_capacity;
    return [capacity](int, std::unique_ptr<Device>* out) {
      *out = NewCpuDevice(capacity);
      return Status::Ok();
    };
  }
  if (device != "cuda") {
    throw StatusError(Status::InvalidArgument("unknown device '" + device + "': use 'cpu' or 'cuda'"));
  }
  if (!CudaBuilt()) {
    throw StatusError(Status::InvalidArgument(
        "device='cuda', but this mltuner was built without the CUDA backend (nvcc was not found when it "
        "was installed); reinstall on a machine with the CUDA toolkit"));
  }
  const int count = CudaCount();
  if (count == 0) throw StatusError(Status::InvalidArgument("device='cuda', but no CUDA device is visible"));
#ifdef MLTUNER_WITH_CUDA
  return [count](int rank, std::unique_ptr<Device>* out) { return NewCudaDevice(rank % count, out); };
#else
  return nullptr;
#endif
}

void RegisterCluster(py::module_& m) {
  m.def("cuda_built", &CudaBuilt, "Whether this module was built with the CUDA backend.");
  m.def("cuda_device_count", &CudaCount, "Visible CUDA devices (0 without the CUDA backend).");
  py::class_<LocalCluster, KeepingPtr<LocalCluster>>(m, "LocalCluster")
      .def(py::init([](const Config& config, int num_workers, const std::string& device) {
             std::unique_ptr<LocalCluster> cluster;
             const DeviceFactory factory = FactoryFor(device, config);  // counts the GPUs: see Keep
             KeepCallerDevice keep;
             py::gil_scoped_release release;
             Check(LocalCluster::Create(config, num_workers, &cluster, factory));
             return KeepingPtr<LocalCluster>(cluster.release());
           }),
           py::arg("config"), py::arg("num_workers"), py::arg("device") = "cpu")
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
          py::return_value_policy::reference_internal, Keep())
      .def_property_readonly("rejected_messages", &LocalCluster::rejected_messages)
      .def("shutdown", [](LocalCluster& c) { CheckInterruptibly([&] { return c.Shutdown(); }); }, Keep());
}

}  // namespace mltuner::python
