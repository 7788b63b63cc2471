"""Batch balancing on 2 real worker processes: a slowed rank gets a smaller
share of each clock's samples, the two parts still cover each clock's samples
exactly once, and with the steps' weights the servers' parameters equal
sequential SGD on the clocks' whole batches (an independent float64
reference), which plain per-worker means would not."""

from __future__ import annotations

import numpy as np

from balance_worker import BATCH, LR, NUM_TRAIN, NUM_VAL, make_data  # type: ignore[import-not-found]
from conftest import WORKER

PROGRAM = WORKER.with_name("balance_worker.py")
RUNS, CLOCKS = 5, 8


def sgd(batches: list[tuple[np.ndarray, np.ndarray]], weighted: bool) -> np.ndarray:
    """Sequential SGD from zero on each clock's (rank 0, rank 1) samples: the
    whole batch's mean gradient, or (weighted=False) the mean of the two
    ranks' means, what unweighted unequal parts would sum to."""
    x, y = make_data()
    w = np.zeros(x.shape[1])
    for parts in batches:
        grads = [x[p].T @ (x[p] @ w - y[p]) / len(p) for p in parts]
        if weighted:
            whole = np.concatenate(parts)
            grad = x[whole].T @ (x[whole] @ w - y[whole]) / len(whole)
        else:
            grad = sum(grads) / len(grads)
        w = w - LR * grad
    return w


def test_a_slow_rank_takes_a_smaller_share_and_training_equals_sequential_sgd(start_workers) -> None:  # type: ignore[no-untyped-def]
    workers = start_workers(2, "--runs", str(RUNS), "--clocks", str(CLOCKS), "--slow-rank", "1",
                            "--slow-s", "0.02", program=PROGRAM)
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    ranks = [workers.result(r) for r in range(2)]
    counts = [r["counts"] for r in ranks]
    assert len(counts[0]) == len(counts[1]) == RUNS * CLOCKS
    np.testing.assert_array_equal(counts[0] + counts[1], 2 * BATCH)
    # The first run is split equally; rank 1 sleeps 20 ms a clock, far more
    # than a clock's compute, so later runs give it the least share: one sample.
    assert (counts[1][:CLOCKS] == BATCH).all()
    assert (counts[1][-CLOCKS:] == 1).all(), counts[1]
    assert ranks[0]["shares"][1] < 0.1
    for r in range(2):
        np.testing.assert_allclose(ranks[r]["weights"], counts[r] * 2 / (2 * BATCH))
    # Each clock's two parts are the next 2 x BATCH samples of the epoch's order.
    batches, begin = [], [0, 0]
    epoch_clocks = NUM_TRAIN // (2 * BATCH)
    for clock in range(RUNS * CLOCKS):
        parts = []
        for r in range(2):
            parts.append(ranks[r]["trained"][begin[r]:begin[r] + counts[r][clock]])
            begin[r] += counts[r][clock]
        batches.append((parts[0], parts[1]))
    for epoch_start in range(0, RUNS * CLOCKS, epoch_clocks):
        seen = np.concatenate([np.concatenate(b) for b in batches[epoch_start:epoch_start + epoch_clocks]])
        assert len(set(seen.tolist())) == len(seen)
    # The validation pass covers the validation set once, split by the shares.
    validated = np.concatenate([ranks[0]["validated"], ranks[1]["validated"]])
    assert sorted(validated.tolist()) == list(range(NUM_VAL))
    assert len(ranks[1]["validated"]) < len(ranks[0]["validated"])

    final = ranks[0]["final"]
    np.testing.assert_array_equal(final, ranks[1]["final"])
    want = sgd(batches, weighted=True)
    assert np.linalg.norm(final - want) / np.linalg.norm(want) < 1e-5
    unweighted = sgd(batches, weighted=False)
    assert np.linalg.norm(unweighted - want) / np.linalg.norm(want) > 1e-3
