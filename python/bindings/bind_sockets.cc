// SocketPump: the data plane's send and receive threads in C++, over the
// libzmq sockets pyzmq made (mltuner/transport/_sockets.py hands them over
// by their `underlying` handles and keeps the Python objects open).
#include <pybind11/stl.h>

#include "bindings.h"
#include "mltuner/frame_memory.h"
#include "mltuner/process_node.h"
#include "mltuner/socket_pump.h"

namespace py = pybind11;

namespace mltuner::python {

namespace {

void* Handle(uintptr_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

void RegisterSockets(py::module_& m) {
  py::class_<SocketPump>(m, "SocketPump")
      .def(py::init([](ProcessNode& node, const std::string& zmq_library, const std::map<int, uintptr_t>& peers,
                       const std::vector<uintptr_t>& inboxes, int64_t wait_timeout_ms, int64_t queue_limit_bytes) {
             SocketPumpOptions options;
             options.zmq_library = zmq_library;
             for (const auto& peer : peers) options.peers[peer.first] = Handle(peer.second);
             for (uintptr_t inbox : inboxes) options.inboxes.push_back(Handle(inbox));
             options.wait_timeout_ms = wait_timeout_ms;
             options.queue_limit_bytes = queue_limit_bytes;
             std::unique_ptr<SocketPump> pump;
             Check(SocketPump::Start(&node, std::move(options), &pump));
             return pump;
           }),
           py::arg("node"), py::arg("zmq_library"), py::arg("peers"), py::arg("inboxes"), py::arg("wait_timeout_ms"),
           py::arg("queue_limit_bytes"), py::keep_alive<1, 2>(),
           "Starts the send and receive threads over node: peers maps a rank to its PUSH socket's "
           "libzmq handle (zmq.Socket.underlying), inboxes are the bound PULL sockets' handles, and "
           "zmq_library is the path of the libzmq that made them. Use no socket from Python until stop().")
      .def("stop", &SocketPump::Stop, py::call_guard<py::gil_scoped_release>(),
           "Joins both threads; the sockets are the caller's again. Idempotent.")
      .def("set_queue_limit", &SocketPump::SetQueueLimit, py::arg("bytes"),
           "Payload bytes that may wait in ZeroMQ for one peer (0: no bound).")
      .def_property_readonly(
          "stats",
          [](const SocketPump& pump) {
            const SocketPumpStats stats = pump.stats();
            py::dict out;
            out["queued_bytes"] = stats.queued_bytes;
            out["peak_queued_bytes"] = stats.peak_queued_bytes;
            out["lent_payloads"] = stats.lent_payloads;
            out["refused_messages"] = stats.refused_messages;
            out["sent_messages"] = stats.sent_messages;
            out["received_messages"] = stats.received_messages;
            out["stalls"] = stats.stalls;
            return out;
          },
          "Counters: bytes queued per peer (and their peak), payloads the node reads in place, messages "
          "refused for their frame count, messages sent and received, stalls done.")
      .def("take_refusals", &SocketPump::TakeRefusals,
           "Why input was refused since the last call (the latest 16 at most).")
      .def_property_readonly("stuck", &SocketPump::stuck, "Why a peer was declared stuck, or ''.")
      .def("stall_next_delivery", &SocketPump::StallNextDelivery, py::arg("min_payload_bytes"), py::arg("milliseconds"),
           "For tests: the next received message with a payload of at least min_payload_bytes waits this long "
           "before delivery, as a receiver far slower than its sender.");
  m.def(
      "keep_freed_memory_for_frames",
      [] {
        std::string why;
        const bool changed = KeepFreedMemoryForFrames(&why);
        return py::make_tuple(changed, why);
      },
      "(changed, why): raise glibc's mmap and trim thresholds once per process, so that received frames freed "
      "together are not handed back to the kernel and faulted in again next clock (mltuner/frame_memory.h); "
      "not where the environment tunes malloc or MLTUNER_MALLOC_TUNING=0.");
}

}  // namespace mltuner::python
