"""A picture of one tuning run, drawn from its decision log.

``write_report("out/decisions.jsonl")`` writes ``out/report.png`` (the name a
job gives it): training loss over wall time above validation accuracy over
wall time, each search (the initial one and every re-tune) shaded and
numbered, each rollback marked, and beside the plots what each search chose.
Training lines are drawn only where training ran: they break at every search
and rollback. The title names the model, workers, outcome and test accuracy
when the job's ``result.json`` lies beside the log. ``mltuner report LOG``
does the same from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._log import format_tunables

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["write_report", "read_log", "dashboard_command", "REPORT_NAME"]

REPORT_NAME = "report.png"  # what a job and `mltuner report` write beside the log

_SEARCH_COLOUR = "#f2c14e"
_INITIAL_COLOUR = "#7fb7e6"


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a decision log's records, checking that each line is a JSON
    object with a numeric ``time`` and a string ``event``.

    A last line cut off without its newline (a job that died while writing
    it) is left out with a warning.

    Raises:
        FileNotFoundError: no such file.
        InvalidArgumentError: the file is empty, or a line is malformed (the
            message gives the line number).
    """
    log = Path(path)
    if not log.is_file():
        raise FileNotFoundError(f"no decision log at {log}")
    records: list[dict[str, Any]] = []
    with log.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if not line.endswith("\n") and records:  # the last line, cut off by a job that died writing it
                    warnings.warn(f"{log}:{number}: the last line is cut off (not JSON: {error.msg}); "
                                  "reading the records before it", stacklevel=2)
                    break
                raise InvalidArgumentError(
                    f"{log}:{number}: not JSON ({error.msg} at column {error.colno}); a "
                    "decision log has one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise InvalidArgumentError(
                    f"{log}:{number}: a {type(record).__name__}, not a JSON object"
                )
            time_s, event = record.get("time"), record.get("event")
            if (not isinstance(time_s, (int, float)) or isinstance(time_s, bool)
                    or not math.isfinite(time_s)):
                raise InvalidArgumentError(f"{log}:{number}: no numeric 'time' field")
            if not isinstance(event, str):
                raise InvalidArgumentError(f"{log}:{number}: no 'event' field")
            records.append(record)
    if not records:
        raise InvalidArgumentError(f"{log} is empty: the tuner wrote no decisions to it")
    return records


@dataclasses.dataclass
class _Search:
    index: int
    start: float
    end: float | None = None
    tunables: dict[str, Any] | None = None   # the winner's; None without a winner
    trials: int | None = None
    marginal: bool = False
    seconds: float | None = None


@dataclasses.dataclass
class _Run:
    """The curves of one run, times in seconds from its first record."""

    number: int
    runs: int
    train: list[list[tuple[float, float]]] = dataclasses.field(default_factory=lambda: [[]])
    accuracy_runs: list[list[tuple[float, float]]] = dataclasses.field(default_factory=lambda: [[]])
    rollbacks: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    storage: str | None = None
    trials: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    diverged: list[float] = dataclasses.field(default_factory=list)   # times only
    baselines: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    accuracy: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    searches: list[_Search] = dataclasses.field(default_factory=list)
    duration: float = 0.0
    outcome: str | None = None
    sampler: str | None = None
    baseline: str | None = None  # set for a baseline's log (run_fixed, run_optuna, ...)


