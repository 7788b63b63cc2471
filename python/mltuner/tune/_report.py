"""Moved to :mod:`mltuner.tune.display`; kept while ``mltuner.cli`` imports
it from here."""

from __future__ import annotations

from mltuner.tune.display._report import dashboard_command, read_log, write_report

__all__ = ["write_report", "read_log", "dashboard_command"]
