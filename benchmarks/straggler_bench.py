"""Stragglers: time to a target validation accuracy with one of 2 (or 4)
workers slowed, for mltuner at slack 0, 1, 3 and 7, each with equal batches,
with batches balanced by speed (``--balance-batches``) and, at slack >= 1,
balanced and stolen from a late worker (``--steal-batches``), against PyTorch
DDP (gloo), whose batches are equal.

    python benchmarks/straggler_bench.py [--quick] [--workers 2,4] [--only 3x,bursts] [--target 0.7]
                                         [--slacks 0,1,3,7] [--modes equal,balanced,balanced+stealing] [--rounds 1]
                                         [--out PATH] [--figures PATH]

The model is the MNIST-1D CNN, trained with a fixed setting (lr 0.3,
dampened momentum 0.9, 32 samples per worker and clock) by
``python -m mltuner.apps.mnist1d --mode fixed`` and by
``benchmarks/ddp_mnist1d.py`` (the same data order, batches and update rule).
Rank 1 is slowed by sleeping after its clocks:

- none;
- constant 1.5x and 3x (``--slow-factor``): rank 1 computes 1.5 or 3 times
  as slowly, as a slower device would: after each training clock it sleeps
  0.5 or 2 times its own forward + backward time for that clock's samples
  (measured before training, in each job the same way). With balanced
  batches it computes fewer samples, and so sleeps less;
- bursts: a sleep of 10 t after a clock with probability 0.1, whatever the
  rank computes (2x on average, as from a noisy neighbour), t = the CNN's
  forward + backward time for one batch of 32, measured here first.

Before stop 50 the constant patterns were fixed sleeps of 0.5 t and 2 t
after every clock: a rank that then computed one sample still slept as long
as for 32, slower than the stated factor.

Time is the seconds of training to the first validation at or above the
target, validations included (mltuner's validation clocks; DDP's forward
pass over the validation split on rank 0); with ``--rounds N``, the median
of N runs, the columns alternated. One seed. ``--workers`` lists the job
sizes (default 2); each worker takes 32 samples a clock, so 4 workers train
with twice the global batch of 2, and each size has its own DDP baseline.
``--quick`` runs slack 0 and 3 under no straggler, constant 3x and bursts.

Balanced batches keep each clock's samples and summed update (each worker's
loss weighted by its share) and move samples from the slow rank to the
others; a slack absorbs the delays that come and go. Stealing (since stop
52; stop 53: a late rank's clocks declared empty on the shards) gives the
parts of a rank silent for two clocks to the others, so its empty clocks let
it catch up. ``--modes`` picks the
columns: ``equal``, ``balanced``, ``stealing``, ``balanced+stealing``
(default: all but ``stealing``). Every column shares one
setting, a good one for BSP. Until stop 50 the program ignored
``--staleness`` unless it searched staleness, so the slack columns of
earlier runs were BSP; until stop 51 (read-my-writes, ``Config.read_my_writes``)
a stale read also missed the worker's own last steps, and at slack 3 and 7
this setting never reached 70%.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from mltuner.apps._cnn import forward_backward_seconds, mnist1d_cnn
from figures import Figure, ratio, write_figures
from local_job import run_job

SLACKS = (0, 1, 3, 7)
# How mltuner splits a clock's samples: the options of each column's run.
MODES = {"equal": [], "balanced": ["--balance-batches"], "stealing": ["--steal-batches"],
         "balanced+stealing": ["--balance-batches", "--steal-batches"]}
QUICK_SLACKS = (0, 3)
BENCH = Path(__file__).resolve().parent


def batch_seconds() -> float:
    """The CNN's forward + backward time for one batch of 32, one thread."""
    torch.set_num_threads(1)
    return forward_backward_seconds(mnist1d_cnn(), torch.randn(32, 1, 40), torch.randint(0, 10, (32,)),
                                    repeats=200, warmup=20)


