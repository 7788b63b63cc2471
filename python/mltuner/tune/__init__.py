"""In-training hyperparameter tuning (the MLtuner design, mltuner.md §1).

Subpackages, by job: :mod:`~mltuner.tune.tuner` (the tuner and its
searches), :mod:`~mltuner.tune.session` (tuning a training loop on the
parameter server), :mod:`~mltuner.tune.display` (live view, watcher,
report) and :mod:`~mltuner.tune.baselines`; the shared pieces (search space,
branch system, progress summary, decision log, config) sit here. The tuner,
the session, the baselines and the building blocks docs/tuner.md names are
re-exported from ``mltuner.tune``; a subpackage's other names (the
session's command classes, ``StepBatchSampler``, ``follow_log``, ...) are
imported from it.

The :class:`Tuner` drives a :class:`BranchSystem` (the parameter server, or a
simulation): it forks trial branches from a snapshot of the model, scores
each by its noise-penalised loss slope per second, lets Optuna propose the
next setting, keeps the winner with its trial progress, validates every epoch
and re-tunes when validation accuracy plateaus. See docs/tuner.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mltuner.tune.baselines._baselines import (
    BaselineConfig,
    BaselineResult,
    BaselineTrial,
    TimedSystem,
    curve_from_log,
    mltuner_result,
    run_fixed,
    run_hyperband,
    run_mltuner,
    run_optuna,
    running_best,
    time_to_target,
)
from mltuner.tune._config import DEFAULT_CLOCKS_TO_TEST, RetuneMode, TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune.display._live import LiveDisplay
from mltuner.tune.display._watch import log_env, run_watched
from mltuner.tune._log import DecisionLog, Listener, format_tunables
from mltuner.tune._progress import (
    DIVERGENCE_THRESHOLD,
    GO_UP_THRESHOLD,
    NUM_POINTS,
    ProgressState,
    ProgressSummary,
    summarize_progress,
)
from mltuner.tune.tuner._search import SearchBudget, SearchEpisode, SearchResult, halving_cost
from mltuner.tune.session._session import Driver, PSBranchSystem, Step, TuningSession
from mltuner.tune._config import SAMPLERS
from mltuner.tune.tuner._searcher import Proposal, Searcher, open_storage, top_k_close
from mltuner.tune._space import Choice, LogUniform, SearchSpace, Tunable, Uniform, default_space
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport
from mltuner.tune.tuner._trial import Trial
from mltuner.tune.tuner._tuner import (
    AGGRESSIVE_DIRECTIONS,
    Outcome,
    Tuner,
    TuningResult,
    at_least_as_aggressive,
    larger_batch,
    no_slower,
    plateaued,
    validation_collapsed,
)
from mltuner.tune.tuner._guard import Alarm, TrainingGuard

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers
    from mltuner.tune.display._report import dashboard_command, read_log, write_report


def __getattr__(name: str) -> object:
    # The report pulls in matplotlib, which the tuner never needs: loaded at
    # first use of its names.
    if name in ("write_report", "read_log", "dashboard_command"):
        from mltuner.tune.display import _report

        return getattr(_report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "TuningSession",
    "Step",
    "PSBranchSystem",
    "Driver",
    "LiveDisplay",
    "Listener",
    "format_tunables",
    "read_log",
    "write_report",
    "dashboard_command",
    "run_watched",
    "log_env",
    "Tuner",
    "TunerConfig",
    "RetuneMode",
    "DEFAULT_CLOCKS_TO_TEST",
    "TuningResult",
    "Outcome",
    "TuningError",
    "SearchSpace",
    "Tunable",
    "LogUniform",
    "Uniform",
    "Choice",
    "default_space",
    "BranchSystem",
    "BranchKind",
    "ClockReport",
    "ProgressState",
    "ProgressSummary",
    "summarize_progress",
    "NUM_POINTS",
    "GO_UP_THRESHOLD",
    "DIVERGENCE_THRESHOLD",
    "Searcher",
    "Proposal",
    "SAMPLERS",
    "top_k_close",
    "open_storage",
    "SearchEpisode",
    "SearchResult",
    "SearchBudget",
    "halving_cost",
    "Trial",
    "DecisionLog",
    "plateaued",
    "at_least_as_aggressive",
    "no_slower",
    "validation_collapsed",
    "larger_batch",
    "AGGRESSIVE_DIRECTIONS",
    "TrainingGuard",
    "Alarm",
]
