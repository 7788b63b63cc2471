"""Mistakes raise the right exception class, with a message that names the
table, handle or op at fault, and do not break the engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, Worker


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(1, Config(wait_timeout_s=20)) as c:
        yield c


@pytest.fixture
def worker(cluster: LocalCluster) -> Worker:
    return cluster.workers[0]


def record_simple(worker: Worker, name: str = "t") -> tuple[Any, int, int]:
    """One table of 4 x 4; the iteration reads it and updates rows 1, 2."""
    table = worker.create_table(name, 4, 4)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    update = worker.virtual_pre_update(table, [1, 2])
    worker.virtual_update(update)
    worker.virtual_clock()
    return table, read, update


# -- rows and arguments of the virtual iteration --------------------------------


def test_row_out_of_range(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match=r"row 4 is outside table 'weights' \(rows 0..3\)") as e:
        worker.virtual_read(table, [0, 4])
    assert isinstance(e.value, ValueError)
    with pytest.raises(mltuner.InvalidArgumentError, match=r"row -1 is outside table 'weights'"):
        worker.virtual_pre_update(table, [-1, 2])
    with pytest.raises(mltuner.InvalidArgumentError, match="row 7 is outside table 'weights'"):
        worker.fetch(table, [7])


def test_duplicate_rows(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match="row 2 appears twice in one access to table 'weights'"):
        worker.virtual_read(table, [2, 0, 2])
    with pytest.raises(mltuner.InvalidArgumentError, match="'weights'"):
        worker.fetch(table, [1, 1])


def test_no_rows(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match="access to table 'weights' names no rows"):
        worker.virtual_read(table, np.array([], dtype=np.int64))


def test_float_and_bool_row_ids(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(TypeError, match="row ids for table 'weights' must be integers.*float64"):
        worker.virtual_read(table, [0.0, 1.0])
    with pytest.raises(TypeError, match="'weights'.*bool"):
        worker.virtual_pre_update(table, np.array([True, False]))


def test_two_dimensional_rows(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(ValueError, match=r"row ids for table 'weights' must be 1-D, got shape \(2, 1\)"):
        worker.virtual_read(table, [[0], [1]])


def test_slack_out_of_range(worker: Worker) -> None:
    table = worker.create_table("weights", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match=r"slack must be in \[0, 2\*\*31 - 1\], got -1"):
        worker.virtual_read(table, slack=-1)
    with pytest.raises(mltuner.InvalidArgumentError, match="slack 1001 is above the maximum of 1000"):
        worker.virtual_read(table, slack=1001)


def test_not_a_table(worker: Worker) -> None:
    # Worker._rows raises this TypeError for anything but a Table; the access
    # methods must reach that check instead of failing on `table.id` first.
    with pytest.raises(TypeError, match="expected a Table, got int"):
        worker.fetch(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a Table, got int"):
        worker.virtual_read(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a Table, got str"):
        worker.virtual_pre_update("weights")  # type: ignore[arg-type]


def test_table_of_another_cluster(worker: Worker) -> None:
    worker.create_table("mine", 4, 4)
    with LocalCluster(1, Config(wait_timeout_s=20)) as other:
        theirs = other.workers[0].create_table("theirs", 4, 4)
        with pytest.raises(LookupError, match="table 'theirs' does not belong to worker 0"):
            worker.virtual_read(theirs)
        with pytest.raises(LookupError, match="'theirs'"):
            worker.fetch(theirs)


# -- handles -------------------------------------------------------------------------


def test_unknown_handle(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    read = worker.virtual_read(table)
    with pytest.raises(mltuner.NotFoundError, match="unknown handle 99") as e:
        worker.virtual_post_read(99)
    assert isinstance(e.value, LookupError)
    with pytest.raises(mltuner.NotFoundError, match="unknown handle -1"):
        worker.virtual_update(-1)
    worker.virtual_post_read(read)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    with pytest.raises(mltuner.NotFoundError, match=r"unknown handle 5 in read \(the virtual iteration recorded 1 handles\)"):
        worker.read(5)
    worker.start_iterations()
    with pytest.raises(mltuner.NotFoundError, match="unknown handle 5 in post_read"):
        worker.post_read(5)


def test_post_of_the_wrong_kind(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    read = worker.virtual_read(table)
    update = worker.virtual_pre_update(table, [1, 2])
    with pytest.raises(
        mltuner.InvalidArgumentError, match=rf"post_read of handle {update}, which is a pre_update of table 't'.*expected update"
    ):
        worker.virtual_post_read(update)
    with pytest.raises(mltuner.InvalidArgumentError, match=rf"update of handle {read}, which is a read of table 't'"):
        worker.virtual_update(read)
    with pytest.raises(mltuner.InvalidArgumentError, match=rf"handle {read}, which is a read of table 't'"):
        worker.virtual_post_local_access(read)
    worker.virtual_update(update)
    worker.virtual_post_read(read)
    worker.virtual_clock()
    worker.finish_virtual_iteration()
    worker.start_iterations()
    worker.read(read)
    with pytest.raises(
        mltuner.InvalidArgumentError, match=rf"post_read of handle {update}, which was recorded as a pre_update.*closed by update"
    ):
        worker.post_read(update)
    with pytest.raises(mltuner.InvalidArgumentError, match=rf"pre_update of handle {read}, which was recorded as a read"):
        worker.pre_update(read)


def test_double_virtual_post(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    with pytest.raises(mltuner.OutOfOrderError, match=f"handle {read} was already posted") as e:
        worker.virtual_post_read(read)
    assert isinstance(e.value, RuntimeError)


# -- phases ---------------------------------------------------------------------------


def test_virtual_op_after_virtual_clock(worker: Worker) -> None:
    table, read, _ = record_simple(worker)
    with pytest.raises(mltuner.OutOfOrderError, match="virtual read after the virtual clock"):
        worker.virtual_read(table)
    with pytest.raises(mltuner.OutOfOrderError, match="virtual post_read after the virtual clock"):
        worker.virtual_post_read(read)
    with pytest.raises(mltuner.OutOfOrderError, match="already has its clock"):
        worker.virtual_clock()


def test_virtual_clock_with_open_handles(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    worker.virtual_read(table)
    with pytest.raises(mltuner.OutOfOrderError, match=r"handles still open: read of table 't' \(handle 0, 4 rows\)"):
        worker.virtual_clock()


def test_finish_without_clock(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    read = worker.virtual_read(table)
    worker.virtual_post_read(read)
    with pytest.raises(mltuner.OutOfOrderError, match="finish_virtual_iteration before the virtual clock"):
        worker.finish_virtual_iteration()


def test_real_calls_before_finish(worker: Worker) -> None:
    _, read, update = record_simple(worker)
    with pytest.raises(mltuner.OutOfOrderError, match="read before finish_virtual_iteration"):
        worker.read(read)
    with pytest.raises(mltuner.OutOfOrderError, match="pre_update before finish_virtual_iteration"):
        worker.pre_update(update)
    with pytest.raises(mltuner.OutOfOrderError, match="update before finish_virtual_iteration"):
        worker.update(update)
    with pytest.raises(mltuner.OutOfOrderError, match="start_iterations before finish_virtual_iteration"):
        worker.start_iterations()


def test_clock_before_start_iterations(worker: Worker) -> None:
    record_simple(worker)
    with pytest.raises(mltuner.OutOfOrderError, match=r"clock\(\) before start_iterations"):
        worker.clock()
    worker.finish_virtual_iteration()
    with pytest.raises(mltuner.OutOfOrderError, match=r"clock\(\) before start_iterations"):
        worker.clock()


def test_virtual_calls_after_finish(worker: Worker) -> None:
    table, read, _ = record_simple(worker)
    worker.finish_virtual_iteration()
    with pytest.raises(mltuner.OutOfOrderError, match="virtual_read after finish_virtual_iteration"):
        worker.virtual_read(table)
    with pytest.raises(mltuner.OutOfOrderError, match="virtual_post_read after finish_virtual_iteration"):
        worker.virtual_post_read(read)
    with pytest.raises(mltuner.OutOfOrderError, match="finish_virtual_iteration was already called"):
        worker.finish_virtual_iteration()


def test_out_of_order_call_after_start_names_the_expected_op(worker: Worker) -> None:
    table, read, update = record_simple(worker)
    worker.finish_virtual_iteration()
    worker.start_iterations()
    with pytest.raises(
        mltuner.OutOfOrderError,
        match=rf"called pre_update\(handle {update}\) but the recorded iteration expects "
        rf"read\(handle {read}: read of table 't' \(handle {read}, 4 rows\)\) as op 0 of clock 0",
    ):
        worker.pre_update(update)
    with pytest.raises(mltuner.OutOfOrderError, match=r"called clock\(\) but the recorded iteration expects read"):
        worker.clock()
    worker.read(read)
    with pytest.raises(mltuner.OutOfOrderError, match=rf"expects post_read\(handle {read}.*as op 1 of clock 0"):
        worker.update(update)
    worker.post_read(read)
    worker.pre_update(update)
    worker.update(update)
    with pytest.raises(mltuner.OutOfOrderError, match=r"expects clock\(\) as op 4 of clock 0"):
        worker.read(read)
    worker.clock()
    # The mistakes left the engine working: clock 1 runs normally.
    assert worker.read(read).shape == (4, 4)
    with pytest.raises(mltuner.OutOfOrderError, match="of clock 1"):
        worker.read(read)
    worker.post_read(read)


def test_read_buffers_are_read_only(worker: Worker) -> None:
    _, read, update = record_simple(worker)
    worker.finish_virtual_iteration()
    init = worker.read(read)
    with pytest.raises(ValueError, match="read-only"):
        init[0, 0] = 1.0
    worker.post_read(read)
    worker.start_iterations()
    values = worker.read(read)
    assert not values.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        values[...] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        np.add(values, 1.0, out=values)
    worker.post_read(read)
    buffer = worker.pre_update(update)
    assert buffer.flags.writeable
    buffer[...] = 2.0
    worker.update(update)
    worker.clock()


def test_use_after_shutdown(cluster: LocalCluster, worker: Worker) -> None:
    table, read, update = record_simple(worker)
    worker.finish_virtual_iteration()
    worker.start_iterations()
    worker.read(read)
    worker.post_read(read)
    worker.shutdown()
    worker.shutdown()  # idempotent
    for call in (
        lambda: worker.pre_update(update),
        lambda: worker.update(update),
        lambda: worker.read(read),
        lambda: worker.clock(),
        lambda: worker.fetch(table),
        lambda: worker.start_iterations(),
        lambda: worker.finish_virtual_iteration(),
    ):
        with pytest.raises(mltuner.ShutdownError, match="shut down") as e:
            call()
        assert isinstance(e.value, RuntimeError)


def test_virtual_calls_after_shutdown(worker: Worker) -> None:
    table = worker.create_table("t", 4, 4)
    worker.shutdown()
    with pytest.raises(mltuner.ShutdownError):
        worker.virtual_read(table)


def test_cluster_shutdown_stops_every_worker() -> None:
    with LocalCluster(2, Config(wait_timeout_s=20)) as cluster:
        tables = [w.create_table("t", 4, 4) for w in cluster.workers]
    for worker, table in zip(cluster.workers, tables):
        with pytest.raises(mltuner.ShutdownError):
            worker.fetch(table)


# -- tables ----------------------------------------------------------------------------


def test_create_table_after_finish(worker: Worker) -> None:
    record_simple(worker)
    worker.finish_virtual_iteration()
    with pytest.raises(mltuner.OutOfOrderError, match="create_table\\('late'\\)"):
        worker.create_table("late", 4, 4)


def test_duplicate_table_name(worker: Worker) -> None:
    worker.create_table("weights", 4, 4)
    with pytest.raises(mltuner.InvalidArgumentError, match="table 'weights' already exists"):
        worker.create_table("weights", 8, 2)
    with pytest.raises(mltuner.InvalidArgumentError, match="table 'weights' already exists"):
        worker.create_table("weights", 4, 4, local=True)


@pytest.mark.parametrize(("rows", "width"), [(0, 4), (4, 0), (-1, 4)])
def test_empty_or_negative_table(worker: Worker, rows: int, width: int) -> None:
    setting = "num_rows" if rows < 1 else "row_width"
    with pytest.raises(mltuner.InvalidArgumentError, match=rf"create_table\('bad'\): {setting} must be in \[1, 2"):
        worker.create_table("bad", rows, width)


def test_table_without_a_name(worker: Worker) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match="create_table: name must be a non-empty printable string"):
        worker.create_table("", 4, 4)


def test_start_iterations_twice(worker: Worker) -> None:
    record_simple(worker)
    worker.finish_virtual_iteration()
    worker.start_iterations()
    with pytest.raises(mltuner.OutOfOrderError, match="start_iterations was already called"):
        worker.start_iterations()


def test_init_phase_double_open(worker: Worker) -> None:
    _, read, update = record_simple(worker)
    worker.finish_virtual_iteration()
    worker.pre_update(update)
    with pytest.raises(mltuner.OutOfOrderError, match=rf"handle {update} \(pre_update of table 't'.*already open"):
        worker.pre_update(update)
    with pytest.raises(mltuner.OutOfOrderError, match=rf"handle {read} \(read of table 't'.*is not open"):
        worker.post_read(read)
    with pytest.raises(mltuner.OutOfOrderError, match=rf"initialisation access of handle {update} is still open"):
        worker.start_iterations()
    worker.update(update)
    worker.start_iterations()


# -- a worker that never clocks -----------------------------------------------------------


def test_read_times_out_when_a_worker_never_clocks(run_workers: Callable[..., list[Any]]) -> None:
    timeout_s = 1.0
    with LocalCluster(2, Config(wait_timeout_s=timeout_s)) as cluster:
        handles = [record_simple(w, "versions") for w in cluster.workers]

        def setup(worker: Worker) -> None:
            worker.finish_virtual_iteration()
            worker.start_iterations()

        run_workers(setup, cluster.workers, timeout_s=20, on_error=cluster.shutdown)
        worker = cluster.workers[0]
        table, read, update = handles[0]
        worker.read(read)  # clock 0 needs only the initial values
        worker.post_read(read)
        worker.pre_update(update)[...] = 1.0
        worker.update(update)
        worker.clock()
        start = time.monotonic()
        with pytest.raises(mltuner.WaitTimeoutError, match="data age") as e:
            worker.read(read)  # clock 1 needs worker 1's clock 0, which never comes
        elapsed = time.monotonic() - start
        assert isinstance(e.value, TimeoutError)
        assert timeout_s * 0.9 <= elapsed <= timeout_s + 3.0, elapsed
        message = str(e.value)
        assert "'versions'" in message and "clock 1" in message, message

        start = time.monotonic()
        with pytest.raises(mltuner.WaitTimeoutError, match="'versions' did not reach data age 0"):
            worker.sync()
        assert time.monotonic() - start <= timeout_s + 3.0
