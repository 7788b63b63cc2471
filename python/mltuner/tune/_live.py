"""A live view of a tuning run, fed by the decision log.

:class:`LiveDisplay` is a :class:`~mltuner.tune.DecisionLog` listener. In a
terminal it keeps a ``rich`` table up to date: the phase, the branch, its
setting, the last loss and accuracy, the elapsed time and the trials so far.
Elsewhere (CI, a file, a pipe) it prints one plain line per event instead,
so logs stay greppable. A rendering failure falls back to plain lines, and
the decision log drops a listener that still raises: the display can never
stop the tuner.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from mltuner.tune._log import format_tunables

__all__ = ["LiveDisplay"]

_logger = logging.getLogger(__name__)

# Event fields worth a place on a plain line, after the common ones.
_DETAIL_FIELDS = ("reason", "state", "slope", "trial_time_s", "epoch", "trials", "outcome")


def _is_terminal(file: IO[str]) -> bool:
    # Not rich's detection: it counts FORCE_COLOR, which CI systems set for
    # coloured logs, as a terminal, and a live table redrawn into a CI log is
    # unreadable. Only an interactive, non-dumb terminal gets the table.
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class LiveDisplay:
    """Shows a tuning run's progress as its decisions are logged.

    Use it as a listener of the run's decision log, and close it (or use it
    as a context manager) when the run ends; it also stops on the ``end``
    record::

        with LiveDisplay() as display, DecisionLog("decisions.jsonl",
                                                    listeners=[display]) as log:
            Tuner(system, space, config, log=log).run()

    Args:
        file: where to write; default: ``sys.stdout`` when the first record
            arrives.
        terminal: force the live table (True) or plain lines (False);
            default: the table only when ``file`` is an interactive terminal
            (``isatty()``, and ``TERM`` is not ``dumb``).

    Thread safety: called on the tuner's thread only.
    """

    def __init__(self, *, file: IO[str] | None = None, terminal: bool | None = None) -> None:
        self._file = file
        self._terminal = terminal
        self._console: Console | None = None
        self._live: Live | None = None
        self._plain: bool | None = None   # decided on the first record
        self._closed = False
        self._t0: float | None = None
        self._state: dict[str, Any] = {"trials": 0}

    # -- listener ----------------------------------------------------------------------

    def __call__(self, record: Mapping[str, Any]) -> None:
        if self._closed:
            return
        self._update(record)
        if self._plain is None:
            self._start()
        if not self._plain:
            try:
                assert self._live is not None
                self._live.update(self.table(), refresh=True)
            except Exception:
                # Fall back to plain lines rather than lose the progress.
                _logger.warning("live display failed; printing plain lines", exc_info=True)
                self._stop_live()
                self._plain = True
        if self._plain:
            print(self.line(record), file=self._out(), flush=True)
        if record.get("event") == "end":
            self.close()

    def close(self) -> None:
        """Stops the live table (the last state stays on screen)."""
        self._stop_live()
        self._closed = True

    def __enter__(self) -> LiveDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rendering ---------------------------------------------------------------------

    def line(self, record: Mapping[str, Any]) -> str:
        """The plain line for one record, e.g.
        ``[   12.3s] search fork_trial search=0 branch=5 lr=0.01 momentum=0.9``."""
        elapsed = self._state.get("elapsed", 0.0)
        parts = [f"[{elapsed:8.1f}s]", str(record.get("phase", "?")), str(record.get("event"))]
        for key in ("search", "branch"):
            if record.get(key) is not None:
                parts.append(f"{key}={record[key]}")
        tunables = record.get("tunables")
        if isinstance(tunables, Mapping) and tunables:
            parts.append(format_tunables(tunables))
        for key in ("loss", "accuracy", *_DETAIL_FIELDS):
            if record.get(key) is not None:
                parts.append(f"{key}={_fmt(record[key])}")
        return " ".join(parts)

    def table(self) -> Table:
        """The live table of the current state."""
        state = self._state
        table = Table(title="MLtuner", show_header=False, title_justify="left",
                      min_width=60)
        table.add_column("field", style="bold cyan", no_wrap=True)
        table.add_column("value", overflow="fold")
        search = state.get("search")
        phase = str(state.get("phase", "-"))
        if phase == "search" and search is not None:
            phase += " (initial)" if search == 0 else f" (re-tune {search})"
        rows = [
            ("phase", phase),
            ("last event", str(state.get("event", "-"))),
            ("branch", _fmt(state.get("branch", "-"))),
            ("tunables", format_tunables(state.get("tunables")) or "-"),
            ("last loss", _fmt(state.get("loss", "-"))),
            ("last accuracy", _fmt(state.get("accuracy", "-"))),
            ("elapsed", f"{state.get('elapsed', 0.0):.1f} s"),
            ("trials so far", str(state["trials"])),
        ]
        if "outcome" in state:
            rows.append(("outcome", str(state["outcome"])))
        for name, value in rows:
            table.add_row(name, value)
        return table

    # -- helpers -----------------------------------------------------------------------

    def _update(self, record: Mapping[str, Any]) -> None:
        state = self._state
        time_s = record.get("time")
        if isinstance(time_s, (int, float)):
            if self._t0 is None:
                self._t0 = float(time_s)
            state["elapsed"] = float(time_s) - self._t0
        for key in ("phase", "event", "search", "branch", "tunables", "loss", "accuracy",
                    "outcome"):
            if record.get(key) is not None:
                state[key] = record[key]
        if record.get("event") == "fork_trial":
            state["trials"] += 1

    def _out(self) -> IO[str]:
        return self._file if self._file is not None else sys.stdout

    def _start(self) -> None:
        try:
            out = self._out()
            self._plain = not (self._terminal if self._terminal is not None
                               else _is_terminal(out))
            if not self._plain:
                self._console = Console(file=out, force_terminal=True)
                self._live = Live(self.table(), console=self._console, auto_refresh=False,
                                  transient=False)
                self._live.start()
        except Exception:
            _logger.warning("live display could not start; printing plain lines", exc_info=True)
            self._live = None
            self._plain = True

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            try:
                live.stop()
            except Exception:
                _logger.warning("live display could not stop cleanly", exc_info=True)
