"""A picture of one tuning run, drawn from its decision log.

``write_report("decisions.jsonl")`` writes ``decisions.png``: training loss
over wall time above validation accuracy over wall time, each search (the
initial one and every re-tune) shaded, and the setting it chose written at
its end. ``mltuner report LOG`` does the same from the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mltuner.exceptions import InvalidArgumentError
from mltuner.tune._log import format_tunables

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["write_report", "read_log"]

_SEARCH_COLOUR = "#f2c14e"
_INITIAL_COLOUR = "#7fb7e6"


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a decision log's records, checking that each line is a JSON
    object with a numeric ``time`` and a string ``event``.

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


@dataclasses.dataclass
class _Run:
    """The curves of one run, times in seconds from its first record."""

    number: int
    runs: int
    train: list[tuple[float, float]] = dataclasses.field(default_factory=list)
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
            run.train.append((t, loss))
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
        elif event == "search_start":
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
                tunables = record.get("tunables")
                if event == "winner" and isinstance(tunables, dict):
                    found.tunables = tunables
        elif event == "start":
            sampler = record.get("sampler")
            run.sampler = str(sampler) if sampler is not None else None
            baseline = record.get("baseline")
            run.baseline = str(baseline) if baseline is not None else None
        elif event == "end":
            outcome = record.get("outcome")
            run.outcome = str(outcome) if outcome is not None else None
        run.duration = max(run.duration, t)
    return run


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
    (lr = 0, crosses); the lower one the validation
    accuracy after each epoch. Searches are shaded and labelled (an
    unfinished one, from a crashed job, runs to the last record), and each
    search's chosen setting is written at its end. Times are wall time from
    the run's first record.

    Args:
        log_path: the JSON-lines log a :class:`~mltuner.tune.DecisionLog` wrote.
            A file holding several runs (the log appends) is drawn for its
            last run.
        png_path: where to write; default: ``log_path`` with ``.png``.

    Raises:
        FileNotFoundError, InvalidArgumentError: see :func:`read_log`.
    """
    records = read_log(log_path)
    runs = _split_runs(records)
    run = _collect(runs[-1], len(runs), len(runs))
    out = Path(png_path) if png_path is not None else Path(log_path).with_suffix(".png")

    # Imported here: matplotlib takes a while to import, and the tuner
    # itself never draws. The Agg canvas needs no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 7), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, acc_ax = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    scale, unit = _time_unit(run.duration)
    _draw_curves(run, loss_ax, acc_ax, scale)
    for ax in (loss_ax, acc_ax):
        _shade_searches(run, ax, scale, label=ax is loss_ax)
    _annotate_winners(run, loss_ax, scale)

    loss_ax.set_ylabel("training loss")
    acc_ax.set_ylabel("validation accuracy")
    acc_ax.set_xlabel(f"time ({unit})")
    acc_ax.set_xlim(0.0, max(run.duration, 1e-9) / scale * 1.02)
    for ax in (loss_ax, acc_ax):
        ax.grid(True, alpha=0.3)
    title = f"{run.baseline or 'MLtuner'} run: {Path(log_path).name}"
    if run.runs > 1:
        title += f" (run {run.number} of {run.runs} in the file)"
    details = [f"sampler {run.sampler}" if run.sampler else None,
               f"{len(run.searches)} search{'es' if len(run.searches) != 1 else ''}" if run.searches else None,
               f"{len(run.accuracy)} epochs",
               f"outcome: {run.outcome}" if run.outcome else "no end record (unfinished)"]
    figure.suptitle(title + "\n" + ", ".join(d for d in details if d), fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


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
    if run.train:
        loss_ax.plot(xs(run.train), ys(run.train), "o-", color="#1f5f99", markersize=3,
                     label="training (epoch mean)", zorder=4)
    if run.accuracy:
        acc_ax.plot(xs(run.accuracy), ys(run.accuracy), "o-", color="#2e8b57", markersize=3,
                    label="validation", zorder=4)
    losses = [v for _, v in run.train + run.trials + run.baselines]
    # Losses often fall by orders of magnitude; a log scale keeps the late
    # epochs readable.
    if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
        loss_ax.set_yscale("log")
    for ax, empty in ((loss_ax, not losses), (acc_ax, not run.accuracy)):
        if empty:
            ax.text(0.5, 0.5, "no data in the log", transform=ax.transAxes,
                    ha="center", va="center", color="0.5")
        else:
            ax.legend(loc="upper right" if ax is loss_ax else "lower right", fontsize=8)


def _shade_searches(run: _Run, ax: Axes, scale: float, *, label: bool) -> None:
    for search in run.searches:
        end = search.end if search.end is not None else run.duration
        colour = _INITIAL_COLOUR if search.index == 0 else _SEARCH_COLOUR
        ax.axvspan(search.start / scale, end / scale, color=colour, alpha=0.35, lw=0, zorder=0)
        if label:
            name = "initial search" if search.index == 0 else f"re-tune {search.index}"
            if search.marginal:
                name += " (marginal)"
            if search.end is None:
                name += "\nunfinished"
            elif search.trials is not None:
                name += f"\n{search.trials} trial{'s' if search.trials != 1 else ''}"
            # Above the panel, where no curve runs; near the right edge it
            # ends at the span's end, so that it never widens the figure.
            right = search.start > 0.8 * run.duration
            ax.annotate(name, xy=((end if right else search.start) / scale, 1.0),
                        xycoords=ax.get_xaxis_transform(), xytext=(0, 6),
                        textcoords="offset points", ha="right" if right else "left",
                        va="bottom", fontsize=8, color="0.25", annotation_clip=False)


def _annotate_winners(run: _Run, ax: Axes, scale: float) -> None:
    for search in run.searches:
        if search.end is None:
            continue
        text = (format_tunables(search.tunables, sep="\n") if search.tunables
                else "no progress:\nmodel converged")
        ax.axvline(search.end / scale, color="0.35", lw=0.8, ls="--", zorder=1)
        # Near the right edge the box goes on the line's left, inside the plot.
        right = search.end > 0.85 * run.duration
        ax.annotate(text, xy=(search.end / scale, 0.62), xycoords=ax.get_xaxis_transform(),
                    xytext=(-4 if right else 4, 0), textcoords="offset points",
                    ha="right" if right else "left", va="center",
                    fontsize=7, family="monospace", zorder=6,
                    bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.6",
                          "alpha": 0.9})
