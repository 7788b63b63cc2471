"""Baselines to compare MLtuner with, driven through the same :class:`BranchSystem`.

mltuner.md §4 ("Baseline logics") and §5 compare the tuner with tuners that
fix a setting per trial and start every trial from the *initial* weights,
judging it by validation accuracy per epoch. Here they are, on the branch
interface the :class:`~mltuner.tune.Tuner` uses, so that time to a target
accuracy is measured the same way for all:

- :func:`run_fixed`: no tuning; one setting trained epoch by epoch.
- :func:`run_optuna`: Optuna (TPE) with a whole training run per trial: the
  paper's Spearmint logic, with Optuna's TPE in place of Spearmint's GP.
- :func:`run_hyperband`: the same trials under Optuna's ``HyperbandPruner``,
  with epochs as the resource.
- :func:`run_mltuner` and :func:`mltuner_result`: the Tuner's run summarised
  in the same :class:`BaselineResult`.

Time. Every driver counts the sum of :attr:`ClockReport.seconds` over every
clock it runs on every branch: the INIT clock, training, and each validation
(TESTING) branch; for the Tuner, also its evaluation branches and trials.
Branches run one at a time on the same workers (§1.2), so this sum is the
job's time on the cluster less the decision overhead (forks, branch switches,
Optuna's ``ask``), which is left out on both sides alike. A simulated system
therefore gives deterministic times. :class:`TimedSystem` does the counting.

Ownership: every driver frees every branch it forks, the INIT root included,
also when it raises; nothing it forked is alive when it returns, except,
with ``keep_branch=True``, the training branch of its best run
(:attr:`BaselineResult.branch`), which the caller frees (a
:class:`~mltuner.tune.TuningSession` trains on from it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.pruners import BasePruner, HyperbandPruner, NopPruner
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import DEFAULT_CLOCKS_TO_TEST, TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._log import DecisionLog
from mltuner.tune.tuner._searcher import open_storage
from mltuner.tune._space import Choice, SearchSpace
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport
from mltuner.tune.tuner._search import run_clocks
from mltuner.tune.tuner._tuner import Tuner, TuningResult, plateaued

__all__ = [
    "BaselineConfig",
    "BaselineResult",
    "BaselineTrial",
    "TimedSystem",
    "run_fixed",
    "run_optuna",
    "run_hyperband",
    "run_mltuner",
    "mltuner_result",
    "curve_from_log",
    "time_to_target",
    "running_best",
]

BASELINE_SAMPLERS = ("tpe", "random")

Curve = list[tuple[float, float]]
"""(counted seconds since the start, validation accuracy), one point per validation."""


# -- counting time ---------------------------------------------------------------------


class TimedSystem:
    """A :class:`BranchSystem` that passes every call on to ``system`` and
    counts the seconds of every clock it runs and the branches alive.

    Give :meth:`now` to a :class:`DecisionLog` as its clock to time the log's
    records in counted clock seconds instead of wall time.

    Thread safety: none, like the systems it wraps.
    """

    def __init__(self, system: BranchSystem) -> None:
        _check_system(system)
        self.system = system
        self.seconds = 0.0
        """Sum of ClockReport.seconds of every clock run through this wrapper."""
        self.clocks = 0
        """Clocks run through this wrapper."""
        self._live: dict[int, None] = {}   # in fork order

    @property
    def live(self) -> set[int]:
        """Branches forked through this wrapper and not freed yet."""
        return set(self._live)

    def fork(self, parent: int | None, tunables: Mapping[str, Any], kind: BranchKind) -> int:
        """``system.fork``; the new branch counts as alive."""
        branch = self.system.fork(parent, tunables, kind)
        self._live[branch] = None
        return branch

    def free(self, branch: int) -> None:
        """``system.free``; the branch no longer counts as alive."""
        self.system.free(branch)
        self._live.pop(branch, None)

    def run(self, branch: int, clocks: int) -> Sequence[ClockReport]:
        """``system.run``, adding its reports' seconds and clocks to the
        counts."""
        reports = self.system.run(branch, clocks)
        self.seconds += math.fsum(float(r.seconds) for r in reports)
        self.clocks += len(reports)
        return reports

    def clocks_per_epoch(self, tunables: Mapping[str, Any]) -> int:
        """``system.clocks_per_epoch``."""
        return self.system.clocks_per_epoch(tunables)

    def now(self) -> float:
        """The counted seconds so far (a :class:`DecisionLog` clock)."""
        return self.seconds

    def free_all(self, keep: int | None = None) -> None:
        """Frees every branch still alive that was forked through this wrapper
        but ``keep``, newest first (children before the branches they were
        forked from)."""
        for branch in reversed(list(self._live)):
            if branch != keep:
                self.free(branch)


# -- configuration and results ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BaselineConfig:
    """How a baseline trains, validates and stops.

    Args:
        target_accuracy: stop at the first validation reaching this accuracy,
            in (0, 1]; None runs to the other limits.
        max_epochs: epochs of one training run: the whole fixed run, or each
            trial of the Optuna baselines (Hyperband's maximum resource).
        num_clocks_to_test: clocks of each validation (TESTING) branch; use
            the Tuner's value for a fair comparison (in a
            :class:`TuningSession`, ``session.config.num_clocks_to_test``:
            the clocks that cover its validation set once).
        plateau_size_for_convergence: a run stops when this many validations
            in a row bring no new best accuracy (the Tuner's stop rule, §1.1
            step 6).
        n_trials: trials of the Optuna baselines; None is unbounded (then
            ``time_budget_s`` is required).
        time_budget_s: stop once this many counted seconds have run, checked
            after each validation; None is unbounded.
        sampler: ``"tpe"`` (default) or ``"random"``.
        n_startup_trials: random trials before TPE models the results
            (Optuna's default 10).
        seed: seeds the sampler.
        storage: an Optuna storage URL or object (see
            :func:`~mltuner.tune.open_storage`); None keeps the study in memory.
        study_name: the study's name; None picks one from the baseline, the
            date and the process id, so reruns into one storage never collide.
        reduction_factor: Hyperband's reduction factor (Optuna's default 3).
        diverged_value: the accuracy told for a trial whose loss became
            non-finite: 0.0, the worst, so that TPE learns to avoid its region
            (as the Tuner tells a diverged trial's slope as 0, and the
            original baseline told a diverged run's chance-level accuracy).
            None tells it FAIL, which TPE ignores, so it keeps proposing
            settings there.
    """

    target_accuracy: float | None = None
    max_epochs: int = 100
    num_clocks_to_test: int = DEFAULT_CLOCKS_TO_TEST
    plateau_size_for_convergence: int = 5
    n_trials: int | None = 20
    time_budget_s: float | None = None
    sampler: str = "tpe"
    n_startup_trials: int = 10
    seed: int | None = None
    storage: str | BaseStorage | None = None
    study_name: str | None = None
    reduction_factor: int = 3
    diverged_value: float | None = 0.0

    def __post_init__(self) -> None:
        _check_target(self.target_accuracy)
        for name in ("max_epochs", "num_clocks_to_test", "plateau_size_for_convergence"):
            _check_positive_int(name, getattr(self, name))
        if self.n_trials is not None:
            _check_positive_int("n_trials", self.n_trials)
        budget = self.time_budget_s
        if budget is not None and not (isinstance(budget, (int, float))
                                       and math.isfinite(budget) and budget > 0):
            raise InvalidArgumentError(f"time_budget_s must be > 0 or None, got {budget!r}")
        if self.sampler not in BASELINE_SAMPLERS:
            raise InvalidArgumentError(
                f"unknown baseline sampler {self.sampler!r}: use one of "
                f"{', '.join(BASELINE_SAMPLERS)}"
            )
        if not isinstance(self.n_startup_trials, int) or self.n_startup_trials < 0:
            raise InvalidArgumentError(
                f"n_startup_trials must be an integer >= 0, got {self.n_startup_trials!r}"
            )
        if not isinstance(self.reduction_factor, int) or self.reduction_factor < 2:
            raise InvalidArgumentError(
                f"reduction_factor must be an integer >= 2, got {self.reduction_factor!r}"
            )
        if self.diverged_value is not None and not _is_number(self.diverged_value):
            raise InvalidArgumentError(
                f"diverged_value must be a finite number or None, got {self.diverged_value!r}"
            )

    @classmethod
    def matching(cls, tuner_config: TunerConfig, **changes: Any) -> BaselineConfig:
        """A config that validates and stops like ``tuner_config``: the same
        ``num_clocks_to_test`` (``DEFAULT_CLOCKS_TO_TEST`` when it is None, as
        a Tuner without a session runs), ``plateau_size_for_convergence``,
        ``seed``, ``n_startup_trials`` and, when set, ``max_epochs``;
        ``changes`` override any field."""
        test_clocks = tuner_config.num_clocks_to_test
        fields: dict[str, Any] = {
            "num_clocks_to_test": test_clocks if test_clocks is not None else DEFAULT_CLOCKS_TO_TEST,
            "plateau_size_for_convergence": tuner_config.plateau_size_for_convergence,
            "seed": tuner_config.seed,
            "n_startup_trials": tuner_config.n_startup_trials,
        }
        if tuner_config.max_epochs is not None:
            fields["max_epochs"] = tuner_config.max_epochs
        fields.update(changes)
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class BaselineTrial:
    """One training run of a baseline (the fixed run is trial 0).

    Attributes:
        number: the Optuna trial number (0 for the fixed run).
        tunables: the run's decoded setting.
        epochs: epochs trained (a diverged epoch included).
        accuracies: the validation accuracy after each validated epoch.
        seconds: counted seconds of this run: its training and validation
            clocks.
        ended: why it ended: ``"target"``, ``"converged"`` (plateau),
            ``"max_epochs"``, ``"time_budget"``, ``"pruned"`` or
            ``"diverged"`` (a non-finite training loss).
    """

    number: int
    tunables: dict[str, Any]
    epochs: int
    accuracies: list[float]
    seconds: float
    ended: str

    @property
    def best_accuracy(self) -> float | None:
        return max(self.accuracies) if self.accuracies else None


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    """A baseline's (or the Tuner's) run, in terms that compare across them.

    Attributes:
        name: ``"fixed"``, ``"optuna"``, ``"hyperband"`` or ``"mltuner"``.
        outcome: why it ended: a trial's ``ended`` for the fixed run;
            ``"target"``, ``"n_trials"`` or ``"time_budget"`` for the Optuna
            baselines; the Tuner's :class:`~mltuner.tune.Outcome` value.
        reached_target: some validation reached the target accuracy.
        time_to_target_s: counted seconds up to and including the first
            validation that reached the target; None if none did.
        time_s: counted seconds of the whole run.
        best_accuracy: the best validation accuracy; None without any.
        best_tunables: the setting that gave it.
        trials: training runs (Optuna trials; 1 for the fixed run; the
            Tuner's trial branches).
        epochs: epochs trained, summed over runs (for the Tuner, epochs of its
            training branch; trial clocks are not epochs).
        curve: (counted seconds, accuracy) after each validation, in order;
            over all trials, not a running best (see :func:`running_best`).
        runs: each training run (empty for the Tuner).
        study_name: the Optuna study, for the Optuna baselines.
        target_accuracy: the target the result was measured against.
        branch: with ``keep_branch=True``, the training branch of the best
            run that did not diverge, as that run ended, alive for the caller
            (None without keep_branch, or when no such run validated).
        tunables: the setting :attr:`branch` trained with (a
            :class:`~mltuner.tune.TuningSession` gives it to the model).
    """

    name: str
    outcome: str
    reached_target: bool
    time_to_target_s: float | None
    time_s: float
    best_accuracy: float | None
    best_tunables: dict[str, Any] | None
    trials: int
    epochs: int
    curve: Curve
    runs: list[BaselineTrial]
    study_name: str | None = None
    target_accuracy: float | None = None
    branch: int | None = None
    tunables: dict[str, Any] | None = None


def time_to_target(curve: Sequence[tuple[float, float]], target: float | None) -> float | None:
    """The time of the first point whose accuracy is at least ``target``, or None."""
    if target is None:
        return None
    return next((t for t, accuracy in curve if accuracy >= target), None)


def running_best(curve: Sequence[tuple[float, float]]) -> Curve:
    """The curve of the best accuracy so far (what a time-to-accuracy plot shows)."""
    best, out = -math.inf, []
    for t, accuracy in curve:
        best = max(best, accuracy)
        out.append((t, best))
    return out


# -- the three baselines ---------------------------------------------------------------


def run_fixed(
    system: BranchSystem,
    tunables: Mapping[str, Any],
    config: BaselineConfig | None = None,
    *,
    space: SearchSpace | None = None,
    log: DecisionLog | str | os.PathLike[str] | None = None,
    keep_branch: bool = False,
) -> BaselineResult:
    """Trains one setting with no tuning: forks a TRAINING branch from the
    INIT root, trains it epoch by epoch and validates after each epoch as the
    Tuner does, until the target accuracy, ``max_epochs``, a plateau, the
    time budget or a non-finite loss (outcome ``"diverged"``).

    Args:
        system: the training system.
        tunables: the full decoded setting.
        config: see :class:`BaselineConfig` (``n_trials`` and the sampler
            fields do not apply).
        space: when given, ``tunables`` is checked against it.
        log: a :class:`DecisionLog`, or a path to append one to; a log made
            here is timed in counted seconds (see :class:`TimedSystem`).
        keep_branch: leave the run's training branch alive for the caller
            (:attr:`BaselineResult.branch`); by default it is freed.

    Raises:
        InvalidArgumentError: a bad setting, or one batch larger than an epoch.
    """
    config = config if config is not None else BaselineConfig()
    _check_system(system)
    if space is not None:
        space.check_setting(tunables)
    setting = dict(tunables)
    _check_epoch_fits(system, setting)
    with _Driver("fixed", system, config, log, keep_branch=keep_branch) as driver:
        driver.start(setting, sampler=None, searched=[])
        root = driver.init_root(setting)
        run = driver.train_run(root, setting, 0)
        driver.free(root)
        return driver.finish(run.ended)


def run_optuna(
    system: BranchSystem,
    space: SearchSpace,
    config: BaselineConfig | None = None,
    *,
    log: DecisionLog | str | os.PathLike[str] | None = None,
    keep_branch: bool = False,
) -> BaselineResult:
    """Optuna with a whole training run per trial.

    One study, maximising validation accuracy. Each trial asks for a
    setting, forks a fresh TRAINING branch from the INIT root (so every trial
    starts from the same initial weights), trains it epoch by epoch up to
    ``max_epochs`` (or to the target, a plateau, or a non-finite loss, told
    as ``diverged_value``), reports each epoch's accuracy as an intermediate
    value, tells its best accuracy, and frees the branch. The search stops
    when a trial reaches the target, after ``n_trials`` or at the time budget.
    With ``keep_branch``, the branch of the trial with the best accuracy
    stays alive for the caller (:attr:`BaselineResult.branch`).

    Raises:
        InvalidArgumentError: nothing to search, no stop rule (``n_trials``
            and ``time_budget_s`` both None), a batch larger than an epoch,
            or a study name already in ``storage``.
    """
    return _run_search("optuna", system, space, config, log, prune=False, keep_branch=keep_branch)


def run_hyperband(
    system: BranchSystem,
    space: SearchSpace,
    config: BaselineConfig | None = None,
    *,
    log: DecisionLog | str | os.PathLike[str] | None = None,
    keep_branch: bool = False,
) -> BaselineResult:
    """Hyperband over epochs: :func:`run_optuna`'s trial loop under Optuna's
    ``HyperbandPruner`` (min_resource 1, max_resource ``max_epochs``,
    ``reduction_factor``), asked ``should_prune()`` after each epoch's report.
    A pruned trial is told PRUNED (Optuna takes its last accuracy as its
    value). Optuna's Hyperband is asynchronous (ASHA-style): each trial is
    hashed into a bracket, and goes on past a rung only if its accuracy there
    is in the top 1/reduction_factor of the accuracies its bracket's trials
    reached at that rung so far (while fewer than reduction_factor have, it
    must be the best), so early trials are pruned less often than late ones.
    ``keep_branch`` as for :func:`run_optuna`."""
    return _run_search("hyperband", system, space, config, log, prune=True, keep_branch=keep_branch)


def _run_search(name: str, system: BranchSystem, space: SearchSpace,
                config: BaselineConfig | None, log: DecisionLog | str | os.PathLike[str] | None,
                *, prune: bool, keep_branch: bool) -> BaselineResult:
    config = config if config is not None else BaselineConfig()
    _check_system(system)
    if not isinstance(space, SearchSpace):
        raise InvalidArgumentError(f"space must be a SearchSpace, got {type(space).__name__}")
    if not space.searched:
        raise InvalidArgumentError(
            f"nothing for the {name} baseline to search: every tunable has search=False "
            "(use run_fixed for a fixed setting)"
        )
    if config.n_trials is None and config.time_budget_s is None:
        raise InvalidArgumentError(
            f"the {name} baseline needs n_trials or time_budget_s: without either it "
            "never stops unless the target is reached"
        )
    defaults = space.defaults()
    _check_choices_fit(system, space, defaults)
    pruner: BasePruner = (
        HyperbandPruner(min_resource=1, max_resource=config.max_epochs,
                        reduction_factor=config.reduction_factor) if prune else NopPruner()
    )
    study = _create_study(name, config, pruner)
    distributions = space.distributions()
    with _Driver(name, system, config, log, study_name=study.study_name, keep_branch=keep_branch) as driver:
        driver.start(defaults, sampler=config.sampler, searched=[t.name for t in space.searched])
        root = driver.init_root(defaults)
        outcome = "n_trials"
        while config.n_trials is None or len(driver.runs) < config.n_trials:
            if driver.over_budget():
                outcome = "time_budget"
                break
            trial = study.ask(fixed_distributions=dict(distributions))
            try:
                tunables = space.decode(trial.params)
                _check_epoch_fits(system, tunables)
                run = driver.train_run(root, tunables, trial.number, trial=trial, prune=prune)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            _tell(study, trial, run, config.diverged_value)
            if run.ended == "target":
                outcome = "target"
                break
            if run.ended == "time_budget":
                outcome = "time_budget"
                break
        driver.free(root)
        return driver.finish(outcome)


def _create_study(name: str, config: BaselineConfig, pruner: BasePruner) -> optuna.Study:
    if config.sampler == "tpe":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(
            seed=config.seed, n_startup_trials=config.n_startup_trials)
    else:
        sampler = optuna.samplers.RandomSampler(seed=config.seed)
    study_name = config.study_name or (
        f"{name}-baseline-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        return optuna.create_study(storage=open_storage(config.storage), study_name=study_name,
                                   direction="maximize", sampler=sampler, pruner=pruner)
    except optuna.exceptions.DuplicatedStudyError as error:
        raise InvalidArgumentError(
            f"the storage already has a study named {study_name!r}: choose another study_name"
        ) from error


def _tell(study: optuna.Study, trial: optuna.trial.Trial, run: BaselineTrial,
          diverged_value: float | None) -> None:
    for key, value in (("tunables", run.tunables), ("epochs", run.epochs),
                       ("seconds", run.seconds), ("ended", run.ended)):
        trial.set_user_attr(key, value)
    if run.ended == "diverged":
        if diverged_value is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, diverged_value)
    elif run.best_accuracy is None:
        study.tell(trial, state=TrialState.FAIL)
    elif run.ended == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, run.best_accuracy)


# -- the shared training loop ----------------------------------------------------------


class _Driver:
    """One baseline run: counts time, logs, trains and validates runs, and
    frees whatever it forked, also on an error (but, with ``keep_branch``,
    the best run's training branch on success)."""

    def __init__(self, name: str, system: BranchSystem, config: BaselineConfig,
                 log: DecisionLog | str | os.PathLike[str] | None,
                 *, study_name: str | None = None, keep_branch: bool = False) -> None:
        self.name = name
        self.config = config
        self.timer = TimedSystem(system)
        self.study_name = study_name
        self._owns_log = not isinstance(log, DecisionLog)
        # A log made here is timed in counted seconds, so that `mltuner
        # report` and curve_from_log show the time being compared.
        self.log = log if isinstance(log, DecisionLog) else DecisionLog(log, clock=self.timer.now)
        self.runs: list[BaselineTrial] = []
        self.curve: Curve = []
        self._best: tuple[float, dict[str, Any]] | None = None
        self._keep_branch = keep_branch
        self._kept: tuple[float, int, dict[str, Any]] | None = None  # the best run's (accuracy, branch, tunables)
        self._returned: int | None = None  # the kept branch, once finish() handed it out

    def __enter__(self) -> _Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            # Nothing is alive after a normal run but the branch handed out;
            # after an error, this frees the trial and its TESTING branch, if
            # any, the best run's branch and the root.
            self.timer.free_all(keep=self._returned if exc[0] is None else None)
        finally:
            if self._owns_log:
                self.log.close()

    # -- steps -------------------------------------------------------------------------

    def start(self, tunables: Mapping[str, Any], *, sampler: str | None,
              searched: list[str]) -> None:
        config = self.config
        self.note("start", "init", baseline=self.name, tunables=tunables, sampler=sampler,
                  searched=searched, target_accuracy=config.target_accuracy,
                  max_epochs=config.max_epochs, n_trials=config.n_trials,
                  time_budget_s=config.time_budget_s, study=self.study_name)

    def init_root(self, tunables: Mapping[str, Any]) -> int:
        # §1.1 step 0, as the Tuner does: the root runs one clock, in which
        # the application writes the initial weights.
        root = self.timer.fork(None, tunables, BranchKind.INIT)
        run_clocks(self.timer, root, 1)
        self.note("init", "init", branch=root)
        return root

    def train_run(self, root: int, tunables: dict[str, Any], number: int, *,
                  trial: optuna.trial.Trial | None = None, prune: bool = False) -> BaselineTrial:
        """Trains one setting from ``root`` until it ends; frees its branch."""
        per_epoch = self.timer.clocks_per_epoch(tunables)
        start = self.timer.seconds
        branch = self.timer.fork(root, tunables, BranchKind.TRAINING)
        self.note("fork_trial", "search", branch=branch, tunables=tunables, trial=number,
                  clocks_per_epoch=per_epoch)
        accuracies: list[float] = []
        epoch, ended = 0, "max_epochs"
        while epoch < self.config.max_epochs:
            epoch += 1
            if not self._train_epoch(branch, tunables, number, epoch, per_epoch):
                ended = "diverged"
                break
            accuracy = self._validate(branch, tunables, number, epoch)
            accuracies.append(accuracy)
            if trial is not None:
                trial.report(accuracy, epoch)
            stop = self._stop_reason(accuracies, epoch)
            if stop is None and prune and trial is not None and trial.should_prune():
                stop = "pruned"
            if stop is not None:
                ended = stop
                break
        run = BaselineTrial(number, dict(tunables), epoch, accuracies,
                            self.timer.seconds - start, ended)
        self._keep_or_free(branch, run)
        self.runs.append(run)
        self.note("free_trial", "search", branch=branch, tunables=tunables, trial=number,
                  reason=ended, accuracy=run.best_accuracy, epochs=epoch,
                  trial_seconds=run.seconds)
        return run

    def _keep_or_free(self, branch: int, run: BaselineTrial) -> None:
        """With keep_branch, keeps the branch of the best run so far (a
        strictly better accuracy replaces it) unless it diverged, whose
        weights are no longer finite; frees every other."""
        accuracy = run.best_accuracy
        if (self._keep_branch and accuracy is not None and run.ended != "diverged"
                and (self._kept is None or accuracy > self._kept[0])):
            if self._kept is not None:
                self.free(self._kept[1])
            self._kept = (accuracy, branch, dict(run.tunables))
        else:
            self.free(branch)

    def _stop_reason(self, accuracies: list[float], epoch: int) -> str | None:
        config = self.config
        target = config.target_accuracy
        if target is not None and accuracies[-1] >= target:
            return "target"
        if plateaued(accuracies, config.plateau_size_for_convergence):
            return "converged"
        if epoch >= config.max_epochs:
            return "max_epochs"
        if self.over_budget():
            return "time_budget"
        return None

    def _train_epoch(self, branch: int, tunables: Mapping[str, Any], number: int,
                     epoch: int, clocks: int) -> bool:
        """Runs one epoch; False when the loss became non-finite (diverged)."""
        reports = run_clocks(self.timer, branch, clocks)
        losses = [float(r.loss) for r in reports]
        finite = all(math.isfinite(loss) for loss in losses)
        self.note("train", "train", branch=branch, tunables=tunables, trial=number,
                  epoch=epoch, clocks=clocks, diverged=not finite,
                  loss=math.fsum(losses) / len(losses) if finite else None)
        return finite

    def _validate(self, branch: int, tunables: Mapping[str, Any], number: int,
                  epoch: int) -> float:
        # §1.1 step 5, exactly as the Tuner validates: a TESTING branch with
        # lr = 0 runs the validation set; its mean accuracy is the result.
        clocks = self.config.num_clocks_to_test
        test = self.timer.fork(branch, tunables, BranchKind.TESTING)
        try:
            reports = run_clocks(self.timer, test, clocks)
        finally:
            self.timer.free(test)
        values = [r.accuracy for r in reports]
        if any(v is None or not math.isfinite(v) for v in values):
            raise TuningError(
                f"the TESTING branch {test} must report a finite accuracy on every clock, "
                f"got {values[:5]}{'...' if len(values) > 5 else ''}"
            )
        accuracy = math.fsum(v for v in values if v is not None) / len(values)
        self.curve.append((self.timer.seconds, accuracy))
        if self._best is None or accuracy > self._best[0]:
            self._best = (accuracy, dict(tunables))
        self.note("validate", "train", branch=branch, tunables=tunables, trial=number,
                  epoch=epoch, accuracy=accuracy)
        return accuracy

    def free(self, branch: int) -> None:
        self.timer.free(branch)

    def over_budget(self) -> bool:
        budget = self.config.time_budget_s
        return budget is not None and self.timer.seconds >= budget

    def finish(self, outcome: str) -> BaselineResult:
        target = self.config.target_accuracy
        reached = time_to_target(self.curve, target)
        best_accuracy, best_tunables = self._best if self._best is not None else (None, None)
        self._returned = self._kept[1] if self._kept is not None else None
        result = BaselineResult(
            name=self.name, outcome=outcome, reached_target=reached is not None,
            time_to_target_s=reached, time_s=self.timer.seconds, best_accuracy=best_accuracy,
            best_tunables=best_tunables, trials=len(self.runs),
            epochs=sum(r.epochs for r in self.runs), curve=list(self.curve),
            runs=list(self.runs), study_name=self.study_name, target_accuracy=target, branch=self._returned,
            tunables=self._kept[2] if self._kept is not None else None)
        self.note("end", "end", baseline=self.name, outcome=outcome, accuracy=best_accuracy,
                  tunables=best_tunables, epochs=result.epochs, trials=result.trials,
                  reached_target=result.reached_target, time_to_target_s=reached,
                  time_s=result.time_s)
        return result

    def note(self, event: str, phase: str, **fields: Any) -> None:
        # elapsed_s: counted seconds, whatever clock the caller's log uses.
        self.log.write(event, phase=phase, elapsed_s=self.timer.seconds, **fields)



# -- the Tuner, measured the same way --------------------------------------------------


def curve_from_log(records: Sequence[Mapping[str, Any]]) -> Curve:
    """(seconds, accuracy) after each ``validate`` record of the last run in
    ``records`` (a :class:`DecisionLog`'s records or :func:`read_log`'s).

    Seconds are a record's ``elapsed_s`` when it has one (the baselines'
    records, and those :func:`run_mltuner` stamps), else its ``time`` less
    the run's first record's: counted clock seconds when the log's clock was
    :meth:`TimedSystem.now`, wall time otherwise.
    """
    run = _last_run(records)
    return [(_elapsed(r, run), float(r["accuracy"])) for r in run
            if r.get("event") == "validate" and _is_number(r.get("accuracy"))]


def mltuner_result(records: Sequence[Mapping[str, Any]], target_accuracy: float | None = None,
                   *, tuning: TuningResult | None = None) -> BaselineResult:
    """The Tuner's run in a :class:`BaselineResult`, from its decision log
    (the last run in ``records``) and optionally its :class:`TuningResult`.
    A baseline's log reads back too (named after its ``start`` record), but
    without its per-trial ``runs``.

    Times are as in :func:`curve_from_log`: for a comparison with the
    baselines, run the Tuner through :func:`run_mltuner`, or on a
    :class:`TimedSystem` with a ``DecisionLog(clock=timed.now)``.
    """
    _check_target(target_accuracy)
    run = _last_run(records)
    curve = curve_from_log(run)
    validations = [r for r in run if r.get("event") == "validate"
                   and _is_number(r.get("accuracy"))]
    best = max(validations, key=lambda r: float(r["accuracy"]), default=None)
    end = next((r for r in reversed(run) if r.get("event") == "end"), None)
    outcome = (tuning.outcome.value if tuning is not None
               else str(end.get("outcome")) if end is not None else "unfinished")
    reached = time_to_target(curve, target_accuracy)
    return BaselineResult(
        name=str(run[0].get("baseline", "mltuner")), outcome=outcome,
        reached_target=reached is not None, time_to_target_s=reached, time_s=_elapsed(run[-1], run),
        best_accuracy=float(best["accuracy"]) if best is not None else None,
        best_tunables=dict(best["tunables"]) if best is not None and isinstance(
            best.get("tunables"), Mapping) else None,
        trials=tuning.trials if tuning is not None else sum(
            1 for r in run if r.get("event") == "fork_trial"),
        epochs=tuning.epochs if tuning is not None else len(validations),
        curve=curve, runs=[], target_accuracy=target_accuracy)


def run_mltuner(
    system: BranchSystem,
    space: SearchSpace,
    config: TunerConfig | None = None,
    *,
    target_accuracy: float | None = None,
    log: DecisionLog | str | os.PathLike[str] | None = None,
    keep_branch: bool = False,
) -> tuple[BaselineResult, TuningResult]:
    """Runs the :class:`~mltuner.tune.Tuner` with its time counted as the
    baselines count theirs (every clock of every branch, its evaluation
    branches and trials included), and returns its summary with the
    :class:`TuningResult`. The time to ``target_accuracy`` is read from the
    Tuner's validations; the Tuner stops there only when
    ``config.target_accuracy`` says so (else it trains until it converges or
    reaches ``config.max_epochs``).

    Args:
        log: a :class:`DecisionLog` (its records get no ``elapsed_s``; the
            summary is stamped from a listener), or a path; a log made here is
            timed in counted seconds.
        keep_branch: leave the Tuner's final training branch alive for the
            caller (``TuningResult.branch``); by default it is freed.
    """
    timer = TimedSystem(system)
    owns_log = not isinstance(log, DecisionLog)
    the_log = log if isinstance(log, DecisionLog) else DecisionLog(log, clock=timer.now)
    first = len(the_log.records)
    stamps: list[float] = []
    the_log.listeners.append(lambda record: stamps.append(timer.seconds))
    listener = the_log.listeners[-1]
    try:
        tuning = Tuner(timer, space, config, log=the_log).run()
    except BaseException:
        timer.free_all()
        raise
    finally:
        if listener in the_log.listeners:
            the_log.listeners.remove(listener)
        if owns_log:
            the_log.close()
    if not keep_branch:
        timer.free(tuning.branch)
    stamped = [{**r, "elapsed_s": s} for r, s in zip(the_log.records[first:], stamps)]
    return mltuner_result(stamped, target_accuracy, tuning=tuning), tuning


# -- helpers ---------------------------------------------------------------------------


def _check_system(system: object) -> None:
    if not isinstance(system, BranchSystem):
        raise InvalidArgumentError(
            f"system must implement BranchSystem (fork, free, run, clocks_per_epoch), "
            f"got {type(system).__name__}"
        )


def _check_target(target: float | None) -> None:
    if target is not None and not (_is_number(target) and 0.0 < target <= 1.0):
        raise InvalidArgumentError(f"target_accuracy must be in (0, 1] or None, got {target!r}")


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")


def _check_epoch_fits(system: BranchSystem, tunables: Mapping[str, Any]) -> None:
    per_epoch = system.clocks_per_epoch(tunables)
    if per_epoch < 1:
        raise InvalidArgumentError(
            f"the setting {dict(tunables)} gives {per_epoch} clocks per epoch: one batch is "
            "larger than the whole epoch; use a smaller batch size or a larger training set"
        )


def _check_choices_fit(system: BranchSystem, space: SearchSpace,
                       defaults: Mapping[str, Any]) -> None:
    # As the Tuner does before any branch exists: every Choice value (batch
    # sizes above all) with the other tunables at their defaults.
    _check_epoch_fits(system, defaults)
    for tunable in space.searched:
        if isinstance(tunable, Choice):
            for value in tunable.values:
                _check_epoch_fits(system, {**defaults, tunable.name: value})


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _last_run(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    # A log file appends, so it may hold several runs, each opened by `start`.
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    run = list(records[starts[-1]:] if starts else records)
    if not run:
        raise InvalidArgumentError("no decision records to read")
    return run


def _elapsed(record: Mapping[str, Any], run: Sequence[Mapping[str, Any]]) -> float:
    if _is_number(record.get("elapsed_s")):
        return float(record["elapsed_s"])
    # Relative to the run's start, in whichever clock the log used.
    return float(record["time"]) - float(run[0]["time"])
