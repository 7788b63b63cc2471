"""The tuner's settings, one frozen dataclass with the reason beside each default."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from optuna.storages import BaseStorage

from mltuner._validate import is_integer, is_real
from mltuner.exceptions import InvalidArgumentError

__all__ = ["TunerConfig", "RetuneMode", "SAMPLERS", "DEFAULT_CLOCKS_TO_TEST"]

# The searchers a search episode can use (mltuner.md §4).
SAMPLERS = ("tpe", "random", "grid", "gp", "cmaes")

RetuneMode = Literal["full", "marginal", "off"]

# Clocks of a validation when nothing says how many: a Tuner or baseline
# driven without a TuningSession (a session derives them from its
# validation batch). The tuner's fixed default before None meant that.
DEFAULT_CLOCKS_TO_TEST = 100


@dataclasses.dataclass(frozen=True)
class TunerConfig:
    """How the tuner searches, schedules and stops (mltuner.md §1, §1.5).

    Args:
        sampler: the searcher of every search episode: ``"tpe"`` (the
            paper's default, HyperOpt TPE), ``"random"``, ``"grid"``, ``"gp"``
            or ``"cmaes"``.
        retune: at a plateau, ``"full"`` searches every tunable again,
            ``"marginal"`` changes one tunable at a time from the current
            setting (§4), ``"off"`` never re-tunes.
        initial_tuning: False trains with ``initial_setting`` from the start
            (the paper's robustness test); re-tuning still applies.
        initial_setting: the decoded setting used without initial tuning;
            None means the search space's defaults.
        seed: seeds every searcher (search i uses seed + i).
        storage: an Optuna storage URL (``sqlite:///tuning.db``,
            ``journal:tuning.log``) or object; every trial branch becomes an
            Optuna trial there. None: a journal file ``optuna.journal``
            beside the decision log when the log is a file, else memory.
        study_name_prefix: studies are named ``PREFIX-initial``,
            ``PREFIX-retune-1``, ...; None picks one from the date and the
            process id, so reruns into one storage never collide.
        num_clocks_to_eval: clocks of the lr = 0 evaluation branch whose mean
            loss is the starting progress (Caffe's default 100).
        num_clocks_to_test: clocks of each validation (TESTING) branch. None
            (the default) covers the validation set once: a
            :class:`TuningSession` derives the clocks from its validation
            batch; a Tuner driven without one runs
            ``DEFAULT_CLOCKS_TO_TEST`` (100). A number given here is used
            as it is by a session without ``validation_batch_size`` (at
            most one clock per validation sample); with one, it must
            match the clocks that batch gives.
        num_progress_samples: clocks a new trial runs first (§1.2: 10, enough
            for the K = 10 summariser).
        num_branches: branches alive at once during a search: the parent plus
            concurrent trials (30 in the paper's CIFAR config, 40 for
            ImageNet). Bounds the trials that find the trial time together.
        plateau_size_for_retune: re-tune when this many validations in a row
            bring no new best accuracy (4; one less than the stop size because
            an epoch of training follows every re-tune).
        plateau_size_for_convergence: stop at this many (5). Stopping takes
            precedence over re-tuning.
        retune_every_epochs: also re-tune after this many epochs without a
            search, plateau or not (None: only on a plateau). A setting that
            trains too slowly climbs steadily and never plateaus; such a
            re-tune that finds nothing better goes on with the current
            setting. It spends the searches' budget like any re-tune, with
            no floor; when the job's searches cannot pay for it, it runs as a
            climb check (the current setting against its learning rate a
            step up) paid from ``max_search_share`` of the time trained since
            the last search.
        max_trials_per_search: the trial cap of the initial search; each
            re-tune is capped at the previous search's count (§1.1). None is
            unbounded, as in the original code, where a random searcher, or a
            space in which every setting diverges, never stops searching.
        initial_trial_time_s: the first trial time; None measures the
            searcher's first decision time (§1.1 step 3a). Tests set it so
            that runs are deterministic.
        max_epochs: a safety stop after this many epochs of training (not in
            the paper); None trains until convergence.
        target_accuracy: end the job at the first validation accuracy at or
            above this, in (0, 1] (``Outcome.TARGET``); None trains until
            convergence or ``max_epochs``. It changes nothing before then: the
            searches' budgets still come from ``max_epochs`` or
            ``time_budget_s``.
        n_startup_trials: random proposals before a model-based sampler fits
            the results (Optuna's default 10; hyperopt's 20).
        search_share: the share of the job's budget each search (the
            initial one and every re-tune) may spend on its clocks (0.1).
            The job's budget is ``time_budget_s``, or ``max_epochs`` times
            the measured epoch time; with neither, searches are bounded only
            by their trial cap (the paper's behaviour). None turns it off.
        time_budget_s: the job's budget in seconds of clocks, when it is
            known better than ``max_epochs`` says; the job ends at the first
            validation after its clocks reached it (``Outcome.TIME_BUDGET``).
        max_search_share: the most the job's searches may spend together,
            as a share of the job's budget (0.2), when the floor raises a
            search above ``search_share``. The floor: a search may spend
            what the paper's trial-time rule takes to find its trial time
            (rounds of doubling until a trial converges or every trial
            reaches the one-epoch cap) plus successive halving over
            ``floor_trials`` trials of that length. On a short job 10% of
            the budget pays for trials too short to tell settings apart
            (they choose on noise); on a long one the share is above the
            floor and holds. A search is raised at most to this share less
            what earlier searches spent. A re-tune also gets no more than
            what is left of it, and is skipped when that cannot pay for
            comparing the current setting with one other (a periodic one
            then runs as a climb check, see ``retune_every_epochs``); the
            initial search and a search after a rollback always get their
            own share. None: no floor, ``search_share`` is a hard limit.
        floor_trials: trials of the start length that the floor pays
            successive halving for (4: the phase's winner and three new
            ones, two rungs).
        retune_tunables: the tunables a re-tune searches, the others kept
            at the current setting: learning rate and momentum by default,
            the ones that can help late in training (a smaller batch or more
            staleness rarely does). Names not searched in the space are
            ignored; None searches every tunable, as the initial search.
        batch_check: in a job bounded by time (``time_budget_s`` or
            ``target_accuracy`` set: :attr:`time_bounded`), after the first
            validation of each training stretch (the steep start is over),
            compare the current setting with the
            next larger batch size of the space, its learning rate scaled
            per ``batch_check_lr_scaling`` (clipped to the range): two
            trials of equal run time from the training branch, the larger
            batch kept when the mean loss of its last quarter is no higher,
            and checked again at once while it wins. Short trials from the
            untrained model favour small batches (more steps per second)
            whatever they cost per epoch, and a re-tune searches only
            ``retune_tunables``. Paid like a re-tune from the searches'
            allowance, else from ``max_search_share`` of the time trained
            since the last search (as a climb check); after each check the
            current setting won, the next needs twice the trained time. A
            job bounded by ``max_epochs`` alone gets no check: its samples
            are fixed, so a larger batch takes fewer steps to the end, which
            trials of equal time do not see (demo, 10 seeds on 16 cores:
            with the check, seed 1 moved to batch 128 and ended at
            max_epochs with 78.7% test accuracy; without it, 96.7%).
        batch_check_lr_scaling: the larger batch's learning rate: ``sqrt``
            (the current one times the square root of the batch ratio,
            the default), ``linear`` (times the ratio) or ``none``.
        rollback: keep a frozen copy of the best-validated model and roll
            back to it when training collapses (the guard, see below).
        rollback_margin: roll back when two validation accuracies in a
            row fall this far (absolute) below the best so far, or one falls
            three times as far (0.05).
        guard_chunks_per_epoch: chunks each epoch of training is checked in
            (4): a chunk that diverges, or two in a row whose mean loss
            rises beyond the noise band, roll back before the validation.
        max_rollbacks: rollbacks that search again (5); the next collapse
            ends the job with the best validated model.
    """

    sampler: str = "tpe"
    retune: RetuneMode = "full"
    initial_tuning: bool = True
    initial_setting: Mapping[str, Any] | None = None
    seed: int | None = None
    storage: str | BaseStorage | None = None
    study_name_prefix: str | None = None
    num_clocks_to_eval: int = 100
    num_clocks_to_test: int | None = None
    num_progress_samples: int = 10
    num_branches: int = 30
    plateau_size_for_retune: int = 4
    plateau_size_for_convergence: int = 5
    retune_every_epochs: int | None = None
    max_trials_per_search: int | None = 100
    initial_trial_time_s: float | None = None
    max_epochs: int | None = None
    target_accuracy: float | None = None
    n_startup_trials: int = 10
    search_share: float | None = 0.1
    time_budget_s: float | None = None
    max_search_share: float | None = 0.2
    floor_trials: int = 4
    retune_tunables: tuple[str, ...] | None = ("lr", "momentum")
    batch_check: bool = True
    batch_check_lr_scaling: str = "sqrt"
    rollback: bool = True
    rollback_margin: float = 0.05
    guard_chunks_per_epoch: int = 4
    max_rollbacks: int = 5

    def job_budget_s(self, epoch_seconds: float | None) -> float | None:
        """The job's budget in seconds: ``time_budget_s``, or ``max_epochs``
        epochs of ``epoch_seconds`` each; None when neither is known."""
        if self.time_budget_s is not None:
            return float(self.time_budget_s)
        if self.max_epochs is None or epoch_seconds is None:
            return None
        return self.max_epochs * epoch_seconds

    @property
    def time_bounded(self) -> bool:
        """Whether the job ends by time (a time budget, or reaching a target
        accuracy) rather than by ``max_epochs`` or convergence alone."""
        return self.time_budget_s is not None or self.target_accuracy is not None

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise InvalidArgumentError(
                f"unknown sampler {self.sampler!r}: use one of {', '.join(SAMPLERS)}"
            )
        if self.retune not in ("full", "marginal", "off"):
            raise InvalidArgumentError(
                f"unknown retune mode {self.retune!r}: use 'full', 'marginal' or 'off'"
            )
        positive = {
            "num_clocks_to_eval": self.num_clocks_to_eval,
            "num_progress_samples": self.num_progress_samples,
            "plateau_size_for_retune": self.plateau_size_for_retune,
            "plateau_size_for_convergence": self.plateau_size_for_convergence,
            "guard_chunks_per_epoch": self.guard_chunks_per_epoch,
        }
        for name, value in positive.items():
            if not is_integer(value) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        test = self.num_clocks_to_test
        if test is not None and (not is_integer(test) or test < 1):
            raise InvalidArgumentError(
                f"num_clocks_to_test must be an integer >= 1 or None (cover the validation set once), "
                f"got {test!r}"
            )
        if not is_integer(self.num_branches) or self.num_branches < 2:
            raise InvalidArgumentError(
                f"num_branches must be an integer >= 2 (the parent and one trial), got {self.num_branches!r}"
            )
        for name, limit in (("max_trials_per_search", self.max_trials_per_search),
                            ("max_epochs", self.max_epochs), ("retune_every_epochs", self.retune_every_epochs)):
            if limit is not None and (not is_integer(limit) or limit < 1):
                raise InvalidArgumentError(f"{name} must be an integer >= 1 or None, got {limit!r}")
        if self.initial_trial_time_s is not None and not (
            is_real(self.initial_trial_time_s) and math.isfinite(self.initial_trial_time_s)
            and self.initial_trial_time_s > 0
        ):
            raise InvalidArgumentError(
                f"initial_trial_time_s must be > 0 or None, got {self.initial_trial_time_s}"
            )
        if self.retune != "off" and (
            self.plateau_size_for_retune >= self.plateau_size_for_convergence
        ):
            raise InvalidArgumentError(
                f"plateau_size_for_retune ({self.plateau_size_for_retune}) must be smaller than "
                f"plateau_size_for_convergence ({self.plateau_size_for_convergence}): stopping "
                "takes precedence, so a re-tune would never happen (use retune='off')"
            )
        if self.search_share is not None and not (
            is_real(self.search_share) and 0 < self.search_share <= 1
        ):
            raise InvalidArgumentError(
                f"search_share must be in (0, 1] or None, got {self.search_share!r}"
            )
        if self.max_search_share is not None and not (
            is_real(self.max_search_share) and 0 < self.max_search_share <= 1
        ):
            raise InvalidArgumentError(
                f"max_search_share must be in (0, 1] or None, got {self.max_search_share!r}"
            )
        if (self.search_share is not None and self.max_search_share is not None
                and self.max_search_share < self.search_share):
            raise InvalidArgumentError(
                f"max_search_share ({self.max_search_share}) must be at least search_share "
                f"({self.search_share}): it caps what the floor raises the share to"
            )
        if not is_integer(self.floor_trials) or self.floor_trials < 1:
            raise InvalidArgumentError(
                f"floor_trials must be an integer >= 1, got {self.floor_trials!r}"
            )
        if self.target_accuracy is not None and not (
            is_real(self.target_accuracy) and 0 < self.target_accuracy <= 1
        ):
            raise InvalidArgumentError(
                f"target_accuracy must be in (0, 1] or None, got {self.target_accuracy!r}"
            )
        if self.time_budget_s is not None and not (
            is_real(self.time_budget_s) and math.isfinite(self.time_budget_s)
            and self.time_budget_s > 0
        ):
            raise InvalidArgumentError(
                f"time_budget_s must be > 0 or None, got {self.time_budget_s!r}"
            )
        if self.retune_tunables is not None:
            names = tuple(self.retune_tunables)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise InvalidArgumentError(
                    f"retune_tunables must be a non-empty list of tunable names or None, "
                    f"got {self.retune_tunables!r}"
                )
            object.__setattr__(self, "retune_tunables", names)
        if self.batch_check_lr_scaling not in ("sqrt", "linear", "none"):
            raise InvalidArgumentError(
                f"batch_check_lr_scaling must be 'sqrt', 'linear' or 'none', "
                f"got {self.batch_check_lr_scaling!r}"
            )
        if not (is_real(self.rollback_margin)
                and math.isfinite(self.rollback_margin) and self.rollback_margin >= 0):
            raise InvalidArgumentError(
                f"rollback_margin must be a finite number >= 0, got {self.rollback_margin!r}"
            )
        if not is_integer(self.max_rollbacks) or self.max_rollbacks < 0:
            raise InvalidArgumentError(
                f"max_rollbacks must be an integer >= 0, got {self.max_rollbacks!r}"
            )
        if not is_integer(self.n_startup_trials) or self.n_startup_trials < 0:
            raise InvalidArgumentError(
                f"n_startup_trials must be an integer >= 0, got {self.n_startup_trials!r}"
            )
