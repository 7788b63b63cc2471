"""Time to a target validation accuracy on MNIST-1D: MLtuner against the
best fixed setting found in hindsight, Optuna TPE with whole training runs,
and Hyperband (Optuna's HyperbandPruner over epochs), over several seeds.

    python benchmarks/tuner_bench.py [--size small|large] [--seeds 0,1,2] [--parallel N]
                                     [--out PATH] [--json PATH] [--figures PATH]
    python benchmarks/tuner_bench.py --merge A.json,B.json ... [--target T]
                                     (one table from earlier runs; a lower --target re-reads them)

Every run is a real job: 2 worker processes under ``mltuner launch`` running
``python -m mltuner.apps.mnist1d``. Two sizes:

- ``small`` (the default): the numpy MLP 40-100-100-10 through the
  parameter server, 3,600 training and 400 validation samples, target 55%;
  the best fixed setting gets there in under a second. A share of a job of
  a few seconds pays for no search at all, so MLtuner runs here with the
  paper's search, bounded only by its trial cap (``--search-share 0``).
- ``large``: the MNIST-1D CNN (PyTorch) on 350,000 generated samples
  (252,000 training, 28,000 validation), target 98.9%, per-worker batches
  of 32-256 searched: a job whose best fixed run takes about two minutes or
  more (the issue's condition; the table says on how many seeds it held),
  so that a tuner's search can be amortised. Why these numbers (single
  fixed runs on the 2-core machine under load): with 100,000 samples lr 1
  x batch 128 stalled at 98.7% by 46 s and the plateau rule stopped it,
  with 200,000 at 98.6% by 60 s, so no target it reaches takes 2 minutes
  there; with 350,000 it kept climbing (98.2% at 31 s, 98.8% at 112 s,
  98.9% at 221 s, 99.0% at 231 s), and lr 1 x batch 256 reached 98.9% at
  114 s (best 98.99%). The target is set from these constant settings'
  curves, not from any MLtuner run: 98.9% is about where they top out, the
  lowest target at which the best fixed run took about 2 minutes here
  (``--merge --target`` re-reads the same runs at a lower one). 350,000 is the most samples whose
  cached data set (59 MB) still travels with a working tree to a device
  host (64 MiB); generating it takes about 3 minutes. Every run stops at
  the target or at its budget of clocks: MLtuner and the Optuna baselines
  at ``--baseline-budget`` (450 s; MLtuner's job budget too, so its
  searches get their shares of it), a fixed run at ``--fixed-budget``
  (240 s: the reference must reach the target by then to count). A run
  that has not reached the target by then counts with the time it ran (a
  baseline's ratio is then a lower bound). One seed's 12 jobs on 8 slots
  of 2 cores end within about 9 minutes (each job also takes 10-15 s to
  start and stop): the three budgeted runs start first, beside the five
  fixed runs with the largest steps, which reach the target soonest and
  free their slots for the other four; two waves of fixed runs fit in the
  baselines' time. ``--deadline`` (560 s, counted from the command's
  start, generating the data set included) stops any job still running
  then, so the table is written before a device command's 10-minute limit.
Time is the counted time of each driver (mltuner.tune's baselines): the sum
of the wall time of every clock of every branch it ran (trials, evaluation
and validation branches included), up to the first validation at or above
the target. Start-up, forks and the searchers' decisions are left out on
all sides alike. Each ratio compares runs of the same seed.

The fixed settings of the hindsight grid: momentum 0.9, learning rate x
per-worker batch size over the size's grid; the best is the fastest to the
target for that seed (a setting that never reaches it does not count).

On a host with more than 2 cores every job is pinned to 2 cores of its own
(``taskset``) and ``--parallel`` jobs (default cores // 2) run side by side,
the budgeted ones first (``--cores-per-job 1``: one core each, twice the
jobs at once, and every job about twice as long: on a 16-core H100 host this
is what gives the large job a best fixed run of about 2 minutes, where 2
cores give 70-80 s); GPUs should be hidden (``CUDA_VISIBLE_DEVICES=``: the
benchmark suite does it). ``--json`` keeps every run's summary, and
``--merge`` makes one table of several such files (seeds run in separate
commands).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from cores import Cores, core_slots, run_pinned
from figures import Figure, ratio, spread, write_figures
from local_job import STOP_SECONDS, run_job

COMMAND_START = time.perf_counter()  # --deadline counts from here
CORES_PER_JOB = 2  # each job's 2 workers get 2 cores (the default of --cores-per-job)
BEST_FIXED_GOAL_S = 120.0  # the condition on the job: the best fixed run takes >= 2 minutes


@dataclasses.dataclass(frozen=True)
class Size:
    """One job size: the program's options for every run, and the grid."""

    name: str
    options: tuple[str, ...]   # for every mode
    target: float
    max_epochs: int
    lrs: tuple[float, ...]
    batches: tuple[int, ...]
    trials: int                # trials of the Optuna baselines
    baseline_budget: Optional[float]  # seconds of clocks MLtuner and an Optuna baseline may run
    samples: int
    tune_options: tuple[str, ...] = ()  # for MLtuner's run only
    fixed_budget: Optional[float] = None  # seconds of clocks a fixed run may run
    timeout: float = 3600.0    # wall seconds one job may take
    deadline: Optional[float] = None  # wall seconds the whole command may take


