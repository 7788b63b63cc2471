"""A batch check: the training setting against the next larger batch size
(learning rate scaled for it, see larger_batch), two trials of equal run time from the
training branch, judged by the loss they end at.

Short trials from the untrained model favour small batches: far from a
minimum every step helps about as much whatever its batch, and small
batches take more steps per second. Once the steep start is over the loss
sits near a noise floor that a larger batch lowers, at a cost per sample
that is often lower too (on a CPU host, batch 32 took 20 s an epoch where
batch 256 took 5 s). The check sees both over a horizon long enough to
average the noise of a trained model's loss: a slope over a few seconds
there is mostly noise, so the two trials, of equal run time from the same
branch, are compared by the mean loss of their last quarter.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._log import DecisionLog
from mltuner.tune._progress import ProgressState
from mltuner.tune._system import BranchKind, BranchSystem
from mltuner.tune.tuner._search import run_clocks
from mltuner.tune.tuner._searcher import Searcher
from mltuner.tune.tuner._trial import Trial

__all__ = ["BatchCheck", "BatchCheckResult", "tail_mean"]

_PHASE = "search"


def tail_mean(losses: Sequence[float]) -> float:
    """The mean of the last quarter of ``losses`` (at least one value); NaN
    when empty or when a value in it is not finite."""
    if not losses:
        return math.nan
    tail = losses[-max(1, len(losses) // 4):]
    if not all(math.isfinite(v) for v in tail):
        return math.nan
    return statistics.fmean(tail)


@dataclasses.dataclass(frozen=True)
class BatchCheckResult:
    """How a batch check ended.

    Attributes:
        winner: the trial that trains on (its branch is alive; the caller
            owns it), or None when both diverged.
        larger_won: the winner is the larger batch.
        levels: the mean loss of each trial's last quarter, the current
            setting's first (NaN for a diverged one).
        seconds: clock time of both trials.
    """

    winner: Trial | None
    larger_won: bool
    levels: tuple[float, float]
    seconds: float


class BatchCheck:
    """Runs ``larger`` from ``parent`` for ``length_s`` seconds of its own
    run time (after its first ``first_clocks`` clocks, never past one epoch
    of its batch), then the current setting for as long, and keeps the larger batch when the mean loss of its last
    quarter is at most the current setting's: with the same run time, the
    lower loss is the more progress per second. A trial whose loss is not
    finite loses. Both are trials of ``searcher``'s study (enqueued, so its
    params are the two settings), told the level as their value.

    Args:
        index: the search number in the decision log.
    """

    def __init__(self, system: BranchSystem, searcher: Searcher, log: DecisionLog, *,
                 index: int, parent: int, current: Mapping[str, Any],
                 larger: Mapping[str, Any], length_s: float, first_clocks: int) -> None:
        if not (math.isfinite(length_s) and length_s > 0):
            raise InvalidArgumentError(f"a batch check's length must be > 0 s, got {length_s!r}")
        if first_clocks < 1:
            raise InvalidArgumentError(f"first_clocks must be >= 1, got {first_clocks!r}")
        self._system = system
        self._searcher = searcher
        self._log = log
        self._index = index
        self._parent = parent
        self._settings = (dict(current), dict(larger))
        self._length = length_s
        self._first = first_clocks
        self._spent = 0.0

    def run(self) -> BatchCheckResult:
        # The larger batch first: its one-epoch cap may end it before the
        # length, and the current setting then runs as long as it did.
        for setting in reversed(self._settings):
            if not self._searcher.enqueue(setting):
                raise InvalidArgumentError(f"a batch check's setting {setting} is not in its space")
        larger_trial = self._run_trial(self._length)
        trials = [self._run_trial(larger_trial.run_time), larger_trial]
        levels = tuple(tail_mean(t.losses) for t in trials)
        current, larger = levels
        winner: Trial | None = None
        if math.isfinite(larger) and not larger > current:  # a NaN current: the larger wins
            winner = trials[1]
        elif math.isfinite(current):
            winner = trials[0]
        for trial, level in zip(trials, levels):
            outcome = "best" if trial is winner else "lost"
            self._tell(trial, level, outcome)
            if trial is not winner:
                self._system.free(trial.branch)
                self._note("free_trial", branch=trial.branch, tunables=trial.tunables,
                           reason=outcome, level=level, run_time_s=trial.run_time)
        study = self._searcher.study
        study.set_user_attr("check", "batch")
        study.set_user_attr("seconds", self._spent)
        study.set_user_attr("length_s", self._length)
        if winner is not None:
            study.set_user_attr("winner_trial", winner.proposal.number)
            study.set_user_attr("winner_tunables", winner.tunables)
            self._note("winner", branch=winner.branch, tunables=winner.tunables,
                       levels=list(levels), clocks=winner.clocks, trials=2,
                       seconds=self._spent, check="batch")
        else:
            self._note("no_progress", branch=self._parent, trials=2, seconds=self._spent,
                       levels=list(levels), check="batch")
        self._searcher.publish()
        return BatchCheckResult(winner, winner is trials[1], (current, larger), self._spent)

    def _run_trial(self, length_s: float) -> Trial:
        proposal = self._searcher.ask()
        assert proposal is not None and proposal.enqueued
        cap = self._system.clocks_per_epoch(proposal.tunables)
        branch = self._system.fork(self._parent, proposal.tunables, BranchKind.TRAINING)
        trial = Trial(proposal, branch, cap)
        self._note("fork_trial", branch=branch, tunables=proposal.tunables,
                   trial=proposal.number, cap_clocks=cap, enqueued=True)
        for _ in range(2):  # its first clocks time it; then on to the length
            clocks = trial.clocks_to_reach(length_s, self._first)
            if clocks > 0:
                reports = run_clocks(self._system, branch, clocks)
                self._spent += math.fsum(float(r.seconds) for r in reports)
                trial.record(reports)
        trial.summarize(trial.losses[0])
        self._note("summary", branch=branch, tunables=trial.tunables, loss=trial.losses[-1],
                   level=tail_mean(trial.losses), run_time_s=trial.run_time,
                   clocks=trial.clocks, spent_s=self._spent,
                   state=trial.summary.state if trial.summary else ProgressState.UNSTABLE)
        return trial

    def _tell(self, trial: Trial, level: float, outcome: str) -> None:
        assert trial.summary is not None
        trial.told = True
        self._searcher.tell(trial.proposal, trial.summary, trial.losses, {
            "branch": trial.branch, "outcome": outcome, "run_time_s": trial.run_time,
            "search": self._index, "level": level if math.isfinite(level) else None,
            "check": "batch"}, seconds=trial.seconds, value=level)

    def _note(self, event: str, **fields: Any) -> None:
        self._log.write(event, phase=_PHASE, search=self._index, **fields)
