"""The tuner and its searches: the outer state machine with its rollback
guard (:class:`Tuner`), one search episode (:class:`SearchEpisode`: the
trial-time rule, then successive halving), the Optuna searcher and the
trial branches."""

from __future__ import annotations

from mltuner.tune.tuner._guard import Alarm, TrainingGuard
from mltuner.tune.tuner._search import SearchBudget, SearchEpisode, SearchResult, halving_cost, halving_size
from mltuner.tune.tuner._searcher import Proposal, Searcher, open_storage, record_failure, top_k_close
from mltuner.tune.tuner._trial import Trial
from mltuner.tune.tuner._tuner import (
    AGGRESSIVE_DIRECTIONS,
    JOURNAL_NAME,
    LR_STEP,
    Outcome,
    Tuner,
    TuningResult,
    at_least_as_aggressive,
    larger_batch,
    lr_neighbours,
    no_slower,
    validation_collapsed,
    plateaued,
)

__all__ = [
    "Tuner", "TuningResult", "Outcome", "plateaued", "at_least_as_aggressive",
    "lr_neighbours", "larger_batch", "no_slower", "validation_collapsed", "LR_STEP", "AGGRESSIVE_DIRECTIONS", "JOURNAL_NAME", "TrainingGuard", "Alarm", "SearchEpisode",
    "SearchResult", "SearchBudget", "halving_size", "halving_cost", "Searcher", "Proposal", "open_storage", "record_failure",
    "top_k_close", "Trial",
]
