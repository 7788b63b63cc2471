"""The two ways an update reaches the shards must agree with a reference:
a table updated once per clock ships its buffer directly, a table updated
several times per clock (overlapping rows included) goes through the update
log, which sums the updates first."""

from __future__ import annotations

import numpy as np
import pytest

import mltuner as mlt

CLOCKS = 6
ROWS, WIDTH = 11, 5


def _updates(rank: int, clock: int, shape: tuple[int, int], salt: int) -> np.ndarray:
    """Deterministic non-zero update values, different per worker, clock and access."""
    rng = np.random.default_rng(1000 * rank + 10 * clock + salt)
    return rng.integers(1, 9, size=shape).astype(np.float32)  # small integers: exact sums


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("budget_fraction", [0.0, 0.5])
def test_single_and_multiple_updates_per_clock_sum_exactly(num_workers: int, budget_fraction: float) -> None:
    first_rows = np.array([0, 1, 2, 3, 9])      # both accesses touch row 2 and 9
    second_rows = np.array([9, 2, 7, 10])
    single_rows = np.array([6, 4, 5, 0, 10, 3])  # scrambled order, spans every shard

    def expected() -> tuple[np.ndarray, np.ndarray]:
        multi = np.zeros((ROWS, WIDTH), np.float32)
        single = np.zeros((ROWS, WIDTH), np.float32)
        for rank in range(num_workers):
            for clock in range(CLOCKS):
                np.add.at(multi, first_rows, _updates(rank, clock, (len(first_rows), WIDTH), 1))
                np.add.at(multi, second_rows, _updates(rank, clock, (len(second_rows), WIDTH), 2))
                np.add.at(single, single_rows, _updates(rank, clock, (len(single_rows), WIDTH), 3))
        return multi, single

    # Peak: both multi-update buffers and the single one may be open at once.
    peak = sum(((len(r) * WIDTH * 4 + 255) // 256) * 256 for r in (first_rows, second_rows, single_rows))
    budget = 0 if budget_fraction == 0 else 2 * peak + int(budget_fraction * 2 * ROWS * WIDTH * 4)
    config = mlt.Config(wait_timeout_s=20, device_memory_budget=budget)
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def train(worker: mlt.Worker) -> None:
        multi = worker.create_table("multi", ROWS, WIDTH)
        single = worker.create_table("single", ROWS, WIDTH)
        a = worker.virtual_pre_update(multi, first_rows)
        s = worker.virtual_pre_update(single, single_rows)
        b = worker.virtual_pre_update(multi, second_rows)
        worker.virtual_update(a)
        worker.virtual_update(s)
        worker.virtual_update(b)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        for clock in range(CLOCKS):
            worker.pre_update(a)[...] = _updates(worker.rank, clock, (len(first_rows), WIDTH), 1)
            worker.pre_update(s)[...] = _updates(worker.rank, clock, (len(single_rows), WIDTH), 3)
            worker.pre_update(b)[...] = _updates(worker.rank, clock, (len(second_rows), WIDTH), 2)
            worker.update(a)
            worker.update(s)
            worker.update(b)
            worker.clock()
        worker.sync()
        results[worker.rank] = (worker.fetch(multi), worker.fetch(single))

    with mlt.LocalCluster(num_workers, config) as cluster:
        cluster.run(train, timeout_s=60)
    want_multi, want_single = expected()
    for rank in range(num_workers):
        got_multi, got_single = results[rank]
        np.testing.assert_array_equal(got_multi, want_multi)
        np.testing.assert_array_equal(got_single, want_single)
