"""Uneven data splits: a rank that closes the job while another trains on
lends it its later clocks as empty ones (zero updates, as PyTorch DDP's
``Join``), so the other never waits for it; the servers' values are then
those of the ranks' real updates alone, and the close says what happened."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest

import mltuner

from test_wire_security import close, start_pair  # type: ignore[import-not-found]

SHORT, LONG, ROWS, WIDTH = 3, 12, 4, 2


def run_ranks(jobs: list[mltuner.Job], train: Callable[[int], None], errors: list[BaseException]) -> None:
    """``train(rank)`` on a thread per rank; raises the first error it
    recorded in ``errors``; closes the jobs in the end."""
    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a rank hung"
        if errors:
            raise errors[0]
    finally:
        close(jobs)


def value(rank: int, clock: int) -> float:
    return float((rank + 1) * (clock + 1))


def run_clock(worker: mltuner.Worker, read: int, update: int, update_by: float) -> float:
    """One clock of record_read_update's recording: reads (row 0's first
    value is returned), posts, updates every value by ``update_by``."""
    seen = float(np.asarray(worker.read(read))[0, 0])
    worker.post_read(read)
    worker.pre_update(update)[:] = update_by
    worker.update(update)
    worker.clock()
    return seen


def close_ignoring_warnings(job: mltuner.Job) -> None:
    """Closes a rank's job that ended at another clock than the other's
    (its close warns so, which these tests expect)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job.close()


@pytest.mark.parametrize("ending", ["close", "sys.exit(0)"])
@pytest.mark.parametrize("slack", [0, 1])
def test_a_rank_that_closes_early_lends_its_clocks_to_the_one_that_trains_on(
        slack: int, ending: str, record_read_update: Callable[..., tuple[int, int]]) -> None:
    """Rank 0 ends after 3 clocks: by close(), or by sys.exit(0) inside
    ``with job:`` (a clean end too); rank 1 trains 12."""
    jobs = start_pair()  # the add rule: the servers' values are the sums of the updates
    reads: list[float] = []
    elapsed: list[float] = []
    caught: list[warnings.WarningMessage] = []
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            worker = jobs[rank].worker
            table = worker.create_table("t", ROWS, WIDTH)
            read, update = record_read_update(worker, table, slack)
            started = time.monotonic()
            for clock in range(SHORT if rank == 0 else LONG):
                seen = run_clock(worker, read, update, value(rank, clock))
                if rank == 1:
                    reads.append(seen)
            if rank == 1:
                elapsed.append(time.monotonic() - started)
                worker.sync()
                reads.append(float(worker.fetch(table)[0, 0]))
            with warnings.catch_warnings(record=True) as seen_warnings:
                warnings.simplefilter("always")
                if rank == 0 and ending == "sys.exit(0)":
                    try:
                        with jobs[rank]:
                            sys.exit(0)
                    except SystemExit:
                        pass
                else:
                    jobs[rank].close()
            caught.extend(seen_warnings)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    run_ranks(jobs, train, errors)
    # Rank 1's read of clock c sees every update through clock c - 1 - slack
    # at least (its own through c - 1): rank 0's first three, then its own.
    for clock, seen in enumerate(reads[:-1]):
        through = [c for c in range(clock)]
        newest = sum(value(0, c) for c in through if c < SHORT) + sum(value(1, c) for c in through)
        oldest = sum(value(0, c) for c in through[:max(0, clock - slack)] if c < SHORT) + \
            sum(value(1, c) for c in through)
        assert oldest <= seen <= newest, f"clock {clock}: {seen} outside [{oldest}, {newest}]"
    assert reads[-1] == sum(value(0, c) for c in range(SHORT)) + sum(value(1, c) for c in range(LONG))
    # Far within Config.wait_timeout_s (20 s): no clock waited for rank 0.
    assert elapsed[0] < 10.0
    messages = [str(w.message) for w in caught]
    assert any("rank 0 at clock 3, rank 1 at clock 12" in m and "counted its update as zero" in m
               for m in messages), messages


def test_the_rank_that_trains_on_may_change_its_learning_rate(
        record_read_update: Callable[..., tuple[int, int]]) -> None:
    """A schedule goes on after rank 0 closed: rank 1 sets a new rate at
    clock 6. The shards refused it ("the workers set different learning
    rates ... worker 0: none"): the lent clocks carry no rate."""
    lr0, lr1, changed_at = 0.1, 0.05, 6
    jobs = start_pair(rule=mltuner.UpdateRule("sgd", learning_rate=lr0))
    finals: list[np.ndarray] = []
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            worker = jobs[rank].worker
            table = worker.create_table("t", ROWS, WIDTH)
            read, update = record_read_update(worker, table, 0)
            for clock in range(SHORT if rank == 0 else LONG):
                if clock == changed_at:
                    worker.set_learning_rate(table, lr1)
                run_clock(worker, read, update, value(rank, clock))
            if rank == 1:
                worker.sync()
                finals.append(worker.fetch(table))
            close_ignoring_warnings(jobs[rank])
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    run_ranks(jobs, train, errors)
    # The servers' sgd: w -= lr * (the mean of the workers' updates), a lent clock's counted as zero.
    want = -sum((lr0 if c < changed_at else lr1) * (value(1, c) + (value(0, c) if c < SHORT else 0.0)) / 2
                for c in range(LONG))
    np.testing.assert_allclose(finals[0], np.full((ROWS, WIDTH), want), rtol=1e-6)


