"""The progress summariser (mltuner.md §1.3) on curves with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mltuner.tune import (
    DIVERGENCE_THRESHOLD,
    GO_UP_THRESHOLD,
    NUM_POINTS,
    ProgressState,
    summarize_progress,
)


def clock_times(n: int, seconds: float = 0.1) -> list[float]:
    return [seconds * (i + 1) for i in range(n)]


def test_constants_are_the_papers() -> None:
    assert NUM_POINTS == 10
    assert GO_UP_THRESHOLD == 0.1
    assert DIVERGENCE_THRESHOLD == 10.0


def test_noisy_but_decreasing_curve_is_converging() -> None:
    rng = np.random.default_rng(0)
    n = 200
    losses = 10.0 - 0.04 * np.arange(n) + rng.normal(0.0, 0.1, n)
    # Raw points rise often; the 20-clock window means do not.
    assert np.any(np.diff(losses) > 0)
    summary = summarize_progress(clock_times(n), list(losses), baseline=10.0)
    assert summary.state is ProgressState.CONVERGING
    assert summary.noise <= GO_UP_THRESHOLD * abs(summary.range)
    assert summary.slope < 0 and summary.made_progress


def test_curve_rising_tenfold_is_diverged() -> None:
    losses = list(np.geomspace(1.5, 11.0, 30))
    summary = summarize_progress(clock_times(30), losses, baseline=1.0)
    assert summary.state is ProgressState.DIVERGED
    assert math.isnan(summary.slope) and not summary.made_progress


def test_divergence_threshold_is_strict() -> None:
    # Exactly 10x the start is not divergence; it is a rise, so no progress.
    summary = summarize_progress([1.0], [10.0], baseline=1.0)
    assert summary.state is ProgressState.UNSTABLE
    assert math.isnan(summary.slope)
    assert summarize_progress([1.0], [10.01], baseline=1.0).state is ProgressState.DIVERGED


def test_a_loss_below_zero_converges_and_diverges_as_it_does_above() -> None:
    # A loss with a constant offset (a Gaussian log-likelihood's) is the same
    # curve shifted: its state and slope must not change with the shift.
    losses = list(np.linspace(3.0, 1.0, 40))
    for shift in (0.0, -4.0, -100.0):
        summary = summarize_progress(clock_times(40), [v + shift for v in losses], baseline=3.2 + shift)
        assert summary.state is ProgressState.CONVERGING, shift
        assert summary.slope == pytest.approx(summarize_progress(clock_times(40), losses, baseline=3.2).slope)
    # From -1: diverged once it has risen by more than 9x its magnitude (10x a positive start).
    assert summarize_progress([1.0], [8.0], baseline=-1.0).state is ProgressState.UNSTABLE
    assert summarize_progress([1.0], [8.01], baseline=-1.0).state is ProgressState.DIVERGED


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_is_diverged(bad: float) -> None:
    losses = [9.0, 8.0, bad, 6.0, 5.0]
    summary = summarize_progress(clock_times(5), losses, baseline=10.0)
    assert summary.state is ProgressState.DIVERGED
    assert math.isnan(summary.slope)


def test_flat_noisy_curve_is_unstable() -> None:
    rng = np.random.default_rng(1)
    losses = list(5.0 + rng.normal(0.0, 0.5, 100))
    summary = summarize_progress(clock_times(100), losses, baseline=5.0)
    assert summary.state is ProgressState.UNSTABLE
    assert summary.noise > GO_UP_THRESHOLD * abs(summary.range)


def test_unstable_curve_scores_with_its_noise_added() -> None:
    # Baseline 10, then 9, 9.5 (a rise of 0.5), 8: range -2, noise 0.5.
    summary = summarize_progress([1.0, 2.0, 3.0], [9.0, 9.5, 8.0], baseline=10.0)
    assert summary.state is ProgressState.UNSTABLE
    assert summary.range == pytest.approx(-2.0)
    assert summary.noise == pytest.approx(0.5)
    assert summary.slope == pytest.approx((-2.0 + 0.5) / 3.0)


def test_slope_of_a_linear_curve() -> None:
    # loss = 10 - 0.5 t, one clock every 0.1 s: the window means and the
    # baseline lie on the line, so the slope is exactly -0.5 per second.
    times = clock_times(100)
    losses = [10.0 - 0.5 * t for t in times]
    summary = summarize_progress(times, losses, baseline=10.0)
    assert summary.state is ProgressState.CONVERGING
    assert summary.noise == 0.0
    assert summary.slope == pytest.approx(-0.5)
    assert summary.range == pytest.approx(-0.5 * np.mean(times[90:]))


def test_faster_progress_has_the_lower_slope() -> None:
    times = clock_times(50)
    slow = summarize_progress(times, [10.0 - 0.1 * t for t in times], baseline=10.0)
    fast = summarize_progress(times, [10.0 - 0.3 * t for t in times], baseline=10.0)
    assert fast.slope < slow.slope < 0


def test_a_rising_curve_makes_no_progress() -> None:
    times = clock_times(20)
    summary = summarize_progress(times, [10.0 + 0.1 * t for t in times], baseline=10.0)
    assert math.isnan(summary.slope)


@pytest.mark.parametrize(("clocks", "points"), [(9, 10), (19, 20), (25, 13), (105, 11), (200, 11)])
def test_downsampling_to_k_windows(clocks: int, points: int) -> None:
    # r = floor(N / 10); windows only when r > 1, the tail dropped; +1 for the baseline.
    times = clock_times(clocks)
    summary = summarize_progress(times, [10.0 - 0.01 * i for i in range(clocks)], baseline=10.0)
    assert summary.points == points


def test_downsampling_drops_the_tail() -> None:
    # 105 clocks: ten windows of 10; the last 5 clocks (a blow-up) are dropped.
    losses = [10.0 - 0.05 * i for i in range(100)] + [1e6] * 5
    summary = summarize_progress(clock_times(105), losses, baseline=10.0)
    assert summary.state is ProgressState.CONVERGING
    assert summary.made_progress


def test_baseline_is_prepended() -> None:
    # A flat curve below the shared baseline made progress since the fork...
    below = summarize_progress([1.0, 2.0], [8.0, 8.0], baseline=10.0)
    assert below.range == pytest.approx(-2.0)
    assert below.state is ProgressState.CONVERGING
    assert below.slope == pytest.approx(-1.0)
    # ...and one that jumps above it first is unstable even if it falls after.
    above = summarize_progress([1.0, 2.0, 3.0], [12.0, 11.0, 9.5], baseline=10.0)
    assert above.noise == pytest.approx(2.0)
    assert above.state is ProgressState.UNSTABLE


def test_flat_curve_at_the_baseline_makes_no_progress() -> None:
    summary = summarize_progress(clock_times(10), [10.0] * 10, baseline=10.0)
    assert summary.state is ProgressState.CONVERGING
    assert math.isnan(summary.slope) and not summary.made_progress


def test_no_elapsed_time_makes_no_slope() -> None:
    summary = summarize_progress([0.0, 0.0], [9.0, 8.0], baseline=10.0)
    assert math.isnan(summary.slope)


def test_start_time_offsets_the_baseline() -> None:
    summary = summarize_progress([11.0, 12.0], [9.0, 8.0], baseline=10.0, start_time=10.0)
    assert summary.span == pytest.approx(2.0)
    assert summary.slope == pytest.approx(-1.0)


def test_malformed_curves_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        summarize_progress([], [], baseline=1.0)
    with pytest.raises(ValueError, match="length"):
        summarize_progress([1.0], [1.0, 2.0], baseline=1.0)
