"""Training under a device-memory budget that forces host residence and
swapping gives bit-for-bit the results of an unlimited budget.

The model: linear regression y = x W with W of shape (256, 32), split over four
tables ("layers") of 64 rows x 32 floats (8 KiB each). Each clock follows the
GeePS pattern: the forward pass reads layers 0..3 and keeps the read buffers
open; the backward pass, from layer 3 down, opens the layer's update buffer,
writes its gradient, updates and then posts the layer's read. So the largest
set of buffers open at once is 4 reads + 1 update = 5 x 8192 bytes, and the
packed buffers of a clock fit in exactly that (each update after the first
takes the addresses of the read posted just before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mltuner
from mltuner import Config, LocalCluster, UpdateRule, Worker

NUM_LAYERS, ROWS, WIDTH, BATCH, CLOCKS, NUM_WORKERS = 4, 64, 32, 8, 12, 2
TABLE_BYTES = ROWS * WIDTH * 4  # 8192: a multiple of the engine's 256-byte buffer alignment
PEAK_BYTES = (NUM_LAYERS + 1) * TABLE_BYTES  # 40960
POOL_MIN = 2 * PEAK_BYTES  # 81920: a region of packed buffers per clock in flight (prefetch_clocks = 1: two)
# With prefetch_clocks None (the default) a budget below POOL_MIN gets one
# region: the least budget is then one region's.
ONE_REGION_POOL_MIN = PEAK_BYTES
# The pool a budget buys first: the deepest lookahead, where no two buffers of
# a clock share addresses (4 reads + 4 updates a region).
DEEPEST_POOL = 2 * 2 * NUM_LAYERS * TABLE_BYTES  # 131072
# Each layer is updated once a clock, straight from its buffer, so a
# device-resident row costs its cache row alone (no update log). This budget
# fits the deepest pool and two of the four layers, so the other two live in
# host memory and are swapped in on every read.
SMALL_BUDGET = DEEPEST_POOL + 2 * TABLE_BYTES
LR = 0.5


def make_data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dim = NUM_LAYERS * ROWS
    x = rng.normal(size=(CLOCKS, NUM_WORKERS, BATCH, dim)) / np.sqrt(dim)
    true_w = rng.normal(size=(dim, WIDTH))
    y = x @ true_w + 0.1 * rng.normal(size=(CLOCKS, NUM_WORKERS, BATCH, WIDTH))
    w0 = (rng.uniform(0.1, 1.0, size=(dim, WIDTH)) * rng.choice([-1, 1], size=(dim, WIDTH))).astype(np.float32)
    return {"x": x, "y": y, "w0": w0}


def record(worker: Worker) -> tuple[list[Any], list[int], list[int]]:
    tables = [worker.create_table(f"layer{i}", ROWS, WIDTH) for i in range(NUM_LAYERS)]
    reads = [worker.virtual_read(t, slack=0) for t in tables]
    updates = [0] * NUM_LAYERS
    for i in reversed(range(NUM_LAYERS)):
        updates[i] = worker.virtual_pre_update(tables[i])
        worker.virtual_update(updates[i])
        worker.virtual_post_read(reads[i])
    worker.virtual_clock()
    return tables, reads, updates


def train(budget: int, data: dict[str, np.ndarray], run_workers: Callable[..., list[Any]],
          prefetch_clocks: int | None = None) -> dict[str, Any]:
    config = Config(device_memory_budget=budget, wait_timeout_s=20, update_rule=UpdateRule("sgd", learning_rate=LR),
                    prefetch_clocks=prefetch_clocks)
    with LocalCluster(NUM_WORKERS, config) as cluster:
        setups = [record(worker) for worker in cluster.workers]
        w0 = cluster.workers[0]
        tables0 = setups[0][0]

        def body(worker: Worker) -> list[np.ndarray]:
            _, reads, updates = setups[worker.rank]
            worker.finish_virtual_iteration()  # a barrier over all workers
            if worker.rank == 0:
                for i in range(NUM_LAYERS):  # worker 0 writes the initial weights
                    worker.pre_update(updates[i])[...] = data["w0"][i * ROWS : (i + 1) * ROWS]
                    worker.update(updates[i])
            worker.start_iterations()
            losses = []
            for c in range(CLOCKS):
                x, y = data["x"][c, worker.rank], data["y"][c, worker.rank]
                layers = [worker.read(h) for h in reads]  # forward: all reads open
                w = np.concatenate(layers).astype(np.float64)
                residual = x @ w - y
                losses.append(0.5 * float(np.mean(np.sum(residual**2, axis=1))))
                grad = x.T @ residual / BATCH
                for i in reversed(range(NUM_LAYERS)):  # backward
                    worker.pre_update(updates[i])[...] = grad[i * ROWS : (i + 1) * ROWS].astype(np.float32)
                    worker.update(updates[i])
                    worker.post_read(reads[i])
                worker.clock()
            worker.sync()
            return losses

        losses = run_workers(body, cluster.workers, on_error=cluster.shutdown)
        final = np.concatenate([w0.fetch(t) for t in tables0])
        return {
            "final": final,
            "losses": losses,
            "stats": [w.stats for w in cluster.workers],
            "plans": [w.plan for w in cluster.workers],
        }


def test_small_budget_swaps_and_gives_bit_identical_results(run_workers: Callable[..., list[Any]]) -> None:
    data = make_data(7)
    unlimited = train(0, data, run_workers)
    limited = train(SMALL_BUDGET, data, run_workers)

    # Training did something: the weights moved and the loss fell.
    assert np.max(np.abs(unlimited["final"] - data["w0"])) > 1e-2
    for losses in unlimited["losses"]:
        assert np.mean(losses[-3:]) < np.mean(losses[:3])

    np.testing.assert_array_equal(limited["final"], unlimited["final"])
    assert limited["losses"] == unlimited["losses"]

    for rank in range(NUM_WORKERS):
        small, big = limited["stats"][rank], unlimited["stats"][rank]
        assert big["bytes_swapped_in"] == 0, unlimited["plans"][rank]
        assert big["host_store_bytes"] == 0, unlimited["plans"][rank]
        assert small["bytes_swapped_in"] > 0, limited["plans"][rank]
        assert small["host_store_bytes"] > 0, limited["plans"][rank]
        # The budget is respected: pool plus device stores fit in it.
        assert small["pool_bytes"] + small["device_store_bytes"] <= SMALL_BUDGET, limited["plans"][rank]
        assert small["pool_bytes"] == DEEPEST_POOL == big["pool_bytes"], limited["plans"][rank]
        assert small["pool_min_bytes"] == POOL_MIN
        # The budget holds two regions at the deepest lookahead: the plan keeps prefetch_clocks 1.
        assert small["prefetch_clocks"] == 1 == big["prefetch_clocks"], limited["plans"][rank]
        # All four layers are read every clock, each row either gathered from
        # the device or swapped in; the allocator may already have prefetched
        # the reads of the next clock (prefetch_clocks = 1).
        total = small["bytes_gathered"] + small["bytes_swapped_in"]
        assert CLOCKS * NUM_LAYERS * TABLE_BYTES <= total <= (CLOCKS + 1) * NUM_LAYERS * TABLE_BYTES
        assert CLOCKS * NUM_LAYERS * TABLE_BYTES <= big["bytes_gathered"] <= (CLOCKS + 1) * NUM_LAYERS * TABLE_BYTES
        # Two of the four layers are host-resident: half of what is read is swapped in.
        assert small["bytes_swapped_in"] % (2 * TABLE_BYTES) == 0
        assert 2 * CLOCKS * TABLE_BYTES <= small["bytes_swapped_in"] <= 2 * (CLOCKS + 1) * TABLE_BYTES


@pytest.mark.parametrize(("prefetch_clocks", "least", "regions"),
                         [(1, POOL_MIN, "2 regions"), (None, ONE_REGION_POOL_MIN, "1 region")])
def test_budget_below_the_least_pool_is_refused_with_the_bytes_needed(prefetch_clocks: int | None, least: int,
                                                                       regions: str) -> None:
    config = Config(device_memory_budget=least - 1, wait_timeout_s=20, prefetch_clocks=prefetch_clocks)
    with LocalCluster(1, config) as cluster:
        worker = cluster.workers[0]
        record(worker)
        with pytest.raises(mltuner.ResourceExhaustedError, match=f"pool needs {least} bytes \\({regions},") as raised:
            worker.finish_virtual_iteration()
        assert isinstance(raised.value, MemoryError)
        assert str(PEAK_BYTES) in str(raised.value)
        assert str(least - 1) in str(raised.value)
        if prefetch_clocks is None:  # why one region: two need POOL_MIN
            assert f"takes one region when the budget cannot hold two ({POOL_MIN} bytes)" in str(raised.value)


@pytest.mark.parametrize(("prefetch_clocks", "least"), [(1, POOL_MIN), (None, ONE_REGION_POOL_MIN)])
def test_budget_of_exactly_the_least_pool_is_enough(run_workers: Callable[..., list[Any]],
                                                    prefetch_clocks: int | None, least: int) -> None:
    """The smallest legal budget (all parameters in host memory) still trains
    to the same result: two regions' least with prefetch_clocks=1, one
    region's with the default (the plan takes prefetch_clocks 0)."""
    data = make_data(8)
    unlimited = train(0, data, run_workers)
    tight = train(least, data, run_workers, prefetch_clocks=prefetch_clocks)
    np.testing.assert_array_equal(tight["final"], unlimited["final"])
    for stats, plan in zip(tight["stats"], tight["plans"]):
        assert stats["prefetch_clocks"] == (1 if prefetch_clocks == 1 else 0), plan
        assert stats["pool_bytes"] == stats["pool_min_bytes"] == least, plan
        assert stats["device_store_bytes"] == 0
        assert stats["bytes_gathered"] == 0
        swapped = stats["bytes_swapped_in"]
        assert CLOCKS * NUM_LAYERS * TABLE_BYTES <= swapped <= (CLOCKS + 1) * NUM_LAYERS * TABLE_BYTES


