"""The tuner's outer state machine (mltuner.md §1.1): initialise, search,
train epoch by epoch with a validation after each, re-tune on a plateau, stop
on a longer one; with a rollback guard that keeps the best-validated model
and goes back to it when training collapses."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import DEFAULT_CLOCKS_TO_TEST, TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune.tuner._guard import Alarm, TrainingGuard
from mltuner.tune._log import DecisionLog
from mltuner.tune.tuner._batch_check import BatchCheck
from mltuner.tune.tuner._search import SearchBudget, SearchEpisode, SearchResult, run_clocks
from mltuner.tune.tuner._searcher import Searcher, open_storage
from mltuner.tune._space import Choice, LogUniform, SearchSpace, Uniform
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport

__all__ = ["Tuner", "TuningResult", "Outcome", "plateaued", "at_least_as_aggressive", "lr_neighbours",
           "larger_batch", "LR_STEP", "AGGRESSIVE_DIRECTIONS", "JOURNAL_NAME"]

_PHASES = {"start": "init", "init": "init", "search_start": "search", "end": "end"}

# Which way each tunable makes training more aggressive (a larger step, more
# gradient noise, older gradients): +1 when a larger value is, -1 when a
# smaller one is. Settings at least as aggressive as one that collapsed the
# model in every one of these are not tried again.
AGGRESSIVE_DIRECTIONS = {"lr": 1, "momentum": 1, "staleness": 1, "batch_size": -1}
# A re-tune also tries the current learning rate this factor up and down (half
# a decade): a local step that does not hang on the sampler's luck. With the
# few trials a re-tune affords, random proposals over a wide log range mostly
# land far from a good rate (seen under load: lr 0.012 kept for 50 epochs, 54%).
LR_STEP = math.sqrt(10.0)
# The Optuna journal a job writes beside its decision log by default.
JOURNAL_NAME = "optuna.journal"
# Tuners made in this process so far (the default study-name prefix).
_TUNERS_MADE = itertools.count(1)


class Outcome(enum.Enum):
    """Why a tuning run ended."""

    CONVERGED = "converged"
    """Validation accuracy plateaued for plateau_size_for_convergence epochs."""
    NO_PROGRESS = "no_progress"
    """A search from the best-validated model in which no trial made
    progress, after validation stopped improving (§1.1 step 3a): the model
    has converged."""
    MAX_EPOCHS = "max_epochs"
    """The max_epochs safety stop."""
    TARGET = "target"
    """A validation reached ``TunerConfig.target_accuracy``."""
    TIME_BUDGET = "time_budget"
    """The job's clocks reached ``TunerConfig.time_budget_s``."""
    ROLLBACK_LIMIT = "rollback_limit"
    """Training collapsed max_rollbacks + 1 times, or collapsed with nothing
    left to search; the job ends with the best-validated model."""


@dataclasses.dataclass(frozen=True)
class TuningResult:
    """The end of a tuning run.

    Attributes:
        outcome: why it ended.
        branch: the branch holding the final model, the best-validated one
            (the caller owns it).
        tunables: the setting that trained that branch.
        accuracies: the validation accuracy after each epoch, collapsed
            epochs included.
        epochs: epochs trained (validations made).
        searches: search episodes run, the initial one included.
        trials: trial branches forked over all searches.
        studies: the Optuna study name of each search, in order.
        best_accuracy: the final branch's validation accuracy (None when it
            was never validated).
        rollbacks: how many times the guard went back to the best model.
        seconds: clock time of the whole run (every branch), in seconds.
        search_seconds: clock time of the searches (their evaluation
            branches and trials), in seconds.
        training_study: the Optuna study with one trial per training
            stretch (None without one).
    """

    outcome: Outcome
    branch: int
    tunables: dict[str, Any]
    accuracies: list[float]
    epochs: int
    searches: int
    trials: int
    studies: list[str]
    best_accuracy: float | None = None
    rollbacks: int = 0
    seconds: float = 0.0
    search_seconds: float = 0.0
    training_study: str | None = None


# A validation this many rollback margins below the best is a collapse at once.
SEVERE_DROP = 3.0


def plateaued(accuracies: Sequence[float], size: int) -> bool:
    """§1.1 step 6: True when the last ``size`` accuracies include nothing
    strictly above the best accuracy before them."""
    if len(accuracies) <= size:
        return False
    return max(accuracies[-size:]) <= max(accuracies[:-size])


def validation_collapsed(accuracies: Sequence[float], best: float, margin: float) -> bool:
    """Whether a stretch's validation ``accuracies`` (the last one new) say
    the model collapsed below the ``best`` accuracy so far: the last lies
    more than SEVERE_DROP x ``margin`` below it, or the last two both more
    than ``margin``. A single smaller dip is the noise of a fast or stale
    setting (seen: SSP at slack 3 dipping 8-10 points for one epoch, each
    dip rolled back, until the excluded settings left a crawling rate)."""
    if not accuracies:
        return False
    last = best - accuracies[-1]
    if last > SEVERE_DROP * margin:
        return True
    return last > margin and len(accuracies) >= 2 and best - accuracies[-2] > margin


