"""`mltuner demo` over several seeds, each on 2 CPU cores: test accuracy,
time, rollbacks and the search's share of the time, per seed and summed up.

    python benchmarks/demo_seeds.py [--seeds 0-9] [--parallel N] [--out DIR] [--figures PATH]

Each seed is a whole `mltuner demo --seed S` (2 workers: the MNIST-1D CNN,
every tunable of the paper searched) in its own output folder under DIR.
On a host with more than 2 cores every run is pinned to 2 of them with
`taskset`, so that N runs go side by side (N = cores // 2 by default) and
each still sees a 2-core machine; with 2 cores or fewer they run one at a
time, unpinned. GPUs are hidden from the runs (CUDA_VISIBLE_DEVICES="")
unless --gpu is given, which runs the demo on the GPU, one seed at a time.

The issue's bars (issue 18): every seed reaches >= 94% test accuracy (the
MNIST-1D authors' figure for this CNN) and none collapses (ends near
chance); on one GPU the searches take <= 20% of the demo's time. Time is
the demo's own (rank 0, from the job's start to its end: the data set,
the searches, training and the test), and the wall time of the whole
command beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cores import Cores, core_slots, pinned, run_pinned
from figures import Figure, spread, write_figures
from machine import cpu_name

TARGET = 0.94       # the MNIST-1D authors' test accuracy for this CNN
COLLAPSED = 0.5     # a test accuracy below this is a collapsed model (chance is 0.1)
SEARCH_SHARE_GOAL = 0.2
CORES_PER_RUN = 2


def parse_seeds(text: str) -> list[int]:
    """``0-9``, ``0,3,5`` or a mix: the seeds, in order, without repeats."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            values = range(int(low), int(high) + 1) if high else [int(low)]
        except ValueError:
            raise SystemExit(f"--seeds: expected integers or ranges like 0-9, got {part!r}") from None
        seeds += [v for v in values if v not in seeds]
    if not seeds:
        raise SystemExit("--seeds: no seed given")
    return seeds


def demo_command(seed: int, out: Path, cores: Cores, extra: list[str]) -> list[str]:
    return pinned([sys.executable, "-m", "mltuner.cli", "demo", "--plain", "--out", str(out), "--seed", str(seed),
                   *extra], cores)


def run_seed(seed: int, out: Path, cores: Cores, gpu: bool, timeout_s: float,
             extra: list[str]) -> dict[str, Any]:
    """One demo; what its result.json and decision log say, with the wall time."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    with open(out / "demo.out", "w") as log:
        # Its own session: a timeout stops the launcher and its workers together.
        proc = subprocess.Popen(demo_command(seed, out, cores, extra), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"seed": seed, "cores": cores, "wall_s": wall, "exit": code, "out": str(out)}
    result_path = out / "result.json"
    if code != 0 or not result_path.exists():
        row["error"] = "timed out" if code is None else f"exit code {code}"
        return row
    result = json.loads(result_path.read_text())
    row.update({
        "test_accuracy": result.get("test_accuracy"),
        "seconds": result.get("seconds"),
        "search_s": result.get("search_seconds"),
        "search_share": result.get("search_share"),
        "searches": result.get("searches"),
        "rollbacks": result.get("rollbacks", 0),
        "epochs": result.get("summary", {}).get("epochs"),
        "outcome": result.get("outcome"),
        "tunables": result.get("tunables"),
        "alarms": alarm_reasons(out / "decisions.jsonl"),
    })
    return row


def alarm_reasons(log: Path) -> list[str]:
    """The reason of every rollback in a decision log, in order."""
    reasons = []
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "rollback":
                reasons.append(str(record.get("reason")))
    return reasons


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the run's session, SIGKILL after 20 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def run_all(seeds: list[int], out: Path, slots: list[Cores], gpu: bool, timeout_s: float,
            extra: list[str]) -> list[dict[str, Any]]:
    """Every seed, as many at once as there are slots, each on its slot's cores."""
    def one(seed: int, cores: Cores) -> dict[str, Any]:
        row = run_seed(seed, out / f"seed-{seed}", cores, gpu, timeout_s, extra)
        print(f"seed {seed}: {describe(row)}", flush=True)
        return row

    return run_pinned(seeds, slots, one)


def describe(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"FAILED ({row['error']}; see {row['out']}/demo.out)"
    share = row.get("search_share")
    return (f"test {row['test_accuracy']:.1%}, {row['seconds']:.0f} s ({row['wall_s']:.0f} s wall), "
            f"search {share:.0%} of it, {row['rollbacks']} rollback(s), {row['epochs']} epochs, "
            f"ended {row['outcome']}" if share is not None else f"test {row['test_accuracy']}")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r and r.get("test_accuracy") is not None]
    times = [r["seconds"] for r in done]
    shares = [r["search_share"] for r in done if r.get("search_share") is not None]
    return {
        "seeds": len(rows), "finished": len(done),
        "reached": sum(1 for r in done if r["test_accuracy"] >= TARGET),
        "collapsed": sum(1 for r in done if r["test_accuracy"] < COLLAPSED),
        "rollbacks": sum(r["rollbacks"] for r in done),
        "median_s": statistics.median(times) if times else None,
        "worst_s": max(times) if times else None,
        "worst_accuracy": min((r["test_accuracy"] for r in done), default=None),
        "median_accuracy": statistics.median([r["test_accuracy"] for r in done]) if done else None,
        "median_share": statistics.median(shares) if shares else None,
        "max_share": max(shares) if shares else None,
        "shares": shares,
    }


