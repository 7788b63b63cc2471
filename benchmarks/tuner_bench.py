"""Time to a target validation accuracy on MNIST-1D: MLtuner against the
best fixed setting found in hindsight, Optuna TPE with whole training runs,
and Hyperband (Optuna's HyperbandPruner over epochs), over several seeds.

    python benchmarks/tuner_bench.py [--quick] [--out docs/tuner_benchmarks.md] [--figures PATH]

Every run is a real job: 2 worker processes under ``mltuner launch`` running
``python -m mltuner.apps.mnist1d`` (the numpy MLP 40-100-100-10 through the
parameter server; 3,600 training, 400 validation samples). Time is the
counted time of each driver (mltuner.tune._baselines): the sum of the wall
time of every clock of every branch it ran (trials, evaluation and
validation branches included), up to the first validation at or above the
target. Start-up, forks and the searchers' decisions are left out on all
sides alike. Each ratio compares runs of the same seed.

The fixed settings of the hindsight grid: momentum 0.9, learning rate x
per-worker batch size over the grid below; the best is the fastest to the
target for that seed (a setting that never reaches it does not count).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import Figure, ratio, spread, write_figures
from local_job import run_job

GRID_LR = (0.1, 0.3, 1.0, 3.0)
GRID_BATCH = (16, 32, 64)


def run(mode: str, seed: int, target: float, max_epochs: int, trials: int, extra: list[str],
        work: Path) -> dict[str, Any]:
    """One job; the summary of its driver, with its wall time."""
    result = work / "result.json"
    command = [sys.executable, "-m", "mltuner.apps.mnist1d", "--mode", mode, "--seed", str(seed),
               "--target-accuracy", str(target), "--max-epochs", str(max_epochs), "--trials", str(trials),
               "--result", str(result), *extra]
    written = run_job(command, result)
    return {**written["summary"], "wall_s": written["seconds"]}


def fmt_time(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed and a 2x2 grid (a few minutes)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; quick 0)")
    parser.add_argument("--lrs", help="learning rates of the fixed grid (default 0.1,0.3,1,3; quick 0.3,1)")
    parser.add_argument("--batches", help="per-worker batch sizes of the fixed grid (default 16,32,64; quick 32,64)")
    parser.add_argument("--target", type=float, default=0.55, help="validation accuracy to reach")
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--trials", type=int, default=20, help="trials of the Optuna baselines")
    parser.add_argument("--out", default="results/tuner_bench.md")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    args = parser.parse_args()
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else GRID_LR[1:3] if args.quick else GRID_LR
    batches = ([int(x) for x in args.batches.split(",")] if args.batches
               else GRID_BATCH[1:] if args.quick else GRID_BATCH)
    grid = list(itertools.product(lrs, batches))
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for seed in seeds:
            print(f"seed {seed}: fixed grid of {len(grid)} ...", flush=True)
            fixed = {}
            for lr, batch in grid:
                fixed[(lr, batch)] = run("fixed", seed, args.target, args.max_epochs, 1,
                                         ["--lr", str(lr), "--batch-size", str(batch), "--search", ""], work)
            reached = {k: v for k, v in fixed.items() if v["time_to_target_s"] is not None}
            best_key = min(reached, key=lambda k: reached[k]["time_to_target_s"]) if reached else None
            best_fixed = reached[best_key]["time_to_target_s"] if best_key else None
            print(f"seed {seed}: mltuner, optuna, hyperband ...", flush=True)
            tuned = run("tune", seed, args.target, args.max_epochs, 30, [], work)
            optuna = run("optuna", seed, args.target, args.max_epochs, args.trials, [], work)
            hyperband = run("hyperband", seed, args.target, args.max_epochs, args.trials, [], work)
            rows.append({"seed": seed, "best": best_key, "fixed": best_fixed, "tune": tuned, "optuna": optuna,
                         "hyperband": hyperband, "grid": {f"{k[0]}x{k[1]}": v["time_to_target_s"]
                                                          for k, v in fixed.items()}})
    lines = table(rows, args, time.perf_counter() - started)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    write_figures(args.figures, figures(rows, args))
    return 0


# key: (figure name, the other side, its label, ratio numerator, denominator, better, goal)
RATIOS = {
    "fixed": ("MLtuner vs best fixed in hindsight", "fixed", "best fixed setting", "tune", "fixed", "lower", 1.5),
    "optuna": ("MLtuner vs Optuna-TPE whole runs", "optuna", "Optuna-TPE", "optuna", "tune", "higher", 3.0),
    "hyperband": ("MLtuner vs Hyperband", "hyperband", "Hyperband", "hyperband", "tune", "higher", 3.0),
}


def seconds(row: dict[str, Any], key: str) -> float | None:
    """A row's time to the target for one side ("fixed" is a number already)."""
    value = row[key]
    return value if key == "fixed" else value["time_to_target_s"]


