"""A simulated model to tune: a noisy quadratic bowl trained with the
parameter server's damped_momentum rule (h = (1 - m) g + m h; w -= lr h, mltuner.md
§2), curvatures from 10 down to 0.01, so a learning rate above about 0.2
diverges and a small one crawls along the flat directions. Mini-batch noise
shrinks with the batch size; a clock's simulated time is a fixed overhead
plus a cost per sample, and shrinks with staleness, and a stale branch computes its gradient on
old weights. Every branch has its own seeded random stream, forked with the
branch, so trials from one parent see the same data and every run is
deterministic."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mltuner.testing._checks import batch_size_of, clock_count, live_branch
from mltuner.tune._system import BranchKind, ClockReport

__all__ = ["QuadraticSystem", "CURVATURES"]

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
    """A :class:`~mltuner.tune.BranchSystem` over a simulated model (see
    the module docstring), for tests of tuners and drivers that need a model
    with a best learning rate, a divergence edge and batch-size trade-offs.

    Args:
        samples_per_epoch: training samples (clocks per epoch = this // batch).
        seed: seeds the data stream of the root branch.
        loss_scale: multiplies every loss (the starting loss is about 10).
        nan_from_start: every reported loss is NaN (a broken model).
        clock_overhead_s: the simulated time of a clock before its samples
            (0.002 s); a large one makes small batches cost more per sample,
            as on a CPU host, where the per-clock work outweighs the batch.
        sample_s: the simulated time of one sample of a batch (0.0002 s).
    """

    def __init__(self, samples_per_epoch: int = 6400, seed: int = 0,
                 loss_scale: float = 1.0, nan_from_start: bool = False,
                 clock_overhead_s: float = 0.002, sample_s: float = 0.0002) -> None:
        self.samples_per_epoch = samples_per_epoch
        self.loss_scale = loss_scale
        self.nan_from_start = nan_from_start
        self.clock_overhead_s = clock_overhead_s
        self.sample_s = sample_s
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
            src = self._branches[live_branch(parent, self._branches)]
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
        del self._branches[live_branch(branch, self._branches)]
        self.freed.append(branch)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        b = self._branches[live_branch(branch, self._branches)]
        return [self._clock(b) for _ in range(clock_count(clocks))]

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        return self.samples_per_epoch // batch_size_of(tunables)

    # -- simulation ------------------------------------------------------------------

    def live(self) -> list[int]:
        return sorted(self._branches)

    def true_loss(self, w: np.ndarray) -> float:
        return float(0.5 * np.sum(CURVATURES * w * w)) * self.loss_scale

    def _clock(self, b: _Branch) -> ClockReport:
        self.clocks_run += 1
        batch = batch_size_of(b.tunables)
        slack = int(b.tunables.get("staleness", 0))
        seconds = (self.clock_overhead_s + self.sample_s * batch) / (1.0 + 0.2 * min(slack, 3))
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