def _split_runs(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    # DecisionLog appends, so one file may hold several runs, each opened by
    # a `start` record.
    runs: list[list[dict[str, Any]]] = []
    for record in records:
        if record["event"] == "start" or not runs:
            runs.append([])
        runs[-1].append(record)
    return runs


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _collect(records: list[dict[str, Any]], number: int, runs: int) -> _Run:
    t0 = float(records[0]["time"])
    run = _Run(number, runs)
    open_searches: dict[int, _Search] = {}
    for record in records:
        t = float(record["time"]) - t0
        event = record["event"]
        loss, accuracy = _number(record.get("loss")), _number(record.get("accuracy"))
        if event == "train" and loss is not None:
            run.train[-1].append((t, loss))
        elif event == "summary":
            # A diverged trial's loss (often 1e30 or NaN) would flatten every
            # other curve; it is marked at the top of the panel instead.
            if record.get("state") == "diverged" or loss is None:
                run.diverged.append(t)
            else:
                run.trials.append((t, loss))
        elif event == "starting_progress" and loss is not None:
            run.baselines.append((t, loss))
        elif event == "validate" and accuracy is not None:
            run.accuracy.append((t, accuracy))
            run.accuracy_runs[-1].append((t, accuracy))
        elif event == "rollback":
            run.rollbacks.append((t, str(record.get("reason"))))
            _break(run)
        elif event == "search_start":
            _break(run)
            index = _int(record.get("search"))
            search = _Search(index if index is not None else len(run.searches), t,
                             marginal=record.get("marginal") is True)
            run.searches.append(search)
            open_searches[search.index] = search
        elif event in ("winner", "no_progress"):
            found = open_searches.pop(_int(record.get("search")) or 0, None)
            if found is not None:
                found.end = t
                found.trials = _int(record.get("trials"))
                found.seconds = _number(record.get("seconds"))
                tunables = record.get("tunables")
                if event == "winner" and isinstance(tunables, dict):
                    found.tunables = tunables
        elif event == "start":
            sampler = record.get("sampler")
            run.sampler = str(sampler) if sampler is not None else None
            baseline = record.get("baseline")
            run.baseline = str(baseline) if baseline is not None else None
            storage = record.get("storage")
            run.storage = storage if isinstance(storage, str) else None
        elif event == "end":
            outcome = record.get("outcome")
            run.outcome = str(outcome) if outcome is not None else None
        run.duration = max(run.duration, t)
    return run


def _break(run: _Run) -> None:
    # Training stops here (a search or a rollback): the next points start
    # new line segments, so no line is drawn across time when it did not run.
    for runs in (run.train, run.accuracy_runs):
        if runs[-1]:
            runs.append([])


def dashboard_command(log_path: str | os.PathLike[str]) -> str | None:
    """The ``optuna-dashboard`` command that opens a run's studies: its
    journal file (``storage`` of the log's last ``start`` record, or
    ``optuna.journal`` beside the log), or None when there is none."""
    log = Path(log_path)
    storage: str | None = None
    try:
        starts = [r for r in read_log(log) if r["event"] == "start"]
        if starts and isinstance(starts[-1].get("storage"), str):
            storage = starts[-1]["storage"]
    except (OSError, InvalidArgumentError):
        pass
    if storage is None:
        journal = log.parent / "optuna.journal"
        return f"optuna-dashboard {journal}" if journal.exists() else None
    if storage.startswith("journal:"):
        return f"optuna-dashboard {storage[len('journal:'):]}"
    if "://" in storage:
        return f"optuna-dashboard {storage}"
    return None


def _job_result(log_path: Path) -> dict[str, Any]:
    # What the job wrote beside its log (mltuner tune / demo): model, workers, test accuracy.
    path = log_path.parent / "result.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return result if isinstance(result, dict) else {}


def _time_unit(duration: float) -> tuple[float, str]:
    if duration >= 3 * 3600:
        return 3600.0, "h"
    if duration >= 600:
        return 60.0, "min"
    return 1.0, "s"


def write_report(log_path: str | os.PathLike[str],
                 png_path: str | os.PathLike[str] | None = None) -> Path:
    """Draws the last run in a decision log as a PNG and returns its path.

    The upper panel shows the training branch's mean loss per epoch, each
    trial's last loss when it was summarised (grey; a diverged trial is a
    red triangle on the top edge) and each search's starting progress
    (lr = 0, crosses); the lower one the validation accuracy after each
    epoch. Lines break where training stopped (a search, a rollback).
    Searches are shaded and numbered above the panels (an unfinished one,
    from a crashed job, runs to the last record), rollbacks are red dashed
    lines, and the panel on the right lists what each search chose and each
    rollback's reason, so that no label covers a curve. Times are wall time
    from the run's first record.

    Args:
        log_path: the JSON-lines log a :class:`~mltuner.tune.DecisionLog` wrote.
            A file holding several runs (the log appends) is drawn for its
            last run.
        png_path: where to write; default: ``report.png`` beside the log, the
            name the job itself uses.

    Raises:
        FileNotFoundError, InvalidArgumentError: see :func:`read_log`.
    """
    records = read_log(log_path)
    runs = _split_runs(records)
    run = _collect(runs[-1], len(runs), len(runs))
    out = Path(png_path) if png_path is not None else Path(log_path).with_name(REPORT_NAME)

    # Imported here: matplotlib takes a while to import, and the tuner
    # itself never draws. The Agg canvas needs no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 7), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(2, 2, width_ratios=(3.2, 1), height_ratios=(3, 2))
    loss_ax = figure.add_subplot(grid[0, 0])
    acc_ax = figure.add_subplot(grid[1, 0], sharex=loss_ax)
    side = figure.add_subplot(grid[:, 1])
    scale, unit = _time_unit(run.duration)
    _draw_curves(run, loss_ax, acc_ax, scale)
    for ax in (loss_ax, acc_ax):
        _shade_searches(run, ax, scale, label=ax is loss_ax)
        _mark_rollbacks(run, ax, scale)
    _side_panel(run, side, scale, unit)

    loss_ax.set_ylabel("training loss")
    acc_ax.set_ylabel("validation accuracy")
    acc_ax.set_xlabel(f"time ({unit})")
    acc_ax.set_xlim(0.0, max(run.duration, 1e-9) / scale * 1.02)
    for ax in (loss_ax, acc_ax):
        ax.grid(True, alpha=0.3)
    figure.suptitle(_title(run, Path(log_path)), fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def _title(run: _Run, log_path: Path) -> str:
    job = _job_result(log_path)
    model, workers = job.get("model"), job.get("workers")
    who = run.baseline or "MLtuner"
    head = f"{who}: {model} on {workers} worker{'s' if workers != 1 else ''}" if model and workers \
        else f"{who} run: {log_path.name}"
    outcome = f"outcome: {run.outcome}" if run.outcome else "no end record (unfinished)"
    test = job.get("test_accuracy")
    best = max((a for _, a in run.accuracy), default=None)
    details = [outcome,
               f"test accuracy {test:.1%}" if isinstance(test, (int, float)) else None,
               f"best validation {best:.1%}" if best is not None else None,
               f"{len(run.accuracy)} epochs",
               f"{len(run.searches)} search{'es' if len(run.searches) != 1 else ''}"
               if run.searches else None,
               f"{len(run.rollbacks)} rollback{'s' if len(run.rollbacks) != 1 else ''}"
               if run.rollbacks else None,
               f"sampler {run.sampler}" if run.sampler else None]
    title = head + "\n" + ", ".join(d for d in details if d)
    if run.runs > 1:
        title += f" (run {run.number} of {run.runs} in the file)"
    return title


def _draw_curves(run: _Run, loss_ax: Axes, acc_ax: Axes, scale: float) -> None:
    def xs(points: Sequence[tuple[float, float]]) -> list[float]:
        return [t / scale for t, _ in points]

    def ys(points: Sequence[tuple[float, float]]) -> list[float]:
        return [v for _, v in points]

    if run.trials:
        loss_ax.scatter(xs(run.trials), ys(run.trials), s=10, color="0.55", alpha=0.6,
                        label="trial (last loss)", zorder=2)
    if run.baselines:
        loss_ax.scatter(xs(run.baselines), ys(run.baselines), marker="x", s=40,
                        color="#c0392b", label="starting progress (lr = 0)", zorder=3)
    if run.diverged:
        loss_ax.scatter([t / scale for t in run.diverged], [1.0] * len(run.diverged),
                        marker="^", s=22, color="#c0392b", clip_on=False, zorder=3,
                        transform=loss_ax.get_xaxis_transform(),
                        label="diverged trial (off scale)")
    for i, segment in enumerate(s for s in run.train if s):
        loss_ax.plot(xs(segment), ys(segment), "o-", color="#1f5f99", markersize=3,
                     label="training (epoch mean)" if i == 0 else None, zorder=4)
    for i, segment in enumerate(s for s in run.accuracy_runs if s):
        acc_ax.plot(xs(segment), ys(segment), "o-", color="#2e8b57", markersize=3,
                    label="validation" if i == 0 else None, zorder=4)
    if run.rollbacks:  # a legend entry for the dashed lines drawn later
        loss_ax.plot([], [], color="#c0392b", lw=1.0, ls="--", label="rollback")
    train = [p for segment in run.train for p in segment]
    losses = [v for _, v in train + run.trials + run.baselines]
    # Losses often fall by orders of magnitude; a log scale keeps the late
    # epochs readable.
    if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
        loss_ax.set_yscale("log")
    for ax, empty in ((loss_ax, not losses), (acc_ax, not run.accuracy)):
        if empty:
            ax.text(0.5, 0.5, "no data in the log", transform=ax.transAxes,
                    ha="center", va="center", color="0.5")
    # The legends sit outside the plots, under the side panel's text.
    handles = [h for ax in (loss_ax, acc_ax) for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in (loss_ax, acc_ax) for lab in ax.get_legend_handles_labels()[1]]
    if handles:
        loss_ax.figure.legend(handles, labels, loc="lower right", fontsize=8, frameon=False)


def _search_tag(search: _Search) -> str:
    return "S" if search.index == 0 else f"R{search.index}"


def _shade_searches(run: _Run, ax: Axes, scale: float, *, label: bool) -> None:
    for search in run.searches:
        end = search.end if search.end is not None else run.duration
        colour = _INITIAL_COLOUR if search.index == 0 else _SEARCH_COLOUR
        ax.axvspan(search.start / scale, end / scale, color=colour, alpha=0.35, lw=0, zorder=0)
        if label:
            # A short tag above the panel, where no curve runs; the side
            # panel says what it means.
            ax.annotate(_search_tag(search), xy=(search.start / scale, 1.0),
                        xycoords=ax.get_xaxis_transform(), xytext=(0, 3),
                        textcoords="offset points", ha="left", va="bottom", fontsize=7,
                        color="0.25", annotation_clip=False)


def _mark_rollbacks(run: _Run, ax: Axes, scale: float) -> None:
    for t, _ in run.rollbacks:
        ax.axvline(t / scale, color="#c0392b", lw=1.0, ls="--", zorder=1)


def _side_panel(run: _Run, ax: Axes, scale: float, unit: str) -> None:
    ax.axis("off")
    lines: list[tuple[float, int, str]] = []  # (time, a rollback before a search, text)
    for search in run.searches:
        name = "initial search" if search.index == 0 else f"re-tune {search.index}"
        if search.marginal:
            name += " (marginal)"
        when = f"{search.start / scale:.3g} {unit}"
        if search.end is None:
            what = "unfinished"
        elif search.tunables:
            parts = format_tunables(search.tunables).split(" ")
            what = "\n   ".join(" ".join(parts[i:i + 2]) for i in range(0, len(parts), 2))
        else:
            what = "nothing better"
        trials = f", {search.trials} trials" if search.trials is not None else ""
        spent = f" in {search.seconds:.1f} s" if search.seconds is not None else ""
        lines.append((search.start, 1, f"{_search_tag(search)} {name} at {when}{trials}{spent}:\n"
                                    f"   {what}"))
    for t, reason in run.rollbacks:
        lines.append((t, 0, f"-- rollback at {t / scale:.3g} {unit}: {reason.replace('_', ' ')}"))
    lines.sort(key=lambda item: (item[0], item[1]))
    text = "\n".join(line for _, _, line in lines) or "no searches"
    ax.text(0.0, 1.0, text, transform=ax.transAxes, ha="left", va="top", fontsize=7.5,
            family="monospace", wrap=True)