def per_seed_ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each ratio of RATIOS for every seed where both sides reached the target."""
    out: dict[str, list[float]] = {}
    for key, (_, _, _, top, bottom, _, _) in RATIOS.items():
        values = [ratio(seconds(row, top), seconds(row, bottom)) for row in rows]
        out[key] = [v for v in values if v is not None]
    return out


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def figures(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[Figure]:
    """MLtuner's median time against each baseline's; the ratio is the median
    of the per-seed ratios, with their range."""
    result = []
    for key, values in per_seed_ratios(rows).items():
        name, other, label, top, bottom, better, goal = RATIOS[key]
        result.append(Figure(
            "tuning", name, median_or_none([seconds(row, "tune") for row in rows]), "s to target (median)",
            label, median_or_none([seconds(row, other) for row in rows]),
            statistics.median(values) if values else None, f"{top} time / {bottom} time, median of seeds",
            better, goal, f"{len(values)} of {len(rows)} seeds reached {args.target:.0%} on both sides",
            spread(values)))
    return result


def table(rows: list[dict[str, Any]], args: argparse.Namespace, total_s: float) -> list[str]:
    lines = [
        "# MLtuner time-to-accuracy benchmark (MNIST-1D MLP, 2 workers)", "",
        "```",
        f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}",
        f"target: {args.target:.0%} validation accuracy; max {args.max_epochs} epochs per run; "
        f"{args.trials} trials per Optuna baseline; MLtuner trial cap 30",
        f"total time: {total_s:.0f} s",
        "```", "",
        "Seconds of clocks to the first validation at or above the target (lower is better). Ratios: MLtuner "
        "/ best fixed (goal <= 1.5), Optuna whole runs / MLtuner and Hyperband / MLtuner (goal >= 3 each).", "",
        "| seed | best fixed (lr x batch) | best fixed s | MLtuner s | Optuna-TPE s | Hyperband s | "
        "MLtuner / best fixed | Optuna / MLtuner | Hyperband / MLtuner | MLtuner's setting |",
        "|--:|:--|--:|--:|--:|--:|--:|--:|--:|:--|",
    ]
    for row in rows:
        tune_s = row["tune"]["time_to_target_s"]
        r_fixed = ratio(tune_s, row["fixed"])
        r_optuna = ratio(row["optuna"]["time_to_target_s"], tune_s)
        r_hyper = ratio(row["hyperband"]["time_to_target_s"], tune_s)
        best = "-" if row["best"] is None else f"{row['best'][0]:g} x {row['best'][1]}"
        setting = row["tune"].get("best_tunables") or {}
        lines.append(
            f"| {row['seed']} | {best} | {fmt_time(row['fixed'])} | {fmt_time(tune_s)} | "
            f"{fmt_time(row['optuna']['time_to_target_s'])} | {fmt_time(row['hyperband']['time_to_target_s'])} | "
            f"{fmt_ratio(r_fixed)} | {fmt_ratio(r_optuna)} | {fmt_ratio(r_hyper)} | "
            + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items()) + " |")
    lines += ["", "| ratio | median | min | max | seeds |", "|:--|--:|--:|--:|--:|"]
    names = {"fixed": "MLtuner / best fixed", "optuna": "Optuna-TPE / MLtuner", "hyperband": "Hyperband / MLtuner"}
    for key, values in per_seed_ratios(rows).items():
        if values:
            lines.append(f"| {names[key]} | {statistics.median(values):.2f} | {min(values):.2f} | "
                         f"{max(values):.2f} | {len(values)} |")
    lines += ["", "Fixed grid, seconds to the target per setting (lr x per-worker batch):", "",
              "| seed | " + " | ".join(rows[0]["grid"]) + " |", "|--:|" + "--:|" * len(rows[0]["grid"])]
    for row in rows:
        lines.append(f"| {row['seed']} | " + " | ".join(fmt_time(v) for v in row["grid"].values()) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
