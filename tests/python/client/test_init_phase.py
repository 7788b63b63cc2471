"""The initialisation phase, between finish_virtual_iteration and
start_iterations: real calls with the recorded handles run synchronously and in
any order; reads show the servers' values and updates add to them directly,
without the update rule."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker

ROWS, WIDTH = 6, 5
# A rule that would visibly change the values if init adds went through it.
RULE = UpdateRule("sgd", learning_rate=0.5)


def record(worker: Worker) -> dict[str, Any]:
    table = worker.create_table("w", ROWS, WIDTH)
    local = worker.create_table("scratch", 3, WIDTH, local=True)
    h: dict[str, Any] = {"table": table, "local": local}
    h["read"] = worker.virtual_read(table)
    h["read_some"] = worker.virtual_read(table, [4, 1])
    worker.virtual_post_read(h["read_some"])
    h["update"] = worker.virtual_pre_update(table)
    worker.virtual_update(h["update"])
    worker.virtual_post_read(h["read"])
    h["update_some"] = worker.virtual_pre_update(table, [5, 0, 2])
    worker.virtual_update(h["update_some"])
    h["local_access"] = worker.virtual_local_access(local)
    worker.virtual_post_local_access(h["local_access"])
    worker.virtual_clock()
    return h


def run_one_clock(worker: Worker, h: dict[str, Any]) -> np.ndarray:
    """Runs clock 0 with no updates; returns what its read showed."""
    values = worker.read(h["read"]).copy()
    worker.read(h["read_some"])
    worker.post_read(h["read_some"])
    worker.pre_update(h["update"])
    worker.update(h["update"])
    worker.post_read(h["read"])
    worker.pre_update(h["update_some"])
    worker.update(h["update_some"])
    worker.local_access(h["local_access"])
    worker.post_local_access(h["local_access"])
    worker.clock()
    return values


def test_init_accesses_in_any_order(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    rng = np.random.default_rng(21)
    a = nonzero_uniform(rng, (ROWS, WIDTH))
    b = nonzero_uniform(rng, (3, WIDTH))
    scratch = nonzero_uniform(rng, (3, WIDTH))
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=RULE)) as cluster:
        worker = cluster.workers[0]
        h = record(worker)
        worker.finish_virtual_iteration()

        # Reverse of the recorded order, with several accesses open at once.
        local = worker.local_access(h["local_access"])
        some = worker.pre_update(h["update_some"])
        assert np.all(some == 0) and some.shape == (3, WIDTH)
        values = worker.read(h["read"])
        assert np.all(values == 0)  # tables start at zero
        worker.post_read(h["read"])
        some[...] = b
        worker.update(h["update_some"])
        local[...] = scratch
        worker.post_local_access(h["local_access"])

        expected = np.zeros((ROWS, WIDTH), np.float32)
        expected[[5, 0, 2]] += b
        np.testing.assert_array_equal(worker.read(h["read"]), expected)  # read after add shows it
        worker.post_read(h["read"])

        full = worker.pre_update(h["update"])
        full[...] = a
        np.testing.assert_array_equal(worker.read(h["read_some"]), expected[[4, 1]])  # not added before update
        worker.update(h["update"])
        worker.post_read(h["read_some"])
        expected = expected + a  # init adds bypass the sgd rule
        np.testing.assert_array_equal(worker.read(h["read_some"]), expected[[4, 1]])
        worker.post_read(h["read_some"])
        np.testing.assert_array_equal(worker.fetch(h["table"]), expected)
        np.testing.assert_array_equal(worker.local_access(h["local_access"]), scratch)
        worker.post_local_access(h["local_access"])

        worker.start_iterations()
        np.testing.assert_array_equal(run_one_clock(worker, h), expected)


def test_pre_update_buffers_are_zeroed(nonzero_uniform: Callable[..., np.ndarray]) -> None:
    rng = np.random.default_rng(22)
    with LocalCluster(1, Config(wait_timeout_s=20, update_rule=UpdateRule("add"))) as cluster:
        worker = cluster.workers[0]
        h = record(worker)
        worker.finish_virtual_iteration()
        total = np.zeros((ROWS, WIDTH), np.float32)
        for _ in range(3):
            buffer = worker.pre_update(h["update"])
            assert np.all(buffer == 0), "the previous init update leaked into a new buffer"
            value = nonzero_uniform(rng, (ROWS, WIDTH))
            buffer[...] = value
            total = total + value
            worker.update(h["update"])
        np.testing.assert_array_equal(worker.fetch(h["table"]), total)
        worker.start_iterations()
        # In the iterations too: every clock's update buffer starts zeroed.
        for c in range(4):
            np.testing.assert_allclose(worker.read(h["read"]), total, rtol=1e-6, atol=1e-6)
            worker.read(h["read_some"])
            worker.post_read(h["read_some"])
            buffer = worker.pre_update(h["update"])
            assert np.all(buffer == 0), f"clock {c}: update buffer not zeroed"
            value = nonzero_uniform(rng, (ROWS, WIDTH))
            buffer[...] = value
            total = total + value
            worker.update(h["update"])
            worker.post_read(h["read"])
            buffer = worker.pre_update(h["update_some"])
            assert np.all(buffer == 0), f"clock {c}: update buffer not zeroed"
            buffer[...] = 7.0  # garbage the next clock's buffer must not show
            total[[5, 0, 2]] += 7.0
            worker.update(h["update_some"])
            worker.local_access(h["local_access"])
            worker.post_local_access(h["local_access"])
            worker.clock()
        worker.sync()
        # (float32 adds grouped differently from the engine's: rounding only)
        np.testing.assert_allclose(worker.fetch(h["table"]), total, rtol=1e-6, atol=1e-6)


def test_init_adds_from_several_workers_sum(
    run_workers: Callable[..., list[Any]], nonzero_uniform: Callable[..., np.ndarray]
) -> None:
    num_workers = 3
    rng = np.random.default_rng(23)
    adds = [nonzero_uniform(rng, (ROWS, WIDTH)) for _ in range(num_workers)]
    adds_some = [nonzero_uniform(rng, (3, WIDTH)) for _ in range(num_workers)]
    expected = np.sum(np.stack(adds), axis=0, dtype=np.float64)
    expected[[5, 0, 2]] += np.sum(np.stack(adds_some), axis=0, dtype=np.float64)
    all_added = threading.Barrier(num_workers, timeout=20)

    with LocalCluster(num_workers, Config(wait_timeout_s=20, update_rule=RULE)) as cluster:
        handles = [record(worker) for worker in cluster.workers]

        def body(worker: Worker) -> dict[str, np.ndarray]:
            h, r = handles[worker.rank], worker.rank
            worker.finish_virtual_iteration()
            # Workers add in different orders.
            order = ["update", "update_some"] if r % 2 == 0 else ["update_some", "update"]
            for name in order:
                buffer = worker.pre_update(h[name])
                buffer[...] = adds[r] if name == "update" else adds_some[r]
                worker.update(h[name])
            all_added.wait()
            in_init = worker.read(h["read"]).copy()
            worker.post_read(h["read"])
            worker.start_iterations()
            first = run_one_clock(worker, h)
            worker.sync()
            return {"init": in_init, "first": first, "fetch": worker.fetch(h["table"])}

        results = run_workers(body, cluster.workers, on_error=cluster.shutdown)

    for r, result in enumerate(results):
        # float32 sums in some order: equal to the float64 sum within rounding.
        for key in ("init", "first", "fetch"):
            np.testing.assert_allclose(result[key], expected, rtol=1e-6, atol=1e-6, err_msg=f"worker {r} {key}")
        # Every worker sees the very same values.
        np.testing.assert_array_equal(result["init"], results[0]["init"])
        np.testing.assert_array_equal(result["first"], results[0]["first"])
    # Clock 0 applied nothing (all-zero updates through sgd), so it is unchanged.
    np.testing.assert_array_equal(results[0]["fetch"], results[0]["first"])


def test_double_open_and_post_of_closed_handle() -> None:
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        h = record(worker)
        worker.finish_virtual_iteration()
        worker.read(h["read"])
        with pytest.raises(mltuner.OutOfOrderError, match=r"handle 0 \(read of table 'w'.*is already open"):
            worker.read(h["read"])
        worker.post_read(h["read"])
        with pytest.raises(mltuner.OutOfOrderError, match=r"handle 0 \(read of table 'w'.*is not open"):
            worker.post_read(h["read"])
        worker.local_access(h["local_access"])
        with pytest.raises(mltuner.OutOfOrderError, match="'scratch'.*already open"):
            worker.local_access(h["local_access"])
        worker.post_local_access(h["local_access"])
        # Reopening after the post is fine.
        worker.read(h["read"])
        worker.post_read(h["read"])
        worker.start_iterations()
        run_one_clock(worker, h)


def test_write_initial_adds_as_pre_update_and_update_do(
    run_workers: Callable[..., list[Any]], nonzero_uniform: Callable[..., np.ndarray]
) -> None:
    """write_initial from host memory gives the values that writing the
    pre_update buffer and posting it gives, rows in the access's order, on
    both shards."""
    rng = np.random.default_rng(24)
    whole = nonzero_uniform(rng, (ROWS, WIDTH))
    some = nonzero_uniform(rng, (3, WIDTH))
    results = []
    for direct in (False, True):
        with LocalCluster(2, Config(wait_timeout_s=20, update_rule=RULE)) as cluster:
            handles = [record(worker) for worker in cluster.workers]

            def body(worker: Worker) -> np.ndarray:
                h = handles[worker.rank]
                worker.finish_virtual_iteration()
                if worker.rank == 0:
                    for name, values in (("update", whole), ("update_some", some)):
                        if direct:
                            worker.write_initial(h[name], values)
                        else:
                            worker.pre_update(h[name])[...] = values
                            worker.update(h[name])
                worker.start_iterations()
                return worker.fetch(h["table"])

            results.append(run_workers(body, cluster.workers, on_error=cluster.shutdown)[0])
    expected = whole.copy()
    expected[[5, 0, 2]] += some
    np.testing.assert_array_equal(results[0], expected)
    np.testing.assert_array_equal(results[1], results[0])


def test_write_initial_refuses_what_it_cannot_take() -> None:
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        h = record(worker)
        values = np.zeros((ROWS, WIDTH), np.float32)
        with pytest.raises(mltuner.OutOfOrderError, match="outside the initialisation phase"):
            worker.write_initial(h["update"], values)
        worker.finish_virtual_iteration()
        with pytest.raises(mltuner.InvalidArgumentError, match="recorded as a read.*takes an update's handle"):
            worker.write_initial(h["read"], values)
        with pytest.raises(mltuner.InvalidArgumentError, match="got 5 values; its rows hold 30"):
            worker.write_initial(h["update"], values[:1].reshape(-1))
        with pytest.raises(mltuner.InvalidArgumentError, match=r"values of shape \(1, 5\) .*whose rows are \(6, 5\)"):
            worker.write_initial(h["update"], values[:1])
        with pytest.raises(mltuner.ArgumentTypeError, match="float32 numpy array, got an array of float64"):
            worker.write_initial(h["update"], values.astype(np.float64))
        with pytest.raises(mltuner.ArgumentTypeError, match="got list"):
            worker.write_initial(h["update"], [0.0] * 30)  # type: ignore[arg-type]
        with pytest.raises(mltuner.NotFoundError, match="unknown handle 99"):
            worker.write_initial(99, values)
        worker.pre_update(h["update"])
        with pytest.raises(mltuner.OutOfOrderError, match="is open: post it"):
            worker.write_initial(h["update"], values)
        worker.update(h["update"])
        worker.write_initial(h["update"], values)  # posted: fine again
        worker.start_iterations()
        with pytest.raises(mltuner.OutOfOrderError, match="outside the initialisation phase"):
            worker.write_initial(h["update"], values)
        run_one_clock(worker, h)
