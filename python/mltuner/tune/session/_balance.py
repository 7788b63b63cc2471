"""Batch shares by speed: each rank's part of a clock's samples, so that a
slow rank gets fewer and the clocks go faster.

A clock's samples are the same set whatever the split, so with each rank's
mean gradient weighted by its share (``Step.weight``) the summed update is
the one of equal batches; only who computes what moves. Bounded staleness
hides delays that come and go, if the delayed rank can catch up; a rank
that is slow for good (a slower device, a busy host) holds every other rank
back under any slack, and only a smaller share helps it. Load-balanced BSP
(Chen et al., 2019) does the same for synchronous training.

Each rank's busy time per clock (its step time less the time it waited for
the engine, which is waiting for the others) is modelled as ``a + b n + e``
for n samples: ``a`` what a clock costs whatever its size (the clock's own
work, a straggler's sleep), ``b`` the time per sample, both from a
least-squares fit over the recent runs, and ``e`` the clock's deviation
from its run's mean, drawn from the rank's recent clocks. ``b`` is one slope
for all ranks, fitted to every rank's runs about the rank's own mean: the
ranks train one model, and one rank's few sizes cannot tell a slope of a
few percent of its clock from noise. (Ranks whose devices differ get the
mean slope; their ``a`` absorbs the rest at the sizes they run, and the next
runs correct it.) Before any rank's size has moved the model is
proportional (``a = 0``), which moves the shares enough to measure. Shares that give every
rank the same mean time are best only when nothing varies: under BSP
(slack 0) each clock costs the slowest rank's time, so a rank with bursts of
delay should keep its part, since its bursts cost the same whatever it
computes. So the balancer predicts the time per clock of candidate shares
between equal parts and equal mean times by replaying the model under the
run's slack (a rank starts clock c once every rank has finished clock
c - slack - 1), and takes the fastest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = ["BatchBalancer", "split_counts"]

# Runs each rank's fit looks back on: enough to average noise, few enough to
# follow a rank whose speed changes.
_HISTORY = 6
# Below this relative spread of the sizes seen, a fit of a and b is noise.
_MIN_SPREAD = 0.05
# New shares must promise a clock this much shorter: measurements of equal
# ranks differ by noise, and shares that follow it cost more than they gain.
_MIN_GAIN = 0.05
# Clock deviations kept per rank, and clocks replayed per candidate.
_DEVIATIONS = 512
_REPLAY_CLOCKS = 512
# Candidate shares: this many steps from equal parts to equal mean times.
_STEPS = 10


def split_counts(total: int, fractions: Sequence[float]) -> list[int]:
    """``total`` samples split by ``fractions`` (largest remainders, ties to
    the lower rank), at least one per rank while there are enough."""
    raw = [total * f for f in fractions]
    counts = [math.floor(r) for r in raw]
    left = total - sum(counts)
    by_remainder = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in by_remainder[:left]:
        counts[i] += 1
    if total >= len(counts):
        for i, count in enumerate(counts):
            if count == 0:
                counts[max(range(len(counts)), key=lambda j: (counts[j], -j))] -= 1
                counts[i] = 1
    return counts


class _RankModel:
    """One rank's busy seconds per clock: a + b * samples, and deviations."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=_HISTORY)
        self.deviations: deque[float] = deque(maxlen=_DEVIATIONS)

    def usable(self) -> list[tuple[float, float]]:
        return [(n, t) for n, t in self.points if n > 0 and t > 0]

    def moments(self) -> tuple[float, float] | None:
        """(covariance, variance) of time and size about this rank's means,
        or None while its sizes have too little spread to fit."""
        points = self.usable()
        if not points:
            return None
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        if max(n for n, _ in points) - min(n for n, _ in points) <= _MIN_SPREAD * mean_n:
            return None
        return (sum((n - mean_n) * (t - mean_t) for n, t in points),
                sum((n - mean_n) ** 2 for n, _ in points))

    def fit(self, slope: float | None) -> tuple[float, float] | None:
        """(a, b) with b = ``slope`` (None: proportional), or None before any
        run with samples and time."""
        points = self.usable()
        if not points:
            return None
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        if slope is not None and slope * mean_n <= mean_t:
            return mean_t - slope * mean_n, slope
        # Proportional: least squares through the origin.
        return 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points)


