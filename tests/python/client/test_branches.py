"""Branches in the parameter server (mltuner.md §3): fork, free, schedule.

Two workers train linear regression with the server-side SGD rule. The
schedule switches between a training branch forked with another learning
rate, an evaluation branch that must never change, and the original branch.
Reference: per-branch sequential float64 SGD over the same batches, each
branch starting from its parent's parameters at the fork. Every read under
BSP must show exactly its branch's reference parameters at that point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker

IN, OUT, BATCH, N = 6, 3, 5, 2
LR0, LR1 = 0.05, 0.2
# (branch, clocks) blocks after the first 4 clocks on branch 0.
SCHEDULE = [(0, 4), (1, 3), (2, 2), (0, 2), (1, 2)]
CLOCKS = sum(count for _, count in SCHEDULE)


def batches() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(CLOCKS, N, BATCH, IN))
    y = x @ rng.normal(size=(IN, OUT)) + 0.1 * rng.normal(size=(CLOCKS, N, BATCH, OUT))
    w0 = rng.uniform(-1, 1, size=(IN, OUT)).astype(np.float32)
    return x, y, w0


def reference() -> tuple[dict[int, np.ndarray], list[np.ndarray]]:
    """Each branch's final weights, and the weights every clock's read must see."""
    x, y, w0 = batches()
    weights = {0: w0.astype(np.float64)}
    rates = {0: LR0}
    seen = []
    clock = 0
    for branch, count in SCHEDULE:
        if branch not in weights:  # forked from branch 0 as it is now
            weights[branch] = weights[0].copy()
            rates[branch] = LR1 if branch == 1 else 0.0
        for _ in range(count):
            w = weights[branch]
            seen.append(w.copy())
            xs, ys = x[clock].reshape(N * BATCH, IN), y[clock].reshape(N * BATCH, OUT)
            weights[branch] = w - rates[branch] * xs.T @ (xs @ w - ys) / len(xs)
            clock += 1
    return weights, seen


def started(worker: Worker, rows: int, width: int, initial: np.ndarray | float) -> tuple[Any, int, int]:
    """A table of ``rows`` x ``width``, one clock that reads and updates it,
    rank 0's ``initial`` values written, iterations started: the table and
    the read's and update's handles."""
    table = worker.create_table("w", rows, width)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table)
    worker.virtual_update(update)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    if worker.rank == 0:
        worker.pre_update(update)[:] = initial
        worker.update(update)
    worker.start_iterations()
    return table, read, update


def train(worker: Worker) -> tuple[dict[int, np.ndarray], list[np.ndarray]]:
    x, y, w0 = batches()
    table, read, grad = started(worker, IN, OUT, w0)
    seen = []
    clock = 0
    for branch, count in SCHEDULE:
        if branch == 1 and clock == 4:
            worker.fork_branch(1, 0, learning_rate=LR1)
            worker.fork_branch(2, 0, learning_rate=LR0, training=False)
        worker.schedule_branch(branch, count)
        for _ in range(count):
            w = np.asarray(worker.read(read), dtype=np.float64)
            seen.append(w.copy())
            worker.post_read(read)
            xs, ys = x[clock, worker.rank], y[clock, worker.rank]
            worker.pre_update(grad)[:] = xs.T @ (xs @ w - ys) / len(xs)
            worker.update(grad)
            worker.clock()
            clock += 1
        assert worker.branch == branch
        worker.sync()
    finals = {b: worker.fetch(table, branch=b).astype(np.float64) for b in (0, 1, 2)}
    worker.free_branch(2)
    # The shards refuse it with the code the branch calls raise.
    with pytest.raises(mltuner.NotFoundError, match="unknown or freed branch"):
        worker.fetch(table, branch=2)
    return finals, seen


# A row is 12 bytes: parts of one row split each shard's 3 rows into 3, so
# forks, switches and the branch rows a switch asks for go part by part.
@pytest.mark.parametrize("part_bytes", [None, 12], ids=["whole", "parts"])
def test_branches_follow_their_own_sequential_reference(run_workers: Callable[..., list[Any]],
                                                        part_bytes: int | None) -> None:
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR0), branches=True, wait_timeout_s=20,
                    clock_part_bytes=part_bytes)
    with LocalCluster(N, config) as cluster:
        results = run_workers(train, cluster.workers, on_error=cluster.shutdown)
        switches = cluster.worker(0).stats["branch_switches"]
    want_finals, want_seen = reference()
    for finals, seen in results:
        for branch in (0, 1, 2):
            np.testing.assert_allclose(finals[branch], want_finals[branch], rtol=1e-5, atol=1e-6)
        for clock, (got, want) in enumerate(zip(seen, want_seen)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"read at clock {clock}")
    # The evaluation branch never moved from the fork point: it holds exactly
    # what the first read of branch 1 (forked at the same point) saw.
    np.testing.assert_array_equal(results[0][0][2], results[0][1][4])
    assert switches == len(SCHEDULE) - 1


def test_branch_errors(run_workers: Callable[..., list[Any]]) -> None:
    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR0), branches=True, max_branches=2,
                    wait_timeout_s=10)

    def body(worker: Worker) -> None:
        table = worker.create_table("w", 4, 2)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        with pytest.raises(mltuner.OutOfOrderError, match="before start_iterations"):
            worker.fork_branch(1, 0, learning_rate=0.1)
        worker.start_iterations()
        with pytest.raises(mltuner.OutOfOrderError, match="not scheduled"):
            worker.pre_update(update)
        with pytest.raises(mltuner.NotFoundError, match="does not exist"):
            worker.schedule_branch(5, 1)
        with pytest.raises(mltuner.NotFoundError):
            worker.fork_branch(1, 9, learning_rate=0.1)
        worker.fork_branch(1, 0, learning_rate=0.1)
        with pytest.raises(mltuner.ResourceExhaustedError, match="limit is 2"):
            worker.fork_branch(2, 0, learning_rate=0.1)
        with pytest.raises(mltuner.InvalidArgumentError):
            worker.fork_branch(1, 0, learning_rate=0.1)
        worker.schedule_branch(1, 1)
        with pytest.raises(mltuner.OutOfOrderError, match="scheduled for clock 0"):
            worker.free_branch(1)
        worker.pre_update(update)
        worker.update(update)
        worker.clock()
        worker.free_branch(1)

    with LocalCluster(2, config) as cluster:
        run_workers(body, cluster.workers, on_error=cluster.shutdown)


def test_branch_calls_need_branches_on() -> None:
    with LocalCluster(1, Config()) as cluster:
        worker = cluster.worker(0)
        worker.create_table("w", 2, 2)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        with pytest.raises(mltuner.OutOfOrderError, match="Config.branches"):
            worker.schedule_branch(0, 1)


@pytest.mark.parametrize("pause_s", [0.0, 0.3])
def test_sync_after_scheduling_another_branch_is_refused_whatever_the_timing(
        pause_s: float, record_read_update: Callable[..., tuple[int, int]]) -> None:
    """Once the next clock is scheduled on another branch the allocator may
    switch the cache to it at any moment: sync() was refused or not by that
    race. Now it is refused always, and works again after the branch's clock."""
    import time

    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=0.1), branches=True,
                                wait_timeout_s=5)) as cluster:
        worker = cluster.worker(0)
        read, update = record_read_update(worker, worker.create_table("w", 4, 3))

        def clock() -> None:
            worker.read(read)
            worker.post_read(read)
            worker.pre_update(update)[...] = 1
            worker.update(update)
            worker.clock()

        worker.schedule_branch(0, 1)
        clock()
        worker.fork_branch(1, 0, learning_rate=0.1)
        worker.schedule_branch(1, 1)
        clock()
        worker.sync()  # the next clock is not scheduled yet
        worker.schedule_branch(0, 1)
        time.sleep(pause_s)  # long enough for the allocator to switch the cache, or not
        with pytest.raises(mltuner.OutOfOrderError, match="next clock is scheduled on branch 0.*not branch 1"):
            worker.sync()
        clock()
        worker.sync()


