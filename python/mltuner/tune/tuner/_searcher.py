"""Optuna as MLtuner's searcher, through ask-and-tell (mltuner.md §4, §6).

One :class:`Searcher` is one search episode (the initial search or one
re-tune) and owns one Optuna study. The tuner asks for a setting, forks a
branch with it, and tells the trial's slope once the branch stops being a
trial; Optuna minimises the slope (NaN told as 0.0, §1.3 step 4). Several
trials are asked before any is told (successive halving), so TPE runs with
the constant liar: a pending trial counts as a bad result, and the next
proposal goes elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, GridSampler
from optuna.storages import BaseStorage

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._config import SAMPLERS
from mltuner.tune._progress import ProgressSummary
from mltuner.tune._space import SearchSpace
from mltuner.tune.tuner._design import startup_design

__all__ = [
    "Searcher",
    "Proposal",
    "SAMPLERS",
    "STOP_TOP_K",
    "STOP_THRESHOLD",
    "MAX_REPORTED_POINTS",
    "MAX_EXCLUDED_ASKS",
    "top_k_close",
    "open_storage",
    "record_failure",
]

# §1.4: the model-based searchers stop when the top 5 finite slopes are within
# 10% (hard-coded in the original searchers; the paper calls it a rule of thumb).
STOP_TOP_K = 5
STOP_THRESHOLD = 0.1
# Intermediate values per trial: every clock up to this many, then averages of
# equal windows, so a one-epoch trial does not write thousands of rows.
MAX_REPORTED_POINTS = 100
# Proposals in a row that an exclusion may refuse before the searcher treats
# the space left as exhausted.
MAX_EXCLUDED_ASKS = 50

# Optional dependencies of some samplers, checked up front for a clear message.
_NEEDS = {"gp": ("torch", "scipy"), "cmaes": ("cmaes",)}
# Samplers whose first n_startup_trials proposals come from startup_design.
_DESIGNED = ("tpe", "gp", "cmaes")


def top_k_close(slopes: Iterable[float], k: int = STOP_TOP_K,
                threshold: float = STOP_THRESHOLD) -> bool:
    """The §1.4 stop rule: True when there are at least ``k`` finite slopes
    and the k-th best is within ``threshold`` of the best, 1 - s_k/s_1 < threshold."""
    finite = sorted(s for s in slopes if math.isfinite(s))
    if len(finite) < k or finite[0] >= 0:
        return False
    return 1.0 - finite[k - 1] / finite[0] < threshold


def open_storage(storage: str | BaseStorage | None) -> str | BaseStorage | None:
    """An Optuna storage from a URL: ``journal:PATH`` opens a journal file
    (what ``optuna-dashboard PATH`` reads); any other string is an RDB URL
    such as ``sqlite:///tuning.db``; a storage object is used as is."""
    if isinstance(storage, str) and storage.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = storage[len("journal:"):]
        if not path:
            raise InvalidArgumentError("a journal storage needs a path: 'journal:PATH'")
        return JournalStorage(JournalFileBackend(path))
    return storage


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A setting to try.

    Attributes:
        number: the Optuna trial number in this episode's study.
        tunables: the full decoded setting, for the training system.
        params: the Optuna parameters (encoded) of the searched tunables.
        varied: in a marginal re-tune, the one tunable this proposal changes
            (None for the current setting itself and outside marginal mode).
        enqueued: the setting was queued with :meth:`Searcher.enqueue` (the
            current setting of a re-tune), not proposed by the sampler.
    """

    number: int
    tunables: dict[str, Any]
    params: dict[str, Any]
    varied: str | None = None
    enqueued: bool = False


class _AskTellGridSampler(GridSampler):
    # GridSampler.after_trial calls study.stop(), which only works inside
    # study.optimize; with ask-and-tell the searcher tracks exhaustion itself.
    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        return None


class Searcher:
    """One search episode's Optuna study, driven by ask and tell.

    Args:
        space: the search space; at least one tunable must be searched.
        sampler: ``"tpe"`` (default, the paper's HyperOpt TPE), ``"random"``,
            ``"grid"`` (11 points per continuous axis and every choice,
            shuffled), ``"gp"`` (≈ Spearmint; needs torch and scipy) or
            ``"cmaes"`` (needs the cmaes package).
        seed: makes proposals reproducible.
        storage: where the study is recorded (see :func:`open_storage`);
            None keeps it in memory.
        study_name: the study's name in ``storage``; it must not exist yet.
        base_setting: a decoded setting: makes this a *marginal* re-tune
            (§4), where every proposal changes one tunable of this setting,
            taking the searched tunables in turn. With ``"grid"`` it tries
            the base setting first, then every one-tunable grid change.
        n_startup_trials: proposals before TPE, GP or CMA-ES models the
            results (Optuna's default 10; hyperopt's is 20). They come from a
            space-filling design (:func:`startup_design`), not independent
            random draws, after any settings queued by :meth:`enqueue`.
        excluded: a predicate on decoded settings; a proposal it accepts is
            told at once as no progress (value 0.0, user attribute
            ``outcome="excluded"``) and the searcher asks again, so the
            sampler learns to avoid the region. The tuner passes the
            settings at least as aggressive as one that collapsed the model.

    Thread safety: none; one thread asks and tells.
    """

    def __init__(
        self,
        space: SearchSpace,
        *,
        sampler: str = "tpe",
        seed: int | None = None,
        storage: str | BaseStorage | None = None,
        study_name: str | None = None,
        base_setting: Mapping[str, Any] | None = None,
        n_startup_trials: int = 10,
        excluded: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> None:
        if sampler not in SAMPLERS:
            raise InvalidArgumentError(
                f"unknown sampler {sampler!r}: use one of {', '.join(SAMPLERS)}"
            )
        missing = [m for m in _NEEDS.get(sampler, ()) if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(
                f"sampler {sampler!r} needs {' and '.join(missing)}: "
                f"pip install {' '.join(missing)} (or choose another sampler)"
            )
        if not space.searched:
            raise InvalidArgumentError("nothing to search: every tunable has search=False")
        if n_startup_trials < 0:
            raise InvalidArgumentError(f"n_startup_trials must be >= 0, got {n_startup_trials}")
        self._space = space
        self._kind = sampler
        self._seed = seed
        self._distributions: dict[str, BaseDistribution] = space.distributions()
        self._base_params: dict[str, Any] | None = None
        if base_setting is not None:
            space.check_setting(base_setting)
            self._base_params = space.encode(base_setting)
        self._sampler = self._make_sampler(n_startup_trials)
        # The model-based samplers' random start, replaced by a space-filling
        # design (tuner/_design.py); a marginal re-tune varies one tunable of
        # its base setting instead.
        self._n_startup = n_startup_trials
        self._design: list[dict[str, Any]] = (
            startup_design(space, n_startup_trials, seed)
            if sampler in _DESIGNED and base_setting is None else [])
        self._grid_size = (
            math.prod(len(t.grid()) for t in space.searched) if sampler == "grid" else 0
        )
        self._marginal_queue: list[tuple[dict[str, Any], str | None]] | None = None
        if self._base_params is not None and sampler == "grid":
            self._marginal_queue = self._marginal_grid(self._base_params)
        self._asked = 0
        self._grid_asks = 0  # grid points consumed, excluded ones included
        self._excluded = excluded
        self._queued: list[dict[str, Any]] = []
        self._marginal_turn = 0
        self._stuck = False
        self._running: dict[int, optuna.trial.Trial] = {}
        self.decision_seconds = math.nan
        """Wall time of the last :meth:`ask` (the first one seeds the trial time, §1.1)."""
        record = open_storage(storage)
        self._record: optuna.Study | None = None
        self._published = 0
        if record is not None and not isinstance(record, optuna.storages.InMemoryStorage):
            try:
                self._record = optuna.create_study(storage=record, study_name=study_name,
                                                   direction="minimize")
            except optuna.exceptions.DuplicatedStudyError as error:
                raise InvalidArgumentError(
                    f"the storage already has a study named {study_name!r}: "
                    "choose another study name prefix"
                ) from error
            study_name = self._record.study_name
            record = None
        # The sampler works on a study in memory, published to the storage
        # by publish(): a journal file syncs every write to disk (about 5 ms
        # each), and a trial holds a hundred intermediate values.
        try:
            self._study = optuna.create_study(
                storage=record,
                study_name=study_name,
                direction="minimize",
                sampler=self._sampler,
            )
        except optuna.exceptions.DuplicatedStudyError as error:
            raise InvalidArgumentError(
                f"the storage already has a study named {study_name!r}: "
                "choose another study name prefix"
            ) from error

    @property
    def study(self) -> optuna.Study:
        """The episode's study (in memory while the search runs when a
        storage was given; :meth:`publish` copies it there)."""
        return self._study

    def publish(self) -> None:
        """Copies the study's user attributes and its finished trials not
        copied yet to the storage, one write per trial. Trials keep their
        numbers as long as nothing else writes to that study."""
        if self._record is None:
            return
        trials = self._study.get_trials(deepcopy=False)
        for trial in trials[self._published:]:
            if not trial.state.is_finished():
                break
            self._record.add_trial(trial)
            self._published += 1
        for key, value in self._study.user_attrs.items():
            if self._record.user_attrs.get(key) != value:
                self._record.set_user_attr(key, value)

    def record_failure(self, setting: Mapping[str, Any], attrs: Mapping[str, Any]) -> int:
        """Adds a FAIL trial with ``setting`` to the study (and the storage):
        how a setting that won this search but later collapsed the model is
        kept in its record. Returns the trial's number."""
        number = record_failure(self._study, self._space, setting, attrs)
        self.publish()
        return number

    @property
    def space(self) -> SearchSpace:
        """The space this episode searches."""
        return self._space

    @property
    def sampler_name(self) -> str:
        """The ``sampler`` asked for: one of :data:`SAMPLERS`."""
        return self._kind

    @property
    def marginal(self) -> bool:
        """Whether this is a marginal re-tune (``base_setting`` given): each
        proposal changes one tunable of that setting."""
        return self._base_params is not None

    @property
    def asked(self) -> int:
        """How many proposals this episode has made (excluded ones not counted)."""
        return self._asked

    def enqueue(self, setting: Mapping[str, Any]) -> bool:
        """Makes ``setting`` (decoded) the next proposal, ahead of the
        sampler: a re-tune tries the current setting first, so that it can
        only end with something at least as good. Returns False, queueing
        nothing, for an excluded setting, and for grid search (a marginal
        grid starts with the current setting already; a full grid tries
        only its own points)."""
        self._space.check_setting(setting)
        if self._kind == "grid" or (self._excluded is not None and self._excluded(setting)):
            return False
        params = self._space.encode(setting)
        self._study.enqueue_trial(params)
        self._queued.append(params)
        return True

    def _make_sampler(self, n_startup_trials: int) -> BaseSampler:
        seed = self._seed
        if self._kind == "tpe":
            # The constant liar (experimental in Optuna 4) keeps TPE from
            # proposing the same region for every trial asked before a result.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials,
                                                  constant_liar=True)
        if self._kind == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self._kind == "grid":
            grid = {self._space.param_name(t.name): t.grid() for t in self._space.searched}
            return _AskTellGridSampler(grid, seed=seed)
        if self._kind == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=n_startup_trials)

    def _marginal_grid(self, base: dict[str, Any]) -> list[tuple[dict[str, Any], str | None]]:
        # §4: marginal-grid tries the current setting first, then each grid
        # value of one tunable with the others kept, in a seeded shuffle.
        changes: list[tuple[dict[str, Any], str | None]] = []
        for tunable in self._space.searched:
            name = self._space.param_name(tunable.name)
            for value in tunable.grid():
                if value != base[name]:
                    changes.append(({**base, name: value}, tunable.name))
        random.Random(self._seed).shuffle(changes)
        return [(dict(base), None), *changes]

    def exhausted(self) -> bool:
        """Whether the searcher has no new setting: the grid is used up, or
        the last MAX_EXCLUDED_ASKS proposals in a row were excluded."""
        if self._stuck:
            return True
        if self._marginal_queue is not None:
            return not self._marginal_queue
        return self._kind == "grid" and self._grid_asks >= self._grid_size

    def should_stop(self, slopes: Iterable[float]) -> bool:
        """Whether the search is done (§1.4): the grid is exhausted, or, for
        the model-based samplers, the top-5 rule holds on ``slopes`` (the
        latest slope of every trial of this episode). Random search stops only
        at the tuner's trial cap."""
        if self.exhausted():
            return True
        if self._kind in ("tpe", "gp", "cmaes"):
            return top_k_close(slopes)
        return False

    def ask(self) -> Proposal | None:
        """The next setting, or None when the searcher is exhausted."""
        for _ in range(MAX_EXCLUDED_ASKS):
            if self.exhausted():
                return None
            proposal = self._ask_once()
            if self._excluded is None or proposal.enqueued or not self._excluded(proposal.tunables):
                self._asked += 1
                return proposal
            trial = self._running.pop(proposal.number)
            trial.set_user_attr("tunables", proposal.tunables)
            trial.set_user_attr("outcome", "excluded")
            self._study.tell(trial, 0.0)
        self._stuck = True
        return None

    def _ask_once(self) -> Proposal:
        enqueued = bool(self._queued)
        if enqueued:
            # study.ask takes the enqueued trial first, whatever the sampler.
            params = self._queued.pop(0)
            self._study.sampler = self._sampler
            start = time.perf_counter()
            trial = self._study.ask(fixed_distributions=dict(self._distributions))
            self.decision_seconds = time.perf_counter() - start
            self._running[trial.number] = trial
            return Proposal(trial.number, self._space.decode(trial.params), dict(params),
                            None, enqueued=True)
        varied: str | None = None
        sampler: BaseSampler = self._sampler
        if self._design and len(self._study.trials) < self._n_startup:
            self._study.enqueue_trial(self._space.encode(self._design.pop(0)))
        elif self._marginal_queue is not None:
            fixed, varied = self._marginal_queue.pop(0)
            sampler = self._partial_fixed(fixed, optuna.samplers.RandomSampler(seed=self._seed))
        elif self._base_params is not None:
            searched = self._space.searched
            varied = searched[self._marginal_turn % len(searched)].name
            self._marginal_turn += 1
            keep = self._space.param_name(varied)
            fixed = {k: v for k, v in self._base_params.items() if k != keep}
            sampler = self._partial_fixed(fixed, self._sampler)
        self._study.sampler = sampler
        start = time.perf_counter()
        trial = self._study.ask(fixed_distributions=dict(self._distributions))
        self.decision_seconds = time.perf_counter() - start
        if self._kind == "grid":
            self._grid_asks += 1
        self._running[trial.number] = trial
        params = dict(trial.params)
        return Proposal(trial.number, self._space.decode(params), params, varied)

    @staticmethod
    def _partial_fixed(fixed: dict[str, Any], base: BaseSampler) -> BaseSampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.PartialFixedSampler(fixed, base)

    def tell(
        self,
        proposal: Proposal,
        summary: ProgressSummary,
        losses: Sequence[float],
        attrs: Mapping[str, Any] | None = None,
        *,
        seconds: Sequence[float] | None = None,
        value: float | None = None,
    ) -> None:
        """Records a trial's result: its loss curve as intermediate values,
        its summary and ``attrs`` as user attributes, and its slope as the
        value (0.0 when there was no progress), or ``value`` when given (a
        batch check's objective, the mean loss of the trial's last
        quarter). Each proposal is told exactly once.

        With ``seconds`` (each clock's run time) the intermediate values are
        the loss against the trial's own run time, step = milliseconds since
        its start (what optuna-dashboard plots); without, step = clock index.
        """
        objective = value
        trial = self._running.pop(proposal.number, None)
        if trial is None:
            raise InvalidArgumentError(f"trial {proposal.number} was already told or never asked")
        if seconds is not None and len(seconds) != len(losses):
            raise InvalidArgumentError(
                f"seconds and losses differ in length: {len(seconds)} vs {len(losses)}")
        for step, value in _report_points(losses, seconds):
            trial.report(value, step)
        record: dict[str, Any] = {
            "tunables": proposal.tunables,
            "varied": proposal.varied,
            "state": summary.state.value,
            "slope": _finite_or_none(summary.slope),
            "noise": _finite_or_none(summary.noise),
            "range": _finite_or_none(summary.range),
            "span_s": _finite_or_none(summary.span),
            "clocks": len(losses),
            "enqueued": proposal.enqueued,
        }
        record.update(attrs or {})
        for key, attr in record.items():
            trial.set_user_attr(key, attr)
        if objective is None or not math.isfinite(objective):
            objective = summary.slope if math.isfinite(summary.slope) else 0.0
        self._study.tell(trial, objective)

    def pending(self) -> list[int]:
        """Trial numbers asked but not told yet."""
        return sorted(self._running)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _report_points(losses: Sequence[float],
                   seconds: Sequence[float] | None = None) -> list[tuple[int, float]]:
    ends: list[int] = []  # the step of each clock: its index, or its end in ms
    if seconds is None:
        ends = list(range(len(losses)))
    else:
        elapsed, last = 0.0, -1
        for s in seconds:
            elapsed += float(s)
            # Steps must grow: a clock shorter than a millisecond takes the next one.
            last = max(last + 1, int(round(elapsed * 1000.0)))
            ends.append(last)
    if len(losses) <= MAX_REPORTED_POINTS:
        return [(ends[i], float(v)) for i, v in enumerate(losses)]
    window = math.ceil(len(losses) / MAX_REPORTED_POINTS)
    points = []
    for start in range(0, len(losses), window):
        chunk = [float(v) for v in losses[start:start + window]]
        points.append((ends[start + len(chunk) - 1], sum(chunk) / len(chunk)))
    return points


def record_failure(study: optuna.Study, space: SearchSpace, setting: Mapping[str, Any],
                   attrs: Mapping[str, Any]) -> int:
    """Adds a FAIL trial with ``setting``'s searched values to ``study``:
    how a setting that won its search but later collapsed the model is kept
    in the search's record. Parameters the study's space does not search are
    left out. Returns the new trial's number."""
    params = space.encode(setting)
    trial = optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL, params=params,
        distributions=space.distributions(),
        user_attrs={"tunables": dict(setting), **attrs})
    study.add_trial(trial)
    return len(study.trials) - 1
