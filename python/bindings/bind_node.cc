// ProcessNode: the C++ half of a worker process in a distributed job. The
// Python transport (mltuner/transport/_sockets.py) moves its bytes: it takes
// encoded messages from next_outgoing and sends the payload array with
// ZeroMQ without copying it, and hands received frames to deliver, which
// decodes and validates them with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "memory/device_block.h"
#include "mltuner/process_node.h"

namespace py = pybind11;

namespace mltuner::python {

namespace {

// A numpy view of a sent payload that owns it until ZeroMQ and Python are
// done with it (pyzmq's copy=False keeps the array until the frame is sent).
// A host frame then goes back to its pool, which may be gone (then it is
// freed); a vector is freed.
py::object PayloadArray(OutgoingMessage&& message) {
  if (message.frame && message.frame->count > 0) {
    auto* owned = new std::shared_ptr<DeviceBuffer>(std::move(message.frame));
    py::capsule owner(owned, [](void* pointer) { delete static_cast<std::shared_ptr<DeviceBuffer>*>(pointer); });
    const auto count = static_cast<py::ssize_t>((*owned)->count);
    return py::array_t<float>({count}, {static_cast<py::ssize_t>(sizeof(float))}, (*owned)->data, owner);
  }
  if (message.payload.empty()) return py::bytes();
  auto* owned = new std::vector<float>(std::move(message.payload));
  py::capsule owner(owned, [](void* pointer) { delete static_cast<std::vector<float>*>(pointer); });
  const auto count = static_cast<py::ssize_t>(owned->size());
  return py::array_t<float>({count}, {static_cast<py::ssize_t>(sizeof(float))}, owned->data(), owner);
}

py::buffer_info ContiguousBytes(const py::buffer& buffer, const char* what) {
  py::buffer_info info = buffer.request();
  if (info.ndim > 1 && info.strides.back() != info.itemsize) {
    throw StatusError(Status::InvalidArgument(std::string(what) + " must be a contiguous buffer"));
  }
  return info;
}

size_t ByteCount(const py::buffer_info& info) { return static_cast<size_t>(info.size * info.itemsize); }

py::array_t<float> ToNumpy(std::vector<float>&& values) {
  auto* owned = new std::vector<float>(std::move(values));
  py::capsule owner(owned, [](void* pointer) { delete static_cast<std::vector<float>*>(pointer); });
  return py::array_t<float>({static_cast<py::ssize_t>(owned->size())}, {static_cast<py::ssize_t>(sizeof(float))},
                            owned->data(), owner);
}

}  // namespace

void RegisterNode(py::module_& m) {
  py::class_<ProcessNode, KeepingPtr<ProcessNode>>(m, "ProcessNode")
      .def(py::init([](const Config& config, int rank, int num_workers, const std::string& device,
                       int device_index) {
             const DeviceFactory factory = FactoryFor(device, config);  // counts the GPUs: see Keep
             KeepCallerDevice keep;
             std::unique_ptr<ProcessNode> node;
             py::gil_scoped_release release;
             std::unique_ptr<Device> made;
             if (factory) Check(factory(device_index, &made));
             Check(ProcessNode::Create(config, rank, num_workers, std::move(made), &node));
             return KeepingPtr<ProcessNode>(node.release());
           }),
           py::arg("config"), py::arg("rank"), py::arg("num_workers"), py::arg("device") = "cpu",
           py::arg("device_index") = 0)
      .def_property_readonly("engine", &ProcessNode::engine, py::return_value_policy::reference_internal)
      .def_property_readonly("rank", &ProcessNode::rank)
      .def_property_readonly("num_workers", &ProcessNode::num_workers)
      .def(
          "next_outgoing",
          [](ProcessNode& node, int timeout_ms) -> py::object {
            OutgoingMessage message;
            bool got;
            {
              py::gil_scoped_release release;
              got = node.NextOutgoing(timeout_ms, &message);
            }
            if (!got) return py::none();
            py::bytes header(message.header);
            const int receiver = message.receiver;
            return py::make_tuple(receiver, header, PayloadArray(std::move(message)));
          },
          py::arg("timeout_ms"),
          "(receiver, header frame, payload) of the next message for another process, or None "
          "after timeout_ms or once the node is shut down and the outbox is empty.", Keep())
      .def(
          "next_outgoing_batch",
          [](ProcessNode& node, int timeout_ms, size_t max_messages, size_t max_bytes) {
            std::vector<OutgoingMessage> batch;
            {
              py::gil_scoped_release release;
              batch = node.NextOutgoingBatch(timeout_ms, max_messages, max_bytes);
            }
            py::list out;
            for (OutgoingMessage& message : batch) {
              py::bytes header(message.header);
              const int receiver = message.receiver;
              out.append(py::make_tuple(receiver, header, PayloadArray(std::move(message))));
            }
            return out;
          },
          py::arg("timeout_ms"), py::arg("max_messages"), py::arg("max_bytes"),
          "The socket messages to send next, [(receiver, header frame, payload), ...]: every message waiting "
          "for another process (at most max_messages, past the first only while their payloads total at most "
          "max_bytes), each run of small ones for one receiver joined into one batch, which deliver opens. "
          "Waits up to timeout_ms for the first; empty after that, or once the node is shut down and the "
          "outbox is empty.", Keep())
      .def_property_readonly("outbox_messages", &ProcessNode::outbox_messages)
      .def_property_readonly("outbox_bytes", &ProcessNode::outbox_bytes)
      .def_property_readonly("peak_outbox_bytes", &ProcessNode::peak_outbox_bytes)
      .def("set_outbox_limit", &ProcessNode::SetOutboxLimit, py::arg("bytes"),
           KeepAndRelease(),
           "Payload bytes the outbox may hold before the engine's sends wait (0: no bound).")
      .def("set_inbox_limit", &ProcessNode::SetInboxLimit, py::arg("bytes"),
           KeepAndRelease(),
           "Payload bytes each inbox (shard's, engine's) lets other processes fill before deliver waits "
           "for room (0: no bound).")
      .def_property_readonly("inbox_bytes", &ProcessNode::inbox_bytes)
      .def_property_readonly("peak_inbox_bytes", &ProcessNode::peak_inbox_bytes)
      .def(
          "deliver",
          [](ProcessNode& node, const py::buffer& frame0, const py::buffer& payload, int64_t token) {
            const py::buffer_info header = ContiguousBytes(frame0, "frame 0");
            const py::buffer_info values = ContiguousBytes(payload, "the payload frame");
            py::gil_scoped_release release;
            Check(node.Deliver(header.ptr, ByteCount(header), values.ptr, ByteCount(values), token));
          },
          py::arg("frame0"), py::arg("payload"), py::arg("token") = -1,
          "Validates and delivers frames received from another process; raises CorruptMessageError "
          "(and counts it) for a malformed or misaddressed message. With a token (>= 0) the payload "
          "may be used where it lies: keep it alive and unchanged until take_released_payloads() "
          "returns the token (it returns every token, the refused messages' too).", Keep())
      .def(
          "take_released_payloads",
          [](ProcessNode& node) {
            std::vector<int64_t> tokens;
            {
              py::gil_scoped_release release;
              Check(node.TakeReleasedPayloads(&tokens));
            }
            return tokens;
          },
          "Tokens of delivered payloads that nothing reads any more: their memory may be freed.", Keep())
      .def_property_readonly("lends_payloads", &ProcessNode::lends_payloads,
                             "Whether deliver uses payloads in place on this device (the CPU backend).")
      .def_property_readonly("borrowed_payloads", &ProcessNode::borrowed_payloads,
                             "Payloads delivered with a token and not yet handed back.")
      .def_property_readonly("payloads_used_in_place", &ProcessNode::payloads_used_in_place,
                             "Received payloads used where they were received (no copy) so far.")
      .def(
          "abort",
          [](ProcessNode& node, const std::string& why) { node.Abort(Status::PeerLost(why)); },
          py::arg("why"), KeepAndRelease(),
          "Makes every engine wait and later call raise PeerLostError(why).")
      .def_property_readonly("aborted", &ProcessNode::aborted)
      .def(
          "export_shard_table",
          [](ProcessNode& node, int table, BranchId branch) {
            ShardSlice slice;
            {
              py::gil_scoped_release release;
              Check(node.ExportShardTable(table, &slice, branch));
            }
            py::dict out;
            out["first_row"] = slice.first_row;
            out["num_rows"] = slice.num_rows;
            out["state_arrays"] = slice.state_arrays;
            out["global_clock"] = slice.global_clock;
            out["values"] = ToNumpy(std::move(slice.values));
            out["state"] = ToNumpy(std::move(slice.state));
            return out;
          },
          py::arg("table"), py::arg("branch") = 0,
          "This shard's slice of a table on a branch: first_row, num_rows, values, optimizer state "
          "(state_arrays arrays of len(values) floats, then scalars) and global_clock (the branch's).", Keep())
      .def(
          "import_shard_table",
          [](ProcessNode& node, int table, py::array_t<float, py::array::c_style | py::array::forcecast> values,
             py::array_t<float, py::array::c_style | py::array::forcecast> state) {
            const float* v = values.data();
            const float* s = state.data();
            const auto nv = static_cast<size_t>(values.size());
            const auto ns = static_cast<size_t>(state.size());
            py::gil_scoped_release release;
            Check(node.ImportShardTable(table, v, nv, s, ns));
          },
          py::arg("table"), py::arg("values"), py::arg("state"),
          "Replaces this shard's slice of a table (same sizes as export_shard_table).", Keep())
      .def_property_readonly("rejected_messages", &ProcessNode::rejected_messages)
      .def(
          "export_cuda_ipc",
          [](ProcessNode& node, size_t slice_bytes) {
            std::string handle;
            {
              py::gil_scoped_release release;
              Check(node.ExportCudaIpc(slice_bytes, &handle));
            }
            return py::bytes(handle);
          },
          py::arg("slice_bytes"),
          "Exports this process's CUDA IPC landing region (slice_bytes per peer) and returns the handle "
          "peers pass to open_cuda_ipc_peer. Raises with the reason where CUDA IPC is unavailable.", Keep())
      .def(
          "open_cuda_ipc_peer",
          [](ProcessNode& node, int peer, const py::bytes& handle, size_t slice_bytes) {
            std::string bytes = handle;
            py::gil_scoped_release release;
            Check(node.OpenCudaIpcPeer(peer, bytes, slice_bytes));
          },
          py::arg("peer"), py::arg("handle"), py::arg("slice_bytes"),
          "Opens peer's exported region and event; raises with the driver's reason where it cannot.", Keep())
      .def(
          "enable_cuda_ipc_peer", [](ProcessNode& node, int peer) { Check(node.EnableCudaIpcPeer(peer)); },
          py::arg("peer"), "From now on, device payloads to and from peer go device -> device.", Keep())
      .def_property_readonly("device_total_bytes", &ProcessNode::device_total_bytes,
                             "The memory of this process's device in bytes (-1 where unknown).")
      .def_property_readonly("cuda_ipc_peers", &ProcessNode::cuda_ipc_peers,
                             "The ranks this process exchanges device payloads with by CUDA IPC.")
      .def_property_readonly("cuda_ipc_same_device_peers", &ProcessNode::cuda_ipc_same_device_peers,
                             "Of cuda_ipc_peers, those whose GPU is this process's (they time-share it).")
      .def_property_readonly(
          "cuda_ipc_stats",
          [](const ProcessNode& node) {
            const IpcStats stats = node.cuda_ipc_stats();
            py::dict out;
            out["sent_messages"] = stats.sent_messages;
            out["sent_bytes"] = stats.sent_bytes;
            out["sent_from_views"] = stats.sent_from_views;
            out["fallbacks"] = stats.fallbacks;
            out["room_waits"] = stats.room_waits;
            out["room_wait_us"] = stats.room_wait_us;
            out["received_messages"] = stats.received_messages;
            out["received_bytes"] = stats.received_bytes;
            out["copied_out_messages"] = stats.copied_out_messages;
            out["copied_out_bytes"] = stats.copied_out_bytes;
            out["releases_sent"] = stats.releases_sent;
            out["releases_received"] = stats.releases_received;
            return out;
          },
          "CUDA IPC traffic so far: payloads and bytes sent and received device -> device (of those sent, the ones "
          "copied straight from the shard's state), fallbacks to "
          "host frames (a full slice), payloads that waited for room in a full slice and the microseconds they "
          "waited, payloads copied out of a crowded slice on landing, releases sent and received.")
      .def_property_readonly("socket_payload_bytes", &ProcessNode::socket_payload_bytes,
                             "Payload bytes sent to other processes through the socket.")
      .def_property_readonly("device_payload_bytes_by_host", &ProcessNode::device_payload_bytes_by_host,
                             "Of those, bytes of device payloads copied device -> host to be sent (no CUDA IPC).")
      .def("shutdown", [](ProcessNode& node) { CheckInterruptibly([&] { return node.Shutdown(); }); }, Keep());
}

}  // namespace mltuner::python