class BatchBalancer:
    """Rank 0's estimate of every rank's speed, and the shares it implies.

    Args:
        world_size: the ranks that share each clock's samples.
        seed: of the replay's draws of past deviations.
    """

    def __init__(self, world_size: int, seed: int = 0) -> None:
        self._models = [_RankModel() for _ in range(world_size)]
        self._fractions = [1.0 / world_size] * world_size
        self._rng = np.random.default_rng(seed)
        self._slope: float | None = None  # seconds per sample, the last positive fit

    def observe(self, samples_per_clock: Sequence[float], busy_per_clock: Sequence[float],
                busy_clocks: Sequence[Sequence[float]] | None = None) -> None:
        """One run, every rank's: mean samples and busy seconds per clock,
        and (optional) the busy seconds of some of its clocks, whose
        deviations from that mean are the rank's variation."""
        clocks = busy_clocks if busy_clocks is not None else [[] for _ in self._models]
        for model, n, t, each in zip(self._models, samples_per_clock, busy_per_clock, clocks, strict=True):
            if math.isfinite(n) and math.isfinite(t):
                model.points.append((float(n), float(t)))
                model.deviations.extend(float(c) - t for c in each if math.isfinite(c))

    def fractions(self, total: int, slack: int = 0) -> list[float]:
        """Each rank's fraction of a clock of ``total`` samples at ``slack``:
        the fastest of the candidates by the replayed model; the previous
        fractions while a rank has no model yet, or when no candidate is
        ``_MIN_GAIN`` faster than them."""
        moments = [m for m in (model.moments() for model in self._models) if m is not None]
        if moments and sum(c for c, _ in moments) > 0:
            self._slope = sum(c for c, _ in moments) / sum(v for _, v in moments)
        fits = [model.fit(self._slope) for model in self._models]
        if any(fit is None for fit in fits) or total < len(fits):
            return list(self._fractions)
        known = [fit for fit in fits if fit is not None]
        equal = np.full(len(known), total / len(known))
        balanced = np.array(_equal_time_counts(total, known))
        steps = np.linspace(0.0, 1.0, _STEPS + 1)[:, None]
        candidates = np.vstack([equal + steps * (balanced - equal), np.array(self._fractions) * total])
        seconds = self._replay(candidates, known, slack)
        best = int(np.argmin(seconds[:-1]))
        if seconds[best] < (1 - _MIN_GAIN) * seconds[-1]:
            self._fractions = [float(n) / total for n in candidates[best]]
        return list(self._fractions)

    def _replay(self, counts: np.ndarray, fits: Sequence[tuple[float, float]], slack: int) -> np.ndarray:
        """Mean seconds per clock of each row of ``counts`` (candidates x
        ranks) over the same draws of the ranks' deviations."""
        a = np.array([fit[0] for fit in fits])
        b = np.array([fit[1] for fit in fits])
        mean = a + b * np.maximum(np.rint(counts), 1.0)  # candidates x ranks
        draws = np.zeros((_REPLAY_CLOCKS, len(fits)))
        for rank, model in enumerate(self._models):
            if model.deviations:
                past = np.fromiter(model.deviations, dtype=float)
                draws[:, rank] = past[self._rng.integers(0, len(past), _REPLAY_CLOCKS)]
        lag = min(max(int(slack), 0), _REPLAY_CLOCKS) + 1
        finished = np.zeros((_REPLAY_CLOCKS, *mean.shape))
        previous = np.zeros(mean.shape)
        for clock in range(_REPLAY_CLOCKS):
            start = previous
            if clock >= lag:
                start = np.maximum(start, finished[clock - lag].max(axis=1, keepdims=True))
            previous = finished[clock] = start + np.maximum(mean + draws[clock], 0.0)
        result: np.ndarray = previous.max(axis=1) / _REPLAY_CLOCKS
        return result


def _equal_time_counts(total: int, fits: Sequence[tuple[float, float]]) -> list[float]:
    """Real counts n_r >= 1 with sum ``total`` and a_r + b_r n_r equal
    wherever n_r > 1: a rank whose fixed cost alone exceeds the others' time
    keeps the one sample."""
    floor_ranks: set[int] = set()
    while True:
        active = [r for r in range(len(fits)) if r not in floor_ranks]
        samples = total - len(floor_ranks)
        pace = sum(1.0 / fits[r][1] for r in active)
        finish = (samples + sum(fits[r][0] / fits[r][1] for r in active)) / pace
        counts = {r: (finish - fits[r][0]) / fits[r][1] for r in active}
        low = {r for r, n in counts.items() if n < 1.0}
        if not low:
            return [1.0 if r in floor_ranks else counts[r] for r in range(len(fits))]
        floor_ranks |= low
