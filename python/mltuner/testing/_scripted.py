"""A training system whose numbers the test gives: the state machine's
tests need known answers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mltuner.testing._checks import clock_count, live_branch
from mltuner.tune._system import BranchKind, ClockReport

__all__ = ["ScriptedSystem", "LossCurve", "AccuracyCurve"]

LossCurve = Callable[[Mapping[str, Any], int], float]
"""The loss of a TRAINING branch with these tunables at its clock c."""
AccuracyCurve = Callable[[Mapping[str, Any], int], float]
"""The validation accuracy of a branch that trained c clocks, the last
stretch of them with these tunables."""


class ScriptedSystem:
    """A :class:`~mltuner.tune.BranchSystem` whose numbers are given by the test.

    A TRAINING branch's loss at its own clock c (counting from its fork,
    continuing its parent's count) is ``curve(tunables, c)``; EVALUATION
    branches report ``baseline``, or ``baseline(c)`` for a callable, c being
    the clock count of the branch they were forked from. A validation (TESTING branch) reports
    ``accuracy(tunables, c)`` for the branch it was forked from when given,
    else the n-th validation reports ``accuracies[n]`` (the last value
    repeats). Each clock takes ``seconds(tunables)``.

    It records every fork (``forks``: branch, parent, kind, tunables),
    every run (``runs``: branch, clocks) and every free (``freed``), and the
    most branches alive at once (``max_live``); :meth:`live` lists those
    alive now. Use it to test a driver's decisions on known curves::

        system = ScriptedSystem(lambda t, c: 10.0 * math.exp(-t["lr"] * c))
        result = Tuner(system, space, config).run()
        assert system.live() == [result.branch]
    """

    def __init__(self, curve: LossCurve, *, baseline: float | Callable[[int], float] = 10.0,
                 seconds: Callable[[Mapping[str, Any]], float] = lambda t: 0.01,
                 accuracies: Sequence[float] = (0.5,), clocks_per_epoch: int = 100,
                 accuracy: AccuracyCurve | None = None) -> None:
        self.accuracy = accuracy
        self.curve = curve
        self.baseline = baseline
        self.seconds = seconds
        self.accuracies = list(accuracies)
        self.epoch = clocks_per_epoch
        self.validations = 0
        self.branches: dict[int, tuple[BranchKind, dict[str, Any], int]] = {}
        self.forks: list[tuple[int, int | None, BranchKind, dict[str, Any]]] = []
        self.freed: list[int] = []
        self.runs: list[tuple[int, int]] = []
        self.max_live = 0
        self._next = 0

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        start = 0 if parent is None else self.branches[live_branch(parent, self.branches)][2]
        branch = self._next
        self._next += 1
        self.branches[branch] = (kind, dict(tunables), start)
        self.forks.append((branch, parent, kind, dict(tunables)))
        self.max_live = max(self.max_live, len(self.branches))
        return branch

    def free(self, branch: int) -> None:
        del self.branches[live_branch(branch, self.branches)]
        self.freed.append(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        clocks = clock_count(clocks)
        kind, tunables, done = self.branches[live_branch(branch, self.branches)]
        self.runs.append((branch, clocks))
        seconds = self.seconds(tunables)
        if kind is BranchKind.TESTING:
            if self.accuracy is not None:
                accuracy = self.accuracy(tunables, done)
            else:
                accuracy = self.accuracies[min(self.validations, len(self.accuracies) - 1)]
            self.validations += 1
            return [ClockReport(0.0, seconds, accuracy) for _ in range(clocks)]
        if kind is BranchKind.TRAINING:
            reports = [ClockReport(self.curve(tunables, done + i), seconds) for i in range(clocks)]
        else:
            level = self.baseline(done) if callable(self.baseline) else self.baseline
            reports = [ClockReport(float(level), seconds) for _ in range(clocks)]
        self.branches[branch] = (kind, tunables, done + clocks)
        return reports

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return self.epoch

    def live(self) -> list[int]:
        return sorted(self.branches)
