"""What people see of a tuning run: the live view, the watcher that follows
a job's decision log, and the report PNG. matplotlib is imported only when
a report is drawn."""

from __future__ import annotations

from mltuner.tune.display._live import LiveDisplay, describe
from mltuner.tune.display._watch import follow_log, log_env, run_watched

__all__ = ["LiveDisplay", "describe", "follow_log", "log_env", "run_watched", "write_report",
           "read_log", "dashboard_command"]


def __getattr__(name: str) -> object:
    # The report pulls in matplotlib: loaded at first use.
    if name in ("write_report", "read_log", "dashboard_command"):
        from mltuner.tune.display import _report

        return getattr(_report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
