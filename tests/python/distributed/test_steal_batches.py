"""Batch stealing on 2 real worker processes at slack 2: rank 1 pauses now
and then, rank 0 takes its part of the clocks it is late for, every clock's
samples are still computed exactly once, and the servers' sum of the steps'
weighted updates equals the sum over the clocks' whole batches (an
independent float64 reference) whoever computed which sample."""

from __future__ import annotations

import numpy as np

from balance_worker import BATCH, NUM_TRAIN, NUM_VAL, make_data  # type: ignore[import-not-found]
from conftest import WORKER

PROGRAM = WORKER.with_name("balance_worker.py")
RUNS, CLOCKS = 3, 12


def _results(workers) -> list[dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    """What both ranks wrote, once both exited cleanly."""
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    return [workers.result(r) for r in range(2)]


def test_a_paused_rank_loses_its_parts_and_every_sample_counts_once(start_workers) -> None:  # type: ignore[no-untyped-def]
    workers = start_workers(2, "--runs", str(RUNS), "--clocks", str(CLOCKS), "--steal", "--slack", "2",
                            "--rule", "add", "--slow-rank", "1", "--slow-s", "0.3", "--slow-every", "6",
                            program=PROGRAM)
    ranks = _results(workers)
    counts = [r["counts"] for r in ranks]
    assert len(counts[0]) == len(counts[1]) == RUNS * CLOCKS and (counts[0] + counts[1] == 2 * BATCH).all()
    # Rank 1's pauses (0.3 s, far longer than a clock) let rank 0 run two clocks
    # ahead: it takes rank 1's part of some clocks, which rank 1 then runs empty.
    assert int(ranks[0]["taken"]) > 0 and int(ranks[1]["given"]) == int(ranks[0]["taken"])
    assert int(ranks[0]["given"]) == 0 and int(ranks[1]["taken"]) == 0
    assert (counts[1] == 0).sum() == int(ranks[1]["given"])
    assert set(counts[0][counts[1] == 0].tolist()) == {2 * BATCH}
    for r in range(2):
        np.testing.assert_allclose(ranks[r]["weights"], counts[r] * 2 / (2 * BATCH))
    # Each clock's samples are exactly the next 2 x BATCH of the epoch's order (seed 0).
    begin = [0, 0]
    epoch_clocks = NUM_TRAIN // (2 * BATCH)
    x, _ = make_data()
    want = np.zeros(x.shape[1])
    for clock in range(RUNS * CLOCKS):
        epoch, offset = divmod(clock, epoch_clocks)
        order = np.random.default_rng([0, epoch]).permutation(NUM_TRAIN)
        expected = order[offset * 2 * BATCH:(offset + 1) * 2 * BATCH]
        got = []
        for r in range(2):
            got.append(ranks[r]["trained"][begin[r]:begin[r] + counts[r][clock]])
            begin[r] += counts[r][clock]
        assert sorted(np.concatenate(got).tolist()) == sorted(expected.tolist()), f"clock {clock}"
        # Each rank adds weight x its mean, weight = its share x 2: the clock adds twice the whole mean.
        want += 2 * x[expected].mean(axis=0)
    validated = np.concatenate([ranks[0]["validated"], ranks[1]["validated"]])
    assert sorted(validated.tolist()) == list(range(NUM_VAL))
    final = ranks[0]["final"]
    np.testing.assert_array_equal(final, ranks[1]["final"])
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-5)


def test_under_bsp_nothing_is_stolen(start_workers) -> None:  # type: ignore[no-untyped-def]
    """A thief under BSP would wait for the late rank's last clock, then
    compute its part after it: the session steals only at slack >= 1."""
    workers = start_workers(2, "--runs", "1", "--clocks", "12", "--steal", "--slack", "0", "--rule", "add",
                            "--slow-rank", "1", "--slow-s", "0.3", "--slow-every", "6", program=PROGRAM)
    ranks = _results(workers)
    assert [int(r["taken"]) for r in ranks] == [0, 0] and [int(r["given"]) for r in ranks] == [0, 0]
    np.testing.assert_array_equal(ranks[1]["counts"], BATCH)
