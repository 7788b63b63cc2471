"""The batch balancer's arithmetic: integer splits, and shares that make
simulated ranks' busy times equal, from measurements alone."""

from __future__ import annotations

import numpy as np
import pytest

from mltuner.tune._errors import TuningError
from mltuner.tune.session._balance import BatchBalancer, split_counts
from mltuner.tune.session._commands import RunCommand, check_report, parse_command


@pytest.mark.parametrize("total,fractions,want", [
    (64, [0.5, 0.5], [32, 32]),
    (10, [1 / 3, 1 / 3, 1 / 3], [4, 3, 3]),  # the remainder to the lower rank
    (64, [0.999, 0.001], [63, 1]),  # one sample at least
    (3, [0.0, 0.5, 0.5], [1, 1, 1]),
    (1, [0.5, 0.5], [1, 0]),  # fewer samples than ranks
    (0, [0.5, 0.5], [0, 0]),
])
def test_split_counts(total: int, fractions: list[float], want: list[int]) -> None:
    assert split_counts(total, fractions) == want


def busy(fixed: list[float], per_sample: list[float], counts: list[int], rng: np.random.Generator,
         noise: float) -> list[float]:
    return [(a + b * n) * (1 + noise * rng.standard_normal()) for a, b, n in zip(fixed, per_sample, counts)]