def test_a_rank_that_closes_during_clocks_on_branches_ends_the_others_wait_within_seconds(
        record_read_update: Callable[..., tuple[int, int]]) -> None:
    """Clocks on branches (a tuning session's) cannot be lent: rank 0 ends
    after 3 clocks, and rank 1's read of clock 4 (slack 0) would wait for
    it until Config.wait_timeout_s (60 s here) and then blame a slow worker.
    The job's wait watcher ends it within seconds, naming the closed rank."""
    jobs = start_pair(wait_timeout_s=60, branches=True)
    failures: list[tuple[int, BaseException, float]] = []
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            worker = jobs[rank].worker
            table = worker.create_table("t", ROWS, WIDTH)
            read, update = record_read_update(worker, table, 0)
            worker.schedule_branch(0, LONG)
            started = time.monotonic()
            try:
                for clock in range(SHORT if rank == 0 else LONG):
                    run_clock(worker, read, update, value(rank, clock))
            except mltuner.MltunerError as error:
                failures.append((rank, error, time.monotonic() - started))
            close_ignoring_warnings(jobs[rank])
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    run_ranks(jobs, train, errors)
    assert [(rank, type(error)) for rank, error, _ in failures] == [(1, mltuner.OutOfOrderError)], failures
    _, error, seconds = failures[0]
    assert "rank 0 closed the job" in str(error) and "tuning session" in str(error), error
    assert seconds < 20.0, seconds


def test_a_collective_call_after_a_rank_closed_fails_at_once(tmp_path, record_read_update) -> None:  # type: ignore[no-untyped-def]
    """A barrier or checkpoint on the rank that trains on, after the other
    closed: an OutOfOrderError naming the closed rank within a second or
    two, not a timeout (Config.wait_timeout_s is 20 s here)."""
    jobs = start_pair()
    failures: list[tuple[str, float, BaseException]] = []
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            worker = jobs[rank].worker
            read, update = record_read_update(worker, worker.create_table("t", ROWS, WIDTH))
            for _ in range(SHORT if rank == 0 else LONG):
                run_clock(worker, read, update, 1.0)
            if rank == 1:
                for name, call in (("barrier", lambda: jobs[1].barrier("after")),
                                   ("save_checkpoint", lambda: jobs[1].save_checkpoint(tmp_path))):
                    started = time.monotonic()
                    try:
                        call()
                    except mltuner.OutOfOrderError as error:
                        failures.append((name, time.monotonic() - started, error))
            close_ignoring_warnings(jobs[rank])
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    run_ranks(jobs, train, errors)
    assert [name for name, _, _ in failures] == ["barrier", "save_checkpoint"]
    for name, seconds, error in failures:
        assert "rank 0 has closed the job" in str(error), name
        assert seconds < 5.0, f"{name} took {seconds:.1f} s"


def test_a_close_that_goes_unanswered_ends_within_its_timeout_while_every_rank_lends(
        record_read_update: Callable[..., tuple[int, int]]) -> None:
    """Every rank in close() lends the others its later clocks, and each
    sees the others' lent clocks as progress. Were that progress to restart
    the close's timeout, a close whose allgather is never answered (here
    rank 0's coordinator drops it) would wait on without end. It ends with
    the timeout's error (no peer was lost: the rank must not end as if the
    job had finished)."""
    jobs = start_pair(wait_timeout_s=2)
    errors: list[BaseException] = []
    try:
        coordinator = jobs[0]._coordinator
        assert coordinator is not None
        answer = coordinator._gather
        coordinator._gather = (  # type: ignore[method-assign]
            lambda routing, rank, name, value: None if name == "close-clocks" else answer(routing, rank, name, value))

        def clock_then_close(job: mltuner.Job) -> None:
            worker = job.worker
            read, update = record_read_update(worker, worker.create_table("t", ROWS, WIDTH))
            for _ in range(2):
                run_clock(worker, read, update, 1.0)
            try:
                job.close()
            except BaseException as error:  # noqa: BLE001 - checked below
                errors.append(error)

        threads = [threading.Thread(target=clock_then_close, args=(job,)) for job in jobs]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "close() waited on past its timeout"
        assert time.monotonic() - started < 15
        assert len(errors) == 2 and all(isinstance(e, mltuner.WaitTimeoutError) for e in errors), errors
    finally:
        close(jobs)
