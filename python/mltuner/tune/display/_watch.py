"""Run a tuning job under ``mltuner launch`` and watch it: the launcher's
process follows rank 0's decision log into a live display, keeps the
workers' output in a file, and draws the report when the job ends.

The workers never draw anything themselves: their output is a pipe, and a
live table needs the terminal, which only this process has.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from mltuner.tune.display._live import LiveDisplay

__all__ = ["run_watched", "follow_log", "log_env"]

_POLL_S = 0.2


def follow_log(path: Path, on_record: Callable[[Mapping[str, Any]], None], stop: threading.Event) -> None:
    """Calls ``on_record`` for every JSON line appended to ``path`` until
    ``stop`` is set, then for the lines written before it was set. A line
    that is not JSON is skipped; the file may not exist yet."""
    offset = 0
    partial = ""
    while True:
        finished = stop.is_set()
        if path.exists():
            with path.open(encoding="utf-8") as file:
                file.seek(offset)
                chunk = file.read()
                offset = file.tell()
            lines = (partial + chunk).split("\n")
            partial = lines.pop()  # an incomplete last line waits for its end
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    on_record(record)
        if finished:
            return
        stop.wait(_POLL_S)


def run_watched(command: Sequence[str], num_workers: int, *, log: Path, workers_log: Path,
                report: Path | None = None, terminal: bool | None = None,
                env: Mapping[str, str] | None = None, out: IO[str] | None = None) -> int:
    """Launches ``command`` on ``num_workers`` local workers, shows rank 0's
    decision ``log`` live, and writes ``report`` (PNG) from it at the end,
    also when the job was stopped with Ctrl-C (SIGINT) or SIGTERM, and
    prints the optuna-dashboard command of its studies.

    The workers' prefixed output goes to ``workers_log``; the last lines of
    rank 0 are printed at the end, and the tail of everything when the job
    fails. Returns the job's exit code.
    """
    from mltuner.launch import launch  # the engine: only when a job is launched

    out = out or sys.stdout
    display = _EachSession(lambda: LiveDisplay(file=out, terminal=terminal))
    stop = threading.Event()
    follower = threading.Thread(target=follow_log, args=(log, display, stop), name="mltuner-watch", daemon=True)
    follower.start()
    try:
        with workers_log.open("w", encoding="utf-8") as sink:
            code = launch(list(command), num_workers, env=env, stdout=sink)
    finally:
        stop.set()
        follower.join(10.0)
        display.close()
    lines = workers_log.read_text(encoding="utf-8", errors="replace").splitlines()
    interrupted = code in (130, 143)  # SIGINT (Ctrl-C) or SIGTERM to the launcher
    if code != 0 and not interrupted:
        print(f"the job failed (exit code {code}); the last lines of {workers_log}:", file=out)
        for line in lines[-25:]:
            print(f"  {line}", file=out)
        return code
    if interrupted:
        print(f"the job was stopped (exit code {code})" + ("; the report shows what ran" if log.exists() else
                                                          ", before the tuner logged a decision: no report"), file=out)
    else:
        for line in [line for line in lines if line.startswith("[rank 0]") and " [I " not in line][-4:]:
            print(line.removeprefix("[rank 0] "), file=out)
    if report is not None and log.exists():
        from mltuner.tune.display._report import dashboard_command, write_report  # matplotlib: only here

        try:
            print(f"report: {write_report(log, report)}", file=out)
        except (OSError, ValueError) as error:  # an interrupted job may have logged nothing
            print(f"no report: {error}", file=out)
        dashboard = dashboard_command(log)
        if dashboard is not None:
            print(f"studies: {dashboard}", file=out)
    if log.exists():
        print(f"decision log: {log}", file=out)
    print(f"workers' output: {workers_log}", file=out)
    return code


class _EachSession:
    """Shows each tuning session of the log in a display of its own: a
    job may run several, and a display ends at its session's end."""

    def __init__(self, make: Callable[[], LiveDisplay]) -> None:
        self._make = make
        self._display = make()

    def __call__(self, record: Mapping[str, Any]) -> None:
        if record.get("event") == "start" and self._display.closed:
            self._display = self._make()
        self._display(record)

    def close(self) -> None:
        self._display.close()


def log_env(log: Path) -> dict[str, str]:
    """The environment telling a TuningSession where rank 0 logs."""
    return dict(os.environ, MLTUNER_TUNING_LOG=str(log))
