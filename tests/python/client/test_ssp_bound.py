"""Stale-synchronous reads respect their staleness bound.

Version counters: a table "versions" with one row of width 4 per worker and
rule add. Every clock worker w adds 1.0 to its own row only, and reads all
rows with slack s. A read at clock c must wait until every worker's updates
through clock c - s - 1 are in, so every row shows at least c - s; it can
never show more than c, since no clock is applied before every worker finished
it. Workers sleep randomly (seeded per trial: different interleavings) and one
worker is slowed down, so the fast ones press against the bound.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mltuner import Config, LocalCluster, UpdateRule, Worker

NUM_WORKERS, CLOCKS, WIDTH = 3, 25, 4
TRIALS = 3
SLOW_RANK = 1


@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("slack", [0, 1, 3])
def test_ssp_reads_are_fresh_within_slack(slack: int, trial: int, run_workers: Callable[..., list[Any]]) -> None:
    config = Config(wait_timeout_s=20, update_rule=UpdateRule(kind="add"))
    progress = [-1] * NUM_WORKERS  # each worker's clock at its latest read
    progress_lock = threading.Lock()
    violations: list[str] = []

    with LocalCluster(NUM_WORKERS, config) as cluster:
        setup = []
        for worker in cluster.workers:
            table = worker.create_table("versions", NUM_WORKERS, WIDTH)
            read = worker.virtual_read(table, slack=slack)
            worker.virtual_post_read(read)
            update = worker.virtual_pre_update(table, [worker.rank])  # its own row only
            worker.virtual_update(update)
            worker.virtual_clock()
            setup.append((table, read, update))

        def body(worker: Worker) -> dict[str, Any]:
            table, read, update = setup[worker.rank]
            rng = random.Random(1000 * trial + 10 * slack + worker.rank)
            worker.finish_virtual_iteration()  # a barrier over all workers
            worker.start_iterations()
            rows_seen, ages = [], []
            for c in range(CLOCKS):
                time.sleep(rng.uniform(0, 0.003) + (0.004 if worker.rank == SLOW_RANK else 0))
                values = worker.read(read)
                with progress_lock:
                    progress[worker.rank] = c
                    spread = max(progress) - min(progress)
                    if spread > slack + 1:
                        violations.append(f"worker {worker.rank} at clock {c}: clocks {list(progress)}")
                rows_seen.append(values.copy())
                ages.append(worker.last_read_data_age)
                worker.post_read(read)
                time.sleep(rng.uniform(0, 0.003))
                buffer = worker.pre_update(update)
                assert buffer.shape == (1, WIDTH)
                buffer[...] = 1.0
                worker.update(update)
                worker.clock()
            worker.sync()
            return {"rows": rows_seen, "ages": ages}

        results = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        final = cluster.workers[0].fetch(setup[0][0])

    assert not violations, f"a worker ran more than slack + 1 = {slack + 1} clocks ahead: {violations[:3]}"
    if slack > 0:
        # The slowed worker makes the others run ahead, so some reads really
        # are stale: otherwise this test would not exercise the bound.
        stale = [c - 1 - age for r in results for c, age in enumerate(r["ages"])]
        assert max(stale) >= 1, f"no read was ever stale (staleness {stale}); the test exercised nothing"
    for rank, result in enumerate(results):
        for c, (rows, age) in enumerate(zip(result["rows"], result["ages"])):
            # Each row holds one counter, the same in every column.
            assert np.all(rows == rows[:, :1]), f"worker {rank} clock {c}: torn row {rows}"
            counts = rows[:, 0]
            assert np.all(counts >= c - slack), (
                f"worker {rank} read at clock {c} with slack {slack} saw counters {counts}: "
                f"some worker's clocks 0..{c - slack - 1} are missing"
            )
            assert np.all(counts <= c), f"worker {rank} clock {c}: counters {counts} from the future"
            assert age >= c - slack - 1, f"worker {rank} clock {c}: data age {age} < {c - slack - 1}"
            assert age <= c - 1, f"worker {rank} clock {c}: data age {age} beyond finished clocks"
            # Every clock through the data age is applied in every row.
            assert np.all(counts >= age + 1), f"worker {rank} clock {c}: counters {counts} below data age {age}"
    # At the end every worker's every clock is in.
    np.testing.assert_array_equal(final, np.full((NUM_WORKERS, WIDTH), float(CLOCKS), dtype=np.float32))


def test_slack_zero_reads_are_exactly_current(run_workers: Callable[..., list[Any]]) -> None:
    """With slack 0 (BSP) the read at clock c shows exactly c in every row."""
    config = Config(wait_timeout_s=20, update_rule=UpdateRule(kind="add"))
    with LocalCluster(2, config) as cluster:
        setup = []
        for worker in cluster.workers:
            table = worker.create_table("versions", 2, WIDTH)
            read = worker.virtual_read(table, slack=0)
            worker.virtual_post_read(read)
            update = worker.virtual_pre_update(table, [worker.rank])
            worker.virtual_update(update)
            worker.virtual_clock()
            setup.append((read, update))

        def body(worker: Worker) -> list[float]:
            read, update = setup[worker.rank]
            worker.finish_virtual_iteration()
            worker.start_iterations()
            seen = []
            for c in range(10):
                if worker.rank == 1:
                    time.sleep(0.003)
                values = worker.read(read)
                seen.append(values.copy())
                assert worker.last_read_data_age == c - 1
                worker.post_read(read)
                worker.pre_update(update)[...] = 1.0
                worker.update(update)
                worker.clock()
            return seen

        for seen in run_workers(body, cluster.workers, on_error=cluster.shutdown):
            for c, rows in enumerate(seen):
                np.testing.assert_array_equal(rows, np.full((2, WIDTH), float(c), dtype=np.float32))


def test_a_worker_that_reads_no_table_stays_within_two_clocks_of_the_others(
        run_workers: Callable[..., list[Any]]) -> None:
    """No read holds back a worker that only updates a table, so its updates
    wait instead: those of clock c until every worker finished clock c - 2
    (one clock more than a read of the largest slack recorded, 0 here), so
    that the shards never pile up its clocks."""
    config = Config(wait_timeout_s=20, update_rule=UpdateRule(kind="add"))
    clocks = 6
    # Clocks each worker finished; worker 1's counted before its update:
    # a table's one update a clock leaves as it is posted, so worker 0 may
    # pass its bound the moment that update lands, before worker 1's thread
    # returns from update() (counted as it entered clock(), worker 0 once
    # read a lead of 3 on a loaded machine), and must never read a count
    # behind the engine's.
    finished = [0, 0]
    lead: list[int] = []  # worker 0's lead over worker 1, after each of its clocks
    released = threading.Semaphore(0)  # worker 1's clocks, let through one at a time
    with LocalCluster(2, config) as cluster:
        setup = []
        for worker in cluster.workers:
            table = worker.create_table("counts", 2, WIDTH)
            update = worker.virtual_pre_update(table, [worker.rank])
            worker.virtual_update(update)
            worker.virtual_clock()
            setup.append(update)

        def body(worker: Worker) -> None:
            worker.finish_virtual_iteration()
            worker.start_iterations()
            for _ in range(clocks):
                if worker.rank == 1:
                    assert released.acquire(timeout=20)
                worker.pre_update(setup[worker.rank])[...] = 1.0
                if worker.rank == 1:
                    finished[1] += 1
                    worker.update(setup[worker.rank])
                    worker.clock()
                else:
                    worker.update(setup[worker.rank])
                    worker.clock()
                    finished[0] += 1
                    lead.append(finished[0] - finished[1])

        def pace() -> None:
            for _ in range(clocks):
                time.sleep(0.3)  # room for worker 0 to run ahead, if it could
                assert finished[0] <= finished[1] + 2, finished
                released.release()

        pacer = threading.Thread(target=pace)
        pacer.start()
        run_workers(body, cluster.workers, on_error=cluster.shutdown)
        pacer.join()
        assert max(lead) == 2, lead  # it did run ahead, as far as the bound
        for worker in cluster.workers:
            worker.flush()
        values = cluster.workers[0].fetch(cluster.workers[0].tables[0])
        np.testing.assert_array_equal(values, np.full((2, WIDTH), float(clocks), dtype=np.float32))


def test_the_worker_knows_the_least_slack_of_its_reads() -> None:
    """The batch balancer replays clocks under it when no branch sets its own."""
    with LocalCluster(1, Config(update_rule=UpdateRule("sgd", learning_rate=0.1))) as cluster:
        worker = cluster.worker(0)
        assert worker.read_slack is None
        table = worker.create_table("t", 2, 4)
        worker.virtual_post_read(worker.virtual_read(table, slack=3))
        worker.virtual_post_read(worker.virtual_read(table, [1], slack=1))
        worker.virtual_post_read(worker.virtual_read(table, [0], slack=5))
        assert worker.read_slack == 1
