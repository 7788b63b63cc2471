"""Moved to :mod:`mltuner.tune.display`; kept while ``mltuner.cli`` imports
it from here."""

from __future__ import annotations

from mltuner.tune.display._watch import follow_log, log_env, run_watched

__all__ = ["run_watched", "follow_log", "log_env"]
