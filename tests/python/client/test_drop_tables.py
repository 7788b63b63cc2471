"""Worker.drop_tables: a caller whose plan did not fit gives up its tables
and records with others. The dropped tables are gone from the worker, its
shard and the rendezvous schema; names and ids are free again; the job
trains as if they had never been made."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker

CLOCKS = 3


def _train(worker: Worker, read: int, update: int) -> np.ndarray:
    """Every worker adds its rank + 1 each clock; the rows read last."""
    rows = np.empty(0)
    for _ in range(CLOCKS + 1):
        rows = np.array(worker.read(read), copy=True)
        worker.post_read(read)
        worker.pre_update(update)[:] = worker.rank + 1
        worker.update(update)
        worker.clock()
    return rows


def _record_clock(worker: Worker, table: mltuner.Table) -> None:
    read = worker.virtual_read(table, slack=0)
    worker.virtual_post_read(read)
    worker.virtual_clock()


def test_dropped_tables_leave_no_trace(record_read_update: Callable[..., tuple[int, int]]) -> None:
    def fn(worker: Worker) -> tuple[np.ndarray, list[str]]:
        kept = worker.create_table("kept", 6, 2)
        first = worker.create_table("big", 40, 8)
        worker.create_table("acts", 40, 8, local=True)
        _record_clock(worker, first)
        worker.reset_virtual_iteration()
        worker.drop_tables(first)
        again = worker.create_table("big", 10, 3)  # the name is free, the id is reused
        assert again.id == first.id
        del kept
        return _train(worker, *record_read_update(worker, again)), [t.name for t in worker.tables]

    with LocalCluster(2, Config(update_rule=UpdateRule("add"), wait_timeout_s=20)) as cluster:
        results = cluster.run(fn, timeout_s=60)
    for rows, names in results:
        assert names == ["kept", "big"]
        # CLOCKS clocks of both workers adding 1 and 2 (add rule): 3 per clock.
        np.testing.assert_array_equal(rows, np.full((10, 3), 3.0 * CLOCKS, np.float32))


def test_drop_tables_refuses_what_it_cannot_do() -> None:
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        table = worker.create_table("t", 4, 2)
        _record_clock(worker, table)
        with pytest.raises(mltuner.OutOfOrderError, match="reset it first"):
            worker.drop_tables(table)
        foreign = mltuner.Table(7, "nobody", 4, 2, False)
        with pytest.raises(mltuner.NotFoundError):
            worker.drop_tables(foreign)
        worker.finish_virtual_iteration()
        with pytest.raises(mltuner.OutOfOrderError, match="after finish_virtual_iteration"):
            worker.drop_tables(table)
        assert [t.name for t in worker.tables] == ["t"]


def test_dropped_tables_give_their_host_memory_back() -> None:
    """create_table reserves the shard's state against the host-memory
    limit; dropping the table releases it, so a table of the same size fits
    again under a limit that holds one."""
    rows, width = 1 << 14, 64  # 4 MiB of values, 8 MiB with momentum
    config = Config(host_memory_limit=12 << 20, update_rule=UpdateRule("momentum", 0.1), wait_timeout_s=20)
    with LocalCluster(1, config) as cluster:
        worker = cluster.workers[0]
        first = worker.create_table("a", rows, width)
        with pytest.raises(mltuner.ResourceExhaustedError, match="create_table"):
            worker.create_table("b", rows, width)
        worker.drop_tables(first)
        worker.create_table("b", rows, width)
