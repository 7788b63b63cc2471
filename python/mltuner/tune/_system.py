"""The interface between the tuner and the training system it drives.

The tuner never touches parameters: it forks, runs and frees *branches*
through a :class:`BranchSystem`. The parameter server implements it with its
branch operations (mltuner.md §3: fork, free, schedule and the workers'
per-clock reports); the tests implement it with a simulated model.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["BranchKind", "ClockReport", "BranchSystem"]


class BranchKind(enum.Enum):
    """What a branch is for; the system applies each kind's overrides."""

    INIT = "init"
    """The root branch (no parent). It runs one clock, in which the
    application writes the initial weights (§1.1 step 0)."""

    TRAINING = "training"
    """Trains with its own tunables: a trial, or the training branch."""

    EVALUATION = "evaluation"
    """Runs the training data with lr = 0 and staleness 0: measures the
    parent's training loss without changing the model (§1.1 step 1)."""

    TESTING = "testing"
    """Runs the validation data from its start with lr = 0 and reports
    accuracy (§1.1 step 5)."""


@dataclasses.dataclass(frozen=True)
class ClockReport:
    """What one clock (one mini-batch on every worker) of one branch produced.

    Attributes:
        loss: the training loss, averaged over workers. May be NaN or inf: the
            tuner treats a non-finite loss as divergence.
        seconds: wall time of this clock, counting only time when this branch
            was running (time spent paused while other branches ran is
            excluded, §1).
        accuracy: the mean per-batch accuracy, for TESTING branches only.
        samples: the samples of the clock over every worker, where known:
            a validation's accuracy weighs each clock by them (a last
            clock may be smaller); None counts every clock alike.
    """

    loss: float
    seconds: float
    accuracy: float | None = None
    samples: int | None = None


@runtime_checkable
class BranchSystem(Protocol):
    """A training system whose model state can be forked into branches.

    Thread safety: the tuner calls it from one thread only, in program order.
    Ownership: the tuner frees every branch it forks except the training
    branch it ends with, which the caller then owns.
    """

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        """Creates a branch and returns its id. It starts as a copy of
        ``parent``'s parameters, optimizer state (momentum history) and data
        cursor, or from the initial weights when ``parent`` is None (kind
        INIT). ``tunables`` is a full decoded setting of the search space."""
        ...

    def free(self, branch: int) -> None:
        """Releases a branch's state; the id is not used again."""
        ...

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        """Runs ``branch`` for ``clocks`` consecutive clocks and returns one
        report per clock, in order. REQUIRES: clocks >= 1."""
        ...

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        """Clocks in one pass over the training data with these tunables
        (samples per epoch / (per-worker batch size x workers)). Zero means
        one batch is larger than the whole epoch."""
        ...
