"""Every setting and API argument is checked in Python, once: a bad value
raises the library's InvalidArgumentError naming the setting and its range
(never a pybind "incompatible function arguments", an OverflowError or a
silent truncation), and the Python defaults are the engine's."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import _core

INF, NAN = math.inf, math.nan


def test_python_defaults_are_the_engines() -> None:
    python, core = mltuner.Config(), _core.Config()
    assert python.device_memory_budget == core.device_memory_budget
    assert int(python.wait_timeout_s * 1000) == core.wait_timeout_ms
    assert python.prefetch_clocks is None and core.prefetch_clocks == -1  # both: the plan chooses
    assert python.to_core().prefetch_clocks == core.prefetch_clocks
    assert python.partitions_per_table == core.partitions_per_table
    assert python.clock_part_bytes is None and core.clock_part_bytes == -1  # both: the device chooses
    assert python.to_core().clock_part_bytes == core.clock_part_bytes
    assert python.branches == core.branches
    assert python.max_branches == core.max_branches
    assert python.check_finite == core.check_finite
    assert mltuner.Config(debug_buffers=False).debug_buffers == core.debug_buffers
    rule, core_rule = python.update_rule, core.update_rule
    assert rule.kind == core_rule.kind.name
    for name in ("learning_rate", "momentum", "beta1", "beta2", "epsilon", "dampening", "weight_decay"):
        assert np.float32(getattr(rule, name)) == np.float32(getattr(core_rule, name)), name
    assert rule.nesterov == core_rule.nesterov and rule.amsgrad == core_rule.amsgrad
    # The engine's struct has torch's defaults; so do the Python rules named after torch's optimizers.
    for kind in ("sgd", "adam"):
        torch_like = mltuner.UpdateRule(kind).to_core()  # type: ignore[arg-type]
        for name in ("momentum", "weight_decay", "dampening", "beta1", "beta2", "epsilon"):
            assert getattr(torch_like, name) == getattr(core_rule, name), (kind, name)
    # And what to_core hands over is what was set.
    converted = python.to_core()
    assert converted.wait_timeout_ms == core.wait_timeout_ms and converted.max_branches == core.max_branches


CONFIG_CASES: list[tuple[dict[str, Any], str]] = [
    ({"wait_timeout_s": INF}, r"Config.wait_timeout_s must be a finite number in \(0, 1e\+06\], got inf"),
    ({"wait_timeout_s": NAN}, r"Config.wait_timeout_s must be a finite number"),
    ({"wait_timeout_s": 0}, r"Config.wait_timeout_s must be a finite number in \(0"),
    ({"prefetch_clocks": 2**31},
     r"Config.prefetch_clocks must be in \[0, 64\] or None \(the plan chooses\), got 2147483648"),
    ({"prefetch_clocks": 1.5}, r"Config.prefetch_clocks must be an integer in \[0, 64\] or None"),
    ({"prefetch_clocks": "1"}, r"Config.prefetch_clocks must be an integer in \[0, 64\] or None"),
    ({"prefetch_clocks": -1}, r"Config.prefetch_clocks must be in \[0, 64\] or None \(the plan chooses\), got -1"),
    ({"device_memory_budget": -1}, r"Config.device_memory_budget must be in \[0, 2\*\*62\]"),
    ({"device_memory_budget": 2**70}, r"Config.device_memory_budget must be in \[0, 2\*\*62\]"),
    ({"partitions_per_table": 0}, r"Config.partitions_per_table must be in \[1, 65536\]"),
    ({"clock_part_bytes": -1}, r"Config.clock_part_bytes must be in \[0, 2\*\*62\]"),
    ({"clock_part_bytes": 1.5}, r"Config.clock_part_bytes must be an integer"),
    ({"max_branches": 2**62}, r"Config.max_branches must be in \[1, 65536\]"),
    ({"branches": 1}, r"Config.branches must be True or False"),
    ({"device": "gpu"}, r"Config.device must be one of 'cpu', 'cuda', got 'gpu'"),
    ({"host_memory_limit": 100}, r"Config.host_memory_limit must be 0 \(detect\) or in \[1048576, 2\*\*62\]"),
    ({"host_memory_limit": -1}, r"Config.host_memory_limit must be in \[0, 2\*\*62\]"),
    ({"update_rule": "sgd"}, r"Config.update_rule must be an UpdateRule"),
]


@pytest.mark.parametrize(("settings", "message"), CONFIG_CASES)
def test_bad_config_values_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match=message):
        mltuner.Config(**settings)


RULE_CASES: list[tuple[dict[str, Any], str]] = [
    ({"learning_rate": INF}, r"UpdateRule.learning_rate must be a finite number in \[0, 1e\+06\], got inf"),
    ({"learning_rate": NAN}, r"UpdateRule.learning_rate must be a finite number"),
    ({"learning_rate": -0.1}, r"UpdateRule.learning_rate"),
    ({"momentum": 1.0}, r"UpdateRule.momentum must be a finite number in \[0, 1\)"),
    ({"kind": "adam", "beta1": -0.1}, r"UpdateRule.beta1"),
    ({"kind": "adamw", "beta2": INF}, r"UpdateRule.beta2"),
    ({"kind": "adam", "epsilon": 0.0}, r"UpdateRule.epsilon must be a finite number in \(0, 1\]"),
    ({"kind": "rmsprop"}, r"UpdateRule.kind must be one of 'add', 'sgd', 'damped_momentum', 'momentum', 'adam', "
                          r"'adamw', got 'rmsprop'"),
    ({"learning_rate": "0.1"}, r"UpdateRule.learning_rate must be a number, got str"),
    ({"dampening": 1.5}, r"UpdateRule.dampening must be a finite number in \[0, 1\]"),
    ({"weight_decay": -1e-4}, r"UpdateRule.weight_decay must be a finite number in \[0, 1e\+06\]"),
    ({"nesterov": True}, r"nesterov needs momentum > 0 and dampening 0"),
    ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, r"nesterov needs momentum > 0 and dampening 0"),
    ({"nesterov": 1, "momentum": 0.9}, r"UpdateRule.nesterov must be True or False"),
    ({"kind": "adam", "momentum": 0.9}, r"UpdateRule.momentum is set to 0.9, but the 'adam' rule does not use it"),
    ({"kind": "add", "weight_decay": 0.1}, r"the 'add' rule does not use it \(its fields: none\)"),
    ({"kind": "add", "learning_rate": 5.0}, r"UpdateRule.learning_rate is set to 5.0, but the 'add' rule does not use it"),
    ({"kind": "damped_momentum", "amsgrad": True}, r"UpdateRule.amsgrad is set to True, but the 'damped_momentum'"),
    ({"beta1": 0.5}, r"UpdateRule.beta1 is set to 0.5, but the 'sgd' rule does not use it"),
]


def test_momentum_is_the_damped_rules_old_name() -> None:
    rule = mltuner.UpdateRule("momentum", 0.1)
    assert rule == mltuner.UpdateRule("damped_momentum", 0.1)
    assert rule.kind == "damped_momentum" and rule.momentum == 0.9
    assert mltuner.UpdateRule("sgd").momentum == 0.0  # torch's default
    assert mltuner.UpdateRule("adamw").weight_decay == 0.01  # torch's default
    assert mltuner.UpdateRule("adam", amsgrad=True).state_arrays == 3


@pytest.mark.parametrize(("settings", "message"), RULE_CASES)
def test_bad_update_rules_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match=message):
        mltuner.UpdateRule(**{"kind": "sgd", **settings})


def test_numpy_numbers_are_accepted() -> None:
    config = mltuner.Config(prefetch_clocks=np.int64(2), wait_timeout_s=np.float32(5.0),
                            update_rule=mltuner.UpdateRule("sgd", np.float64(0.1)))
    assert config.to_core().prefetch_clocks == 2


@pytest.fixture
def worker():  # type: ignore[no-untyped-def]
    with mltuner.LocalCluster(1, mltuner.Config(wait_timeout_s=5)) as cluster:
        yield cluster.worker(0)


def test_a_fractional_row_count_is_refused_not_truncated(worker: mltuner.Worker) -> None:
    with pytest.raises(mltuner.ArgumentTypeError, match=r"create_table\('u'\): num_rows must be an integer.*10.7"):
        worker.create_table("u", 10.7, 4)  # type: ignore[arg-type]
    assert worker.tables == []


@pytest.mark.parametrize(("call", "message"), [
    (lambda w, t: w.virtual_read(t, slack=2**62), r"slack must be in \[0, 2\*\*31 - 1\], got 4611686018427387904"),
    (lambda w, t: w.virtual_read(t, slack=1.0), r"slack must be an integer"),
    (lambda w, t: w.virtual_read(t, [2**70]), r"row ids for table 't'"),
    (lambda w, t: w.virtual_read(t, np.array([2**63], dtype=np.uint64)), r"row id 9223372036854775808 is outside"),
    (lambda w, t: w.virtual_post_read(2**62), r"handle must be in"),
    (lambda w, t: w.virtual_local_access(t, fetch="yes"), r"fetch must be True or False"),
    (lambda w, t: w.create_table("big", 2**40, 2), r"2 values is more than the 2\*\*40"),
    (lambda w, t: w.create_table("w", 4, 2**41), r"row_width must be in \[1, 2\*\*40\]"),
    (lambda w, t: w.create_table("bad\nname", 4, 4), r"name must be a non-empty printable string"),
    (lambda w, t: w.create_table(7, 4, 4), r"name must be a non-empty printable string"),
    (lambda w, t: w.fork_branch(1, 0, learning_rate=INF), r"fork_branch: learning_rate must be a finite number"),
    (lambda w, t: w.fork_branch(1, 0, learning_rate=0.1, momentum=NAN), r"fork_branch: momentum"),
    (lambda w, t: w.fork_branch(2**40, 0, learning_rate=0.1), r"fork_branch: child must be in \[0, 2\*\*31 - 1\]"),
    (lambda w, t: w.schedule_branch(0, 0), r"schedule_branch: clocks must be in \[1, 2\*\*62\]"),
    (lambda w, t: w.fetch(t, branch=-5), r"fetch: branch must be in \[0, 2\*\*31 - 1\]"),
    (lambda w, t: w.post_read(0, stream=-1), r"stream must be in \[0, 2\*\*64 - 1\]"),
    (lambda w, t: w.run(["read"]), r"run: each op is a \(kind, handle\) pair, got 'read'"),
])
def test_bad_api_arguments_name_the_argument(worker: mltuner.Worker, call: Any, message: str) -> None:
    table = worker.create_table("t", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match=message):
        call(worker, table)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: mltuner.TensorLayout(2.5), r"TensorLayout: row_width must be an integer"),  # type: ignore[arg-type]
    (lambda: mltuner.TensorLayout(4).add("w", (2.5, 3)), r"tensor 'w': dimension 0 must be an integer"),
    (lambda: mltuner.TensorLayout(4).add("w", 3), r"tensor 'w': shape must be a sequence"),  # type: ignore[arg-type]
    (lambda: mltuner.TensorLayout(4).add("w", (2**30, 2**30)), r"more than 2\*\*40 values"),
    (lambda: mltuner.LocalCluster(2.0), r"LocalCluster: num_workers must be an integer"),  # type: ignore[arg-type]
    (lambda: mltuner.Job(rendezvous_timeout_s=INF), r"Job: rendezvous_timeout_s must be a finite number"),
    (lambda: mltuner.Job(heartbeat_interval_s=6.0), r"Job: heartbeat_interval_s must be a finite number in \(0, 5\)"),
    (lambda: mltuner.Job(secure="yes"), r"Job: secure must be True or False"),  # type: ignore[arg-type]
])
def test_bad_constructor_arguments_name_the_argument(make: Any, message: str) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match=message):
        make()


def test_job_arguments_are_checked_on_a_single_process(tmp_path: Any) -> None:
    with mltuner.Job() as job:
        with pytest.raises(mltuner.InvalidArgumentError, match=r"save_checkpoint: keep must be in \[1, 1000000\]"):
            job.save_checkpoint(tmp_path, keep=0)
        with pytest.raises(mltuner.InvalidArgumentError, match=r"barrier: timeout_s must be a finite number"):
            job.barrier("b", timeout_s=INF)
        with pytest.raises(mltuner.InvalidArgumentError, match=r"allgather 'x': the value is not JSON"):
            job.allgather("x", object())


def test_buffers_are_read_only_after_their_post(worker: mltuner.Worker) -> None:
    table = worker.create_table("p", 2, 4)
    local = worker.create_table("l", 2, 4, local=True)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    access = worker.virtual_local_access(local)
    worker.virtual_post_local_access(access)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    buffer = worker.read(read)
    with pytest.raises(ValueError, match="read-only"):
        buffer[0, 0] = 1.0  # read buffers always were
    worker.post_read(read)
    out = worker.pre_update(update)
    out[:] = 1.0
    worker.update(update)
    with pytest.raises(ValueError, match="read-only"):
        out[:] = 1000.0  # would have changed what is shipped
    scratch = worker.local_access(access)
    scratch[:] = 2.0
    worker.post_local_access(access)
    with pytest.raises(ValueError, match="read-only"):
        scratch[0] = 3.0
    worker.clock()
    worker.sync()
    np.testing.assert_array_equal(worker.fetch(table), np.ones((2, 4), dtype=np.float32))
    worker.read(read)
    worker.post_read(read)
    fresh = worker.pre_update(update)  # the next clock's buffer is writable again
    fresh[:] = 0.0
    worker.update(update)


def _recorded_update(worker: mltuner.Worker, rows: int = 4, width: int = 3) -> tuple[mltuner.Table, int]:
    table = worker.create_table("initial", rows, width)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    return table, update


def test_initial_values_of_another_shape_are_refused(worker: mltuner.Worker) -> None:
    table, update = _recorded_update(worker)
    for shape in [(3, 4), (1, 12), (2, 2, 3)]:  # the right count, a wrong shape: a transposed model, say
        with pytest.raises(mltuner.InvalidArgumentError, match=rf"values of shape \({shape[0]}, .*whose rows are \(4, 3\)"):
            worker.write_initial(update, np.zeros(shape, np.float32))
    worker.write_initial(update, np.arange(12, dtype=np.float32))  # flat: the rows' values in order
    worker.write_initial(update, np.ones((4, 3), np.float32))
    worker.start_iterations()
    assert worker.fetch(table).tolist() == (np.arange(12, dtype=np.float32).reshape(4, 3) + 1).tolist()


def test_non_finite_initial_values_are_refused_with_check_finite() -> None:
    with mltuner.LocalCluster(1, mltuner.Config(check_finite=True, wait_timeout_s=5)) as cluster:
        worker = cluster.worker(0)
        table, update = _recorded_update(worker)
        for bad in (np.nan, np.inf):
            values = np.zeros((4, 3), np.float32)
            values[2, 1] = bad
            with pytest.raises(mltuner.NonFiniteError, match="initial values of update 0 hold a NaN"):
                worker.write_initial(update, values)
        worker.start_iterations()
        assert not worker.fetch(table).any()  # nothing of them was added


def test_a_table_object_of_a_dropped_table_is_refused(worker: mltuner.Worker) -> None:
    old = worker.create_table("t", 64, 1)
    worker.drop_tables(old)
    worker.create_table("t", 64, 4096)  # the same id and name come back, wider
    with pytest.raises(mltuner.NotFoundError, match=r"\(64 x 1\) is not the worker's table of that name now"):
        worker.virtual_read(old)


def test_a_local_table_has_no_data_age(worker: mltuner.Worker) -> None:
    local = worker.create_table("scratch", 4, 3, local=True)
    with pytest.raises(mltuner.InvalidArgumentError, match="'scratch' is local: it has no data age"):
        worker.data_age(local)  # was -2, where wait_for_data_age refuses


def test_a_layout_packs_real_numbers_only() -> None:
    layout = mltuner.TensorLayout(row_width=4).add("w", (2, 2))
    with pytest.raises(mltuner.ArgumentTypeError, match="'w' is complex64: the tables hold real numbers"):
        layout.pack({"w": np.ones((2, 2), np.complex64)})  # numpy would drop the imaginary part with a warning
    assert layout.pack({"w": np.eye(2, dtype=np.int64)}).sum() == 2


def test_non_finite_initial_values_through_the_buffer_are_refused_by_the_servers() -> None:
    # The initialisation phase's pre_update/update path (kInitAdd), not write_initial.
    with mltuner.LocalCluster(1, mltuner.Config(check_finite=True, wait_timeout_s=5)) as cluster:
        worker = cluster.worker(0)
        _, update = _recorded_update(worker)
        buffer = worker.pre_update(update)
        np.asarray(buffer)[...] = 1.0
        np.asarray(buffer)[1, 2] = np.nan
        # A request's refusal (the initialisation's writes are requests) keeps the shard's code.
        with pytest.raises(mltuner.NonFiniteError, match="1 of 12 values that are NaN or infinite"):
            worker.update(update)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("MLTUNER_CPU_PASS_THREADS", "999", r"MLTUNER_CPU_PASS_THREADS must be an integer in \[1, 64\], got '999'"),
    ("MLTUNER_SPIN_WAIT_US", "50abc", r"MLTUNER_SPIN_WAIT_US must be an integer in \[0, 10000\]"),
    ("MLTUNER_SOCKET_THREADS", "pyhton", r"MLTUNER_SOCKET_THREADS must be python \(or unset\), got 'pyhton'"),
    ("MLTUNER_MALLOC_TUNING", "nope", r"MLTUNER_MALLOC_TUNING must be 0 or 1"),
])
def test_engine_variables_the_engine_would_ignore_are_refused(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                              value: str, message: str) -> None:
    # The engine reads them in C++, where a bad value silently left the default.
    monkeypatch.setenv(variable, value)
    with pytest.raises(mltuner.InvalidArgumentError, match=message):
        mltuner.Config()
    monkeypatch.setenv(variable, "")
    mltuner.Config()