def test_an_id_of_a_freed_branch_forked_again_is_a_new_branch(run_workers: Callable[..., list[Any]]) -> None:
    """Branch 1 trains 3 clocks and is freed while the cache holds it; a new
    branch 1 forked from branch 0 must read branch 0's values and count its
    clocks from 0 (the cache kept the freed branch's rows and ages, and its
    schedule continued the old one's clocks: the shards refused clock 3)."""
    def run(worker: Worker) -> list[np.ndarray]:
        _, read, update = started(worker, 2, 3, 1.0)
        seen = []
        for _ in range(2):  # the same id twice: forked, trained 3 clocks, freed
            worker.fork_branch(1, 0, learning_rate=1.0)
            worker.schedule_branch(1, 3)
            for _ in range(3):
                seen.append(np.array(worker.read(read), dtype=np.float64))
                worker.post_read(read)
                worker.pre_update(update)[:] = 1.0  # the mean of the workers: the branch loses 1 a clock
                worker.update(update)
                worker.clock()
            worker.free_branch(1)
        return seen

    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR0), branches=True, wait_timeout_s=20)
    with LocalCluster(N, config) as cluster:
        results = run_workers(run, cluster.workers, on_error=cluster.shutdown)
    want = [np.full((2, 3), 1.0 - c) for c in range(3)] * 2
    for seen in results:
        for clock, (got, expected) in enumerate(zip(seen, want)):
            np.testing.assert_array_equal(got, expected, err_msg=f"read {clock}")