@pytest.mark.parametrize("fixed,per_sample", [
    ([0.1, 2.1], [0.1, 0.1]),    # rank 1 sleeps after each clock: the straggler benchmark's kind
    ([0.2, 0.2], [0.05, 0.15]),  # rank 1 computes 3x slower
    ([0.1, 0.1, 0.1, 0.5], [0.1, 0.1, 0.2, 0.1]),
])
def test_shares_converge_to_equal_busy_times(fixed: list[float], per_sample: list[float]) -> None:
    total, world = 64, len(fixed)
    rng = np.random.default_rng(0)
    balancer = BatchBalancer(world)
    counts = split_counts(total, balancer.fractions(total))
    assert counts == [total // world] * world  # nothing measured yet: equal parts
    for _ in range(6):
        balancer.observe(counts, busy(fixed, per_sample, counts, rng, noise=0.03))
        counts = split_counts(total, balancer.fractions(total))
    times = [a + b * n for a, b, n in zip(fixed, per_sample, counts)]
    slowest_equal = max(a + b * total / world for a, b in zip(fixed, per_sample))
    assert max(times) < 0.85 * slowest_equal, (counts, times)
    # Within the balancer's 5% (it keeps shares that promise less) and a
    # sample's rounding of the best clock: the least T at which the ranks,
    # each at one sample or more, can compute the clock's samples.
    low, high = 0.0, slowest_equal
    for _ in range(60):
        middle = (low + high) / 2
        fits = sum(max(1.0, (middle - a) / b) for a, b in zip(fixed, per_sample)) >= total
        low, high = (low, middle) if fits else (middle, high)
    assert max(times) <= 1.05 * high + max(per_sample), (counts, times, high)


def test_equal_ranks_keep_equal_shares_through_noise() -> None:
    """Shares that followed the noise would make one rank the slow one."""
    rng = np.random.default_rng(1)
    balancer = BatchBalancer(2)
    counts = [32, 32]
    for _ in range(8):
        balancer.observe(counts, busy([0.5, 0.5], [0.1, 0.1], counts, rng, noise=0.02))
        counts = split_counts(64, balancer.fractions(64))
        assert counts == [32, 32]


def test_run_commands_carry_shares() -> None:
    command = RunCommand(3, 10, (0.75, 0.25))
    assert parse_command(command.to_wire()) == command
    assert parse_command(RunCommand(3, 10).to_wire()).shares is None
    assert parse_command({"op": "run", "branch": 1, "clocks": 2, "shares": [3, 1]}).shares == (0.75, 0.25)


@pytest.mark.parametrize("shares", [[], "half", [0.5, float("nan")], [0.5, -0.1], [0, 0], [True, False]])
def test_malformed_shares_are_refused(shares: object) -> None:
    with pytest.raises(TuningError, match="shares"):
        parse_command({"op": "run", "branch": 1, "clocks": 2, "shares": shares})


def ssp_seconds_per_clock(counts: list[int], slack: int, clocks: int = 4000) -> float:
    """An independent replay of SSP with rank 1 in bursts (10 t after 10% of
    its clocks), t = 32 samples' time: a rank starts clock c when every rank
    has finished clock c - slack - 1."""
    rng = np.random.default_rng(123)
    per_sample = 1 / 32
    done = [[0.0] * clocks for _ in counts]
    for c in range(clocks):
        gate = max(d[c - slack - 1] for d in done) if c > slack else 0.0
        for r, n in enumerate(counts):
            burst = 10.0 if r == 1 and rng.random() < 0.1 else 0.0
            done[r][c] = max(done[r][c - 1] if c else 0.0, gate) + n * per_sample + burst
    return max(d[-1] for d in done) / clocks


def bursty_balancer(slack: int) -> list[int]:
    rng = np.random.default_rng(5)
    balancer = BatchBalancer(2)
    counts = [32, 32]
    for _ in range(6):
        clocks = np.array([[n / 32 for n in counts]] * 64)
        clocks[:, 1] += 10.0 * (rng.random(64) < 0.1)
        balancer.observe(counts, clocks.mean(axis=0).tolist(), clocks.T.tolist())
        counts = split_counts(64, balancer.fractions(64, slack))
    return counts


def test_bursts_keep_their_share_under_bsp() -> None:
    """Under BSP a clock costs its slowest rank's time: a burst costs the same
    whatever the bursty rank computes, so shares by mean time would be slower."""
    counts = bursty_balancer(slack=0)
    assert counts == [32, 32]
    assert ssp_seconds_per_clock([48, 16], 0) > 1.1 * ssp_seconds_per_clock([32, 32], 0)


def test_bursts_move_samples_where_a_slack_lets_the_bursty_rank_catch_up() -> None:
    counts = bursty_balancer(slack=7)
    assert counts[1] < 28, counts
    assert ssp_seconds_per_clock(counts, 7) < 0.92 * ssp_seconds_per_clock([32, 32], 7)


def test_a_fixed_delay_is_found_within_three_runs_when_each_clock_costs_more_than_its_samples() -> None:
    """As measured on the 2-core machine: a clock costs about 3 ms whatever its
    size, 32 samples 1 ms, rank 1 sleeps 2 ms after each. Rank 0's own runs
    cannot tell its small slope from noise; the slope of both ranks' runs can."""
    rng = np.random.default_rng(2)
    balancer = BatchBalancer(2)
    counts = [32, 32]
    for _ in range(3):
        balancer.observe(counts, busy([3.0, 5.0], [1 / 32, 1 / 32], counts, rng, noise=0.05))
        counts = split_counts(64, balancer.fractions(64, slack=3))
    assert counts == [63, 1]


GOOD_REPORT = {"loss": [0.5, float("nan")], "accuracy": [None, 0.25], "samples": [3, 0], "busy": 0.01,
               "busy_samples": 3.0, "busy_clocks": [0.01, 0.02]}


def test_a_runs_reports_are_checked_as_they_come_over_the_network() -> None:
    check_report(1, GOOD_REPORT, 2, balanced=True)
    check_report(1, {k: v for k, v in GOOD_REPORT.items() if not k.startswith("busy")}, 2, balanced=False)


@pytest.mark.parametrize("change", [
    {"loss": [0.5]},  # a clock short
    {"loss": [0.5, "x"]},
    {"accuracy": [True, 0.1]},
    {"samples": [3, -1]},
    {"samples": [3, 1.5]},
    {"busy": None},
    {"busy_samples": "3"},
    {"busy_clocks": "fast"},
    {"busy_clocks": [0.1, None]},
])
def test_malformed_reports_name_the_rank(change: dict[str, object]) -> None:
    with pytest.raises(TuningError, match="rank 1 sent a malformed report"):
        check_report(1, {**GOOD_REPORT, **change}, 2, balanced=True)
    with pytest.raises(TuningError, match="rank 1 sent a malformed report"):
        check_report(1, ["not", "a", "report"], 2, balanced=False)


def test_with_stealing_a_rank_is_modelled_on_its_typical_clock() -> None:
    """A rank with bursts of delay: its mean clock is long, its median is
    not. Stealing absorbs the bursts, so its share must not shrink for them."""
    from mltuner.tune.session._session import typical_busy
    clocks = [0.01] * 9 + [0.1]
    assert typical_busy(clocks, stealing=False) == pytest.approx(0.019)
    assert typical_busy(clocks, stealing=True) == pytest.approx(0.01)
    assert typical_busy([], stealing=True) == 0.0
