"""In-training hyperparameter tuning (the MLtuner design, mltuner.md §1).

The :class:`Tuner` drives a :class:`BranchSystem` (the parameter server, or a
simulation): it forks trial branches from a snapshot of the model, scores
each by its noise-penalised loss slope per second, lets Optuna propose the
next setting, keeps the winner with its trial progress, validates every epoch
and re-tunes when validation accuracy plateaus. See docs/tuner.md.
"""

from __future__ import annotations

from mltuner.tune._baselines import (
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
from mltuner.tune._config import RetuneMode, TunerConfig
from mltuner.tune._errors import TuningError
from mltuner.tune._live import LiveDisplay
from mltuner.tune._log import DecisionLog, Listener, format_tunables
from mltuner.tune._report import read_log, write_report
from mltuner.tune._progress import (
    DIVERGENCE_THRESHOLD,
    GO_UP_THRESHOLD,
    NUM_POINTS,
    ProgressState,
    ProgressSummary,
    summarize_progress,
)
from mltuner.tune._search import SearchEpisode, SearchResult
from mltuner.tune._session import PSBranchSystem, Step, TuningSession
from mltuner.tune._searcher import SAMPLERS, Proposal, Searcher, open_storage, top_k_close
from mltuner.tune._space import Choice, LogUniform, SearchSpace, Tunable, Uniform, default_space
from mltuner.tune._system import BranchKind, BranchSystem, ClockReport
from mltuner.tune._trial import Trial
from mltuner.tune._tuner import (
    AGGRESSIVE_DIRECTIONS,
    Outcome,
    Tuner,
    TuningResult,
    at_least_as_aggressive,
    plateaued,
)
from mltuner.tune._guard import Alarm, TrainingGuard

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
    "LiveDisplay",
    "Listener",
    "format_tunables",
    "read_log",
    "write_report",
    "Tuner",
    "TunerConfig",
    "RetuneMode",
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
    "Trial",
    "DecisionLog",
    "plateaued",
    "at_least_as_aggressive",
    "AGGRESSIVE_DIRECTIONS",
    "TrainingGuard",
    "Alarm",
]
