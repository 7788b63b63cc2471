"""The progress summariser (mltuner.md §1.3): turns one branch's loss curve
into a state and a noise-penalised slope, lower is better."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ProgressState",
    "ProgressSummary",
    "summarize_progress",
    "NUM_POINTS",
    "GO_UP_THRESHOLD",
    "DIVERGENCE_THRESHOLD",
]

# §1.5: K. With K = 10, pure noise looks monotone with probability < 0.1% (§1.3.5).
NUM_POINTS = 10
# §1.5: epsilon = 1/K: no window may rise by more than one expected per-window drop.
GO_UP_THRESHOLD = 0.1
# §1.5: a curve whose last point exceeds 10x its first has diverged.
DIVERGENCE_THRESHOLD = 10.0


class ProgressState(enum.Enum):
    """What a loss curve's points show (:func:`summarize_progress`)."""

    CONVERGING = "converging"
    """Decreasing, with no rise larger than a tenth of the total drop."""
    UNSTABLE = "unstable"
    """Some rise between points exceeds GO_UP_THRESHOLD x |range|."""
    DIVERGED = "diverged"
    """A non-finite loss, or a last point above 10x the first (for a first
    point below zero: risen by more than 9x its magnitude)."""


@dataclasses.dataclass(frozen=True)
class ProgressSummary:
    """The summary of one curve.

    Attributes:
        state: CONVERGING, UNSTABLE or DIVERGED.
        slope: (range + noise) / span, in loss per second; NaN when it is
            >= 0 (no progress), when the curve diverged or when no time passed.
            Negative and lower is better.
        noise: the largest rise between consecutive points (>= 0).
        range: last point minus first point (the baseline).
        span: seconds between the first and the last point.
        points: how many points were summarised, the baseline included.
    """

    state: ProgressState
    slope: float
    noise: float
    range: float
    span: float
    points: int

    @property
    def made_progress(self) -> bool:
        """Whether the slope is finite (the curve went down)."""
        return math.isfinite(self.slope)


def _downsample(values: np.ndarray, window: int) -> np.ndarray:
    # §1.3 step 1: non-overlapping windows, the tail that fills no window dropped.
    usable = (len(values) // window) * window
    means: np.ndarray = values[:usable].reshape(-1, window).mean(axis=1)
    return means


def summarize_progress(
    times: Sequence[float],
    losses: Sequence[float],
    baseline: float,
    *,
    start_time: float = 0.0,
) -> ProgressSummary:
    """Summarises a loss curve against a shared starting point (§1.3).

    Args:
        times: the time at the end of each clock, in seconds of this branch's
            own run time, increasing.
        losses: the loss of each clock.
        baseline: the starting progress, prepended at ``start_time`` (the code
            does this; the paper does not mention it).
        start_time: when the branch started, on the clock of ``times``.

    A non-finite loss anywhere makes the curve DIVERGED (the paper counts
    numeric overflow; the original code never checked NaN).
    """
    if len(times) != len(losses):
        raise ValueError(f"times and losses differ in length: {len(times)} vs {len(losses)}")
    if not losses:
        raise ValueError("cannot summarise an empty curve")
    t = np.asarray(times, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if not math.isfinite(baseline) or not np.all(np.isfinite(y)):
        return ProgressSummary(ProgressState.DIVERGED, math.nan, math.nan, math.nan,
                               float(t[-1] - start_time), len(y) + 1)
    window = len(y) // NUM_POINTS
    if window > 1:
        t, y = _downsample(t, window), _downsample(y, window)
    t = np.concatenate(([start_time], t))
    y = np.concatenate(([baseline], y))

    change = float(y[-1] - y[0])
    span = float(t[-1] - t[0])
    noise = max(0.0, float(np.max(np.diff(y))))
    # 10x the first point, measured as a rise of 9x its magnitude, so that a
    # loss below zero (a log-likelihood's, a loss with a constant offset) can
    # converge too; the same rule as the paper's for a positive first point.
    if y[-1] - y[0] > (DIVERGENCE_THRESHOLD - 1.0) * abs(y[0]):
        state = ProgressState.DIVERGED
    elif noise > GO_UP_THRESHOLD * abs(change):
        state = ProgressState.UNSTABLE
    else:
        state = ProgressState.CONVERGING

    # §1.3 step 4: a slope >= 0 is no progress; a diverged curve never scores.
    slope = math.nan
    if state is not ProgressState.DIVERGED and span > 0:
        raw = (change + noise) / span
        if raw < 0:
            slope = raw
    return ProgressSummary(state, slope, noise, change, span, len(y))
