"""A live view of a tuning run, fed by the decision log.

:class:`LiveDisplay` is a :class:`~mltuner.tune.DecisionLog` listener. In a
terminal it keeps a ``rich`` view up to date: a progress bar of epochs and
one of the current search (its budget spent), each with elapsed and
remaining time, the current setting, the best validation accuracy so far,
and the last decisions in words. Elsewhere (CI, a file, a pipe) it prints one
plain line per decision (:func:`describe`), not per trial. A rendering
failure falls back to plain lines, and the decision log drops a listener that
still raises: the display can never stop the tuner.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from mltuner.tune._log import format_tunables

__all__ = ["LiveDisplay", "describe"]

_logger = logging.getLogger(__name__)
HISTORY = 6  # decisions the live view keeps on screen


def _is_terminal(file: IO[str]) -> bool:
    # Not rich's detection: it counts FORCE_COLOR, which CI systems set for
    # coloured logs, as a terminal, and a live view redrawn into a CI log is
    # unreadable. Only an interactive, non-dumb terminal gets the view.
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _pct(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "-"


def _num(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "?"


def _secs(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def _search_name(record: Mapping[str, Any]) -> str:
    index = record.get("search")
    return "initial search" if index in (0, None) else f"re-tune {index}"


def describe(record: Mapping[str, Any]) -> str | None:
    """One decision in words (``"initial search: 12 trials in 8.1 s, chose
    lr=0.25 momentum=0.9"``), or None for a record that is not a decision
    (a trial forked, summarised or freed, a clock count, a frozen copy)."""
    event = record.get("event")
    tunables = format_tunables(record.get("tunables"))
    if event == "start":
        if record.get("baseline"):
            return f"start: {record['baseline']} baseline"
        searched = ", ".join(record.get("searched") or []) or "nothing"
        return f"start: searching {searched} with {record.get('sampler', '?')}"
    if event == "search_start":
        budget = record.get("budget_s")
        over = ", ".join(record.get("searched") or [])
        return (f"{_search_name(record)}: searching {over or 'the space'}"
                + (f" within {budget:.1f} s" if isinstance(budget, (int, float)) else ""))
    if event == "winner":
        return (f"{_search_name(record)}: {record.get('trials', '?')} trials in "
                f"{_secs(record.get('seconds'))}, chose {tunables}")
    if event == "no_progress":
        return (f"{_search_name(record)}: {record.get('trials', '?')} trials in "
                f"{_secs(record.get('seconds'))} found nothing better")
    if event == "budget_floor":
        purposes = {"trial_time": "to find its trial time", "halving": "to halve over trials of it"}
        return (f"{_search_name(record)}: budget raised from {_secs(record.get('share_s'))} to "
                f"{_secs(record.get('budget_s'))} {purposes.get(str(record.get('reason')), '')}".rstrip())
    if event == "retune":
        if record.get("check") == "batch":
            larger = record.get("larger") or {}
            return (f"epoch {record.get('epoch')}: batch check, the current setting against batch "
                    f"{larger.get('batch_size', '?')} at learning rate {_num(larger.get('lr'))}")
        if record.get("check"):
            return (f"epoch {record.get('epoch')}: climb check, the current setting against its "
                    f"learning rate a step up (the searches' share of the job is spent)")
        why = {"plateau": "validation stopped improving",
               "untuned": "the start setting moved the loss off its start (the initial search saw no progress)"
               }.get(str(record.get("reason")), f"{record.get('epoch')} epochs trained")
        return f"epoch {record.get('epoch')}: {why}, re-tune"
    if event == "retune_skipped":
        if record.get("reason") == "at_fastest":
            return f"epoch {record.get('epoch')}: no re-tune, the learning rate is at the top of its range"
        if record.get("retune") == "batch":
            return (f"epoch {record.get('epoch')}: no batch check yet, the searches have spent "
                    f"their share of the job ({_secs(record.get('search_seconds'))})")
        return (f"epoch {record.get('epoch')}: no re-tune, the searches have spent their share of "
                f"the job ({_secs(record.get('search_seconds'))})")
    if event == "rollback":
        reason = record.get("reason")
        why = {
            "loss_rise": f"the training loss rose back to {record.get('loss', 0):.3g}",
            "collapsed": f"the training loss went back to its start ({record.get('loss', 0):.3g})",
            "diverged": "the training loss diverged",
            "accuracy": f"validation fell to {_pct(record.get('accuracy'))}",
            "search_found_nothing": "the re-tune found nothing better",
        }.get(str(reason), str(reason))
        best = record.get("best_accuracy")
        target = (f"the best model (val {_pct(best)})"
                  if best is not None and record.get("target") != "parent"
                  else "the search's start")
        return f"rolled back to {target}: {why} with {tunables}"
    if event == "validate":
        return (f"epoch {record.get('epoch', '?')}: val {_pct(record.get('accuracy'))} "
                f"(best {_pct(record.get('best_accuracy', record.get('accuracy')))})")
    if event == "keep":
        if record.get("reason") == "no_better":
            return f"kept {tunables}: nothing better"
        return f"kept {tunables}: the search's budget ran out first"
    if event == "train_untuned":
        why = " (the search's budget ran out first)" if record.get("reason") else ""
        return f"training with {tunables}{why}"
    if event == "resume":
        return f"going on with {tunables} from the best model"
    if event == "end":
        return (f"done: {record.get('outcome')} after {record.get('epochs', '?')} epochs, "
                f"best val {_pct(record.get('accuracy'))} with {tunables}")
    return None


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
        terminal: force the live view (True) or plain lines (False);
            default: the view only when ``file`` is an interactive terminal
            (``isatty()``, and ``TERM`` is not ``dumb``).

    Thread safety: called on one thread only (the tuner's, or a watcher's).
    """

    def __init__(self, *, file: IO[str] | None = None, terminal: bool | None = None) -> None:
        self._file = file
        self._terminal = terminal
        self._console: Console | None = None
        self._live: Live | None = None
        self._plain: bool | None = None   # decided on the first record
        self._closed = False
        self._t0: float | None = None
        self._state: dict[str, Any] = {"trials": 0, "elapsed": 0.0}
        self.history: collections.deque[str] = collections.deque(maxlen=HISTORY)
        """The last decisions in words, newest last."""
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("left"),
            TimeRemainingColumn(), expand=False)
        self._epochs: TaskID | None = None
        self._search: TaskID | None = None

    # -- listener ----------------------------------------------------------------------

    def __call__(self, record: Mapping[str, Any]) -> None:
        if self._closed:
            return
        self._update(record)
        if self._plain is None:
            self._start()
        words = describe(record)
        if words is not None:
            self.history.append(words)
        if not self._plain:
            try:
                assert self._live is not None
                self._live.update(self.view(), refresh=True)
            except Exception:
                # Fall back to plain lines rather than lose the progress.
                _logger.warning("live display failed; printing plain lines", exc_info=True)
                self._stop_live()
                self._plain = True
        if self._plain and words is not None:
            print(self.line(record), file=self._out(), flush=True)
        if record.get("event") == "end":
            self.close()

    def close(self) -> None:
        """Stops the live view (the last state stays on screen)."""
        self._stop_live()
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether the display ended (closed, or its session's ``end``)."""
        return self._closed

    def __enter__(self) -> LiveDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rendering ---------------------------------------------------------------------

    def line(self, record: Mapping[str, Any]) -> str:
        """The plain line of a decision, e.g.
        ``[    12.3s] initial search: 12 trials in 8.1 s, chose lr=0.25``;
        the record's event name for one that is not a decision."""
        elapsed = self._state.get("elapsed", 0.0)
        return f"[{elapsed:8.1f}s] {describe(record) or record.get('event')}"

    def table(self) -> Table:
        """The current state: phase, setting, best accuracy, trials, time."""
        state = self._state
        table = Table(show_header=False, box=None, padding=(0, 1))
        table.add_column("field", style="bold cyan", no_wrap=True)
        table.add_column("value", overflow="fold")
        phase = str(state.get("phase", "-"))
        if phase == "search":
            phase = _search_name(state)
        rows = [
            ("now", phase),
            ("setting", format_tunables(state.get("setting")) or "-"),
            ("best val accuracy", _pct(state.get("best"))),
            ("last loss", f"{state['loss']:.4g}" if isinstance(state.get("loss"), float) else "-"),
            ("trials so far", str(state["trials"])),
            ("elapsed", _secs(state.get("elapsed"))),
        ]
        if "outcome" in state:
            rows.append(("outcome", str(state["outcome"])))
        for name, value in rows:
            table.add_row(name, value)
        return table

    def view(self) -> Group:
        """The whole live view: progress bars, state, recent decisions."""
        history = Table(show_header=False, box=None, padding=(0, 1), title="decisions",
                        title_justify="left", title_style="bold")
        history.add_column("decision", overflow="fold")
        for words in self.history:
            history.add_row(words)
        return Group(self._progress, self.table(), history)

    # -- helpers -----------------------------------------------------------------------

    def _update(self, record: Mapping[str, Any]) -> None:
        state = self._state
        time_s = record.get("time")
        if isinstance(time_s, (int, float)):
            if self._t0 is None:
                self._t0 = float(time_s)
            state["elapsed"] = float(time_s) - self._t0
        event = record.get("event")
        for key in ("phase", "search", "loss", "outcome"):
            if record.get(key) is not None:
                state[key] = record[key]
        if event in ("winner", "train_untuned", "resume", "start") and record.get("tunables"):
            state["setting"] = record["tunables"]
        if event == "validate":
            state["best"] = record.get("best_accuracy", record.get("accuracy"))
        if event == "fork_trial":
            state["trials"] += 1
        self._update_progress(record)

    def _update_progress(self, record: Mapping[str, Any]) -> None:
        progress, event = self._progress, record.get("event")
        if event == "start" and self._epochs is None:
            total = record.get("max_epochs")
            self._epochs = progress.add_task("epochs", total=total if isinstance(total, int) else None)
        elif event == "validate" and self._epochs is not None:
            progress.update(self._epochs, completed=record.get("epoch", 0))
        elif event == "search_start":
            if self._search is not None:
                progress.remove_task(self._search)
            budget = record.get("budget_s")
            self._search = progress.add_task(
                f"{_search_name(record)} (s)",
                total=round(budget, 1) if isinstance(budget, (int, float)) else None)
        elif event in ("starting_progress", "budget_floor") and self._search is not None:
            budget = record.get("budget_s")  # a budget in epochs is resolved here; the floor raises it
            if isinstance(budget, (int, float)):
                progress.update(self._search, total=round(budget, 1))
        elif event in ("summary", "search_stop") and self._search is not None:
            spent = record.get("spent_s", record.get("seconds"))
            if isinstance(spent, (int, float)):
                progress.update(self._search, completed=round(spent, 1))
        elif event in ("winner", "no_progress") and self._search is not None:
            task = progress.tasks[-1]
            spent = record.get("seconds")
            progress.update(self._search, total=task.total if task.total else spent,
                            completed=round(spent, 1) if isinstance(spent, (int, float)) else None)
            progress.stop_task(self._search)

    def _out(self) -> IO[str]:
        return self._file if self._file is not None else sys.stdout

    def _start(self) -> None:
        try:
            out = self._out()
            self._plain = not (self._terminal if self._terminal is not None
                               else _is_terminal(out))
            if not self._plain:
                self._console = Console(file=out, force_terminal=True)
                self._live = Live(self.view(), console=self._console, auto_refresh=False,
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
