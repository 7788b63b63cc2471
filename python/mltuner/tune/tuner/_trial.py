"""One trial branch: its clocks so far and how many more it gets (mltuner.md §1.2)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from mltuner.tune._progress import ProgressSummary, summarize_progress
from mltuner.tune.tuner._searcher import Proposal
from mltuner.tune._system import ClockReport

__all__ = ["Trial", "NUM_PROGRESS_SAMPLES"]

# §1.2: a new trial first runs this many clocks (the paper says "e.g. three";
# the code uses 10, enough points for the K = 10 summariser).
NUM_PROGRESS_SAMPLES = 10


@dataclasses.dataclass
class Trial:
    """A trial branch forked from the search's parent.

    ``cap`` is one epoch in this trial's clocks (§1.2: a trial never runs
    longer than that). ``told`` is set once its result went to the searcher.
    """

    proposal: Proposal
    branch: int
    cap: int
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    summary: ProgressSummary | None = None
    told: bool = False

    @property
    def tunables(self) -> dict[str, Any]:
        return self.proposal.tunables

    @property
    def clocks(self) -> int:
        return len(self.losses)

    @property
    def run_time(self) -> float:
        """Seconds this branch has run (its own time only)."""
        return math.fsum(self.seconds)

    @property
    def capped(self) -> bool:
        return self.clocks >= self.cap

    @property
    def slope(self) -> float:
        return math.nan if self.summary is None else self.summary.slope

    def time_per_clock(self) -> float:
        # §1.2: measured from the second clock on; the first one carries the
        # cost of the fork and of switching branches.
        measured = self.seconds[1:] or self.seconds
        return math.fsum(measured) / len(measured)

    def clocks_to_reach(self, trial_time: float, first_clocks: int = NUM_PROGRESS_SAMPLES) -> int:
        """How many more clocks bring this trial to ``trial_time`` seconds:
        ``first_clocks`` for a new trial, then up to floor(trial_time /
        time_per_clock) clocks in all, never past the one-epoch cap (§1.2)."""
        if self.clocks == 0:
            return min(first_clocks, self.cap)
        per_clock = self.time_per_clock()
        # A clock that took no measurable time: only the cap bounds the trial.
        target = self.cap if per_clock <= 0 else min(self.cap, math.floor(trial_time / per_clock))
        return max(0, target - self.clocks)

    def record(self, reports: Sequence[ClockReport]) -> None:
        for report in reports:
            self.losses.append(float(report.loss))
            self.seconds.append(float(report.seconds))

    def summarize(self, baseline: float) -> ProgressSummary:
        """Summarises the curve so far against the search's starting progress."""
        times: list[float] = []
        elapsed = 0.0
        for seconds in self.seconds:
            elapsed += seconds
            times.append(elapsed)
        self.summary = summarize_progress(times, self.losses, baseline)
        return self.summary
