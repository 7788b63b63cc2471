"""Local tables: per-worker data (activations, optimizer history) that the
engine stores, swaps and fetches but never communicates.

One clock of the recorded iteration, per worker:
  acc     fetch=True,  keep=True   an accumulator: acc += delta[c]
  frozen  fetch=True,  keep=True   checked against its initial values, unchanged
  frozen  fetch=True,  keep=False  scribbled over, and the writes are discarded
  out     fetch=False, keep=True   overwritten completely with f(c)
  out     fetch=True,  keep=False  must show f(c), written just before
plus a read and update of a small parameter table, so the iteration also
communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker

ROWS, WIDTH, CLOCKS, NUM_WORKERS = 6, 8, 15, 2
LOCAL_BYTES = 3 * ROWS * WIDTH * 4  # three local tables


def record(worker: Worker) -> dict[str, Any]:
    t = {
        "param": worker.create_table("param", 4, WIDTH),
        "acc": worker.create_table("acc", ROWS, WIDTH, local=True),
        "frozen": worker.create_table("frozen", ROWS, WIDTH, local=True),
        "out": worker.create_table("out", ROWS, WIDTH, local=True),
    }
    h: dict[str, Any] = {"tables": t}
    h["read"] = worker.virtual_read(t["param"])
    worker.virtual_post_read(h["read"])
    h["acc"] = worker.virtual_local_access(t["acc"], fetch=True)
    worker.virtual_post_local_access(h["acc"], keep=True)
    h["frozen_check"] = worker.virtual_local_access(t["frozen"], fetch=True)
    worker.virtual_post_local_access(h["frozen_check"], keep=True)
    h["frozen_scribble"] = worker.virtual_local_access(t["frozen"], fetch=True)
    worker.virtual_post_local_access(h["frozen_scribble"], keep=False)
    # Rows in a scrambled order: the buffer follows the recorded order.
    h["out_rows"] = np.array([3, 0, 5, 1, 4, 2])
    h["out_write"] = worker.virtual_local_access(t["out"], h["out_rows"], fetch=False)
    worker.virtual_post_local_access(h["out_write"], keep=True)
    h["out_check"] = worker.virtual_local_access(t["out"], fetch=True)
    worker.virtual_post_local_access(h["out_check"], keep=False)
    h["update"] = worker.virtual_pre_update(t["param"], [worker.rank])
    worker.virtual_update(h["update"])
    worker.virtual_clock()
    return h


def make_data(seed: int, nonzero_uniform: Callable[..., np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "acc0": nonzero_uniform(rng, (NUM_WORKERS, ROWS, WIDTH)),
        "frozen0": nonzero_uniform(rng, (NUM_WORKERS, ROWS, WIDTH)),
        "delta": nonzero_uniform(rng, (CLOCKS, NUM_WORKERS, ROWS, WIDTH)),
        "out": nonzero_uniform(rng, (CLOCKS, NUM_WORKERS, ROWS, WIDTH)),
        "garbage": nonzero_uniform(rng, (CLOCKS, NUM_WORKERS, ROWS, WIDTH), 5.0, 9.0),
    }


def run(budget: int, data: dict[str, np.ndarray], run_workers: Callable[..., list[Any]]) -> dict[str, Any]:
    config = Config(device_memory_budget=budget, wait_timeout_s=20, update_rule=UpdateRule("add"))
    with LocalCluster(NUM_WORKERS, config) as cluster:
        handles = [record(worker) for worker in cluster.workers]

        def body(worker: Worker) -> dict[str, Any]:
            h, r = handles[worker.rank], worker.rank
            worker.finish_virtual_iteration()
            # Initialisation writes local data through keep=True accesses.
            worker.local_access(h["acc"])[...] = data["acc0"][r]
            worker.post_local_access(h["acc"])
            worker.local_access(h["frozen_check"])[...] = data["frozen0"][r]
            worker.post_local_access(h["frozen_check"])
            # A keep=False access discards its writes in the init phase too.
            worker.local_access(h["frozen_scribble"])[...] = -1.0
            worker.post_local_access(h["frozen_scribble"])
            worker.start_iterations()

            acc_seen, out_seen, expected_acc = [], [], data["acc0"][r].copy()
            for c in range(CLOCKS):
                worker.read(h["read"])
                worker.post_read(h["read"])

                acc = worker.local_access(h["acc"])
                acc_seen.append(acc.copy())
                acc += data["delta"][c, r]
                worker.post_local_access(h["acc"])
                expected_acc = expected_acc + data["delta"][c, r]  # same float32 adds

                frozen = worker.local_access(h["frozen_check"])
                np.testing.assert_array_equal(frozen, data["frozen0"][r], err_msg=f"clock {c}: frozen changed")
                worker.post_local_access(h["frozen_check"])
                scribble = worker.local_access(h["frozen_scribble"])
                np.testing.assert_array_equal(scribble, data["frozen0"][r], err_msg=f"clock {c}: kept a discarded write")
                scribble[...] = data["garbage"][c, r]
                worker.post_local_access(h["frozen_scribble"])

                out = worker.local_access(h["out_write"])
                assert out.shape == (ROWS, WIDTH)
                out[...] = data["out"][c, r][h["out_rows"]]  # buffer rows in the recorded order
                worker.post_local_access(h["out_write"])
                check = worker.local_access(h["out_check"])
                out_seen.append(check.copy())
                check[...] = data["garbage"][c, r]
                worker.post_local_access(h["out_check"])

                worker.pre_update(h["update"])[...] = 1.0
                worker.update(h["update"])
                worker.clock()
            worker.sync()
            return {"acc": acc_seen, "out": out_seen, "expected_acc": expected_acc}

        results = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        stats = [w.stats for w in cluster.workers]
        param = cluster.workers[0].fetch(handles[0]["tables"]["param"])
    np.testing.assert_array_equal(param[:NUM_WORKERS], np.full((NUM_WORKERS, WIDTH), float(CLOCKS), np.float32))
    return {"results": results, "stats": stats}


def check(outcome: dict[str, Any], data: dict[str, np.ndarray]) -> None:
    for r, result in enumerate(outcome["results"]):
        expected = data["acc0"][r].copy()
        for c in range(CLOCKS):
            np.testing.assert_array_equal(result["acc"][c], expected, err_msg=f"worker {r}: accumulator at clock {c}")
            expected = expected + data["delta"][c, r]
            np.testing.assert_array_equal(result["out"][c], data["out"][c, r], err_msg=f"worker {r}: out at clock {c}")


def test_local_tables_keep_discard_and_fetch(
    run_workers: Callable[..., list[Any]], nonzero_uniform: Callable[..., np.ndarray]
) -> None:
    data = make_data(11, nonzero_uniform)
    outcome = run(0, data, run_workers)
    check(outcome, data)
    for stats in outcome["stats"]:
        assert stats["host_store_bytes"] == 0
        assert stats["bytes_swapped_in"] == 0


PARAM_BYTES = 4 * WIDTH * 4  # the parameter table's cache rows (updated once a clock: no update log)


@pytest.mark.parametrize(
    ("extra", "host_bytes"),
    [
        # No local table (192 bytes each) fits; the parameters (128) do.
        (191, LOCAL_BYTES),
        # Split by value (bytes moved per clock from host memory per device
        # byte): frozen (fetched twice, kept once: 3) and out (2; before acc
        # at equal value: it is fetched right after it is written, acc only a
        # clock after its last use) fit, then the parameters in the 191 bytes
        # left; acc stays in host memory.
        (575, ROWS * WIDTH * 4),
    ],
)
def test_local_data_in_host_memory_gives_the_same_results(
    run_workers: Callable[..., list[Any]], nonzero_uniform: Callable[..., np.ndarray], extra: int, host_bytes: int
) -> None:
    """A budget that fits the pool but not all the local tables puts local
    data in host memory, all of it or some tables; the results must not
    change."""
    data = make_data(12, nonzero_uniform)
    unlimited = run(0, data, run_workers)
    # One buffer is open at a time; the largest is 6 x 8 floats = 192 bytes,
    # 256 once aligned. Packed, all of a clock's buffers share those 256
    # bytes, and without a budget the pool needs a region per clock in
    # flight (prefetch_clocks=1: two); under one the plan takes one region.
    pool_min = 2 * 256
    assert unlimited["stats"][0]["pool_min_bytes"] == pool_min
    # A budget buys lookahead up to the plan's floor of 8 ops first: the 7
    # accesses open and close one after the other (ops 2i and 2i + 1), so
    # at a lookahead of 8 ops a region keeps 5 of their buffers apart. The
    # stores split what is left, and what they leave could buy more
    # lookahead (all 7 buffers apart: 1,792 bytes).
    floor_pool = 5 * 256
    limited = run(floor_pool + extra, data, run_workers)
    check(limited, data)
    for r in range(NUM_WORKERS):
        for c in range(CLOCKS):
            np.testing.assert_array_equal(limited["results"][r]["acc"][c], unlimited["results"][r]["acc"][c])
    for stats in limited["stats"]:
        assert stats["pool_bytes"] == floor_pool, stats
        assert stats["host_store_bytes"] == host_bytes, stats
        assert stats["bytes_swapped_in"] > 0, stats
        assert stats["predicted_bytes_to_device_per_clock"] > 0, stats


def test_local_table_cannot_be_read_or_updated_or_fetched() -> None:
    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        local = worker.create_table("scratch", 4, 4, local=True)
        param = worker.create_table("weights", 4, 4)
        with pytest.raises(mltuner.InvalidArgumentError, match="'scratch'.*local_access"):
            worker.virtual_read(local)
        with pytest.raises(mltuner.InvalidArgumentError, match="'scratch'.*local_access"):
            worker.virtual_pre_update(local)
        with pytest.raises(mltuner.InvalidArgumentError, match="'weights' is a parameter table"):
            worker.virtual_local_access(param)
        with pytest.raises(mltuner.InvalidArgumentError, match="'scratch' is local"):
            worker.fetch(local)