def test_clocks_nobody_scheduled_run_on_the_trained_branch(run_workers: Callable[..., list[Any]]) -> None:
    """After a tuning session (Worker.set_trained) the loop's further clocks
    run on its final branch, until a schedule says otherwise; once the
    branch is freed, a clock nobody scheduled is refused again."""
    def run(worker: Worker) -> list[tuple[int, float]]:
        _, read, update = started(worker, 2, 3, 1.0)
        seen = []

        def clock() -> None:
            seen.append((worker.branch, float(np.asarray(worker.read(read))[0, 0])))
            worker.post_read(read)
            worker.pre_update(update)[:] = 1.0  # the mean of the workers: lr x 1 a clock
            worker.update(update)
            worker.clock()

        with pytest.raises(mltuner.OutOfOrderError, match="not scheduled on any branch"):
            worker.read(read)
        worker.fork_branch(1, 0, learning_rate=1.0)
        worker.schedule_branch(1, 2)
        clock(), clock()
        worker.set_trained(1, {"lr": 1.0})
        clock(), clock()  # nobody scheduled them: the trained branch's
        worker.schedule_branch(0, 1)
        clock()
        clock()  # the trained branch's again
        worker.free_branch(1)
        with pytest.raises(mltuner.OutOfOrderError, match="not scheduled on any branch"):
            worker.read(read)
        seen.append((worker.branch, 0.0))
        return seen

    config = Config(update_rule=UpdateRule("sgd", learning_rate=LR0), branches=True, wait_timeout_s=20)
    with LocalCluster(N, config) as cluster:
        results = run_workers(run, cluster.workers, on_error=cluster.shutdown)
    # (the branch of the clock finished before each read, the read's value)
    want = [(0, 1.0), (1, 0.0), (1, -1.0), (1, -2.0), (1, 1.0), (0, -3.0), (1, 0.0)]
    for seen in results:
        assert seen == want


@pytest.mark.parametrize("workers", [1, 2])
def test_a_branch_read_again_after_another_in_parts_holds_only_its_rows(
        workers: int, run_workers: Callable[..., list[Any]]) -> None:
    """Clocks on branches 1, 0, 1, ..., a clock's rows in parts (12 bytes:
    one row each). Parts of branch 1's push that came while the cache held
    branch 0 were dropped; its late last part then set the shard's data age,
    so the branch's own rows, requested at the switch back, were dropped as
    not newer: a third of the reads held branch 0's or older rows."""
    rows, width, rounds, lr = 5, 3, 20, 0.1

    def run(worker: Worker) -> list[tuple[int, int, float]]:
        start = np.arange(rows * width, dtype=np.float32).reshape(rows, width) / 10
        _, read, update = started(worker, rows, width, start)
        worker.fork_branch(1, 0)
        want = {0: start.astype(np.float64), 1: start.astype(np.float64)}
        wrong = []
        for round_ in range(rounds):
            for branch in (1, 0, 1):
                worker.schedule_branch(branch, 1)
            for branch in (1, 0, 1):
                got = np.array(worker.read(read), dtype=np.float64)
                worker.post_read(read)
                if not np.allclose(got, want[branch], rtol=1e-5, atol=1e-5):
                    wrong.append((round_, branch, float(np.abs(got - want[branch]).max())))
                worker.pre_update(update)[:] = 1.0
                worker.update(update)
                worker.clock()
                want[branch] = want[branch] - lr
        return wrong

    config = Config(update_rule=UpdateRule("sgd", learning_rate=lr), branches=True, wait_timeout_s=20,
                    clock_part_bytes=12)
    with LocalCluster(workers, config) as cluster:
        results = run_workers(run, cluster.workers, on_error=cluster.shutdown)
    assert results == [[]] * workers
