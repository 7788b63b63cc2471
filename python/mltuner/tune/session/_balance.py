"""Batch shares by speed: each rank's part of a clock's samples, so that a
slow rank gets fewer and every rank finishes its clock at the same time.

A clock's samples are the same set whatever the split, so with each rank's
mean gradient weighted by its share (``Step.weight``) the summed update is
the one of equal batches; only who computes what moves. Bounded staleness
hides delays that come and go; a rank that is slow for good (a slower
device, a busy host) holds every other rank back under any slack, and only
a smaller share helps it. Load-balanced BSP (Chen et al., 2019) does the
same for synchronous training.

Each rank's busy time per clock (its step time less the time it waited for
the engine, which is waiting for the others) is modelled as ``a + b n``
for n samples: ``a`` what a clock costs whatever its size (the clock's own
work, a straggler's sleep), ``b`` the time per sample. Both come from a
least-squares fit over the rank's recent runs; until the runs have spread in
n, the model is proportional (``a = 0``), whose fixed point is also equal
busy times. The shares then solve ``a_r + b_r n_r = T`` for all ranks with
``sum(n_r) = N``, no rank below one sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

__all__ = ["BatchBalancer", "split_counts"]

# Runs each rank's fit looks back on: enough to average noise, few enough to
# follow a rank whose speed changes.
_HISTORY = 6
# Below this relative spread of the sizes seen, a fit of a and b is noise.
_MIN_SPREAD = 0.05
# New shares must promise a clock this much shorter: measurements of equal
# ranks differ by noise, and shares that follow it cost more than they gain.
_MIN_GAIN = 0.05


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
    """One rank's busy seconds per clock as a + b * samples."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=_HISTORY)

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any run with samples and time."""
        points = [(n, t) for n, t in self.points if n > 0 and t > 0]
        if not points:
            return None
        sizes = [n for n, _ in points]
        mean_n = sum(sizes) / len(sizes)
        mean_t = sum(t for _, t in points) / len(points)
        spread = max(sizes) - min(sizes)
        if spread > _MIN_SPREAD * mean_n:
            covariance = sum((n - mean_n) * (t - mean_t) for n, t in points)
            variance = sum((n - mean_n) ** 2 for n in sizes)
            b = covariance / variance
            a = mean_t - b * mean_n
            if b > 0 and a >= 0:
                return a, b
        # Proportional: least squares through the origin.
        return 0.0, sum(n * t for n, t in points) / sum(n * n for n in sizes)


class BatchBalancer:
    """Rank 0's estimate of every rank's speed, and the shares it implies.

    Args:
        world_size: the ranks that share each clock's samples.
    """

    def __init__(self, world_size: int) -> None:
        self._models = [_RankModel() for _ in range(world_size)]
        self._fractions = [1.0 / world_size] * world_size

    def observe(self, samples_per_clock: Sequence[float], busy_per_clock: Sequence[float]) -> None:
        """One run's mean samples and busy seconds per clock, of every rank."""
        for model, n, t in zip(self._models, samples_per_clock, busy_per_clock, strict=True):
            if math.isfinite(n) and math.isfinite(t):
                model.points.append((float(n), float(t)))

    def fractions(self, total: int) -> list[float]:
        """Each rank's fraction of a clock of ``total`` samples: equal busy
        times under the fitted models; the previous fractions while a rank
        has no model yet or the new ones would not shorten the clock by
        ``_MIN_GAIN``."""
        fits = [model.fit() for model in self._models]
        if any(fit is None for fit in fits) or total < len(fits):
            return list(self._fractions)
        known = [fit for fit in fits if fit is not None]
        counts = _equal_time_counts(total, known)

        def clock_seconds(ns: Sequence[float]) -> float:
            return max(a + b * n for (a, b), n in zip(known, ns))

        if clock_seconds(counts) < (1 - _MIN_GAIN) * clock_seconds([f * total for f in self._fractions]):
            self._fractions = [n / total for n in counts]
        return list(self._fractions)


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
