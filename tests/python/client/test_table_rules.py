"""A table's own update rule (create_table(update_rule=...)) and its
learning rate set between clocks (Worker.set_learning_rate), against
torch.optim.SGD's formula written out here in float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner as mlt

WIDTH = 3


def one_table_loop(worker: mlt.Worker, rule: mlt.UpdateRule | None) -> tuple[mlt.Table, int, int]:
    table = worker.create_table("w", 1, WIDTH, update_rule=rule)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    grad = worker.virtual_pre_update(table)
    worker.virtual_update(grad)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return table, read, grad


def test_a_tables_rule_and_rate_changes_follow_torchs_sgd() -> None:
    """Config says add; the table says sgd with momentum 0.5. The rate set
    before clock 2 applies from clock 2; one set in the middle of clock 3
    before its update (between backward and step in torch's terms) applies
    to clock 3, as torch's would; one set in clock 4 after its update, from
    clock 5."""
    rule = mlt.UpdateRule("sgd", learning_rate=0.1, momentum=0.5)
    rates = {2: 0.01, 3: 0.2, 5: 0.05}
    with mlt.LocalCluster(1, mlt.Config(wait_timeout_s=20)) as cluster:
        worker = cluster.worker(0)
        table, read, grad = one_table_loop(worker, rule)
        assert worker.update_rule_of(table) == rule
        for clock in range(6):
            if clock == 2:
                worker.set_learning_rate(table, rates[2])
            worker.read(read)
            worker.post_read(read)
            if clock == 3:
                worker.set_learning_rate(table, rates[3])  # clock 3 has started, its update not posted yet
            worker.pre_update(grad)[:] = 1.0
            worker.update(grad)
            if clock == 4:
                worker.set_learning_rate(table, rates[5])  # clock 4's update has left: from clock 5 on
            worker.clock()
        worker.sync()  # fetch gives the servers' current values: wait for the last clock's update
        got = worker.fetch(table)
    lr, buffer, w = 0.1, 0.0, 0.0
    for clock in range(6):
        lr = rates.get(clock, lr)
        buffer = 1.0 if clock == 0 else 0.5 * buffer + 1.0
        w -= lr * buffer
    np.testing.assert_allclose(got, np.full((1, WIDTH), w), rtol=1e-6)


@pytest.mark.parametrize(("setup", "call", "message"), [
    (None, lambda w, t: w.set_learning_rate(t, 0.1), r"'w' has the add rule, which has no learning rate"),
    (mlt.UpdateRule("sgd"), lambda w, t: w.set_learning_rate(t, float("nan")),
     r"set_learning_rate\('w'\) must be a finite number"),
    (mlt.UpdateRule("sgd"), lambda w, t: w.set_learning_rate(w.create_table("l", 1, 1, local=True), 0.1),
     r"local data: it has no learning rate"),
    (mlt.UpdateRule("sgd"), lambda w, t: w.create_table("x", 1, 1, local=True, update_rule=mlt.UpdateRule("sgd")),
     r"a local table has no update rule"),
    (mlt.UpdateRule("sgd"), lambda w, t: w.create_table("x", 1, 1, update_rule="sgd"),
     r"update_rule must be an UpdateRule, got str"),
])
def test_bad_rule_calls_name_the_problem(setup: mlt.UpdateRule | None, call: Callable[..., Any], message: str) -> None:
    with mlt.LocalCluster(1, mlt.Config(wait_timeout_s=5)) as cluster:
        worker = cluster.worker(0)
        table = worker.create_table("w", 1, WIDTH, update_rule=setup)
        with pytest.raises(mlt.InvalidArgumentError, match=message):
            call(worker, table)


def test_workers_must_give_a_table_the_same_rule(run_workers: Callable[..., list[Any]]) -> None:
    rules = [mlt.UpdateRule("sgd", learning_rate=0.1), mlt.UpdateRule("sgd", learning_rate=0.2)]

    def body(worker: mlt.Worker) -> None:
        worker.create_table("w", 4, WIDTH, update_rule=rules[worker.rank])
        worker.virtual_clock()
        worker.finish_virtual_iteration()

    with mlt.LocalCluster(2, mlt.Config(wait_timeout_s=10)) as cluster:
        mismatch = r"InvalidArgumentError: .*w:4:3:sgd lr=0.100000001.*every worker must create"
        with pytest.raises(AssertionError, match=mismatch):
            run_workers(body, cluster.workers, on_error=cluster.shutdown)


def test_a_step_any_worker_skips_leaves_the_rule_as_it_was(run_workers: Callable[..., list[Any]]) -> None:
    """Worker.skip_step (a scaler's overflow): a clock that any worker skips
    changes neither the values nor the momentum on the servers, as the
    all-reduced gradient of an overflowing rank skips DDP's step on every
    rank; the others go on as torch's SGD would without that clock. A
    skip after the clock's update was posted is refused."""
    rule = mlt.UpdateRule("sgd", learning_rate=0.1, momentum=0.5, weight_decay=0.01)
    skipped = {1: {0}, 3: {0, 1}}  # clock -> the workers that skip it
    flags = {2: 0.0, 3: 1.0}  # clock -> worker 1's flag (skip_step(if_set=...), read by the engine)

    def body(worker: mlt.Worker) -> np.ndarray:
        table, read, grad = one_table_loop(worker, rule)
        flag = np.zeros(1, dtype=np.float32)
        for clock in range(5):
            worker.read(read)
            worker.post_read(read)
            if worker.rank == 1 and clock in flags:
                flag[0] = flags[clock]
                worker.skip_step(if_set=flag.ctypes.data)
            elif worker.rank in skipped.get(clock, ()):
                worker.skip_step()
            worker.pre_update(grad)[:] = 1.0 + worker.rank
            worker.update(grad)
            if clock == 4:
                with pytest.raises(mlt.OutOfOrderError, match="after some of its updates were posted"):
                    worker.skip_step()
            worker.clock()
        worker.sync()
        return worker.fetch(table)

    with mlt.LocalCluster(2, mlt.Config(wait_timeout_s=20)) as cluster:
        got = run_workers(body, cluster.workers, on_error=cluster.shutdown)
    buffer, w, steps = 0.0, 0.0, 0
    for clock in range(5):
        if clock in skipped:
            continue
        g = (1.0 + 2.0) / 2 + 0.01 * w  # the mean of the workers' gradients, weight decay as torch adds it
        buffer = g if steps == 0 else 0.5 * buffer + g
        w -= 0.1 * buffer
        steps += 1
    for values in got:
        np.testing.assert_allclose(values, np.full((1, WIDTH), w), rtol=1e-6)
