"""Hypothesis fuzz of what users and peers can hand the library: the wire
decoder (through ProcessNode.deliver), TensorLayout, Config and random
sequences of API calls. Whatever comes in, the answer is a result or one of
the library's exceptions: never a crash, a hang, or another exception type.
150-300 examples each, about 15 s in all on a busy 2-core machine."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install .[test])")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mltuner
from mltuner import _core
from mltuner.exceptions import CorruptMessageError, MltunerError

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- the wire decoder ---------------------------------------------------------------
_NODE = _core.ProcessNode(mltuner.Config(wait_timeout_s=1).to_core(), 0, 2)
_NODE_TABLE = _NODE.engine.create_table("t", 8, 4, False)

small = st.integers(-3, 12)
spans = st.lists(st.tuples(st.integers(-2, 10), st.integers(-2, 10)), max_size=4)


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, bytes]:
    if draw(st.booleans()):  # anything at all
        return draw(st.binary(max_size=200)), draw(st.binary(max_size=200))
    span_list = draw(spans)
    text = draw(st.binary(max_size=12))
    head = struct.pack(
        "<IHHiiiiqqqIIQ",
        draw(st.sampled_from([0x4E544C4D, 0x4E544C4D, 0x12345678])), draw(st.sampled_from([1, 1, 0, 2])),
        draw(st.integers(0, 14)), draw(small), draw(small), draw(small), draw(st.integers(-1, 3)),
        draw(st.integers(-3, 10**9)), draw(st.integers(-1, 5)), draw(st.integers(-1, 8)),
        draw(st.sampled_from([len(span_list), len(span_list), draw(st.integers(0, 2**32 - 1))])),
        draw(st.sampled_from([len(text), draw(st.integers(0, 2**32 - 1))])), draw(st.sampled_from([0, 0, 1])))
    body = b"".join(struct.pack("<qq", begin, count) for begin, count in span_list) + text
    rows = sum(max(count, 0) for _, count in span_list)
    payload_floats = draw(st.sampled_from([rows * 4, rows * 4, draw(st.integers(0, 64))]))
    return head + body, np.full(payload_floats, 1.0, dtype=np.float32).tobytes()


@FAST
@given(frames())
def test_the_wire_decoder_refuses_or_accepts_never_crashes(message: tuple[bytes, bytes]) -> None:
    before = int(_NODE.rejected_messages)
    try:
        _NODE.deliver(message[0], message[1])
    except CorruptMessageError:
        assert int(_NODE.rejected_messages) == before + 1


# -- TensorLayout ---------------------------------------------------------------------
shapes = st.lists(st.integers(0, 40), max_size=3).map(tuple)


@FAST
@given(st.integers(1, 64), st.lists(shapes, min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_a_layout_packs_and_views_every_tensor_exactly(row_width: int, tensor_shapes: list[tuple[int, ...]],
                                                        seed: int) -> None:
    layout = mltuner.TensorLayout(row_width)
    for index, shape in enumerate(tensor_shapes):
        layout.add(f"t{index}", shape)
    slots = list(layout)
    assert [s.first_row for s in slots] == [sum(o.num_rows for o in slots[:i]) for i in range(len(slots))]
    assert layout.num_rows == sum(s.num_rows for s in slots)
    for slot in slots:
        assert (slot.num_rows - 1) * row_width < max(slot.size, 1) <= slot.num_rows * row_width
    rng = np.random.default_rng(seed)
    values = {s.name: rng.normal(size=s.shape).astype(np.float32) for s in slots}
    packed = layout.pack(values)
    for name, value in values.items():
        np.testing.assert_array_equal(layout.view(packed, name), value)
    np.testing.assert_array_equal(layout.rows(), np.arange(layout.num_rows))


anything = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=5), st.just((2.5,)), st.just([3, -1]))


@FAST
@given(st.integers(-3, 70) | anything, st.lists(st.integers(-2, 10) | anything, max_size=3) | anything)
def test_a_layout_refuses_bad_input_with_the_librarys_errors(row_width: Any, shape: Any) -> None:
    try:
        mltuner.TensorLayout(row_width).add("x", shape)
    except MltunerError:
        pass


# -- Config ---------------------------------------------------------------------------
config_fields = st.fixed_dictionaries({}, optional={
    "device_memory_budget": st.integers(-5, 2**64) | anything,
    "wait_timeout_s": st.floats(-1, 1e7) | anything,
    "prefetch_clocks": st.integers(-2, 100) | anything,
    "partitions_per_table": st.integers(-2, 2**17) | anything,
    "clock_part_bytes": st.integers(-2, 2**20) | st.none() | anything,
    "branches": anything,
    "max_branches": st.integers(-2, 2**17) | anything,
    "host_memory_limit": st.integers(0, 2**63) | anything,
    "device": st.sampled_from(["cpu", "gpu", ""]) | anything,
})
rule_fields = st.fixed_dictionaries({}, optional={
    "kind": st.sampled_from(["add", "sgd", "momentum", "damped_momentum", "adam", "adamw", "nope"]),
    "learning_rate": st.floats(allow_nan=True) | anything,
    "momentum": st.floats(-1, 2) | anything,
    "beta1": st.floats(-1, 2), "beta2": st.floats(-1, 2), "epsilon": st.floats(-1, 2) | anything,
    "dampening": st.floats(-1, 2) | anything, "weight_decay": st.floats(-1, 2) | anything,
    "nesterov": st.booleans() | anything, "amsgrad": st.booleans() | anything,
})


@FAST
@given(config_fields, rule_fields)
def test_a_config_is_valid_for_the_engine_or_refused(settings_: dict[str, Any], rule: dict[str, Any]) -> None:
    try:
        config = mltuner.Config(update_rule=mltuner.UpdateRule(**rule), **settings_)
    except MltunerError:
        return
    core = config.to_core()  # every accepted value fits the engine's types
    assert core.wait_timeout_ms >= 1
    assert core.prefetch_clocks == -1 if config.prefetch_clocks is None else 0 <= core.prefetch_clocks <= 64
    assert np.isfinite(core.update_rule.learning_rate)


# -- random sequences of API calls ------------------------------------------------------
calls = st.lists(st.tuples(st.sampled_from([
    "create_table", "create_local", "virtual_read", "virtual_post_read", "virtual_pre_update", "virtual_update",
    "virtual_local_access", "virtual_post_local_access", "virtual_clock", "finish_virtual_iteration",
    "start_iterations", "read", "post_read", "pre_update", "update", "local_access", "post_local_access", "clock",
    "fetch", "data_age", "flush"]), st.integers(-1, 4), st.lists(st.integers(-1, 12), max_size=4) | st.none()),
    max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls)
def test_random_api_sequences_give_results_or_the_librarys_errors(sequence: list[tuple[str, int, Any]]) -> None:
    with mltuner.LocalCluster(1, mltuner.Config(wait_timeout_s=0.2)) as cluster:
        worker = cluster.worker(0)
        tables: list[mltuner.Table] = []
        for name, number, rows in sequence:
            table = tables[number % len(tables)] if tables else None
            try:
                if name in ("create_table", "create_local"):
                    tables.append(worker.create_table(f"t{len(tables)}", max(number, 0) + 1, 3,
                                                      local=name == "create_local"))
                elif name in ("virtual_read", "virtual_pre_update", "virtual_local_access", "fetch"):
                    if table is not None:
                        getattr(worker, name)(table, rows)
                elif name == "data_age":
                    if table is not None:
                        worker.data_age(table)
                elif name in ("virtual_clock", "finish_virtual_iteration", "start_iterations", "clock", "flush"):
                    getattr(worker, name)()
                else:
                    getattr(worker, name)(number)
            except MltunerError:
                pass
