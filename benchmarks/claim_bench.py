"""What batch stealing's claims cost a job with no straggler: every rank
claims each clock before computing it, on one host through a board file
the ranks share, across hosts through rank 0 (whose handler waits for rank
0's interpreter lock while its loop computes in Python).

    python benchmarks/claim_bench.py [--workers 2,4] [--work-ms 4] [--clocks 120] [--rounds 3] [--out FILE]

Each worker's clock is a CPU loop of ``--work-ms`` in Python (holding the
interpreter lock, as a training loop's Python between kernels does) and a
one-row table's read, update and clock, in a TuningSession at slack 1 with
nobody slowed. The columns: no stealing (the baseline), stealing through
the shared board, and stealing through rank 0 (``MLTUNER_SHARED_CLAIMS=0``);
the medians of alternated rounds of rank 0's seconds from its first clock
to its last, and each as a ratio to the baseline (above 1: slower), with
the claims' cost per clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from figures import Figure, ratio, write_figures
from local_job import run_job
from machine import cpu_name

COLUMNS = {"no stealing": ([], {}), "shared board": (["--steal"], {}),
           "through rank 0": (["--steal"], {"MLTUNER_SHARED_CLAIMS": "0"})}


def worker(args: argparse.Namespace) -> int:
    """One rank: ``--clocks`` clocks of a CPU loop in one run of one branch."""
    import numpy as np

    import mltuner
    from mltuner.tune import BranchKind, BranchSystem, Choice, SearchSpace, TuningSession

    batch = 8

    def driver(system: BranchSystem) -> None:
        root = system.fork(None, {"batch_size": batch}, BranchKind.INIT)
        branch = system.fork(root, {"batch_size": batch}, BranchKind.TRAINING)
        system.run(branch, args.clocks)

    config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), branches=True, wait_timeout_s=60)
    space = SearchSpace([Choice("batch_size", [batch], default=batch, search=False)])
    with mltuner.Job(config, rendezvous_timeout_s=60) as job:
        w = job.worker
        table = w.create_table("w", 1, 4)
        read = w.virtual_read(table, slack=1)
        w.virtual_post_read(read)
        grad = w.virtual_pre_update(table)
        w.virtual_update(grad)
        w.virtual_clock()
        w.finish_virtual_iteration()
        w.start_iterations()
        session = TuningSession(job, space, num_train=batch * job.world_size * (args.clocks + 1), num_validation=1,
                                driver=driver, steal_batches=args.steal)
        started = None
        for step in session:
            started = started or time.perf_counter()
            w.read(read)
            w.post_read(read)
            end = time.perf_counter() + args.work_ms / 1e3
            while time.perf_counter() < end:  # Python holding the interpreter lock
                pass
            w.pre_update(grad)[:] = np.float32(len(step.indices))
            w.update(grad)
            w.clock()
            step.report(0.0)
        w.sync()
        if job.rank == 0:
            Path(args.result).write_text(json.dumps({"seconds": time.perf_counter() - (started or 0.0),
                                                     "shared": session.claims_shared}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=lambda text: [int(n) for n in text.split(",")], default=[2, 4])
    parser.add_argument("--work-ms", type=float, default=4.0, help="each clock's CPU loop, in ms")
    parser.add_argument("--clocks", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every column, alternated (median)")
    parser.add_argument("--out", default="results/claim_bench.md")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')}; {cpu_name()}, {os.cpu_count()} cores; {args.work_ms:g} ms a clock, "
             f"{args.clocks} clocks, median of {args.rounds} rounds",
             "", "| workers | " + " | ".join(COLUMNS) + " |", "|--:|" + "--:|" * len(COLUMNS)]
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        for workers in args.workers:
            seconds: dict[str, list[float]] = {name: [] for name in COLUMNS}
            for _ in range(args.rounds):
                for name, (flags, env) in COLUMNS.items():
                    command = [sys.executable, __file__, "--worker", "--clocks", str(args.clocks), "--work-ms",
                               str(args.work_ms), "--result", str(result), *flags]
                    outcome = run_job(command, result, workers=workers, env=env)
                    if flags and outcome["shared"] != (name == "shared board"):
                        how = "through the shared board" if outcome["shared"] else "through rank 0"
                        raise RuntimeError(f"{name}: the session claimed {how}")
                    seconds[name].append(outcome["seconds"])
            median = {name: statistics.median(values) for name, values in seconds.items()}
            base = median["no stealing"]
            cells = [f"{median[name]:.2f} s" if name == "no stealing" else
                     f"{median[name]:.2f} s ({median[name] / base:.2f}, "
                     f"{(median[name] - base) / args.clocks * 1e3:+.2f} ms a clock)" for name in COLUMNS]
            lines.append(f"| {workers} | " + " | ".join(cells) + " |")
            figures += [Figure("claims", f"{workers} workers, no straggler: stealing, claims {name}", median[name], "s",
                               "no stealing", base, ratio(base, median[name]), "time without / with stealing",
                               note=f"{args.work_ms:g} ms of Python a clock, {args.clocks} clocks")
                        for name in COLUMNS if name != "no stealing"]
            print(workers, {name: [round(s, 3) for s in values] for name, values in seconds.items()}, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    write_figures(args.figures, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
