"""The tuner's outer state machine (mltuner.md §1.1): initialise, search,
train epoch by epoch with a validation after each, re-tune on a plateau, stop
on a longer one."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._log import DecisionLog
from mltuner.tune._search import SearchEpisode, SearchResult
from mltuner.tune._searcher import Searcher
from mltuner.tune._space import Choice, SearchSpace
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport

__all__ = ["Tuner", "TuningResult", "Outcome", "plateaued"]

_PHASES = {"start": "init", "init": "init", "search_start": "search", "end": "end"}


class Outcome(enum.Enum):
    """Why a tuning run ended."""

    CONVERGED = "converged"
    """Validation accuracy plateaued for plateau_size_for_convergence epochs."""
    NO_PROGRESS = "no_progress"
    """A search in which no trial made progress: every trial reached the
    one-epoch cap, or diverged, without lowering the loss (§1.1 step 3a)."""
    MAX_EPOCHS = "max_epochs"
    """The max_epochs safety stop."""


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """The end of a tuning run.

    Attributes:
        outcome: why it ended.
        branch: the branch holding the final model; the caller owns it.
        tunables: that branch's setting.
        accuracies: the validation accuracy after each epoch.
        epochs: epochs trained (validations made).
        searches: search episodes run, the initial one included.
        trials: trial branches forked over all searches.
        studies: the Optuna study name of each search, in order.
    """

    outcome: Outcome
    branch: int
    tunables: dict[str, Any]
    accuracies: list[float]
    epochs: int
    searches: int
    trials: int
    studies: list[str]


def plateaued(accuracies: Sequence[float], size: int) -> bool:
    """§1.1 step 6: True when the last ``size`` accuracies include nothing
    strictly above the best accuracy before them."""
    if len(accuracies) <= size:
        return False
    return max(accuracies[-size:]) <= max(accuracies[:-size])


class Tuner:
    """Trains a model with MLtuner's in-training tuning, on rank 0.

    Args:
        system: the training system; the tuner forks, runs and frees its
            branches.
        space: the tunables and their ranges.
        config: see :class:`TunerConfig`.
        log: a :class:`DecisionLog`, or a path to write one to (JSON lines);
            None keeps the log in memory (:attr:`log`).

    :meth:`run` blocks until the job ends and returns a :class:`TuningResult`.
    Bad input (an empty or inconsistent space, a batch larger than an epoch,
    a loss that is not finite from the first clock) raises before any
    training or with a message that says which.
    """

    def __init__(
        self,
        system: BranchSystem,
        space: SearchSpace,
        config: TunerConfig | None = None,
        *,
        log: DecisionLog | str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(system, BranchSystem):
            raise InvalidArgumentError(
                f"system must implement BranchSystem (fork, free, run, clocks_per_epoch), "
                f"got {type(system).__name__}"
            )
        if not isinstance(space, SearchSpace):
            raise InvalidArgumentError(f"space must be a SearchSpace, got {type(space).__name__}")
        self._system = system
        self._space = space
        self._config = config if config is not None else TunerConfig()
        self._owns_log = not isinstance(log, DecisionLog)
        self.log: DecisionLog = log if isinstance(log, DecisionLog) else DecisionLog(log)
        start = self._config.initial_setting
        if start is not None:
            space.check_setting(start)
        self._start_setting = dict(start) if start is not None else space.defaults()
        prefix = self._config.study_name_prefix
        self._prefix = prefix if prefix is not None else (
            f"mltuner-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        )
        self._studies: list[str] = []
        self._trials = 0

    def run(self) -> TuningResult:
        try:
            return self._run()
        finally:
            if self._owns_log:
                self.log.close()

    def _run(self) -> TuningResult:
        self._check_epochs()
        system, config = self._system, self._config
        self._note("start", tunables=self._start_setting, sampler=config.sampler,
                   retune=config.retune, searched=[t.name for t in self._space.searched])
        # §1.1 step 0: the root branch runs one clock, in which the
        # application writes the initial weights.
        root = system.fork(None, self._start_setting, BranchKind.INIT)
        system.run(root, 1)
        self._note("init", branch=root)

        if not self._space.searched or not config.initial_tuning:
            training = system.fork(root, self._start_setting, BranchKind.TRAINING)
            system.free(root)
            tunables, clocks = dict(self._start_setting), 0
            last_trials = config.max_trials_per_search
            self._note("train_untuned", branch=training, tunables=tunables)
        else:
            found = self._search(root, self._start_setting, config.max_trials_per_search)
            if found.winner is None:
                if found.all_diverged:
                    raise TuningError(
                        f"every one of the {found.trials} trials of the initial search diverged "
                        "(a non-finite loss or 10x the starting loss): no setting in the search "
                        "space trains this model; lower the learning-rate range"
                    )
                return self._result(Outcome.NO_PROGRESS, root, self._start_setting, [])
            training, tunables = found.winner.branch, dict(found.winner.tunables)
            clocks, last_trials = found.winner.clocks, found.trials

        accuracies: list[float] = []
        while True:
            # §1.1 step 4: the winner keeps its trial clocks and trains on to
            # the next epoch boundary.
            per_epoch = system.clocks_per_epoch(tunables)
            to_run = per_epoch - clocks % per_epoch
            self._train(training, tunables, to_run, len(accuracies))
            clocks += to_run
            accuracies.append(self._validate(training, tunables))
            epochs = len(accuracies)
            if plateaued(accuracies, config.plateau_size_for_convergence):
                return self._result(Outcome.CONVERGED, training, tunables, accuracies)
            if config.max_epochs is not None and epochs >= config.max_epochs:
                return self._result(Outcome.MAX_EPOCHS, training, tunables, accuracies)
            if (config.retune != "off" and self._space.searched
                    and plateaued(accuracies, config.plateau_size_for_retune)):
                self._note("retune", branch=training, tunables=tunables, epoch=epochs)
                # §1.1 step 6: a re-tune may not use more trials than the last search.
                found = self._search(training, tunables, last_trials)
                if found.winner is None:
                    return self._result(Outcome.NO_PROGRESS, training, tunables, accuracies)
                training, tunables = found.winner.branch, dict(found.winner.tunables)
                clocks, last_trials = found.winner.clocks, found.trials

    # -- steps ------------------------------------------------------------------------

    def _search(self, parent: int, tunables: Mapping[str, Any],
                trial_cap: int | None) -> SearchResult:
        config = self._config
        index = len(self._studies)
        name = f"{self._prefix}-initial" if index == 0 else f"{self._prefix}-retune-{index}"
        marginal = index > 0 and config.retune == "marginal"
        searcher = Searcher(
            self._space,
            sampler=config.sampler,
            seed=None if config.seed is None else config.seed + index,
            storage=config.storage,
            study_name=name,
            base_setting=tunables if marginal else None,
            n_startup_trials=config.n_startup_trials,
        )
        self._studies.append(name)
        self._note("search_start", search=index, branch=parent, tunables=tunables,
                   study=name, marginal=marginal, trial_cap=trial_cap)
        episode = SearchEpisode(self._system, config, searcher, self.log, index=index,
                                parent=parent, parent_tunables=tunables, trial_cap=trial_cap)
        found = episode.run()
        self._trials += found.trials
        return found

    def _train(self, branch: int, tunables: Mapping[str, Any], clocks: int, epoch: int) -> None:
        reports = self._system.run(branch, clocks)
        losses = [float(r.loss) for r in reports]
        if len(losses) != clocks:
            raise TuningError(
                f"the training system returned {len(losses)} clock reports for branch {branch}, "
                f"asked to run {clocks} clocks"
            )
        bad = next((loss for loss in losses if not math.isfinite(loss)), None)
        if bad is not None:
            raise TuningError(
                f"the training loss of branch {branch} became {bad} in epoch {epoch + 1} with "
                f"{dict(tunables)}: training diverged; lower the learning rate (the search "
                "space's range, or initial_setting without initial tuning)"
            )
        self._note("train", branch=branch, tunables=tunables, clocks=clocks,
                   loss=math.fsum(losses) / len(losses), epoch=epoch + 1)

    def _validate(self, branch: int, tunables: Mapping[str, Any]) -> float:
        # §1.1 step 5: a TESTING branch with lr = 0 runs the validation set.
        system = self._system
        test = system.fork(branch, tunables, BranchKind.TESTING)
        try:
            reports: Sequence[ClockReport] = system.run(test, self._config.num_clocks_to_test)
        finally:
            system.free(test)
        values = [r.accuracy for r in reports]
        if not values or any(v is None or not math.isfinite(v) for v in values):
            raise TuningError(
                f"the TESTING branch {test} must report a finite accuracy on every clock, "
                f"got {values[:5]}{'...' if len(values) > 5 else ''}"
            )
        accuracy = math.fsum(v for v in values if v is not None) / len(values)
        self._note("validate", branch=branch, tunables=tunables, accuracy=accuracy)
        return accuracy

    def _check_epochs(self) -> None:
        # Every Choice value (batch sizes above all) must fit in one epoch;
        # checked for each value with the other tunables at the start setting,
        # before any branch exists.
        settings = [self._start_setting]
        for tunable in self._space.searched:
            if isinstance(tunable, Choice):
                settings += [{**self._start_setting, tunable.name: v} for v in tunable.values]
        for setting in settings:
            per_epoch = self._system.clocks_per_epoch(setting)
            if per_epoch < 1:
                changed = {k: v for k, v in setting.items() if v != self._start_setting[k]}
                raise InvalidArgumentError(
                    f"the setting {changed or setting} gives {per_epoch} clocks per epoch: one "
                    "batch is larger than the whole epoch; remove that batch size from the "
                    "search space or use a larger training set"
                )

    def _result(self, outcome: Outcome, branch: int, tunables: Mapping[str, Any],
                accuracies: list[float]) -> TuningResult:
        result = TuningResult(outcome, branch, dict(tunables), list(accuracies), len(accuracies),
                              len(self._studies), self._trials, list(self._studies))
        self._note("end", outcome=outcome, branch=branch, tunables=tunables,
                   accuracy=max(accuracies) if accuracies else None, epochs=len(accuracies),
                   searches=len(self._studies), trials=self._trials)
        return result

    def _note(self, event: str, **fields: Any) -> None:
        self.log.write(event, phase=_PHASES.get(event, "train"), **fields)