SIZES = {
    "small": Size("small", ("--model", "mlp"), 0.55, 40, (0.1, 0.3, 1.0, 3.0), (16, 32, 64), 20, None, 5000,
                  ("--search-share", "0")),
    # The large job: see the module docstring for why these numbers.
    "large": Size("large", ("--model", "cnn", "--samples", "350000", "--batch-sizes", "32,64,128,256"),
                  0.989, 80, (0.1, 0.3, 1.0), (64, 128, 256), 30, 450.0, 350000,
                  fixed_budget=240.0, timeout=560.0, deadline=560.0),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One job of the benchmark."""

    seed: int
    mode: str                   # fixed, tune, optuna, hyperband
    setting: Optional[tuple[float, int]] = None  # (lr, batch) of a fixed run
    weight: float = 1.0         # expected length, to start the longest first


def program(run: Run, size: Size, args: argparse.Namespace, result: Path) -> list[str]:
    command = [sys.executable, "-m", "mltuner.apps.mnist1d", *size.options, "--mode", run.mode,
               "--seed", str(run.seed), "--target-accuracy", str(args.target), "--max-epochs", str(args.max_epochs),
               "--result", str(result)]
    if run.mode == "fixed":
        assert run.setting is not None
        command += ["--trials", "1", "--lr", str(run.setting[0]), "--batch-size", str(run.setting[1]),
                    "--search", ""]
        if args.fixed_budget is not None:
            command += ["--time-budget", str(args.fixed_budget)]
    else:
        command += ["--trials", "30", *size.tune_options] if run.mode == "tune" else ["--trials", str(args.trials)]
        if args.baseline_budget is not None:
            # MLtuner's job budget too: its searches get their shares of it.
            command += ["--time-budget", str(args.baseline_budget)]
    return command


def run_one(run: Run, cores: Cores, size: Size, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One job; the summary of its driver, with its wall time (or its error)."""
    name = f"{run.mode}-{run.seed}" + (f"-{run.setting[0]:g}x{run.setting[1]}" if run.setting else "")
    result = work / f"{name}.json"
    started = time.perf_counter()
    timeout = args.timeout
    if args.deadline is not None:
        # Every job ends by the command's deadline (a device command has a
        # hard limit, and what a killed command measured would be lost).
        timeout = min(timeout, args.deadline - (started - COMMAND_START) - STOP_SECONDS)
        if timeout <= 0:
            print(f"{name}: FAILED: not started, the command's deadline is past", flush=True)
            return {"error": "not started: past the command's deadline", "wall_s": 0.0}
    try:
        written = run_job(program(run, size, args, result), result, cores=cores, timeout_s=timeout)
    except (RuntimeError, TimeoutError) as error:
        print(f"{name}: FAILED: {error}", flush=True)
        return {"error": str(error).splitlines()[0], "wall_s": time.perf_counter() - started}
    summary = {**written["summary"], "wall_s": written["seconds"]}
    reached = summary["time_to_target_s"]
    print(f"{name}: {'not reached' if reached is None else f'{reached:.1f} s'} to {args.target:.1%} "
          f"({summary['time_s']:.0f} s of clocks, {summary['wall_s']:.0f} s in all)", flush=True)
    return summary


def plan(seeds: list[int], grid: list[tuple[float, int]]) -> list[Run]:
    runs = []
    for seed in seeds:
        runs += [Run(seed, "optuna", weight=10), Run(seed, "hyperband", weight=10), Run(seed, "tune", weight=3)]
        # The largest steps first: they reach the target soonest (or diverge),
        # so their slots free early for the slow settings, which run to their
        # budget; a run the command's deadline cuts is then a slow one.
        runs += [Run(seed, "fixed", setting) for setting in sorted(grid, key=lambda s: (-s[0], -s[1]))]
    # The budgeted runs first, so that the pool ends together; then the fixed
    # runs by setting across seeds, so that no seed's fast settings wait.
    return sorted(runs, key=lambda r: (-r.weight, *((-r.setting[0], -r.setting[1]) if r.setting else (0, 0))))


def rows_of(runs: list[Run], results: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """One row per seed: the best fixed setting and each driver's summary."""
    rows = []
    for seed in seeds:
        mine = {(r.mode, r.setting): res for r, res in zip(runs, results) if r.seed == seed}
        fixed = {setting: res for (mode, setting), res in mine.items() if mode == "fixed"}
        reached = {k: v for k, v in fixed.items() if v.get("time_to_target_s") is not None}
        best_key = min(reached, key=lambda k: reached[k]["time_to_target_s"]) if reached else None
        rows.append({
            "seed": seed, "best": list(best_key) if best_key else None,
            "fixed": reached[best_key]["time_to_target_s"] if best_key else None,
            "tune": mine[("tune", None)], "optuna": mine[("optuna", None)], "hyperband": mine[("hyperband", None)],
            "grid": {f"{k[0]:g}x{k[1]}": v.get("time_to_target_s") for k, v in sorted(fixed.items())},
            # Each fixed run's validations, so that --merge --target can re-read the times.
            "curves": {f"{k[0]:g}x{k[1]}": v.get("curve") for k, v in sorted(fixed.items())},
        })
    return rows


def retarget(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """The rows with every time to the target re-read from the runs' curves
    at a lower ``target``: a run that stopped at the higher target passed
    the lower one first, on the same path (no driver decides anything by the
    target before reaching it)."""
    from mltuner.tune.baselines import time_to_target

    out = []
    for row in rows:
        curves = row.get("curves")
        if curves is None:
            raise SystemExit(f"--target with --merge: seed {row['seed']}'s file has no fixed runs' curves "
                             "(written by an older tuner_bench.py); run it again")
        grid = {key: (time_to_target(curve, target) if curve else None) for key, curve in curves.items()}
        reached = {key: value for key, value in grid.items() if value is not None}
        best = min(reached, key=lambda key: reached[key]) if reached else None
        new = {**row, "grid": grid, "fixed": reached[best] if best else None,
               "best": [float(best.split("x")[0]), int(best.split("x")[1])] if best else None}
        for side in ("tune", "optuna", "hyperband"):
            if "error" not in row[side]:
                new[side] = {**row[side], "time_to_target_s": time_to_target(row[side].get("curve") or [], target)}
        out.append(new)
    return out


def fmt_time(seconds: Optional[float], stopped: Optional[float] = None) -> str:
    if seconds is not None:
        return f"{seconds:.1f}"
    return "not reached" if stopped is None else f"> {stopped:.0f}"


def fmt_ratio(value: Optional[float], lower_bound: bool = False) -> str:
    return "-" if value is None else (">= " if lower_bound else "") + f"{value:.2f}"


# key: (figure name, the other side, its label, ratio numerator, denominator, better, goal)
RATIOS = {
    "fixed": ("MLtuner vs best fixed in hindsight", "fixed", "best fixed setting", "tune", "fixed", "lower", 1.5),
    "optuna": ("MLtuner vs Optuna-TPE whole runs", "optuna", "Optuna-TPE", "optuna", "tune", "higher", 3.0),
    "hyperband": ("MLtuner vs Hyperband", "hyperband", "Hyperband", "hyperband", "tune", "higher", 3.0),
}


def seconds(row: dict[str, Any], key: str) -> Optional[float]:
    """A row's time to the target for one side ("fixed" is a number already)."""
    value = row[key]
    return value if key == "fixed" else value.get("time_to_target_s")


def seed_ratio(row: dict[str, Any], key: str) -> tuple[Optional[float], bool]:
    """One seed's ratio for RATIOS[key] and whether it is a lower bound: an
    Optuna baseline that stopped at its budget before the target counts with
    the time it ran."""
    _, _, _, top, bottom, _, _ = RATIOS[key]
    value = ratio(seconds(row, top), seconds(row, bottom))
    if value is None and top in ("optuna", "hyperband") and "error" not in row[top] \
            and row[top].get("time_to_target_s") is None and seconds(row, bottom) is not None:
        return ratio(row[top].get("time_s"), seconds(row, bottom)), True
    return value, False


def per_seed_ratios(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, bool]]]:
    """Each ratio of RATIOS for every seed that has one (with its lower-bound flag)."""
    out: dict[str, list[tuple[float, bool]]] = {}
    for key in RATIOS:
        out[key] = []
        for row in rows:
            value, bound = seed_ratio(row, key)
            if value is not None:
                out[key].append((value, bound))
    return out


def median_or_none(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def figures(rows: list[dict[str, Any]], target: float) -> list[Figure]:
    """MLtuner's median time against each baseline's; the ratio is the median
    of the per-seed ratios, with their range."""
    result = []
    for key, pairs in per_seed_ratios(rows).items():
        name, other, label, top, bottom, better, goal = RATIOS[key]
        values = [v for v, _ in pairs]
        bounds = sum(1 for _, b in pairs if b)
        note = f"{len(values)} of {len(rows)} seeds have a ratio at {target:.1%}"
        if bounds:
            note += f"; {bounds} of them lower bounds ({label} stopped at its budget first)"
        if key == "fixed":
            long_enough = sum(1 for row in rows if row["fixed"] is not None and row["fixed"] >= BEST_FIXED_GOAL_S)
            note += f"; best fixed run >= {BEST_FIXED_GOAL_S:.0f} s on {long_enough} of {len(rows)} seeds"
        result.append(Figure(
            "tuning", name, median_or_none([seconds(row, "tune") for row in rows]), "s to target (median)",
            label, median_or_none([seconds(row, other) for row in rows]),
            statistics.median(values) if values else None, f"{top} time / {bottom} time, median of seeds",
            better, goal, note, spread(values)))
    return result


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    budget = meta.get("baseline_budget")
    lines = [
        f"# MLtuner time-to-accuracy benchmark ({meta['size']}: {meta['job']}, 2 workers)", "",
        "```",
        f"date: {meta['date']}",
        f"machine: {meta['machine']}",
        f"target: {meta['target']:.1%} validation accuracy; max {meta['max_epochs']} epochs per run; "
        f"{meta['trials']} trials per Optuna baseline"
        + (f", stopped after {budget:g} s of clocks" if budget else "")
        + (f"; fixed runs stopped after {meta['fixed_budget']:g} s" if meta.get("fixed_budget") else "")
        + "; MLtuner trial cap 30",
        f"runs: {meta['runs']}",
        f"total time: {meta['total_s']:.0f} s",
        "```", "",
        "Seconds of clocks to the first validation at or above the target (lower is better). Ratios: MLtuner "
        "/ best fixed (goal <= 1.5, on a job whose best fixed run takes >= 2 minutes), Optuna whole runs / "
        "MLtuner and Hyperband / MLtuner (goal >= 3 each; '>' marks a baseline stopped at its budget before "
        "the target: its ratio is a lower bound).", "",
        "| seed | best fixed (lr x batch) | best fixed s | MLtuner s | Optuna-TPE s | Hyperband s | "
        "MLtuner / best fixed | Optuna / MLtuner | Hyperband / MLtuner | MLtuner's setting |",
        "|--:|:--|--:|--:|--:|--:|--:|--:|--:|:--|",
    ]
    for row in rows:
        best = "-" if row["best"] is None else f"{row['best'][0]:g} x {row['best'][1]}"
        setting = row["tune"].get("best_tunables") or {}
        cells = []
        for side in ("tune", "optuna", "hyperband"):
            res = row[side]
            cells.append("failed" if "error" in res else fmt_time(
                res.get("time_to_target_s"), res.get("time_s") if side != "tune" and budget else None))
        ratios = [fmt_ratio(*seed_ratio(row, key)) for key in RATIOS]
        lines.append(
            f"| {row['seed']} | {best} | {fmt_time(row['fixed'])} | {' | '.join(cells)} | {' | '.join(ratios)} | "
            + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items()) + " |")
    lines += ["", "| ratio | median | min | max | seeds | goal |", "|:--|--:|--:|--:|--:|:-:|"]
    names = {"fixed": "MLtuner / best fixed", "optuna": "Optuna-TPE / MLtuner", "hyperband": "Hyperband / MLtuner"}
    for key, pairs in per_seed_ratios(rows).items():
        if pairs:
            values = [v for v, _ in pairs]
            bound = " (some lower bounds)" if any(b for _, b in pairs) else ""
            goal = RATIOS[key][6]
            lines.append(f"| {names[key]} | {statistics.median(values):.2f} | {min(values):.2f} | "
                         f"{max(values):.2f} | {len(values)}{bound} | {'<=' if key == 'fixed' else '>='} {goal:g} |")
    fixed = [row["fixed"] for row in rows if row["fixed"] is not None]
    if fixed:
        held = sum(1 for f in fixed if f >= BEST_FIXED_GOAL_S)
        lines += ["", f"Best fixed runs took {min(fixed):.0f}-{max(fixed):.0f} s to the target: the issue's condition "
                  f"(>= {BEST_FIXED_GOAL_S:.0f} s) holds on {held} of {len(rows)} seeds."]
    lines += ["", "Fixed grid, seconds to the target per setting (lr x per-worker batch):", "",
              "| seed | " + " | ".join(rows[0]["grid"]) + " |", "|--:|" + "--:|" * len(rows[0]["grid"])]
    for row in rows:
        lines.append(f"| {row['seed']} | " + " | ".join(fmt_time(v) for v in row["grid"].values()) + " |")
    return lines


def measure(args: argparse.Namespace, size: Size) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else list(size.lrs[1:3] if args.quick else size.lrs)
    batches = ([int(x) for x in args.batches.split(",")] if args.batches
               else list(size.batches[1:] if args.quick else size.batches))
    grid = list(itertools.product(lrs, batches))
    slots = core_slots(args.cores_per_job, args.parallel)
    runs = plan(seeds, grid)
    each = f"{args.cores_per_job} core{'s' if args.cores_per_job > 1 else ''} each"
    print(f"{len(runs)} jobs, {len(slots)} at once"
          + ("" if slots[0] is None else f" ({each}: {', '.join(map(str, slots))})"), flush=True)
    # Generated once here, not by every job's workers at once.
    from mltuner.datasets import load_mnist1d

    loading = time.perf_counter()
    load_mnist1d(num_samples=size.samples)
    print(f"data set of {size.samples:,} samples ready in {time.perf_counter() - loading:.0f} s", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_pinned(runs, slots, lambda run, cores: run_one(run, cores, size, args, Path(tmp)))
    rows = rows_of(runs, results, seeds)
    meta = {
        "size": size.name, "target": args.target, "max_epochs": args.max_epochs,
        "job": " ".join(size.options) + (f"; MLtuner {' '.join(size.tune_options)}" if size.tune_options else ""),
        "trials": args.trials, "baseline_budget": args.baseline_budget, "fixed_budget": args.fixed_budget,
        "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
                   f"{platform.python_version()}, {platform.system()} {platform.release()}",
        "runs": (f"{len(slots)} at once, {each} (taskset)" if slots[0] is not None else "one at a time"),
        "total_s": time.perf_counter() - started,
    }
    return rows, meta


def merge(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of several --json files of one size and target, by seed."""
    rows: dict[int, dict[str, Any]] = {}
    metas = [json.loads(Path(path).read_text()) for path in paths]
    first = metas[0]["meta"]
    for path, data in zip(paths, metas):
        if (data["meta"]["size"], data["meta"]["target"]) != (first["size"], first["target"]):
            raise SystemExit(f"--merge: {path} is another size or target than {paths[0]}")
        rows.update({row["seed"]: row for row in data["rows"]})
    meta = {**first, "runs": f"merged from {len(paths)} file(s)",
            "total_s": sum(data["meta"]["total_s"] for data in metas)}
    return [rows[seed] for seed in sorted(rows)], meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="the job (see below)")
    parser.add_argument("--quick", action="store_true", help="1 seed and a 2x2 grid")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick 0)")
    parser.add_argument("--lrs", help="learning rates of the fixed grid (default: the size's)")
    parser.add_argument("--batches", help="per-worker batch sizes of the fixed grid (default: the size's)")
    parser.add_argument("--target", type=float, default=None, help="validation accuracy to reach (default: the size's)")
    parser.add_argument("--max-epochs", type=int, default=None, help="epochs per run (default: the size's)")
    parser.add_argument("--trials", type=int, default=None, help="trials of the Optuna baselines (default: the size's)")
    parser.add_argument("--baseline-budget", type=float, default=None,
                        help="seconds of clocks MLtuner and each Optuna baseline may run: their job budget "
                             "(default: the size's; 0: unbounded)")
    parser.add_argument("--cores-per-job", type=int, default=CORES_PER_JOB,
                        help="cores each job (2 workers) is pinned to on a many-core host (default 2); "
                             "1 makes every job about twice as long")
    parser.add_argument("--parallel", type=int, default=None,
                        help="jobs at once (default cores // --cores-per-job)")
    parser.add_argument("--fixed-budget", type=float, default=None,
                        help="seconds of clocks a fixed run may run (default: the size's; 0: unbounded)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="wall seconds one job may take (default: the size's)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="wall seconds the whole command may take, data set included: every job is "
                             "stopped by then and the table written (default: the size's; 0: none)")
    parser.add_argument("--out", default="results/tuner_bench.md")
    parser.add_argument("--json", default=None, help="every run's summary (default: --out with .json)")
    parser.add_argument("--merge", default=None, metavar="FILES",
                        help="comma-separated --json files: one table from them, nothing run")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    args = parser.parse_args()
    if args.cores_per_job < 1:
        parser.error("--cores-per-job must be at least 1")
    size = SIZES[args.size]
    asked_target = args.target
    args.target = size.target if args.target is None else args.target
    args.max_epochs = size.max_epochs if args.max_epochs is None else args.max_epochs
    args.trials = size.trials if args.trials is None else args.trials
    budget = size.baseline_budget if args.baseline_budget is None else args.baseline_budget
    args.baseline_budget = budget if budget else None
    fixed = size.fixed_budget if args.fixed_budget is None else args.fixed_budget
    args.fixed_budget = fixed if fixed else None
    args.timeout = size.timeout if args.timeout is None else args.timeout
    deadline = size.deadline if args.deadline is None else args.deadline
    args.deadline = deadline if deadline else None
    if args.merge:
        rows, meta = merge([p for p in args.merge.split(",") if p])
        if asked_target is not None and asked_target != meta["target"]:
            if asked_target > meta["target"]:
                raise SystemExit(f"--target {asked_target} with --merge: the runs stopped at "
                                 f"{meta['target']}; only a lower target can be re-read from them")
            rows = retarget(rows, asked_target)
            meta = {**meta, "target": asked_target,
                    "runs": f"{meta['runs']}; times re-read at {asked_target:.1%} from runs that stopped at "
                            f"{meta['target']:.1%}"}
    else:
        rows, meta = measure(args, size)
        json_path = Path(args.json or Path(args.out).with_suffix(".json"))
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
        print(f"wrote {json_path}")
    text = "\n".join(table(rows, meta)) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    write_figures(args.figures, figures(rows, meta["target"]))
    failed = [row["seed"] for row in rows for side in ("tune", "optuna", "hyperband") if "error" in row[side]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