def progress(workers: int, pattern: str, column: str, seconds: float | None, started: float) -> None:
    """One finished run on stderr, so a run cut short still shows what it measured."""
    took = "not reached" if seconds is None else f"{seconds:.2f} s"
    print(f"[{time.perf_counter() - started:.0f} s] {workers} workers, {pattern}, {column}: {took}",
          file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--out", default="results/straggler_bench.md")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("--quick", action="store_true", help="slack 0 and 3; no straggler, constant 3x, bursts")
    parser.add_argument("--workers", type=lambda text: [int(n) for n in text.split(",")], default=[2],
                        help="comma list of worker counts (default 2)")
    parser.add_argument("--slacks", type=lambda text: tuple(int(n) for n in text.split(",")), default=None,
                        help=f"comma list of the slacks to run (default {','.join(map(str, SLACKS))}; --quick "
                        f"{','.join(map(str, QUICK_SLACKS))})")
    parser.add_argument("--modes", type=lambda text: text.split(","),
                        default=[mode for mode in MODES if mode != "stealing"],
                        help=f"how mltuner splits a clock's samples, comma list of {', '.join(MODES)} (default "
                        "all but stealing)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every column, alternated; the table shows their median (default 1)")
    parser.add_argument("--steal-after", type=float, default=None,
                        help="the stealing columns' --steal-after (typical clocks of silence before a worker's "
                             "parts move; default the session's)")
    parser.add_argument("--test-clocks", type=int, default=None,
                        help="clocks of each of mltuner's validations (default: the app's, the set in one clock)")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="comma list of the patterns to run, by a word of their names (none, 1.5x, 3x, bursts)")
    args = parser.parse_args()
    slacks = args.slacks or (QUICK_SLACKS if args.quick else SLACKS)
    if set(args.modes) - set(MODES):
        parser.error(f"--modes: unknown {', '.join(sorted(set(args.modes) - set(MODES)))}")
    # The session steals only at slack >= 1 (under BSP a thief would wait for the late rank anyway).
    columns = [(slack, mode) for mode in args.modes for slack in slacks if slack > 0 or "stealing" not in mode]
    t = batch_seconds()
    patterns = {"none": [], "constant 1.5x": ["--slow-factor", "1.5"], "constant 3x": ["--slow-factor", "3"],
                "bursts (10t, p=0.1)": ["--slow-ms", str(10 * t * 1000), "--slow-probability", "0.1"]}
    if args.quick:
        del patterns["constant 1.5x"]
    if args.only:
        patterns = {name: pattern for name, pattern in patterns.items()
                    if any(word in name.split() for word in args.only)}
    common = ["--target-accuracy", str(args.target), "--max-epochs", str(args.max_epochs), "--lr", "0.3",
              "--momentum", "0.9", "--batch-size", "32", "--seed", "0"]
    steal_after = [] if args.steal_after is None else ["--steal-after", str(args.steal_after)]
    test_clocks = [] if args.test_clocks is None else ["--test-clocks", str(args.test_clocks)]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        for workers in args.workers:
            for name, pattern in patterns.items():
                slow = ["--slow-rank", "1", *pattern]
                runs: dict[str, list[float | None]] = {}
                shares: dict[str, list[float]] = {}
                taken: dict[str, int] = {}
                waited: dict[str, float] = {}
                for _ in range(args.rounds):  # every column once per round: drift hits them alike
                    for slack, mode in columns:
                        column = column_name(slack, mode)
                        outcome = run_job([sys.executable, "-m", "mltuner.apps.mnist1d", "--model", "cnn", "--mode",
                                           "fixed", "--search", "", "--staleness", str(slack), "--result",
                                           str(result), *common, *slow, *MODES[mode], *steal_after, *test_clocks],
                                          result, workers=workers)
                        runs.setdefault(column, []).append(outcome["summary"]["time_to_target_s"])
                        progress(workers, name, column, runs[column][-1], started)
                        if outcome.get("batch_shares"):
                            shares[column] = [round(f, 3) for f in outcome["batch_shares"]]
                        if outcome.get("clocks_taken"):
                            taken[column] = outcome["clocks_taken"]
                            waited[column] = round(outcome.get("claim_wait_s", 0.0), 3)
                    ddp = run_job([sys.executable, str(BENCH / "ddp_mnist1d.py"), "--result", str(result), *common,
                                   *slow], result, workers=workers)
                    runs.setdefault("DDP", []).append(ddp["time_to_target_s"])
                    progress(workers, name, "DDP", runs["DDP"][-1], started)
                times = {column: median_reached(values) for column, values in runs.items()}
                print(workers, name, runs, "final shares:", shares, "clocks rank 0 took parts in:", taken,
                      "seconds rank 0 waited to claim:", waited,
                      flush=True)
                rows.append((workers, name, times))
    lines = table(rows, columns, t, args, time.perf_counter() - started)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    write_figures(args.figures, [
        Figure("stragglers", f"{workers} workers, rank 1 slowed: {name}; {column} vs DDP", times[column],
               "s to target", "DDP (gloo)", times["DDP"], ratio(times["DDP"], times[column]),
               "DDP time / mltuner time", note=f"target {args.target:.0%}, t = {t * 1e3:.2f} ms")
        for workers, name, times in rows for column in (column_name(*c) for c in columns)])
    return 0


def median_reached(seconds: list[float | None]) -> float | None:
    """The median time of the rounds, None (not reached) unless more than
    half reached the target; the rounds that did not count as the slowest."""
    reached = sorted(s for s in seconds if s is not None)
    if 2 * len(reached) <= len(seconds):
        return None
    ordered = reached + [math.inf] * (len(seconds) - len(reached))  # more than half are finite
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def column_name(slack: int, mode: str) -> str:
    return f"slack {slack}" if mode == "equal" else f"slack {slack}, {mode}"


def table(rows: list[tuple[int, str, dict[str, float | None]]], columns: list[tuple[int, str]], t: float,
          args: argparse.Namespace, total_s: float) -> list[str]:
    names = [column_name(*c) for c in columns] + ["DDP"]
    lines = [
        "```",
        f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}; machine: {platform.machine()}, "
        f"torch {torch.__version__}; {os.cpu_count()} cores; t = {t * 1e3:.2f} ms; target {args.target:.0%}; "
        f"total {total_s:.0f} s"
        + ("" if args.steal_after is None else f"; stealing after {args.steal_after:g} typical clocks"),
        "```", "",
        f"Seconds to the target (lower is better{f'; median of {args.rounds} rounds' if args.rounds > 1 else ''}); "
        "in brackets, DDP's time / mltuner's under the same straggler (above 1: mltuner faster).", "",
        "| workers | rank 1 slowed | " + " | ".join(names) + " |",
        "|--:|:--|" + "--:|" * len(names),
    ]
    for workers, name, times in rows:
        ddp = times["DDP"]
        cells = []
        for column in names:
            value = times[column]
            if value is None:
                cells.append("not reached")
            elif column == "DDP" or ddp is None:
                cells.append(f"{value:.1f}")
            else:
                cells.append(f"{value:.1f} ({ddp / value:.2f})")
        lines.append(f"| {workers} | {name} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