def lr_neighbours(space: SearchSpace, setting: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``setting`` with its learning rate LR_STEP times higher, then lower,
    each clipped to the range; none when the space does not search a
    log-scale ``lr``."""
    lr = next((t for t in space.searched if t.name == "lr"), None)
    if not isinstance(lr, LogUniform) or "lr" not in setting:
        return []
    value = float(setting["lr"])
    steps = (min(lr.high, value * LR_STEP), max(lr.low, value / LR_STEP))
    return [{**setting, "lr": v} for v in steps if v != value]


LR_SCALINGS: dict[str, float] = {"linear": 1.0, "sqrt": 0.5, "none": 0.0}


def larger_batch(space: SearchSpace, setting: Mapping[str, Any], *,
                 lr_scaling: str = "sqrt") -> dict[str, Any] | None:
    """``setting`` with the next larger ``batch_size`` the space searches
    and its learning rate scaled for it, clipped to the range; None when
    the space searches no numeric batch size or the setting's is the
    largest. ``lr_scaling``: ``sqrt`` (by the square root of the batch
    ratio: half the gradient noise's variance per step, a step only a
    little longer), ``linear`` (by the ratio: the same step per sample;
    seen to kill a trained CNN, batch 64 at lr 0.34 to 128 at 0.68 ended at
    chance loss) or ``none``. A learning rate the space does not search
    stays as it is."""
    if lr_scaling not in LR_SCALINGS:
        raise InvalidArgumentError(
            f"lr_scaling must be one of {sorted(LR_SCALINGS)}, got {lr_scaling!r}")
    batch = next((t for t in space.searched if t.name == "batch_size"), None)
    if not isinstance(batch, Choice) or "batch_size" not in setting:
        return None
    current = setting["batch_size"]
    if not isinstance(current, (int, float)) or current <= 0:
        return None
    larger = sorted(v for v in batch.values if isinstance(v, (int, float)) and v > current)
    if not larger:
        return None
    out = {**setting, "batch_size": larger[0]}
    lr = next((t for t in space.searched if t.name == "lr"), None)
    if isinstance(lr, (LogUniform, Uniform)) and "lr" in setting:
        factor = (larger[0] / current) ** LR_SCALINGS[lr_scaling]
        out["lr"] = min(lr.high, float(setting["lr"]) * factor)
    return out


def no_slower(space: SearchSpace, setting: Mapping[str, Any]) -> SearchSpace:
    """``space`` with the learning rate's range starting at ``setting``'s
    (fixed there when it is the top of the range); unchanged when the space
    does not search a log-scale ``lr``. The space of a periodic re-tune:
    short trials favour a lower rate whatever it does later (its loss drops
    at once, by less noise, not by more learning), so a model still
    improving would be slowed too early; a plateau re-tune may lower it."""
    lr = next((t for t in space.searched if t.name == "lr"), None)
    if not isinstance(lr, LogUniform) or "lr" not in setting:
        return space
    value = float(setting["lr"])
    raised = (dataclasses.replace(lr, low=value, default=value) if value < lr.high
              else dataclasses.replace(lr, search=False, default=value))
    return SearchSpace([raised if t.name == "lr" else t for t in space])


def at_least_as_aggressive(setting: Mapping[str, Any], failed: Mapping[str, Any]) -> bool:
    """Whether ``setting`` is at least as aggressive as ``failed`` in every
    tunable of AGGRESSIVE_DIRECTIONS that both name (equal to it when they
    name none)."""
    names = [n for n in AGGRESSIVE_DIRECTIONS if n in setting and n in failed]
    if not names:
        return dict(setting) == dict(failed)
    return all(AGGRESSIVE_DIRECTIONS[n] * (float(setting[n]) - float(failed[n])) >= 0
               for n in names)


@dataclasses.dataclass
class _Frozen:
    """The best-validated model: a branch forked from the training branch
    right after its validation and never run."""

    branch: int
    tunables: dict[str, Any]
    accuracy: float
    epoch: int       # validations made when it was frozen
    clocks: int      # its training clocks (for the epoch boundary)
    source: int      # the training branch it was forked from


@dataclasses.dataclass
class _Stretch:
    """The training branch from its search's winner (or a rollback) on."""

    branch: int
    tunables: dict[str, Any]
    clocks: int
    parent: int | None           # kept until a validation with a trained loss, then freed
    parent_tunables: dict[str, Any]
    parent_clocks: int
    search: int | None           # the search that chose it
    searcher: Searcher | None
    guard: TrainingGuard
    accuracies: list[float] = dataclasses.field(default_factory=list)
    first_epoch: int = 0
    batch_done: bool = False     # no larger batch to check against
    batch_lost: int = 0          # checks its setting won against a larger batch
    batch_chosen: bool = False   # its batch size came from a search over batch sizes
    untuned: bool = False        # the start setting, after an initial search that saw no progress


class _End(Exception):
    """Raised inside the run to end it with a result."""

    def __init__(self, result: TuningResult) -> None:
        super().__init__(result.outcome.value)
        self.result = result


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

    The rollback guard (``config.rollback``): a frozen copy of the model is
    kept at each new best validation accuracy, and a search's parent is kept
    until its winner has survived a validation with its loss clearly below
    the starting loss. Training runs in chunks,
    each summarised like a trial (:class:`~mltuner.tune.TrainingGuard`); a
    chunk that diverges, a loss that rises beyond the noise band or goes
    back to the starting loss, or a validation accuracy ``rollback_margin`` below the best rolls back to the
    frozen copy: the failed setting is recorded in its search's study as a
    FAIL trial, settings at least as aggressive are excluded from every
    later search, and a search starts from the frozen copy (or from the
    kept parent, when the frozen copy comes from the failing branch). The job returns
    the best-validated branch.
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
        # The second and later tuners of a process count on (two sessions of
        # a job within a second shared a journal's study names).
        runs = next(_TUNERS_MADE)
        self._prefix = prefix if prefix is not None else (
            f"mltuner-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" + (f"-{runs}" if runs > 1 else "")
        )
        self._storage_url: str | None = None
        self._storage = self._open_storage()
        self._studies: list[str] = []
        self._trials = 0
        self._accuracies: list[float] = []
        # Validations the plateau rules do not read: those after the best
        # model a collapse went back to (made by the setting that collapsed).
        self._set_aside: set[int] = set()
        self._last_search_epoch = 0  # validations done when the last search started
        self._best: _Frozen | None = None
        self._exclusions: list[dict[str, Any]] = []
        self._rollbacks = 0
        self._batch_losses = 0  # batch checks lost since the last one a larger batch won
        self._last_trials = self._config.max_trials_per_search
        self._seconds = 0.0         # clocks run by the tuner itself
        self._search_seconds = 0.0  # clocks run by its searches
        self._epoch_seconds: float | None = None
        self._clock_seconds: float | None = None  # one training clock, as last measured
        # The trial time of the last search that chose a setting: the length
        # at which a trial's progress could be told from its noise.
        self._trial_time: float | None = None
        self._seconds_at_search = 0.0  # self._seconds when the last search ended
        self._training_study: optuna.Study | None = None
        self._start_loss: float | None = None  # the first search's starting progress
        self._root: int | None = None  # the INIT branch: the untrained model

    @property
    def storage(self) -> str | None:
        """Where the studies are recorded: a storage URL (``journal:PATH``
        for the default journal), a storage object's type name, or None for
        memory."""
        return self._storage_url

    def run(self) -> TuningResult:
        """Trains until the job ends (for a reason of :class:`Outcome`) and
        returns the result, whose branch the caller owns. A log the tuner
        opened from a path is closed on return.

        Raises:
            mltuner.InvalidArgumentError: bad input (see the class).
        """
        try:
            return self._run()
        except _End as end:
            return end.result
        finally:
            if self._owns_log:
                self.log.close()

    def _run(self) -> TuningResult:
        self._check_epochs()
        system, config = self._system, self._config
        self._note("start", tunables=self._start_setting, sampler=config.sampler,
                   retune=config.retune, searched=[t.name for t in self._space.searched],
                   storage=self._storage_url, prefix=self._prefix,
                   search_share=config.search_share, max_epochs=config.max_epochs)
        # §1.1 step 0: the root branch runs one clock, in which the
        # application writes the initial weights.
        root = system.fork(None, self._start_setting, BranchKind.INIT)
        self._root = root
        self._run_clocks(root, 1)
        self._note("init", branch=root)

        if not self._space.searched or not config.initial_tuning:
            branch = system.fork(root, self._start_setting, BranchKind.TRAINING)
            stretch = self._begin(branch, self._start_setting, 0, root, None, None,
                                  self._start_setting, 0)
            self._note("train_untuned", branch=branch, tunables=self._start_setting)
        else:
            searcher, found = self._search(root, self._start_setting)
            if found.winner is not None:
                stretch = self._begin_winner(found, searcher, root, self._start_setting, 0)
            elif found.budget_exhausted and not any(at_least_as_aggressive(self._start_setting, failed)
                                                    for failed in found.diverged):
                # The budget ran out before a trial made progress: that says
                # nothing about the model; train with the start setting, unless
                # one as tame diverged (a short job's search may afford one
                # trial, at lr 16.7 of [1e-3, 100]: that says nothing of 0.01).
                branch = system.fork(root, self._start_setting, BranchKind.TRAINING)
                stretch = self._begin(branch, self._start_setting, 0, root, None, None,
                                      self._start_setting, 0)
                stretch.untuned = True
                self._note("train_untuned", branch=branch, tunables=self._start_setting,
                           reason="search_budget")
            else:
                self._no_winner_at_start(found)
                return self._result(Outcome.NO_PROGRESS, root, self._start_setting, None)

        while True:
            stretch = self._epoch(stretch)

    # -- one epoch and what follows it --------------------------------------------------

    def _epoch(self, stretch: _Stretch) -> _Stretch:
        """Trains ``stretch`` to the next epoch boundary, validates, and
        returns the stretch that trains next (itself, a re-tune's winner or
        a rollback's); raises _End when the job ends."""
        config = self._config
        # §1.1 step 4: the winner keeps its trial clocks and trains on to the
        # next epoch boundary.
        per_epoch = self._system.clocks_per_epoch(stretch.tunables)
        alarm = self._train(stretch, per_epoch - stretch.clocks % per_epoch, per_epoch)
        if alarm is not None:
            return self._rollback(stretch, alarm.reason, loss=alarm.loss,
                                  reference=alarm.reference, band=alarm.band)
        accuracy = self._validate(stretch)
        best = self._best
        if config.rollback and best is not None and validation_collapsed(
                stretch.accuracies, best.accuracy, config.rollback_margin):
            return self._rollback(stretch, "accuracy", accuracy=accuracy)
        if stretch.guard.trained:
            self._release_parent(stretch)
        if config.rollback and (best is None or accuracy > best.accuracy):
            self._freeze(stretch, accuracy)
        epochs = len(self._accuracies)
        if config.target_accuracy is not None and accuracy >= config.target_accuracy:
            self._finish(Outcome.TARGET, stretch)
        if (config.time_budget_s is not None
                and self._seconds + self._search_seconds >= config.time_budget_s):
            self._finish(Outcome.TIME_BUDGET, stretch)
        if plateaued(self._plateau_history(), config.plateau_size_for_convergence):
            self._finish(Outcome.CONVERGED, stretch)
        if config.max_epochs is not None and epochs >= config.max_epochs:
            self._finish(Outcome.MAX_EPOCHS, stretch)
        plateau = plateaued(self._plateau_history(), config.plateau_size_for_retune)
        periodic = (config.retune_every_epochs is not None
                    and epochs - self._last_search_epoch >= config.retune_every_epochs)
        # The initial search saw no progress from the untrained model (a
        # plateau at the start, seen: MNIST-1D's CNN at 2.30 for its first
        # epochs): search again as soon as the start setting has moved the
        # loss clearly, rather than train at an arbitrary setting until a
        # plateau or the periodic re-tune (seen: 10 epochs at 11-18%).
        moved = stretch.untuned and stretch.guard.trained
        if config.retune != "off" and self._space.searched and (plateau or periodic or moved):
            stretch.untuned = False
            return self._retune(stretch, plateau=plateau, reason=None if plateau or periodic else "untuned")
        if config.batch_check and config.time_bounded and not stretch.batch_done:
            return self._batch_check(stretch)
        return stretch

    def _batch_check(self, stretch: _Stretch) -> _Stretch:
        """After a stretch's first validation (the steep start is over): its
        setting against the next larger batch with the learning rate scaled
        alike (:func:`larger_batch`, :class:`BatchCheck`), checked again at
        once while the larger batch wins. Short trials from the untrained
        model pick a small batch for its many steps per second, whatever it
        costs per epoch (seen: batch 32 at 20 s an epoch where batch 256
        took 5 s and reached the target 6x sooner), and a re-tune keeps the
        batch size. A check that completes a choice of batch size (the
        stretch's batch came from a search over batch sizes, or from a
        check it won) is paid as part of that search, as the initial search
        always gets its share; any other from the searches' allowance, else
        from max_search_share of the time trained since the last search (as
        a climb check), and waits for the next validation when neither
        pays. Returns the stretch that trains next."""
        config = self._config
        while True:
            larger = larger_batch(self._space, stretch.tunables,
                                  lr_scaling=config.batch_check_lr_scaling)
            if (larger is None or self._excluded(larger) or self._trial_time is None
                    or self._clock_seconds is None):
                stretch.batch_done = True
                return stretch
            # Long enough to average a trained model's loss noise: the trial
            # time, and at least a guard chunk of the current setting.
            per_epoch = self._system.clocks_per_epoch(stretch.tunables)
            chunk = max(config.num_progress_samples,
                        math.ceil(per_epoch / config.guard_chunks_per_epoch))
            length = max(self._trial_time, chunk * self._clock_seconds)
            least = 2 * (length + config.num_progress_samples * self._clock_seconds)
            budget: float | None
            paid: str | None
            if stretch.batch_chosen and not stretch.batch_lost:
                budget, paid = least, "choice"
            else:
                budget, paid = self._check_budget(least, backoff=self._batch_losses)
            epochs = len(self._accuracies)
            if budget is None:
                self._note("retune_skipped", branch=stretch.branch, tunables=stretch.tunables,
                           epoch=epochs, reason="search_budget", retune="batch",
                           search_seconds=self._search_seconds,
                           left_s=self._retune_affordable(floor=False), least_s=least,
                           lost=self._batch_losses)
                return stretch
            index = len(self._studies)
            name = f"{self._prefix}-batch-{index}"
            self._note("retune", branch=stretch.branch, tunables=stretch.tunables, epoch=epochs,
                       reason="batch", check="batch", budget_s=budget, paid=paid,
                       lost=self._batch_losses, trained_s=self._seconds - self._seconds_at_search,
                       larger=larger, length_s=length)
            space = self._space.narrowed(["batch_size", "lr"], stretch.tunables)
            searcher = Searcher(space, sampler="random", seed=None if config.seed is None
                                else config.seed + index, storage=self._storage, study_name=name)
            self._studies.append(name)
            self._note("search_start", search=index, branch=stretch.branch,
                       tunables=stretch.tunables, study=name, marginal=False, trial_cap=2,
                       searched=[t.name for t in space.searched], enqueued=True,
                       first=[stretch.tunables, larger], budget_s=budget, ceiling_s=None,
                       from_start=False, excluded=len(self._exclusions), check="batch")
            found = BatchCheck(self._system, searcher, self.log, index=index,
                               parent=stretch.branch, current=stretch.tunables, larger=larger,
                               length_s=length, first_clocks=config.num_progress_samples).run()
            self._trials += 2
            self._search_seconds += found.seconds
            self._seconds_at_search = self._seconds
            if found.winner is None:
                # Both diverged from a model that trained: go on as it was.
                self._note("keep", branch=stretch.branch, tunables=stretch.tunables,
                           reason="no_better")
                stretch.batch_done = True
                return stretch
            self._close(stretch, "batch_check")
            self._release_parent(stretch)
            winner = found.winner
            won = self._begin(winner.branch, winner.tunables, winner.clocks, stretch.branch,
                              index, searcher, stretch.tunables, stretch.clocks)
            if not found.larger_won:
                # Checked again once the time trained since pays for it: the
                # larger batch's turn comes as the loss nears its noise floor.
                won.batch_chosen = stretch.batch_chosen
                won.batch_lost = stretch.batch_lost + 1
                self._batch_losses += 1
                return won
            self._batch_losses = 0
            won.batch_chosen = True
            stretch = won

    def _check_budget(self, least: float | None, *,
                      backoff: int = 0) -> tuple[float | None, str | None]:
        """A batch check's budget, ``least`` (see _least_retune_s), and who
        pays for it: ``allowance`` (what the job's searches have left, at
        most a search's share), ``trained`` (max_search_share of the
        tuner's time since the last search, as a climb check) or
        ``unbounded`` (no job budget known); (None, None) when nothing
        pays yet. ``backoff``: checks the current setting won since a
        larger batch last did; when > 0 only the time trained pays, and it
        must pay 2**(backoff - 1) times ``least``, so that a job whose batch
        is already right spends less and less on checking it (at most
        max_search_share of the training time in all, and the searches'
        allowance is kept for re-tunes)."""
        if least is None:
            return None, None
        affordable = None if backoff > 0 else self._retune_affordable(floor=False)
        if affordable is None and backoff == 0:
            return least, "unbounded"
        if affordable is not None and affordable >= least:
            return least, "allowance"
        share = self._config.max_search_share
        owed = least * 2 ** max(0, backoff - 1)
        if share is not None and share * (self._seconds - self._seconds_at_search) >= owed:
            return least, "trained"
        return None, None

    def _retune(self, stretch: _Stretch, *, plateau: bool, reason: str | None = None) -> _Stretch:
        """A re-tune from the training branch: on a plateau over the whole
        range, else (periodic, or ``reason``) no learning rate below the current one; a
        climb check, or none, when the job's searches cannot pay for one
        that can decide anything. Returns the stretch that trains next."""
        config = self._config
        epochs = len(self._accuracies)
        space = self._search_space(stretch.branch, stretch.tunables, upward=not plateau)
        if not space.searched:
            self._note("retune_skipped", branch=stretch.branch, tunables=stretch.tunables,
                       epoch=epochs, reason="at_fastest")
            return stretch
        reason = reason or ("plateau" if plateau else "periodic")
        affordable = self._retune_affordable(floor=plateau)
        least = self._least_retune_s()
        climb: float | None = None
        if affordable is not None and (affordable <= 0 or (least is not None
                                                           and affordable < least)):
            # What the job's searches have left cannot compare even the
            # current setting with one other: such a re-tune only spends
            # (seen: 0.1-0.3 s searches of one trial that found nothing). A
            # periodic one still climbs, paid from the time trained since
            # the last search (a climb check).
            climb = (None if plateau or least is None
                     else self._climb_budget(space, stretch.tunables, least))
            if climb is None:
                # Training goes on; the plateau rule stops the job if nothing
                # improves.
                self._note("retune_skipped", branch=stretch.branch, tunables=stretch.tunables,
                           epoch=epochs, reason="search_budget", retune=reason,
                           search_seconds=self._search_seconds, left_s=affordable,
                           least_s=least)
                return stretch
        self._note("retune", branch=stretch.branch, tunables=stretch.tunables, epoch=epochs,
                   reason=reason, check="climb" if climb is not None else False, budget_s=climb)
        searcher, found = self._search(stretch.branch, stretch.tunables, retune=True,
                                       space=space, floor=plateau, check_s=climb)
        if found.winner is not None:
            self._close(stretch, "retuned")
            self._release_parent(stretch)
            return self._begin_winner(found, searcher, stretch.branch, stretch.tunables,
                                      stretch.clocks)
        if found.budget_exhausted or not plateau:
            # Out of budget before anything beat the current setting, or a
            # periodic re-tune from a model still improving: go on.
            self._note("keep", branch=stretch.branch, tunables=stretch.tunables,
                       reason="search_budget" if found.budget_exhausted else "no_better")
            return stretch
        if not config.rollback or self._best is None:
            self._finish(Outcome.NO_PROGRESS, stretch)
        # §3 of issue 18: a search that finds nothing ends the job only
        # from the best-validated model; from a worse one, go back first.
        return self._rollback(stretch, "search_found_nothing", exclude=False)

    def _train(self, stretch: _Stretch, clocks: int, per_epoch: int) -> Alarm | None:
        """Runs ``clocks`` clocks in chunks; returns the guard's alarm, if any."""
        config = self._config
        chunk = max(config.num_progress_samples, math.ceil(per_epoch / config.guard_chunks_per_epoch))
        losses: list[float] = []
        seconds: list[float] = []
        epoch = len(self._accuracies) + 1
        while len(losses) < clocks:
            reports = self._run_clocks(stretch.branch, min(chunk, clocks - len(losses)))
            part = [float(r.loss) for r in reports]
            part_s = [float(r.seconds) for r in reports]
            losses += part
            seconds += part_s
            stretch.clocks += len(part)
            alarm = stretch.guard.check(part_s, part) if config.rollback else None
            if alarm is not None:
                self._note("guard", branch=stretch.branch, tunables=stretch.tunables,
                           reason=alarm.reason, loss=alarm.loss, reference=alarm.reference,
                           band=alarm.band, epoch=epoch, clocks=len(losses))
                return alarm
            bad = next((v for v in part if not math.isfinite(v)), None)
            if bad is not None:
                raise TuningError(
                    f"the training loss of branch {stretch.branch} became {bad} in epoch {epoch} "
                    f"with {stretch.tunables}: training diverged; lower the learning rate (the "
                    "search space's range, or initial_setting without initial tuning)"
                )
        train_s = math.fsum(seconds)
        self._clock_seconds = train_s / len(losses)
        self._epoch_seconds = self._clock_seconds * per_epoch
        self._note("train", branch=stretch.branch, tunables=stretch.tunables, clocks=clocks,
                   loss=math.fsum(losses) / len(losses), epoch=epoch, seconds=train_s)
        return None

    def _validate(self, stretch: _Stretch) -> float:
        # §1.1 step 5: a TESTING branch with lr = 0 runs the validation set.
        system, branch = self._system, stretch.branch
        test = system.fork(branch, stretch.tunables, BranchKind.TESTING)
        try:
            # None: no session derived the clocks that cover the validation set (a system of its own).
            clocks = self._config.num_clocks_to_test
            reports: Sequence[ClockReport] = self._run_clocks(
                test, clocks if clocks is not None else DEFAULT_CLOCKS_TO_TEST)
        finally:
            system.free(test)
        values = [r.accuracy for r in reports]
        if not values or any(v is None or not math.isfinite(v) for v in values):
            raise TuningError(
                f"the TESTING branch {test} must report a finite accuracy on every clock, "
                f"got {values[:5]}{'...' if len(values) > 5 else ''}"
            )
        accurate = [float(v) for v in values if v is not None]  # all of them (checked above)
        weights = [r.samples or 0 for r in reports]
        if all(weights):  # each clock by its samples (a last clock may be smaller): the split's accuracy
            accuracy = math.fsum(v * w for v, w in zip(accurate, weights)) / sum(weights)
        else:
            accuracy = math.fsum(accurate) / len(accurate)
        if self._epoch_seconds is not None:
            self._epoch_seconds += math.fsum(r.seconds for r in reports)
        self._accuracies.append(accuracy)
        stretch.accuracies.append(accuracy)
        best = self._best.accuracy if self._best is not None else None
        self._note("validate", branch=branch, tunables=stretch.tunables, accuracy=accuracy,
                   epoch=len(self._accuracies),
                   best_accuracy=max(accuracy, best) if best is not None else accuracy)
        return accuracy

    # -- searches ----------------------------------------------------------------------

    def _backoff(self, failed: Mapping[str, Any]) -> dict[str, Any] | None:
        """``failed`` with half its learning rate (no lower than the
        space's) and, where staleness is searched, the least staleness
        (stale gradients at a high rate are the usual way a setting that
        looked fast in a short trial collapses; seen: slack 3 kept by two
        backoffs in a row, both collapsing); None when the learning rate is
        not searched."""
        lr = next((t for t in self._space.searched if t.name == "lr"), None)
        if not isinstance(lr, LogUniform) or "lr" not in failed:
            return None
        safer = {**failed, "lr": max(lr.low, float(failed["lr"]) / 2)}
        slack = next((t for t in self._space.searched if t.name == "staleness"), None)
        if isinstance(slack, Choice) and "staleness" in failed:
            safer["staleness"] = min(slack.values)
        return safer

    def _search_space(self, parent: int, tunables: Mapping[str, Any], *,
                      upward: bool = False, also: Sequence[str] = ()) -> SearchSpace:
        """What a search from ``parent`` varies. From the untrained root (the
        initial search, or after a rollback there) every tunable, as the
        start setting's batch size and staleness are only defaults; from a
        trained branch ``retune_tunables`` and ``also``, the others kept;
        ``upward`` (a periodic re-tune) no learning rate below the current one."""
        space = self._space
        if parent == self._root:
            return space
        if self._config.retune_tunables is not None:
            narrowed = space.narrowed([*self._config.retune_tunables, *also], tunables)
            space = narrowed if narrowed.searched else space
        return no_slower(space, tunables) if upward else space

    def _search(self, parent: int, tunables: Mapping[str, Any], *, retune: bool = False,
                first: Sequence[Mapping[str, Any]] = (),
                space: SearchSpace | None = None, floor: bool = True,
                check_s: float | None = None) -> tuple[Searcher, SearchResult]:
        """A search from ``parent`` over ``space`` (default: _search_space);
        ``first`` are settings to try before the sampler's (their tunables
        the search does not vary are set to its fixed values); ``floor``:
        the floor may raise its budget; ``check_s``: a climb check with this
        budget (see _climb_budget)."""
        config = self._config
        self._last_search_epoch = len(self._accuracies)
        index = len(self._studies)
        name = f"{self._prefix}-initial" if index == 0 else f"{self._prefix}-retune-{index}"
        from_start = parent == self._root
        space = space or self._search_space(parent, tunables)
        marginal = not from_start and config.retune == "marginal"
        trial_cap = config.max_trials_per_search if from_start else self._last_trials
        check = check_s is not None
        if check:
            # The current setting and its learning rate a step up.
            trial_cap = 2
        searcher = Searcher(
            space,
            sampler=config.sampler,
            seed=None if config.seed is None else config.seed + index,
            storage=self._storage,
            study_name=name,
            base_setting=tunables if marginal else None,
            n_startup_trials=config.n_startup_trials,
            excluded=self._excluded if self._exclusions else None,
        )
        # A re-tune tries the current setting first: it can only end with
        # something at least as good as going on; then its learning rate a
        # step up and down.
        fixed = space.defaults()
        wanted = [*first, *([] if from_start else [tunables, *lr_neighbours(space, tunables)])]
        enqueued = [s for s in ({**fixed, **{t.name: s[t.name] for t in space.searched}}
                                for s in wanted) if searcher.enqueue(s)]
        self._studies.append(name)
        budget = (SearchBudget(check_s) if check_s is not None
                  else self._search_budget(retune=retune, floor=floor))
        seconds = budget is not None and budget.unit == "seconds"
        self._note("search_start", search=index, branch=parent, tunables=tunables,
                   study=name, marginal=marginal, trial_cap=trial_cap,
                   searched=[t.name for t in space.searched], enqueued=bool(enqueued),
                   first=enqueued,
                   budget_s=budget.share if seconds and budget else None,
                   ceiling_s=budget.ceiling if seconds and budget else None,
                   from_start=from_start, excluded=len(self._exclusions),
                   check="climb" if check else False)
        episode = SearchEpisode(self._system, config, searcher, self.log, index=index,
                                parent=parent, parent_tunables=tunables,
                                trial_cap=trial_cap, budget=budget, untrained=from_start,
                                trial_time_s=self._trial_time if check else None)
        found = episode.run()
        self._trials += found.trials
        self._search_seconds += found.seconds
        self._seconds_at_search = self._seconds
        if self._start_loss is None:
            self._start_loss = found.starting_progress
        if found.winner is not None and math.isfinite(found.trial_time) and found.trial_time > 0:
            self._trial_time = found.trial_time
        if found.winner is not None and not check:
            # §1.1 step 6: a re-tune may not use more trials than the last search
            # (a climb check's two are no measure of what the job needs).
            # At least two: a re-tune of one trial only runs the current
            # setting again, and could never change it (seen: a winner alone
            # in its search capped every later re-tune at one trial).
            most = config.max_trials_per_search
            self._last_trials = max(found.trials, 2 if most is None else min(2, most))
        return searcher, found

    def _search_allowance(self) -> float | None:
        """Seconds the job's searches may still spend (max_search_share of
        the job's budget less what they spent); None when unbounded."""
        config = self._config
        job = config.job_budget_s(self._epoch_seconds)
        if config.search_share is None or config.max_search_share is None or job is None:
            return None
        return config.max_search_share * job - self._search_seconds

    def _retune_affordable(self, *, floor: bool) -> float | None:
        """Seconds a re-tune may spend now: what the job's searches have
        left, and with no ``floor`` at most its share; None when unbounded."""
        left = self._search_allowance()
        job = self._config.job_budget_s(self._epoch_seconds)
        share = self._config.search_share
        if left is None or floor or job is None or share is None:
            return left
        return min(left, share * job)

    def _least_retune_s(self) -> float | None:
        """The least a re-tune can compare the current setting with one
        other setting on: the evaluation branch, and two trials of the trial
        time of the search that last chose a setting (the length at which a
        trial's progress stood out from its noise; none before one did),
        each branch's first samples counted again (they run before its time
        per clock is known, and carry the switch to it). None before an
        epoch of training has been timed."""
        config = self._config
        if self._clock_seconds is None:
            return None
        clocks = config.num_clocks_to_eval + 2 * config.num_progress_samples
        return clocks * self._clock_seconds + 2 * (self._trial_time or 0.0)

    def _climb_budget(self, space: SearchSpace, tunables: Mapping[str, Any],
                      least: float) -> float | None:
        """The budget of a climb check, for a periodic re-tune that the job's
        searches cannot pay for, or None: it runs when ``max_search_share``
        of the tuner's clock time since the last search ended pays for
        ``least`` and a learning rate a step up is in ``space`` and not
        excluded. A rate too low climbs steadily and never plateaus, and a
        periodic re-tune is the only way up from it; paid from the time
        trained since the last search, the searches keep the same share of
        the time that follows. The budget is ``least`` (two trials at the
        known trial time); before any search chose a setting, when no trial
        time is known, the whole share, for the trial-time rule to find one."""
        share = self._config.max_search_share
        if share is None or "lr" not in tunables:
            return None
        current = float(tunables["lr"])
        if not any(float(s["lr"]) > current and not self._excluded(s)
                   for s in lr_neighbours(space, tunables)):
            return None
        paid = share * (self._seconds - self._seconds_at_search)
        if paid < least:
            return None
        return least if self._trial_time is not None else paid

    def _search_budget(self, *, retune: bool = False, floor: bool = True) -> SearchBudget | None:
        """The next search's budget: its share of the job, and the ceiling
        of the floor for the job's searches together; None when the job's
        budget is not known. A re-tune's share is also capped by what the
        job's searches may still spend; the initial search and a search
        after a rollback (which must choose a setting) always get theirs.
        Without ``floor`` (a periodic re-tune, which goes on with the
        current setting when it finds nothing) the share is a hard limit."""
        config = self._config
        if config.search_share is None:
            return None
        ceiling = config.max_search_share if floor else None
        job = config.job_budget_s(self._epoch_seconds)
        if job is not None:
            share = config.search_share * job
            left = self._search_allowance()
            if retune and left is not None:
                share = min(share, left)
            return SearchBudget(share, None if ceiling is None else max(share, ceiling * job),
                                spent_before_s=self._search_seconds)
        if config.max_epochs is not None:
            # No epoch measured yet: the search measures one from its
            # evaluation branch.
            return SearchBudget(config.search_share * config.max_epochs,
                                None if ceiling is None else ceiling * config.max_epochs,
                                unit="epochs", spent_before_s=self._search_seconds)
        return None

    def _excluded(self, setting: Mapping[str, Any]) -> bool:
        return any(at_least_as_aggressive(setting, failed) for failed in self._exclusions)

    def _no_winner_at_start(self, found: SearchResult) -> None:
        if found.all_diverged:
            raise TuningError(
                f"every one of the {found.trials} trials of the initial search diverged "
                "(a non-finite loss or 10x the starting loss): no setting in the search "
                "space trains this model; lower the learning-rate range"
            )

    # -- stretches, the frozen best and rollbacks ----------------------------------------

    def _begin(self, branch: int, tunables: Mapping[str, Any], clocks: int, parent: int | None,
               search: int | None, searcher: Searcher | None,
               parent_tunables: Mapping[str, Any], parent_clocks: int) -> _Stretch:
        if not self._config.rollback and parent is not None:
            # Without the guard nothing goes back to the parent (§1.1 step 4).
            self._system.free(parent)
            parent = None
        return _Stretch(branch, dict(tunables), clocks, parent, dict(parent_tunables),
                        parent_clocks, search, searcher, TrainingGuard(self._start_loss),
                        first_epoch=len(self._accuracies))

    def _begin_winner(self, found: SearchResult, searcher: Searcher, parent: int,
                      parent_tunables: Mapping[str, Any], parent_clocks: int) -> _Stretch:
        winner = found.winner
        assert winner is not None
        stretch = self._begin(winner.branch, winner.tunables, winner.clocks, parent,
                              len(self._studies) - 1, searcher, parent_tunables, parent_clocks)
        stretch.batch_chosen = any(t.name == "batch_size" for t in searcher.space.searched)
        return stretch

    def _release_parent(self, stretch: _Stretch) -> None:
        # The winner survived a validation with a loss clearly below the
        # starting loss: its parent is no longer a way back. (A network that
        # died in its first epoch validates at chance, and would become the
        # best-validated model: its parent is kept until it has trained.)
        parent, stretch.parent = stretch.parent, None
        if parent is not None and (self._best is None or parent != self._best.branch):
            self._system.free(parent)

    def _freeze(self, stretch: _Stretch, accuracy: float) -> None:
        old = self._best
        branch = self._system.fork(stretch.branch, stretch.tunables, BranchKind.TRAINING)
        self._best = _Frozen(branch, dict(stretch.tunables), accuracy, len(self._accuracies),
                             stretch.clocks, stretch.branch)
        if old is not None:
            self._system.free(old.branch)
        self._note("freeze", branch=branch, tunables=stretch.tunables, accuracy=accuracy,
                   source=stretch.branch, epoch=len(self._accuracies))

    def _plateau_history(self) -> list[float]:
        """The validations the plateau rules read (``_set_aside``)."""
        return [a for number, a in enumerate(self._accuracies) if number not in self._set_aside]

    def _rollback(self, stretch: _Stretch, reason: str, *, exclude: bool = True,
                  **details: Any) -> _Stretch:
        """Goes back to the best-validated model (or, before any validation,
        to the search's parent) and searches from there."""
        config = self._config
        self._rollbacks += 1
        best = self._best
        # Back to the parent while the stretch has not yet trained and made
        # the best model itself (the best is then no better than the parent:
        # a network that died in its first epoch); else to the best.
        to_parent = stretch.parent is not None and (
            best is None or best.source == stretch.branch)
        if to_parent:
            assert stretch.parent is not None
            target = stretch.parent
            tunables, clocks = dict(stretch.parent_tunables), stretch.parent_clocks
        elif best is not None:
            target, tunables, clocks = best.branch, dict(best.tunables), best.clocks
        else:  # only without the guard, which never rolls back
            raise TuningError(f"nothing to roll back to from branch {stretch.branch}")
        self._note("rollback", reason=reason, branch=stretch.branch, tunables=stretch.tunables,
                   to=target, to_tunables=tunables, target="parent" if to_parent else "best",
                   epoch=len(self._accuracies),
                   best_accuracy=best.accuracy if best is not None else None,
                   excluded=exclude, rollbacks=self._rollbacks, **details)
        if exclude:
            self._exclusions.append(dict(stretch.tunables))
            if stretch.searcher is not None:
                stretch.searcher.record_failure(stretch.tunables, {
                    "outcome": "rolled_back", "reason": reason, "branch": stretch.branch,
                    "epoch": len(self._accuracies),
                    **{k: v for k, v in details.items() if _finite_or_text(v)},
                })
        self._close(stretch, f"rolled_back: {reason}")
        self._system.free(stretch.branch)
        if stretch.parent is not None and stretch.parent != target:
            self._system.free(stretch.parent)
        if self._rollbacks > config.max_rollbacks or not self._space.searched:
            self._give_up(target, tunables, stretch, reason)
        # The failed setting with half its learning rate goes first: the
        # nearest setting the exclusion leaves, and one that trained until it
        # collapsed (a search of random proposals from a trained model can
        # otherwise end with one that crawls and never plateaus).
        backoff = self._backoff(stretch.tunables) if exclude else None
        # The search may change what the backoff changes (the staleness too).
        changed = [n for n, v in (backoff or {}).items() if v != tunables.get(n)]
        searcher, found = self._search(target, tunables, first=[backoff] if backoff else [],
                                       space=self._search_space(target, tunables, also=changed))
        if found.winner is not None:
            return self._begin_winner(found, searcher, target, tunables, clocks)
        if best is None:
            self._no_winner_at_start(found)
        if backoff is not None and self._excluded(tunables) and found.budget_exhausted:
            # The model rolled back to was made by the setting that collapsed,
            # and the budget ran out before a trial made progress, which says
            # nothing about the model: go on with the safer backoff (seen: a
            # job ended at 85% after 17 of 50 epochs).
            tunables = backoff
        # A plateau of the model gone back to is judged on the validations up
        # to its own: those after it, of the setting that then collapsed
        # (two lower ones and the collapse), would read as one, now and later.
        if exclude and not to_parent and best is not None:
            self._set_aside.update(range(best.epoch, len(self._accuracies)))
        if self._excluded(tunables) or (
                not to_parent and plateaued(self._plateau_history(), config.plateau_size_for_retune)):
            if best is None:
                self._end(Outcome.NO_PROGRESS, target, tunables)
            assert best is not None
            if target != best.branch:
                self._system.free(target)
            self._end(Outcome.NO_PROGRESS, best.branch, best.tunables)
        # Nothing better than the setting that made the model rolled back
        # to, and validation was still improving with it; or that model is
        # the parent of a collapse (the root, say: short trials from an
        # untrained model often show no progress, which says nothing about
        # it), and its setting had been training it: go on with it.
        branch = self._system.fork(target, tunables, BranchKind.TRAINING)
        self._note("resume", branch=branch, tunables=tunables, source=target)
        return self._begin(branch, tunables, clocks, target, None, None, tunables, clocks)

    def _give_up(self, target: int, tunables: Mapping[str, Any], stretch: _Stretch,
                 reason: str) -> None:
        best = self._best
        if best is None:
            self._system.free(target)
            raise TuningError(
                f"training collapsed ({reason}) {self._rollbacks} time(s) before any "
                f"validation, the last time with {stretch.tunables}: no setting the searches "
                "found trains this model; lower the learning-rate range"
            )
        if target != best.branch:
            self._system.free(target)
        self._end(Outcome.ROLLBACK_LIMIT, best.branch, best.tunables)

    def _finish(self, outcome: Outcome, stretch: _Stretch) -> None:
        """Ends the job with the best-validated branch, freeing the rest."""
        best = self._best
        self._close(stretch, "end")
        if stretch.parent is not None and (best is None or stretch.parent != best.branch):
            self._system.free(stretch.parent)
        if best is None:
            self._end(outcome, stretch.branch, stretch.tunables)
        assert best is not None
        if best.source == stretch.branch and best.epoch == len(self._accuracies):
            # The last validation made the best: the training branch holds it.
            self._system.free(best.branch)
            self._end(outcome, stretch.branch, stretch.tunables)
        self._system.free(stretch.branch)
        self._end(outcome, best.branch, best.tunables)

    def _end(self, outcome: Outcome, branch: int, tunables: Mapping[str, Any]) -> None:
        raise _End(self._result(outcome, branch, tunables, self._best))

    def _close(self, stretch: _Stretch, ended: str) -> None:
        """Records a training stretch as a trial of the training study."""
        study = self._training()
        params = {t.name: stretch.tunables[t.name] for t in self._space}
        intermediate = {stretch.first_epoch + i + 1: a for i, a in enumerate(stretch.accuracies)}
        attrs = {"branch": stretch.branch, "ended": ended, "search": stretch.search,
                 "clocks": stretch.clocks, "tunables": stretch.tunables}
        trial = optuna.trial.create_trial(
            state=(optuna.trial.TrialState.COMPLETE if stretch.accuracies
                   else optuna.trial.TrialState.FAIL),
            value=max(stretch.accuracies) if stretch.accuracies else None,
            params=params, distributions={t.name: t.distribution() for t in self._space},
            user_attrs=attrs, intermediate_values=intermediate)
        study.add_trial(trial)

    def _training(self) -> optuna.Study:
        if self._training_study is None:
            self._training_study = optuna.create_study(
                storage=self._storage, study_name=f"{self._prefix}-training",
                direction="maximize", load_if_exists=True)
            self._training_study.set_user_attr(
                "about", "one trial per training stretch: its setting, the validation accuracy "
                "per epoch (step = epoch), its best as the value; user attribute `ended` says "
                "how it ended (retuned, rolled_back: REASON, end)")
        return self._training_study

    # -- helpers -----------------------------------------------------------------------

    def _run_clocks(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        reports = run_clocks(self._system, branch, clocks)
        self._seconds += math.fsum(float(r.seconds) for r in reports)
        return reports

    def _open_storage(self) -> str | BaseStorage | None:
        storage = self._config.storage
        if storage is None and self.log.path is not None:
            # Absolute: the log names it, and `mltuner report` may run elsewhere.
            storage = f"journal:{Path(self.log.path).resolve().parent / JOURNAL_NAME}"
        self._storage_url = storage if isinstance(storage, str) else (
            None if storage is None else type(storage).__name__)
        # One storage object for every study of the job.
        return open_storage(storage)

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
                best: _Frozen | None) -> TuningResult:
        accuracy = None
        if best is not None:
            accuracy = best.accuracy
        seconds = self._seconds + self._search_seconds
        result = TuningResult(
            outcome, branch, dict(tunables), list(self._accuracies), len(self._accuracies),
            len(self._studies), self._trials, list(self._studies),
            best_accuracy=accuracy if accuracy is not None
            else (max(self._accuracies) if self._accuracies else None),
            rollbacks=self._rollbacks, seconds=seconds, search_seconds=self._search_seconds,
            training_study=(self._training_study.study_name
                            if self._training_study is not None else None))
        self._note("end", outcome=outcome, branch=branch, tunables=tunables,
                   accuracy=result.best_accuracy, epochs=len(self._accuracies),
                   searches=len(self._studies), trials=self._trials, rollbacks=self._rollbacks,
                   seconds=seconds, search_seconds=self._search_seconds,
                   storage=self._storage_url)
        return result

    def _note(self, event: str, **fields: Any) -> None:
        self.log.write(event, phase=_PHASES.get(event, "train"), **fields)


def _finite_or_text(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, (int, float)) and math.isfinite(value))
