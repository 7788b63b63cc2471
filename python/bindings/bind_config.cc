// Config and UpdateRuleConfig as plain attribute bags.
#include <pybind11/stl.h>

#include "bindings.h"
#include "mltuner/config.h"
#include "mltuner/types.h"

namespace py = pybind11;

namespace mltuner::python {

void RegisterConfig(py::module_& m) {
  py::enum_<UpdateRuleKind>(m, "UpdateRuleKind")
      .value("add", UpdateRuleKind::kAdd)
      .value("sgd", UpdateRuleKind::kSgd)
      .value("damped_momentum", UpdateRuleKind::kDampedMomentum)
      .value("adam", UpdateRuleKind::kAdam)
      .value("adamw", UpdateRuleKind::kAdamW);

  py::class_<UpdateRuleConfig>(m, "UpdateRuleConfig")
      .def(py::init<>())
      .def_readwrite("kind", &UpdateRuleConfig::kind)
      .def_readwrite("learning_rate", &UpdateRuleConfig::learning_rate)
      .def_readwrite("momentum", &UpdateRuleConfig::momentum)
      .def_readwrite("dampening", &UpdateRuleConfig::dampening)
      .def_readwrite("nesterov", &UpdateRuleConfig::nesterov)
      .def_readwrite("weight_decay", &UpdateRuleConfig::weight_decay)
      .def_readwrite("beta1", &UpdateRuleConfig::beta1)
      .def_readwrite("beta2", &UpdateRuleConfig::beta2)
      .def_readwrite("epsilon", &UpdateRuleConfig::epsilon)
      .def_readwrite("amsgrad", &UpdateRuleConfig::amsgrad)
      .def("__repr__", [](const UpdateRuleConfig& rule) { return "<UpdateRuleConfig " + UpdateRuleText(rule) + ">"; });

  py::class_<Config>(m, "Config")
      .def(py::init<>())
      .def_readwrite("device_memory_budget", &Config::device_memory_budget)
      .def_readwrite("device_memory_reserve", &Config::device_memory_reserve)
      .def_readwrite("cpu_device_capacity", &Config::cpu_device_capacity)
      .def_readwrite("host_memory_limit", &Config::host_memory_limit)
      .def_readwrite("wait_timeout_ms", &Config::wait_timeout_ms)
      .def_readwrite("prefetch_clocks", &Config::prefetch_clocks)
      .def_readwrite("partitions_per_table", &Config::partitions_per_table)
      .def_readwrite("clock_part_bytes", &Config::clock_part_bytes)
      .def_readwrite("update_rule", &Config::update_rule)
      .def_readwrite("branches", &Config::branches)
      .def_readwrite("max_branches", &Config::max_branches)
      .def_readwrite("read_my_writes", &Config::read_my_writes)
      .def_readwrite("check_finite", &Config::check_finite)
      .def_readwrite("debug_buffers", &Config::debug_buffers);

  py::class_<TableInfo>(m, "TableInfo")
      .def_readonly("id", &TableInfo::id)
      .def_readonly("name", &TableInfo::name)
      .def_readonly("num_rows", &TableInfo::num_rows)
      .def_readonly("row_width", &TableInfo::row_width)
      .def_readonly("local", &TableInfo::local)
      .def_readonly("update_rule", &TableInfo::update_rule);
}

}  // namespace mltuner::python
