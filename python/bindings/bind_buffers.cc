// Access buffers in Python. On the CPU backend a buffer is a numpy array over
// engine memory. On an accelerator it is a DeviceArray: a handle that
// torch.from_dlpack / cupy.from_dlpack turn into a tensor over the same GPU
// memory with no copy.
//
// Stream semantics: the engine hands a buffer out while the work that filled
// it may still be queued: read() makes the stream it is given wait
// for it, and __dlpack__(stream=...) makes the consumer's stream wait. The
// other direction is the post call's job: pass the stream your kernels used
// (post_read / update / post_local_access take `stream`), and the engine
// waits for that work before it reads, reuses or frees the buffer.
#include "buffers.h"

#include <pybind11/numpy.h>

#include "dlpack.h"

namespace py = pybind11;

namespace mltuner::python {

namespace {

// What a DLPack capsule owns: the tensor, its shape, and the buffer (whose
// keepalive holds the engine memory).
struct Exported {
  dlpack::ManagedTensor managed;
  int64_t shape[2];
  AccessBuffer buffer;
};

// On any thread (a tensor freed by the garbage collector or by autograd's
// device thread): dropping the buffer may free engine memory.
void DeleteExported(dlpack::ManagedTensor* self) {
  KeepCallerDevice keep;
  delete static_cast<Exported*>(self->manager_ctx);
}

// A consumer that took the tensor renames the capsule to "used_dltensor" and
// becomes responsible for calling the deleter; otherwise we call it.
void DestroyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

dlpack::Device DeviceOf(const AccessBuffer& buffer) {
  const bool host = !buffer.device || buffer.device->host_addressable();
  return {host ? dlpack::kCpu : dlpack::kCuda, host ? 0 : buffer.device->ordinal()};
}

py::object ToDlpack(const DeviceArray& array) {
  auto* exported = new Exported();
  exported->buffer = array.buffer;
  exported->shape[0] = array.buffer.rows;
  exported->shape[1] = array.buffer.row_width;
  dlpack::Tensor& tensor = exported->managed.dl_tensor;
  tensor.data = array.buffer.data;
  tensor.device = DeviceOf(array.buffer);
  tensor.ndim = 2;
  tensor.dtype = {dlpack::kFloat, 32, 1};
  tensor.shape = exported->shape;
  tensor.strides = nullptr;
  tensor.byte_offset = 0;
  exported->managed.manager_ctx = exported;
  exported->managed.deleter = &DeleteExported;
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", &DestroyCapsule);
  if (capsule == nullptr) {
    delete exported;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

// The copy runs after the work already queued on `stream` (the application's
// writes into the buffer).
py::array CopyToNumpy(const DeviceArray& array, uintptr_t stream) {
  const AccessBuffer& b = array.buffer;
  py::array_t<float> out({b.rows, b.row_width});
  const size_t bytes = static_cast<size_t>(b.rows * b.row_width) * sizeof(float);
  {
    py::gil_scoped_release release;
    DeviceEvent app_done;
    Check(b.device->RecordAppWork(stream, &app_done));
    Check(b.device->WaitEvent(Stream::kApp, app_done));
    Check(b.device->WaitEvent(Stream::kApp, b.ready));
    b.device->CopyDeviceToHost(out.mutable_data(), b.data, bytes, Stream::kApp);
    Check(b.device->Synchronize(Stream::kApp));
  }
  return std::move(out);
}

}  // namespace

py::object BufferToPython(const AccessBuffer& buffer) {
  if (buffer.device && !buffer.device->host_addressable()) return py::cast(DeviceArray{buffer});
  auto* keepalive = new std::shared_ptr<void>(buffer.keepalive);
  py::capsule owner(keepalive, [](void* p) { delete static_cast<std::shared_ptr<void>*>(p); });
  py::array_t<float> array({buffer.rows, buffer.row_width},
                           {buffer.row_width * static_cast<py::ssize_t>(sizeof(float)),
                            static_cast<py::ssize_t>(sizeof(float))},
                           buffer.data, owner);
  if (!buffer.writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return std::move(array);
}

void RegisterBuffers(py::module_& m) {
  py::class_<DeviceArray, KeepingPtr<DeviceArray>>(m, "DeviceArray",
                          "An access buffer in accelerator memory; pass it to torch.from_dlpack or "
                          "cupy.from_dlpack for a zero-copy tensor.")
      .def_property_readonly("shape", [](const DeviceArray& a) { return py::make_tuple(a.buffer.rows, a.buffer.row_width); })
      .def_property_readonly("dtype", [](const DeviceArray&) { return "float32"; })
      .def_property_readonly("writable", [](const DeviceArray& a) { return a.buffer.writable; })
      .def_property_readonly("data_ptr", [](const DeviceArray& a) { return reinterpret_cast<uintptr_t>(a.buffer.data); })
      .def("__dlpack_device__", [](const DeviceArray& a) {
        const dlpack::Device device = DeviceOf(a.buffer);
        return py::make_tuple(device.device_type, device.device_id);
      })
      // DLPack's stream protocol: the consumer's stream (None = the legacy
      // default stream, -1 = the consumer synchronizes itself) waits for the
      // engine's work filling the buffer.
      .def("__dlpack__", [](const DeviceArray& a, py::object stream, py::object, py::object, py::object) {
             // 1 and 2 are CUDA's own handles of the legacy and per-thread default streams.
             const int64_t s = stream.is_none() ? 1 : stream.cast<int64_t>();
             if (s != -1 && a.buffer.device) {
               Check(a.buffer.device->WaitOnAppStream(static_cast<uintptr_t>(s), a.buffer.ready));
             }
             return ToDlpack(a);
           },
           py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(),
           py::arg("dl_device") = py::none(), py::arg("copy") = py::none(), Keep())
      .def("numpy", &CopyToNumpy, py::arg("stream") = 0,
           "A host copy of the buffer as a numpy array, taken after the work queued on `stream`.", Keep())
      .def("__repr__", [](const DeviceArray& a) {
        return "DeviceArray(shape=(" + std::to_string(a.buffer.rows) + ", " + std::to_string(a.buffer.row_width) +
               "), device=" + a.buffer.device->name() + ")";
      });
}

}  // namespace mltuner::python
