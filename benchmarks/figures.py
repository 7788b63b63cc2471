"""The one record every benchmark hands to the suite (benchmarks/run.py):
a measured figure of mltuner, the baseline it was measured against in the
same run, their ratio and the goal, if the issues set one.

Each benchmark script takes ``--figures PATH`` and writes its headline
figures there as a JSON list (``write_figures``); its own detailed tables go
to its ``--out`` file and its output as before.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal, Optional

Better = Literal["higher", "lower"]


@dataclasses.dataclass
class Figure:
    """One headline figure. ``ratio`` compares mltuner with ``baseline`` as
    ``ratio_means`` says (for example "raw time / mltuner time");
    ``better`` says which way the ratio improves, and ``goal`` is the ratio
    an issue asks for (None: no goal, the figure is reported for reading).
    A figure that sums up several measurements (seeds, table sizes) has
    their median as ``ratio`` and their [min, max] as ``ratio_range``."""

    benchmark: str
    name: str
    value: Optional[float]
    unit: str
    baseline: str
    baseline_value: Optional[float]
    ratio: Optional[float]
    ratio_means: str
    better: Better = "higher"
    goal: Optional[float] = None
    note: str = ""
    ratio_range: Optional[list[float]] = None

    @property
    def met(self) -> Optional[bool]:
        """Whether the goal is met; None without a goal or a ratio."""
        if self.goal is None or self.ratio is None:
            return None
        return self.ratio >= self.goal if self.better == "higher" else self.ratio <= self.goal

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "met": self.met}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Figure":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, or None when either is missing or the
    denominator is not positive (a run that never reached its target)."""
    if numerator is None or denominator is None or not denominator > 0 or not math.isfinite(numerator):
        return None
    return numerator / denominator


def spread(ratios: list[float]) -> Optional[list[float]]:
    """[min, max] of several ratios; None for fewer than two."""
    return [min(ratios), max(ratios)] if len(ratios) > 1 else None


def write_figures(path: Optional[str], figures: list[Figure]) -> None:
    """Writes ``figures`` to ``path`` as JSON; nothing when path is None."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([f.to_json() for f in figures], indent=1) + "\n")


def read_figures(path: Path) -> list[Figure]:
    return [Figure.from_json(item) for item in json.loads(path.read_text())]
