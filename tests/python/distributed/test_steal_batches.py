"""Batch stealing on real worker processes at slack 2: a rank that pauses
now and then loses its parts of the clocks it is late for, and its
unclaimed part of the clock before, to the ranks on time; every sample is
still computed exactly once, in its clock or a later one; a rank whose read
would wait for the paused one waits in its claim instead, until the paused one
is late; the servers' sum of
the steps' weighted updates equals the sum over the clocks' whole batches
(an independent float64 reference) whoever computed which sample; and with
three workers the on-time ones read each other's updates while the paused
one sleeps (its clocks are declared empty on the shards)."""

from __future__ import annotations

import numpy as np
import pytest

from balance_worker import BATCH, NUM_TRAIN, NUM_VAL, make_data  # type: ignore[import-not-found]
from conftest import WORKER

PROGRAM = WORKER.with_name("balance_worker.py")
RUNS, CLOCKS = 3, 12


def _results(workers, world: int) -> list[dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    """What every rank wrote, once all exited cleanly."""
    for rank, (code, output) in enumerate(workers.wait()):
        assert code == 0, f"rank {rank} failed:\n{output}"
    return [workers.result(r) for r in range(world)]


def _check_every_sample_counts_once(ranks: list[dict[str, np.ndarray]]) -> None:
    """Each clock's whole batch (the next world x BATCH of the epoch's order,
    seed 0) is computed once, in its own clock or a later one; the final table
    is the float64 sum of every clock's whole-batch mean x world."""
    world = len(ranks)
    chunk = world * BATCH
    epoch_clocks = NUM_TRAIN // chunk
    x, _ = make_data()
    counts = [r["counts"] for r in ranks]
    assert all(len(c) == RUNS * CLOCKS for c in counts)
    assert sum(int(c.sum()) for c in counts) == RUNS * CLOCKS * chunk
    for r in range(world):
        np.testing.assert_allclose(ranks[r]["weights"], counts[r] * world / chunk)
    begin = [0] * world
    want = np.zeros(x.shape[1])
    batches, computed = [], []
    for clock in range(RUNS * CLOCKS):
        epoch, offset = divmod(clock, epoch_clocks)
        order = np.random.default_rng([0, epoch]).permutation(NUM_TRAIN)
        batches.append(order[offset * chunk:(offset + 1) * chunk])
        # Each rank adds weight x its mean, weight = its share x world: a clock adds world x its whole mean.
        want += world * x[batches[-1]].mean(axis=0)
        got = []
        for r in range(world):
            got.append(ranks[r]["trained"][begin[r]:begin[r] + counts[r][clock]])
            begin[r] += counts[r][clock]
        computed.append(np.concatenate(got))
        allowed = set(np.concatenate(batches[-3:]).tolist())  # at slack 2 a late rank's parts move up to 2 clocks
        assert set(computed[-1].tolist()) <= allowed, f"clock {clock}"
    assert sorted(np.concatenate(computed).tolist()) == sorted(np.concatenate(batches).tolist())
    validated = np.concatenate([r["validated"] for r in ranks])
    assert sorted(validated.tolist()) == list(range(NUM_VAL))
    final = ranks[0]["final"]
    for r in range(1, world):
        np.testing.assert_array_equal(final, ranks[r]["final"])
    np.testing.assert_allclose(final, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_a_paused_rank_loses_its_parts_and_every_sample_counts_once(  # type: ignore[no-untyped-def]
        start_workers, shared: bool) -> None:
    """Both ways to claim: the board file of one host, and requests to rank 0."""
    workers = start_workers(2, "--runs", str(RUNS), "--clocks", str(CLOCKS), "--steal", "--slack", "2",
                            "--rule", "add", "--slow-rank", "1", "--slow-s", "0.3", "--slow-every", "6",
                            "--work-s", "0.01", program=PROGRAM,
                            env=None if shared else {"MLTUNER_SHARED_CLAIMS": "0"})
    ranks = _results(workers, 2)
    assert [bool(r["shared"]) for r in ranks] == [shared, shared]
    # Rank 0 answering claims over the network hands its interpreter lock over sooner, then restores it.
    assert ranks[0]["switch"].tolist() == ([0.005, 0.005] if shared else [0.0005, 0.005])
    assert ranks[1]["switch"].tolist() == [0.005, 0.005]
    counts = [r["counts"] for r in ranks]
    # Rank 1's pauses (0.3 s, 30 clocks of 10 ms) let rank 0 run ahead: it
    # takes rank 1's parts of some clocks, which rank 1 then runs empty (several
    # of them in one of rank 0's clocks when the parts of earlier clocks move too).
    assert int(ranks[1]["given"]) >= int(ranks[0]["taken"]) > 0
    for r in range(2):  # a rank that lost its part computes nothing in that clock
        assert (counts[r] == 0).sum() == int(ranks[r]["given"])
    # Rank 0's clocks hold its own part, and rank 1's of this clock, of the clocks it had not
    # claimed when it became late, or both.
    assert (counts[0] % BATCH == 0).all() and counts[0].max() >= 3 * BATCH
    _check_every_sample_counts_once(ranks)


def test_a_rank_whose_read_would_wait_waits_in_its_claim_until_the_other_is_late(  # type: ignore[no-untyped-def]
        start_workers) -> None:
    """Slack 1, rank 1 pausing 50 ms after every clock (so rank 0, ahead,
    waits for it each clock, and that is the typical clock) and 0.6 s once
    a run. Rank 0 reaches the clock whose read needs rank 1's next before
    rank 1 is late; its claim waits until rank 1 is (two typical clocks),
    then takes rank 1's parts, and its read does not wait out the pause."""
    workers = start_workers(2, "--runs", str(RUNS), "--clocks", str(CLOCKS), "--steal", "--slack", "1",
                            "--rule", "add", "--slow-rank", "1", "--slow-s", "0.05", "--burst-s", "0.6",
                            "--burst-at", "8", program=PROGRAM)
    ranks = _results(workers, 2)
    assert int(ranks[0]["taken"]) > 0
    assert float(ranks[0]["claim_wait"]) > 0
    assert float(ranks[0]["longest_read"]) < 0.3, "rank 0's read waited out rank 1's pause"
    _check_every_sample_counts_once(ranks)


def test_a_pause_shorter_than_steal_after_moves_nothing(start_workers) -> None:  # type: ignore[no-untyped-def]
    """The same pauses with ``steal_after`` 100 typical clocks (about 5 s):
    rank 1 is never late, so its parts stay and rank 0 waits for it."""
    workers = start_workers(2, "--runs", "1", "--clocks", str(CLOCKS), "--steal", "--slack", "1", "--rule", "add",
                            "--slow-rank", "1", "--slow-s", "0.05", "--burst-s", "0.6", "--burst-at", "8",
                            "--steal-after", "100", program=PROGRAM)
    ranks = _results(workers, 2)
    assert [int(r["taken"]) for r in ranks] == [0, 0] and [int(r["given"]) for r in ranks] == [0, 0]
    assert float(ranks[0]["longest_read"]) > 0.3 or float(ranks[0]["claim_wait"]) > 0.3


def test_the_others_read_each_others_steps_while_a_rank_sleeps(start_workers) -> None:  # type: ignore[no-untyped-def]
    """Three workers at slack 2, each clock computing for 20 ms a part, rank
    1 pausing 0.6 s after every 6th clock: without the empty clocks
    declared, the shards could apply no clock past rank 1's last until it
    woke, and ranks 0 and 2 would read data ages of at most that clock while
    it slept."""
    workers = start_workers(3, "--runs", str(RUNS), "--clocks", str(CLOCKS), "--steal", "--slack", "2",
                            "--rule", "add", "--slow-rank", "1", "--slow-s", "0.6", "--slow-every", "6",
                            "--work-s", "0.02", program=PROGRAM)
    ranks = _results(workers, 3)
    assert int(ranks[1]["given"]) > 0
    assert int(ranks[0]["taken"]) > 0 and int(ranks[2]["taken"]) > 0
    ahead = 0
    for began, ended, clock in ranks[1]["pauses"]:
        for r in (0, 2):
            seen = ranks[r]["seen"]
            during = seen[(seen[:, 0] > began) & (seen[:, 0] < ended)]
            # Data ages are per branch and run; rank 1 had finished `clock` of this branch.
            same_run = during[(during[:, 1] > clock) & (during[:, 1] <= clock + CLOCKS)]
            if len(same_run) and same_run[:, 2].max() > clock:
                ahead += 1
    assert ahead >= 2, f"ranks 0 and 2 saw no clock past rank 1's while it slept ({ahead})"
    _check_every_sample_counts_once(ranks)


def test_under_bsp_nothing_is_stolen(start_workers) -> None:  # type: ignore[no-untyped-def]
    """A thief under BSP would wait for the late rank's last clock, then
    compute its part after it: the session steals only at slack >= 1."""
    workers = start_workers(2, "--runs", "1", "--clocks", "12", "--steal", "--slack", "0", "--rule", "add",
                            "--slow-rank", "1", "--slow-s", "0.3", "--slow-every", "6", program=PROGRAM)
    ranks = _results(workers, 2)
    assert [int(r["taken"]) for r in ranks] == [0, 0] and [int(r["given"]) for r in ranks] == [0, 0]
    np.testing.assert_array_equal(ranks[1]["counts"], BATCH)
