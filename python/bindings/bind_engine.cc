// Engine: access buffers become numpy arrays over engine memory (no copy);
// every call that can block or do heavy work releases the GIL, and every one
// that can block is interruptible by Ctrl-C and the engine's wait watcher
// (CheckInterruptibly).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "bindings.h"
#include "buffers.h"
#include "mltuner/engine.h"
#include "mltuner/host_headroom.h"

namespace py = pybind11;

namespace mltuner::python {

namespace {

using RowArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Release = KeepAndRelease;

std::vector<RowId> ToRows(const RowArray& rows) {
  if (rows.ndim() != 1) throw py::value_error("rows must be a 1-D sequence of row ids");
  return std::vector<RowId>(rows.data(), rows.data() + rows.size());
}

template <Status (Engine::*Method)(Handle, AccessBuffer*, uintptr_t)>
py::tuple OpenBuffer(Engine& engine, Handle handle, uintptr_t stream) {
  AccessBuffer buffer;
  CheckInterruptibly(&engine, [&] { return (engine.*Method)(handle, &buffer, stream); });
  return py::make_tuple(BufferToPython(buffer), buffer.data_age);
}

template <Status (Engine::*Method)(Handle, uintptr_t)>
void PostBuffer(Engine& engine, Handle handle, uintptr_t stream) {
  CheckInterruptibly(&engine, [&] { return (engine.*Method)(handle, stream); });
}

// A batch of (kind, handle) pairs, kinds as OpKind's numbers; a third item,
// for an update or post_local_access, lists pieces (address, offset, count)
// to copy into its buffer first; a fourth, for a post_local_access, pieces
// to copy out of it; a fifth, the address of a float32 that, nonzero when
// the copy runs, makes it write zeros instead of the pieces in (0: none).
py::list RunBatch(Engine& engine, const py::list& calls, uintptr_t stream) {
  std::vector<OpCall> ops;
  ops.reserve(calls.size());
  for (py::handle item : calls) {
    const py::tuple call = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
    if (call.size() < 2 || call.size() > 5) {
      throw py::value_error("run: each op is (kind, handle[, pieces in[, pieces out[, zero-if flag]]])");
    }
    const int kind = call[0].cast<int>();
    if (kind < static_cast<int>(OpKind::kRead) || kind > static_cast<int>(OpKind::kClock)) {
      throw py::value_error("run: op kind " + std::to_string(kind) + " is not an OpKind number (0-6)");
    }
    OpCall op{static_cast<OpKind>(kind), call[1].cast<Handle>(), {}};
    for (size_t item = 2; item < std::min<size_t>(call.size(), 4); ++item) {
      std::vector<CopyPiece>& pieces = item == 2 ? op.fill : op.drain;
      for (py::handle piece : call[item]) {
        const auto [address, offset, count] = piece.cast<std::tuple<uintptr_t, int64_t, int64_t>>();
        pieces.push_back({reinterpret_cast<float*>(address), offset, count});
      }
    }
    if (call.size() == 5) {
      if (op.kind != OpKind::kUpdate) throw py::value_error("run: only an update takes a zero-if flag");
      op.fill_zero_if = reinterpret_cast<const float*>(call[4].cast<uintptr_t>());
    }
    ops.push_back(std::move(op));
  }
  std::vector<AccessBuffer> opened;
  CheckInterruptibly(&engine, [&] { return engine.Run(ops, &opened, stream); });
  py::list buffers;
  for (const AccessBuffer& buffer : opened) buffers.append(BufferToPython(buffer));
  return buffers;
}

}  // namespace

void RegisterEngine(py::module_& m) {
  py::class_<EngineStats>(m, "EngineStats")
      .def_readonly("clock", &EngineStats::clock)
      .def_readonly("stall_seconds", &EngineStats::stall_seconds)
      .def_readonly("wait_fresh_seconds", &EngineStats::wait_fresh_seconds)
      .def_readonly("bytes_gathered", &EngineStats::bytes_gathered)
      .def_readonly("bytes_swapped_in", &EngineStats::bytes_swapped_in)
      .def_readonly("bytes_swapped_out", &EngineStats::bytes_swapped_out)
      .def_readonly("bytes_scattered", &EngineStats::bytes_scattered)
      .def_readonly("messages_sent", &EngineStats::messages_sent)
      .def_readonly("messages_received", &EngineStats::messages_received)
      .def_readonly("pool_bytes", &EngineStats::pool_bytes)
      .def_readonly("pool_min_bytes", &EngineStats::pool_min_bytes)
      .def_readonly("prefetch_clocks", &EngineStats::prefetch_clocks)
      .def_readonly("device_store_bytes", &EngineStats::device_store_bytes)
      .def_readonly("host_store_bytes", &EngineStats::host_store_bytes)
      .def_readonly("host_memory_bytes", &EngineStats::host_memory_bytes)
      .def_readonly("budget_bytes", &EngineStats::budget_bytes)
      .def_readonly("automatic_budget", &EngineStats::automatic_budget)
      .def_readonly("device_reserve_bytes", &EngineStats::device_reserve_bytes)
      .def_readonly("device_free_at_plan_bytes", &EngineStats::device_free_at_plan_bytes)
      .def_readonly("shard_in_host_memory", &EngineStats::shard_in_host_memory)
      .def_readonly("predicted_bytes_to_device_per_clock", &EngineStats::predicted_bytes_to_device_per_clock)
      .def_readonly("predicted_bytes_to_host_per_clock", &EngineStats::predicted_bytes_to_host_per_clock)
      .def_readonly("branch", &EngineStats::branch)
      .def_readonly("branch_clock", &EngineStats::branch_clock)
      .def_readonly("branch_switches", &EngineStats::branch_switches)
      .def_readonly("scheduled_ahead", &EngineStats::scheduled_ahead)
      .def_readonly("next_branch", &EngineStats::next_branch)
      .def_readonly("own_steps", &EngineStats::own_steps);

  py::class_<HostMemoryNeed>(m, "HostMemoryNeed")
      .def_readonly("parameter_stores", &HostMemoryNeed::parameter_stores)
      .def_readonly("local_data", &HostMemoryNeed::local_data)
      .def_readonly("device_memory", &HostMemoryNeed::device_memory)
      .def_readonly("staging", &HostMemoryNeed::staging)
      .def_readonly("payloads", &HostMemoryNeed::payloads)
      .def_readonly("shard_per_branch", &HostMemoryNeed::shard_per_branch)
      .def_readonly("shard_in_host_memory", &HostMemoryNeed::shard_in_host_memory)
      .def("total", &HostMemoryNeed::total)
      .def("describe", &HostMemoryNeed::Describe);

  m.def(
      "host_memory_headroom",
      [] {
        const HostHeadroom room = HostMemoryHeadroom();
        return py::make_tuple(room.bytes, room.source);
      },
      "(bytes, source): host memory this process may still allocate, the smallest of MemAvailable, its "
      "cgroups' limits and RLIMIT_AS, and which limit says so; bytes is -1 when none can be read.");

  py::class_<PlanPreview>(m, "PlanPreview")
      .def_readonly("pool_min_bytes", &PlanPreview::pool_min_bytes)
      .def_readonly("prefetch_clocks", &PlanPreview::prefetch_clocks)
      .def_readonly("fits", &PlanPreview::fits)
      .def_readonly("budget_bytes", &PlanPreview::budget_bytes)
      .def_readonly("automatic_budget", &PlanPreview::automatic_budget)
      .def_readonly("pool_bytes", &PlanPreview::pool_bytes)
      .def_readonly("device_store_bytes", &PlanPreview::device_store_bytes)
      .def_readonly("host_store_bytes", &PlanPreview::host_store_bytes)
      .def_readonly("host_to_device_bytes", &PlanPreview::host_to_device_bytes)
      .def_readonly("device_to_host_bytes", &PlanPreview::device_to_host_bytes)
      .def_readonly("device_local_accesses", &PlanPreview::device_local_accesses)
      .def_readonly("host", &PlanPreview::host)
      .def_readonly("description", &PlanPreview::description);

  py::class_<Engine>(m, "Engine")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("num_workers", &Engine::num_workers)
      .def_property_readonly("device", &Engine::device_name)
      .def("create_table",
           [](Engine& e, const std::string& name, int64_t num_rows, int64_t row_width, bool local,
              std::optional<UpdateRuleConfig> update_rule) {
             TableId id;
             Check(e.CreateTable(name, num_rows, row_width, local, &id, update_rule));
             return id;
           },
           py::arg("name"), py::arg("num_rows"), py::arg("row_width"), py::arg("local"),
           py::arg("update_rule") = py::none(), Keep())
      .def("set_learning_rate",
           [](Engine& e, TableId table, float learning_rate) { Check(e.SetLearningRate(table, learning_rate)); },
           py::arg("table"), py::arg("learning_rate"), Keep())
      .def("skip_step",
           [](Engine& e, uintptr_t flag, uintptr_t stream) {
             Check(e.SkipStep(reinterpret_cast<const float*>(flag), stream));
           },
           py::arg("flag") = 0, py::arg("stream") = 0, Keep())
      .def("tables", &Engine::tables, Keep())
      .def("virtual_read",
           [](Engine& e, TableId table, const RowArray& rows, int slack) {
             Handle h;
             Check(e.VirtualRead(table, ToRows(rows), slack, &h));
             return h;
           }, Keep())
      .def("virtual_post_read", [](Engine& e, Handle h) { Check(e.VirtualPostRead(h)); }, Keep())
      .def("virtual_pre_update",
           [](Engine& e, TableId table, const RowArray& rows) {
             Handle h;
             Check(e.VirtualPreUpdate(table, ToRows(rows), &h));
             return h;
           }, Keep())
      .def("virtual_update", [](Engine& e, Handle h) { Check(e.VirtualUpdate(h)); }, Keep())
      .def("virtual_local_access",
           [](Engine& e, TableId table, const RowArray& rows, bool fetch) {
             Handle h;
             Check(e.VirtualLocalAccess(table, ToRows(rows), fetch, &h));
             return h;
           }, Keep())
      .def("virtual_post_local_access",
           [](Engine& e, Handle h, bool keep) { Check(e.VirtualPostLocalAccess(h, keep)); }, Keep())
      .def("virtual_clock", [](Engine& e) { Check(e.VirtualClock()); }, Keep())
      .def("preview_plan",
           [](Engine& e) {
             PlanPreview preview;
             {
               py::gil_scoped_release release;
               Check(e.PreviewPlan(&preview));
             }
             return preview;
           }, Keep())
      .def("reset_virtual_iteration", [](Engine& e) { Check(e.ResetVirtualIteration()); }, Keep())
      .def("drop_tables", [](Engine& e, int32_t first) { Check(e.DropTables(first)); }, py::arg("first"), Keep())
      .def("reserve_device_memory", [](Engine& e, int64_t bytes) { Check(e.ReserveDeviceMemory(bytes)); },
           py::arg("bytes"), Keep())
      .def("release_host_memory_during_init",
           [](Engine& e, int64_t bytes) { Check(e.ReleaseHostMemoryDuringInit(bytes)); }, py::arg("bytes"), Keep())
      .def("finish_virtual_iteration",
           [](Engine& e) { CheckInterruptibly(&e, [&] { return e.FinishVirtualIteration(); }); }, Keep())
      .def("write_initial",
           [](Engine& e, Handle handle, const py::array_t<float, py::array::c_style | py::array::forcecast>& values) {
             const float* data = values.data();
             const int64_t count = static_cast<int64_t>(values.size());
             CheckInterruptibly(&e, [&] { return e.WriteInitial(handle, data, count); });
           },
           py::arg("handle"), py::arg("values"), Keep())
      .def("start_iterations", [](Engine& e) { Check(e.StartIterations()); }, Release())
      .def("read", &OpenBuffer<&Engine::Read>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("post_read", &PostBuffer<&Engine::PostRead>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("pre_update", &OpenBuffer<&Engine::PreUpdate>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("update", &PostBuffer<&Engine::Update>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("local_access", &OpenBuffer<&Engine::LocalAccess>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("post_local_access", &PostBuffer<&Engine::PostLocalAccess>, py::arg("handle"), py::arg("stream") = 0, Keep())
      .def("clock", [](Engine& e) { Check(e.Clock()); }, Release())  // never waits
      .def("run", &RunBatch, py::arg("ops"), py::arg("stream") = 0, Keep())
      .def("finish_clock",
           [](Engine& e, uintptr_t stream) {
             int64_t ran = 0;
             CheckInterruptibly(&e, [&] { return e.FinishClock(stream, &ran); });
             return ran;
           },
           py::arg("stream") = 0, Keep())
      .def("fetch",
           [](Engine& e, TableId table, const RowArray& rows, int64_t row_width, BranchId branch) {
             std::vector<RowId> ids = ToRows(rows);
             // Sized by the caller's width, which the engine checks against
             // the table's before it writes (a negative one is refused
             // there, over an empty array).
             py::array_t<float> out(
                 {static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(std::max<int64_t>(row_width, 0))});
             float* data = out.mutable_data();
             CheckInterruptibly(&e, [&] { return e.Fetch(table, ids, row_width, data, branch); });
             return out;
           },
           py::arg("table"), py::arg("rows"), py::arg("row_width"), py::arg("branch") = -1, Keep())
      .def("fork_branch",
           [](Engine& e, BranchId child, BranchId parent, float learning_rate, float momentum, bool training,
              int slack, bool keep_rate_ratios) {
             BranchSettings settings;
             settings.learning_rate = learning_rate;
             settings.momentum = momentum;
             settings.training = training;
             settings.slack = slack;
             settings.keep_rate_ratios = keep_rate_ratios;
             CheckInterruptibly(&e, [&] { return e.ForkBranch(child, parent, settings); });
           },
           py::arg("child"), py::arg("parent"), py::arg("learning_rate"), py::arg("momentum"), py::arg("training"),
           py::arg("slack"), py::arg("keep_rate_ratios") = false, Keep())
      .def("free_branch",
           [](Engine& e, BranchId branch) { CheckInterruptibly(&e, [&] { return e.FreeBranch(branch); }); }, Keep())
      .def("schedule_branch",
           [](Engine& e, BranchId branch, int64_t clocks) {
             CheckInterruptibly(&e, [&] { return e.ScheduleBranch(branch, clocks); });
           },
           Keep())
      .def("continue_on_branch",
           [](Engine& e, BranchId branch) { CheckInterruptibly(&e, [&] { return e.ContinueOnBranch(branch); }); },
           Keep())
      .def("declare_empty_clock",
           [](Engine& e, WorkerId worker, BranchId branch, int64_t clock) {
             CheckInterruptibly(&e, [&] { return e.DeclareEmptyClock(worker, branch, clock); });
           },
           py::arg("worker"), py::arg("branch"), py::arg("clock"), Keep())
      .def("flush", [](Engine& e) { CheckInterruptibly(&e, [&] { return e.Flush(); }); }, Keep())
      .def("wait_for_data_age",
           [](Engine& e, TableId table, int64_t age) {
             CheckInterruptibly(&e, [&] { return e.WaitForDataAge(table, age); });
           },
           Keep())
      .def("data_age", &Engine::DataAge, Keep())
      .def("stats", &Engine::Stats, Keep())
      .def("describe_plan", &Engine::DescribePlan, Keep())
      .def("set_wait_watcher", [](Engine& e, py::object watcher) { SetWaitWatcher(e, std::move(watcher)); },
           py::arg("watcher"), "A callable(seconds_blocked) asked while a call is blocked; it raises to end the call.")
      .def("shutdown",
           [](Engine& e) {
             SetWaitWatcher(e, py::none());
             CheckInterruptibly([&] { return e.Shutdown(); });
           },
           Keep());
}

}  // namespace mltuner::python
