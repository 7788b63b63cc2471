"""LocalCluster: workers, ranks, shutdown, and the set-up of several workers
each driven from its own thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker


def test_workers_and_ranks() -> None:
    with LocalCluster(3, Config(wait_timeout_s=20)) as cluster:
        assert cluster.num_workers == 3
        assert [w.rank for w in cluster.workers] == [0, 1, 2]
        assert all(w.num_workers == 3 for w in cluster.workers)
        assert all(w.device == "cpu" for w in cluster.workers)
        assert cluster.worker(2) is cluster.workers[2]
        assert cluster.rejected_messages == 0
    with pytest.raises(ValueError, match=r"num_workers must be in \[1, 1024\], got 0"):
        LocalCluster(0)


def test_default_config() -> None:
    with LocalCluster() as cluster:
        assert cluster.num_workers == 1
        assert cluster.config == Config()


def train_counter(worker: Worker, clocks: int, delay_s: float = 0.0) -> np.ndarray:
    """The whole life of a worker on its own thread: tables, virtual iteration,
    barrier, initialisation and `clocks` clocks of adding 1 to its own row."""
    if delay_s:
        time.sleep(delay_s)
    table = worker.create_table("counts", worker.num_workers, 4)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table, [worker.rank])
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.pre_update(update)[...] = 100.0 * (worker.rank + 1)  # initial value of its row
    worker.update(update)
    worker.start_iterations()
    for _ in range(clocks):
        worker.read(read)
        worker.post_read(read)
        worker.pre_update(update)[...] = 1.0
        worker.update(update)
        worker.clock()
    worker.sync()
    return worker.fetch(table)


@pytest.mark.parametrize("late_rank", [0, 1])
def test_workers_set_up_on_their_own_threads(late_rank: int, run_workers: Callable[..., list[Any]]) -> None:
    """The natural way to drive a cluster: each thread runs its worker's whole
    life. One worker starts late (it is still importing, loading data, ...):
    the others' finish_virtual_iteration must wait for it at the barrier, not
    fail because its shard does not know the tables yet."""
    clocks = 5
    with LocalCluster(2, Config(wait_timeout_s=5, update_rule=UpdateRule("add"))) as cluster:
        fns = [
            lambda w, r=rank: train_counter(w, clocks, delay_s=0.3 if r == late_rank else 0.0)
            for rank in range(2)
        ]
        results = run_workers(fns, cluster.workers, timeout_s=30, on_error=cluster.shutdown)
        assert cluster.rejected_messages == 0
    want = np.array([[100.0 + clocks] * 4, [200.0 + clocks] * 4], dtype=np.float32)
    for result in results:
        np.testing.assert_array_equal(result, want)


def test_workers_with_different_tables_are_refused(run_workers: Callable[..., list[Any]]) -> None:
    with LocalCluster(2, Config(wait_timeout_s=1.0)) as cluster:
        for worker, name in zip(cluster.workers, ["alpha", "beta"]):
            table = worker.create_table(name, 4, 4)
            read = worker.virtual_read(table)
            worker.virtual_post_read(read)
            worker.virtual_clock()

        def finish(worker: Worker) -> str:
            with pytest.raises(mltuner.InvalidArgumentError, match="same tables in the same order") as e:
                worker.finish_virtual_iteration()
            return str(e.value)

        messages = run_workers(finish, cluster.workers, timeout_s=20, on_error=cluster.shutdown)
    for message in messages:
        assert "alpha" in message and "beta" in message, message


# -- LocalCluster.run ------------------------------------------------------------------


def test_run_returns_results_by_rank() -> None:
    with LocalCluster(3, Config(wait_timeout_s=20, update_rule=UpdateRule("add"))) as cluster:
        results = cluster.run(lambda w: (w.rank, train_counter(w, 3)), timeout_s=30)
    assert [rank for rank, _ in results] == [0, 1, 2]
    want = np.array([[100.0 * (r + 1) + 3] * 4 for r in range(3)], dtype=np.float32)
    for _, values in results:
        np.testing.assert_array_equal(values, want)


def test_run_reraises_a_worker_error() -> None:
    class Boom(Exception):
        pass

    def fn(worker: Worker) -> int:
        if worker.rank == 1:
            raise Boom(f"worker {worker.rank} failed")
        return worker.rank

    with LocalCluster(2, Config(wait_timeout_s=20)) as cluster:
        with pytest.raises(Boom, match="worker 1 failed"):
            cluster.run(fn, timeout_s=10)


def start_one_read(worker: Worker) -> int:
    """Records a clock of one read of a small table, starts the iterations,
    and returns the read's handle."""
    read = worker.virtual_read(worker.create_table("t", 2, 4))
    worker.virtual_post_read(read)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    return read


def test_run_reraises_the_cause_before_the_timeouts_it_caused() -> None:
    """Worker 1 fails before its first clock; worker 0, rank first, times
    out waiting for its rows. The cause is raised, the timeout a note."""

    class Boom(Exception):
        pass

    def fn(worker: Worker) -> None:
        read = start_one_read(worker)
        if worker.rank == 1:
            raise Boom("worker 1 failed")
        for _ in range(2):
            worker.read(read)
            worker.post_read(read)
            worker.clock()

    with LocalCluster(2, Config(wait_timeout_s=1)) as cluster:
        with pytest.raises(Boom, match="worker 1 failed") as raised:
            cluster.run(fn, timeout_s=10)
    notes = getattr(raised.value, "__notes__", [])
    assert any("worker 0 also failed: WaitTimeoutError" in note for note in notes), notes


def test_run_shuts_a_stuck_cluster_down() -> None:
    """Worker 0 never clocks, so worker 1 blocks in its read at clock 1 (its
    wait_timeout_s is far away): run gives up after timeout_s, shuts the
    cluster down, which releases the blocked read, and raises."""
    with LocalCluster(2, Config(wait_timeout_s=20)) as cluster:
        released: list[BaseException] = []

        def fn(worker: Worker) -> None:
            read = start_one_read(worker)
            if worker.rank == 0:
                return
            worker.read(read)
            worker.post_read(read)
            worker.clock()
            try:
                worker.read(read)  # needs worker 0's clock 0: never comes
            except mltuner.ShutdownError as error:
                released.append(error)
                raise

        start = time.monotonic()
        with pytest.raises(mltuner.WaitTimeoutError, match="mltuner-worker-1"):
            cluster.run(fn, timeout_s=1.0)
        assert time.monotonic() - start < 10
        assert len(released) == 1, "the blocked read was not released by the shutdown"


def test_shutdown_from_several_threads_at_once_returns_on_each() -> None:
    # Each worker's thread shutting the cluster down on its error: two
    # joined one hub thread, and one of them waited forever.
    import threading

    for _ in range(5):
        cluster = LocalCluster(2, Config(wait_timeout_s=10))
        errors: list[BaseException] = []

        def stop() -> None:
            try:
                cluster.shutdown()
            except BaseException as error:  # noqa: BLE001 - checked below
                errors.append(error)

        threads = [threading.Thread(target=stop) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert not any(thread.is_alive() for thread in threads), "a shutdown call hung"
        assert errors == []