def table(rows: list[dict[str, Any]], total: dict[str, Any], args: argparse.Namespace, slots: list[Any],
          elapsed: float) -> list[str]:
    where = "GPU" if args.gpu else ("2 cores per run (taskset), "
                                    f"{len(slots)} at once" if slots[0] is not None else "unpinned, one at a time")
    lines = [
        f"# mltuner demo over {len(rows)} seeds", "", "```",
        f"date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"machine: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}",
        f"runs: {where}; extra demo options: {' '.join(args.demo_args) or '-'}",
        f"total time: {elapsed:.0f} s", "```", "",
        f"Seconds are the demo's own (rank 0, job start to end); wall is the whole command. Search: the "
        f"searches' clock time and its share of the demo's time. Goal: every seed >= {TARGET:.0%} test "
        f"accuracy, none collapsed (< {COLLAPSED:.0%}).", "",
        "| seed | test accuracy | seconds | wall s | search s | search share | epochs | rollbacks (reasons) "
        "| ended | setting |",
        "|--:|--:|--:|--:|--:|--:|--:|:--|:--|:--|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seed']} | {r['error']} | | {r['wall_s']:.0f} | | | | | | |")
            continue
        setting = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in (r.get("tunables") or {}).items())
        share = "-" if r.get("search_share") is None else f"{r['search_share']:.0%}"
        search = "-" if r.get("search_s") is None else f"{r['search_s']:.1f}"
        alarms = f"{r['rollbacks']}" + (f" ({', '.join(r['alarms'])})" if r["alarms"] else "")
        lines.append(f"| {r['seed']} | {r['test_accuracy']:.1%} | {r['seconds']:.0f} | {r['wall_s']:.0f} | "
                     f"{search} | {share} | {r['epochs']} | {alarms} | {r['outcome']} | {setting} |")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines += [
        "",
        f"- **{total['reached']} of {total['seeds']}** seeds reached >= {TARGET:.0%} test accuracy "
        f"({total['finished']} finished; worst {fmt(total['worst_accuracy'], '.1%')}, median "
        f"{fmt(total['median_accuracy'], '.1%')}); {total['collapsed']} collapsed; {total['rollbacks']} "
        "rollback(s) in all.",
        f"- Time: median {fmt(total['median_s'], '.0f')} s, worst {fmt(total['worst_s'], '.0f')} s.",
        f"- Search share of the demo's time: median {fmt(total['median_share'], '.0%')}, most "
        f"{fmt(total['max_share'], '.0%')} (goal on one GPU: <= {SEARCH_SHARE_GOAL:.0%}).",
    ]
    return lines


def figures(total: dict[str, Any], gpu: bool) -> list[Figure]:
    where = "GPU" if gpu else "2 CPU cores"
    seeds = total["seeds"]
    share = total["median_share"]
    return [
        Figure("demo", f"seeds reaching {TARGET:.0%} test accuracy ({where})", total["reached"], "seeds",
               "all seeds", seeds, total["reached"] / seeds if seeds else None, "seeds reaching / seeds",
               "higher", 1.0, f"{total['collapsed']} collapsed; worst accuracy "
               f"{total['worst_accuracy']}; {total['rollbacks']} rollbacks"),
        Figure("demo", f"demo time, median of seeds ({where})", total["median_s"], "s", "worst seed",
               total["worst_s"], None, "", "lower", None, f"{seeds} seeds"),
        # The issue's bound is for one GPU; on CPU cores the share is reported for reading.
        Figure("demo", f"search time / demo time ({where})", share, "of the demo (median)", "-", None, share,
               "search seconds / demo seconds, median of seeds", "lower", SEARCH_SHARE_GOAL if gpu else None,
               f"{len(total['shares'])} seeds", spread(total["shares"])),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--seeds", default="0-9", help="seeds: ranges and lists, e.g. 0-9 or 0,4,7 (default 0-9)")
    parser.add_argument("--parallel", type=int, default=None,
                        help="runs at once, each on 2 cores (default: cores // 2; 1 on 2 cores)")
    parser.add_argument("--gpu", action="store_true", help="run on the GPU (one seed at a time, unpinned)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one demo may take")
    parser.add_argument("--out", default=None, help="folder of the runs and the table (default results/demo-DATE)")
    parser.add_argument("--figures", metavar="PATH", help="write the headline figures for the suite (JSON)")
    parser.add_argument("demo_args", nargs="*", help="options for mltuner demo, after --")
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    out = Path(args.out or Path(__file__).resolve().parent.parent / "results" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    slots = [None] if args.gpu else core_slots(CORES_PER_RUN, args.parallel)
    pinned = "unpinned" if slots[0] is None else f"pinned to cores {', '.join(map(str, slots))}"
    print(f"{len(seeds)} seed(s), {len(slots)} at once, {pinned}; writing to {out}/", flush=True)
    # The demo's data set, generated once here, not by every run's workers at once.
    from mltuner.cli import DEMO_ARGS
    from mltuner.datasets import load_mnist1d

    load_mnist1d(num_samples=int(DEMO_ARGS[DEMO_ARGS.index("--samples") + 1]))
    started = time.perf_counter()
    rows = run_all(seeds, out, slots, args.gpu, args.timeout, args.demo_args)
    total = summary(rows)
    text = "\n".join(table(rows, total, args, slots, time.perf_counter() - started)) + "\n"
    print(text)
    (out / "demo_seeds.md").write_text(text)
    (out / "demo_seeds.json").write_text(json.dumps({"rows": rows, "summary": total}, indent=1) + "\n")
    print(f"wrote {out}/demo_seeds.md")
    write_figures(args.figures, figures(total, args.gpu))
    return 0 if total["finished"] == total["seeds"] else 1


if __name__ == "__main__":
    sys.exit(main())