def test_device_memory_the_application_reserves_is_left_out_of_the_budget() -> None:
    """Worker.reserve_device_memory: plans are made under the budget less the
    reservation, and say so; the preview names the local accesses whose
    rows stay on the device (all of them without a budget, none when the
    budget holds no more than the pool)."""
    def record_with_local_data(worker: Worker) -> list[int]:
        tables, _, _ = record(worker)
        worker.reset_virtual_iteration()
        local = worker.create_table("acts", ROWS, WIDTH, local=True)
        read = worker.virtual_read(tables[0], slack=0)
        stores = [worker.virtual_local_access(local, range(k * 16, k * 16 + 16), fetch=False) for k in range(2)]
        for handle in stores:
            worker.virtual_post_local_access(handle)
        loads = [worker.virtual_local_access(local, range(k * 16, k * 16 + 16)) for k in (1, 0)]
        for handle in loads:
            worker.virtual_post_local_access(handle, keep=False)
        update = worker.virtual_pre_update(tables[0])
        worker.virtual_update(update)
        worker.virtual_post_read(read)
        worker.virtual_clock()
        return stores + loads

    with LocalCluster(1, Config(wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        local_accesses = record_with_local_data(worker)
        assert worker.preview_plan().device_local_accesses == frozenset(local_accesses)
    budget = 4 * POOL_MIN
    with LocalCluster(1, Config(device_memory_budget=budget, wait_timeout_s=20)) as cluster:
        worker = cluster.workers[0]
        record_with_local_data(worker)
        least = worker.preview_plan().pool_min_bytes
        worker.reserve_device_memory(budget - least)  # room for the least pool and nothing else
        preview = worker.preview_plan()
        assert preview.fits and preview.budget_bytes == least and preview.pool_bytes == least
        assert preview.device_local_accesses == frozenset() and preview.host_store_bytes > 0
        assert (f"device_memory_budget {least} B for the engine ({budget} B set by hand, less the "
                f"{budget - least} B the application keeps beside it)") in preview.description
        worker.reserve_device_memory(budget - least + 1)
        assert not worker.preview_plan().fits
        with pytest.raises(mltuner.InvalidArgumentError, match="nbytes must be in"):
            worker.reserve_device_memory(-1)
        worker.reserve_device_memory(0)
        preview = worker.preview_plan()
        assert preview.budget_bytes == budget and "set by hand)" in preview.description
        worker.finish_virtual_iteration()
        with pytest.raises(mltuner.OutOfOrderError, match="reserve_device_memory after finish_virtual_iteration"):
            worker.reserve_device_memory(0)
