"""Simulated training systems for the tuner tests.

``QuadraticSystem`` trains a noisy quadratic bowl with the parameter server's
momentum rule (h = (1 - m) g + m h; w -= lr h, mltuner.md §2): curvatures from
10 down to 0.01, so a learning rate above about 0.2 diverges and a small one
crawls along the flat directions. Mini-batch noise shrinks with the batch
size; a clock's simulated time grows with the batch size and shrinks with
staleness, and a stale branch computes its gradient on old weights. Every
branch has its own seeded random stream, forked with the branch, so trials
from one parent see the same data and every run is deterministic.

``ScriptedSystem`` reports exactly the losses, clock times and accuracies a
test gives it, and records every fork, run and free, for the state-machine
tests that need known answers.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from mltuner.tune import BranchKind, ClockReport

CURVATURES = np.logspace(1, -2, 12)
GRADIENT_NOISE = 2.0      # per-sample gradient noise (scaled by sqrt(curvature / batch))
LOSS_NOISE = 0.02         # relative noise of a reported mini-batch loss
ACCURACY_NOISE = 0.002    # noise of one validation


@dataclasses.dataclass
class _Branch:
    kind: BranchKind
    tunables: dict[str, Any]
    w: np.ndarray
    h: np.ndarray
    history: deque[np.ndarray]
    rng: np.random.Generator
    clocks: int = 0


def _copy_rng(rng: np.random.Generator) -> np.random.Generator:
    child = np.random.Generator(np.random.PCG64())
    child.bit_generator.state = rng.bit_generator.state
    return child


class QuadraticSystem:
    """A BranchSystem over a simulated model (see the module docstring).

    Args:
        samples_per_epoch: training samples (clocks per epoch = this // batch).
        seed: seeds the data stream of the root branch.
        loss_scale: multiplies every loss (the starting loss is about 10).
        nan_from_start: every reported loss is NaN (a broken model).
    """

    def __init__(self, samples_per_epoch: int = 6400, seed: int = 0,
                 loss_scale: float = 1.0, nan_from_start: bool = False) -> None:
        self.samples_per_epoch = samples_per_epoch
        self.loss_scale = loss_scale
        self.nan_from_start = nan_from_start
        self._seed = seed
        self._branches: dict[int, _Branch] = {}
        self._next_id = 0
        self.forks: list[tuple[int | None, BranchKind, dict[str, Any]]] = []
        self.freed: list[int] = []
        self.clocks_run = 0

    # -- BranchSystem ----------------------------------------------------------------

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        if parent is None:
            w = np.ones_like(CURVATURES) * 1.0
            h = np.zeros_like(w)
            rng = np.random.default_rng(self._seed)
            history: deque[np.ndarray] = deque([w.copy()], maxlen=8)
        else:
            src = self._branches[parent]
            w, h = src.w.copy(), src.h.copy()
            history = deque((x.copy() for x in src.history), maxlen=8)
            rng = _copy_rng(src.rng)
            if kind is BranchKind.TESTING:
                # The validation set: the same data for every test.
                rng = np.random.default_rng(self._seed + 10_000)
        branch = self._next_id
        self._next_id += 1
        self._branches[branch] = _Branch(kind, dict(tunables), w, h, history, rng)
        self.forks.append((parent, kind, dict(tunables)))
        return branch

    def free(self, branch: int) -> None:
        del self._branches[branch]
        self.freed.append(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        assert clocks >= 1
        b = self._branches[branch]
        return [self._clock(b) for _ in range(clocks)]

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return self.samples_per_epoch // int(tunables.get("batch_size", 32))

    # -- simulation ------------------------------------------------------------------

    def live(self) -> list[int]:
        return sorted(self._branches)

    def true_loss(self, w: np.ndarray) -> float:
        return float(0.5 * np.sum(CURVATURES * w * w)) * self.loss_scale

    def _clock(self, b: _Branch) -> ClockReport:
        self.clocks_run += 1
        batch = int(b.tunables.get("batch_size", 32))
        slack = int(b.tunables.get("staleness", 0))
        seconds = (0.002 + 0.0002 * batch) / (1.0 + 0.2 * min(slack, 3))
        with np.errstate(over="ignore", invalid="ignore"):
            loss = self.true_loss(b.w)
            noisy_loss = loss * (1.0 + LOSS_NOISE * b.rng.standard_normal())
            if self.nan_from_start:
                noisy_loss = float("nan")
            if b.kind is BranchKind.TESTING:
                accuracy = float(np.exp(-loss) + ACCURACY_NOISE * b.rng.standard_normal())
                return ClockReport(noisy_loss, seconds, accuracy)
            if b.kind is BranchKind.TRAINING:
                lr = float(b.tunables.get("lr", 0.01))
                m = float(b.tunables.get("momentum", 0.0))
                stale = b.history[max(0, len(b.history) - 1 - slack)]
                noise = GRADIENT_NOISE * np.sqrt(CURVATURES / batch)
                g = CURVATURES * stale + noise * b.rng.standard_normal(CURVATURES.shape)
                b.h = (1.0 - m) * g + m * b.h
                b.w = b.w - lr * b.h
                b.history.append(b.w.copy())
            else:
                b.rng.standard_normal(CURVATURES.shape)  # reads a batch, changes nothing
        b.clocks += 1
        return ClockReport(float(noisy_loss), seconds)


@pytest.fixture(name="quadratic_system")
def quadratic_system_fixture() -> type[QuadraticSystem]:
    """The QuadraticSystem class (tests are imported with
    --import-mode=importlib, so helpers come through fixtures)."""
    return QuadraticSystem


LossCurve = Callable[[Mapping[str, Any], int], float]


class ScriptedSystem:
    """A BranchSystem whose numbers are given by the test.

    A TRAINING branch's loss at its own clock c (counting from its fork,
    continuing its parent's count) is ``curve(tunables, c)``; EVALUATION
    branches report ``baseline``; the n-th validation reports
    ``accuracies[n]`` (the last value repeats). Each clock takes
    ``seconds(tunables)``.
    """

    def __init__(self, curve: LossCurve, *, baseline: float = 10.0,
                 seconds: Callable[[Mapping[str, Any]], float] = lambda t: 0.01,
                 accuracies: Sequence[float] = (0.5,), clocks_per_epoch: int = 100) -> None:
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
        start = 0 if parent is None else self.branches[parent][2]
        branch = self._next
        self._next += 1
        self.branches[branch] = (kind, dict(tunables), start)
        self.forks.append((branch, parent, kind, dict(tunables)))
        self.max_live = max(self.max_live, len(self.branches))
        return branch

    def free(self, branch: int) -> None:
        del self.branches[branch]
        self.freed.append(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        assert clocks >= 1
        kind, tunables, done = self.branches[branch]
        self.runs.append((branch, clocks))
        seconds = self.seconds(tunables)
        if kind is BranchKind.TESTING:
            accuracy = self.accuracies[min(self.validations, len(self.accuracies) - 1)]
            self.validations += 1
            return [ClockReport(0.0, seconds, accuracy) for _ in range(clocks)]
        if kind is BranchKind.TRAINING:
            reports = [ClockReport(self.curve(tunables, done + i), seconds) for i in range(clocks)]
        else:
            reports = [ClockReport(self.baseline, seconds) for _ in range(clocks)]
        self.branches[branch] = (kind, tunables, done + clocks)
        return reports

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return self.epoch

    def live(self) -> list[int]:
        return sorted(self.branches)


@pytest.fixture(name="scripted_system")
def scripted_system_fixture() -> type[ScriptedSystem]:
    return ScriptedSystem
