"""The first proposals of a model-based search: a space-filling design.

TPE, GP and CMA-ES draw their first ``n_startup_trials`` settings at random.
A short job's search runs only four to six trials, and four independent
draws over five decades of learning rate leave all of them in one bad
region about one time in four (seen: 0.74, 0.001, 0.0001, 0.0005, and the
job trained the start setting to 65%). A shifted Halton sequence spreads
every prefix of the design over each axis: its first two points split the
first axis's range in halves, its first four in quarters, and so on, so a
search that can afford only a few trials still covers the range. The shift
(a Cranley-Patterson rotation, seeded) keeps designs of different seeds
apart.
"""

from __future__ import annotations

import math
import random
from typing import Any

from mltuner.tune._space import Choice, LogUniform, SearchSpace, Tunable, Uniform

# One prime base per searched axis; the first axis, base 2, is stratified
# best, so the space's first searched tunable (the learning rate in the
# default space) should be the one that matters most.
_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def radical_inverse(index: int, base: int) -> float:
    """The van der Corput value of ``index`` in ``base``: its digits
    mirrored behind the point (1 -> 0.5, 2 -> 0.25, 3 -> 0.75 in base 2)."""
    value, scale = 0.0, 1.0 / base
    while index > 0:
        index, digit = divmod(index, base)
        value += digit * scale
        scale /= base
    return value


def value_at(tunable: Tunable, unit: float) -> Any:
    """The value of ``tunable`` at ``unit`` in [0, 1) along its search scale:
    log for LogUniform, linear for Uniform, the ``floor(unit * n)``-th value
    of a Choice."""
    if isinstance(tunable, LogUniform):
        low, high = math.log(tunable.low), math.log(tunable.high)
        return min(tunable.high, max(tunable.low, math.exp(low + unit * (high - low))))
    if isinstance(tunable, Uniform):
        return min(tunable.high, tunable.low + unit * (tunable.high - tunable.low))
    assert isinstance(tunable, Choice)
    return tunable.values[min(len(tunable.values) - 1, int(unit * len(tunable.values)))]


def startup_design(space: SearchSpace, count: int, seed: int | None = None) -> list[dict[str, Any]]:
    """``count`` decoded settings of a shifted Halton design over the
    searched tunables (the others at their defaults); ``seed`` fixes the
    shift, None draws it from the system's entropy."""
    searched = space.searched
    rng = random.Random(seed)
    shifts = [rng.random() for _ in searched]
    design = []
    for index in range(count):
        setting = space.defaults()
        for axis, (tunable, shift) in enumerate(zip(searched, shifts)):
            # Axes past the bases (a space of more than 12 tunables) are drawn at random.
            unit = (radical_inverse(index, _BASES[axis]) + shift) % 1.0 if axis < len(_BASES) \
                else rng.random()
            setting[tunable.name] = value_at(tunable, unit)
        design.append(setting)
    return design
