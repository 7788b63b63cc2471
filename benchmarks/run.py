"""mltuner's benchmark suite: every benchmark in one command, each figure a
ratio to a baseline measured side by side in the same run, one summary
table, CSV and plots, with the machine and the versions recorded.

    mltuner bench [--quick] [--gpu] [--long] [--only NAMES] [--skip NAMES] [--out DIR]
    python benchmarks/run.py ...        (the same, from a source checkout)

The benchmarks, in the order they run (each is also a script of its own in
benchmarks/, with more options and tables):

  engine      gather / scatter-add and the engine's read and update paths vs
              numpy copy and add; a 20-layer model cycle vs numpy
  transport   per-clock updates and fresh rows between processes vs raw pyzmq
  torch       the PyTorch adapter vs plain PyTorch, 1 worker; budget 1/4
  throughput  mltuner on N workers vs DDP (gloo on CPU, NCCL on GPU) and
              1 worker vs plain PyTorch; with --gpu also throughput-transformer,
              a BERT-base-sized encoder with Adam
  stragglers  time to accuracy with one slowed worker, slack 0..7, equal, balanced or stolen batches, vs DDP
  claims      what batch stealing's claims cost with no straggler: a board file
              on one host, requests to rank 0 across hosts, vs no stealing
  tuning      MLtuner vs the best fixed setting, Optuna TPE and Hyperband,
              time to accuracy over seeds (median and spread)
  gpu-path    (--gpu) torchvision ResNet-18 (batch 128/256/512, slack 0/1) and
              12 TransformerEncoderLayers through one worker vs plain PyTorch
  gpu-path-amp (--gpu) the same at slack 0 under bf16 and fp16 (GradScaler) autocast
  gpu-copy    (--gpu) the CUDA backend's gather, scatter-add and swaps vs the
              GPU's measured device and pinned host<->device copy bandwidth
  demo-gpu    (--gpu) `mltuner demo` on the GPU: its time and the searches'
              share of it (goal <= 20%)
  demo        (--long) `mltuner demo` over 10 seeds, each on 2 CPU cores:
              how many reach 94% test accuracy, median and worst time
  tuning-large (--long) the tuning benchmark on a job whose best fixed run
              takes minutes (the MNIST-1D CNN on 350,000 samples), 3 seeds

--long adds the benchmarks that run for tens of minutes on 2 cores; on a
host with many cores they run their jobs side by side, each pinned to 2
cores (taskset), in about 10 (demo) and 30 (tuning-large) minutes on 16.
--quick sizes everything to finish in about 5 minutes on 2 CPU cores.
--gpu runs torch and throughput on the GPU (ResNet-18) and adds gpu-copy;
the CPU-only benchmarks then run at their --quick size, so that the whole
GPU run fits in about 12 minutes on one machine. Each benchmark runs in its own
process with a time limit; one that fails or runs over is reported as
failed (its log is kept) and the others go on. Writes to DIR (default
results/bench-DATE): summary.md, summary.csv, figures.json, machine.json,
one PNG per benchmark, and each benchmark's own log and tables.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional

from figures import Figure, read_figures
from machine import cpu_name, git_commit, gpu_names, memory_bytes

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


@dataclasses.dataclass
class Step:
    """One benchmark of the suite: its script and arguments for this run."""

    name: str
    script: str
    args: list[str]  # "{dir}" stands for the results directory
    timeout_s: float
    needs_torch: bool = False
    hide_gpus: bool = False  # a CPU comparison: keep CUDA out of both sides


@dataclasses.dataclass
class Outcome:
    step: Step
    status: str  # "ok", "failed", "timed out", "skipped: why"
    seconds: float
    figures: list[Figure]


def plan(quick: bool, gpu: bool, long: bool = False) -> list[Step]:
    """The steps of this run, sized by --quick and --gpu (see the docstring)."""
    cpu_quick = quick or gpu
    steps = [
        Step("engine", "engine_bench.py",
             ["--csv", "{dir}/engine.csv"] + (["--quick", "--no-device-bench", "--sizes", "1,16", "--widths",
                                               "128,1024"] if cpu_quick else ["--sizes", "1,16,64"]),
             300 if cpu_quick else 900),
        Step("transport", "transport_bench.py",
             ["--out", "{dir}/transport.md"] + (["--quick", "--sizes", "10"] if cpu_quick
                                                else ["--sizes", "10,100", "--procs", "2,4"]),
             300 if cpu_quick else 1200),
    ]
    if gpu:
        steps += [
            Step("torch", "torch_bench.py", ["--out", "{dir}/torch.md", "--device", "cuda", "--batch", "512",
                                             "--steps", "20"], 400, True),
            Step("torch-b128", "torch_bench.py", ["--out", "{dir}/torch-b128.md", "--device", "cuda", "--batch",
                                                  "128", "--steps", "30"], 400, True),
            Step("throughput", "throughput_bench.py", ["--out", "{dir}/throughput.md", "--device", "cuda"]
                 + (["--quick"] if quick else []), 600, True),
            Step("throughput-transformer", "throughput_bench.py",
                 ["--out", "{dir}/throughput-transformer.md", "--device", "cuda", "--model", "transformer", "--rule",
                  "adam"] + (["--quick"] if quick else []), 600, True),
            Step("gpu-path", "gpu_path_bench.py", ["--out", "{dir}/gpu-path.md", "--steps", "20" if quick else "50"],
                 600, True),
            Step("gpu-path-amp", "gpu_path_bench.py",
                 ["--out", "{dir}/gpu-path-amp.md", "--precision", "bf16,fp16", "--match", "s0", "--steps",
                  "20" if quick else "40", "--rounds", "1" if quick else "2"], 600, True),
        ]
    else:
        steps += [
            Step("torch", "torch_bench.py", ["--out", "{dir}/torch.md", "--device", "cpu", "--width", "16",
                                             "--batch", "32", "--steps", "10" if quick else "30", "--warmup", "3"],
                 300, True, True),
            Step("throughput", "throughput_bench.py", ["--out", "{dir}/throughput.md", "--device", "cpu"]
                 + (["--quick"] if quick else []), 300 if quick else 900, True, True),
        ]
    steps += [
        Step("stragglers", "straggler_bench.py", ["--out", "{dir}/stragglers.md"]
             + (["--quick", "--target", "0.6"] if cpu_quick else []), 400 if cpu_quick else 1800, True, True),
        Step("claims", "claim_bench.py", ["--out", "{dir}/claims.md", "--workers", "2", "--rounds",
                                          "1" if cpu_quick else "3"],
             120 if cpu_quick else 300, hide_gpus=True),
        Step("tuning", "tuner_bench.py", ["--out", "{dir}/tuning.md"]
             + (["--seeds", "0", "--lrs", "0.3,1.0", "--batches", "32", "--trials", "6"] if cpu_quick
                else ["--seeds", "0,1,2"]), 400 if cpu_quick else 2400, hide_gpus=True),
    ]
    if gpu:
        steps.append(Step("gpu-copy", "gpu_copy_bench.py", ["--out", "{dir}/gpu-copy.txt", "--sizes",
                                                            "64" if quick else "64,256"], 600))
        steps.append(Step("demo-gpu", "demo_seeds.py", ["--gpu", "--seeds", "0", "--out", "{dir}/demo-gpu"], 900,
                          True))
    if long:
        steps += [
            Step("demo", "demo_seeds.py", ["--seeds", "0-9", "--out", "{dir}/demo"], 3600, True, True),
            Step("tuning-large", "tuner_bench.py", ["--size", "large", "--seeds", "0,1,2",
                                                    "--out", "{dir}/tuning-large.md"], 7200, True, True),
        ]
    return steps


def has_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def run_step(step: Step, out: Path) -> Outcome:
    """Runs one benchmark in its own process group, bounded by its time
    limit; its output goes to out/NAME.log and its figures to out/NAME.json."""
    if step.needs_torch and not has_module("torch"):
        return Outcome(step, "skipped: needs PyTorch (pip install \"mltuner[torch]\")", 0.0, [])
    figures_path, log_path = out / f"{step.name}.json", out / f"{step.name}.log"
    command = [sys.executable, str(BENCH / step.script), *(a.replace("{dir}", str(out)) for a in step.args),
               "--figures", str(figures_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if step.hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"\n== {step.name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    # A new session, so that a timeout stops the benchmark's own workers too.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    assert proc.stdout is not None
    lines: queue.Queue[Optional[str]] = queue.Queue()
    # A reader thread keeps the deadline honest while the benchmark is silent.
    reader = threading.Thread(target=pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    finished = False
    try:
        with open(log_path, "w") as log:
            finished = relay(lines, log, start + step.timeout_s)
    finally:
        if not finished:  # over its limit, or the suite itself is stopped (Ctrl-C, SIGTERM)
            stop(proc)
    reader.join(timeout=10)
    proc.stdout.close()
    try:
        proc.wait(timeout=30)  # it closed its output; it should be ending
    except subprocess.TimeoutExpired:
        stop(proc)
    seconds = time.perf_counter() - start
    if not finished:
        return Outcome(step, f"timed out after {step.timeout_s:.0f} s", seconds, [])
    if proc.returncode != 0 or not figures_path.exists():
        return Outcome(step, f"failed (exit {proc.returncode}; see {log_path.name})", seconds, [])
    return Outcome(step, "ok", seconds, read_figures(figures_path))


def pump(stream: IO[str], lines: queue.Queue[Optional[str]]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def relay(lines: queue.Queue[Optional[str]], log: IO[str], deadline: float) -> bool:
    """Copies the benchmark's lines to its log and to stdout until it closes
    its output (True) or the deadline passes (False)."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return False
        try:
            line = lines.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if line is None:
            return True
        log.write(line)
        log.flush()
        print(f"  {line}", end="", flush=True)


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the benchmark's process group, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# -- the record of the machine ---------------------------------------------------------
def machine(args: argparse.Namespace) -> dict[str, object]:
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": ("quick" if args.quick else "full") + (" + gpu" if args.gpu else "") + (" + long" if args.long else ""),
        "cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(memory_bytes() / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    for module in ("mltuner", "numpy", "zmq", "optuna", "torch"):
        try:
            info[module] = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            info[module] = "not installed"
    if info["zmq"] != "not installed":
        import zmq

        info["libzmq"] = zmq.zmq_version()
    import mltuner

    info["mltuner_cuda_built"] = mltuner.cuda_built()
    info["gpus"] = gpu_names()
    if info["torch"] != "not installed":
        import torch

        info["torch_cuda"] = torch.version.cuda or "none"
    return info


# -- the summary ----------------------------------------------------------------------
def cell(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def goal_text(figure: Figure) -> str:
    if figure.goal is None:
        return ""
    return f"{'>=' if figure.better == 'higher' else '<='} {figure.goal:g}"


def met_text(figure: Figure) -> str:
    return {True: "yes", False: "NO", None: ""}[figure.met]


def ratio_text(figure: Figure) -> str:
    text = cell(figure.ratio)
    if figure.ratio_range:
        text += f" ({cell(figure.ratio_range[0])}-{cell(figure.ratio_range[1])})"
    return text


def summary_rows(outcomes: list[Outcome]) -> list[list[str]]:
    rows = []
    for o in outcomes:
        if o.status != "ok":
            rows.append([o.step.name, o.status, "", "", "", "", "", ""])
        for f in o.figures:
            rows.append([o.step.name, f.name, f"{cell(f.value)} {f.unit}", f"{cell(f.baseline_value)} ({f.baseline})",
                         ratio_text(f), f.ratio_means, goal_text(f), met_text(f)])
    return rows


HEADER = ["benchmark", "figure", "mltuner", "baseline", "ratio", "ratio is", "goal", "met"]


def print_table(rows: list[list[str]]) -> None:
    widths = [min(60, max(len(r[i]) for r in [HEADER, *rows])) for i in range(len(HEADER))]
    for r in [HEADER, ["-" * w for w in widths], *rows]:
        print("  ".join(text[:w].ljust(w) for text, w in zip(r, widths)).rstrip())


def write_csv(path: Path, outcomes: list[Outcome]) -> None:
    columns = ["benchmark", "figure", "value", "unit", "baseline", "baseline_value", "ratio", "ratio_min",
               "ratio_max", "ratio_means", "better", "goal", "met", "note"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for o in outcomes:
            if o.status != "ok":
                writer.writerow([o.step.name, o.status] + [""] * (len(columns) - 2))
            for fig in o.figures:
                low, high = fig.ratio_range or (None, None)
                writer.writerow([o.step.name, fig.name, fig.value, fig.unit, fig.baseline, fig.baseline_value,
                                 fig.ratio, low, high, fig.ratio_means, fig.better, fig.goal, met_text(fig), fig.note])


def write_markdown(path: Path, info: dict[str, object], outcomes: list[Outcome], rows: list[list[str]]) -> None:
    lines = ["# mltuner benchmark suite", "", "```"]
    lines += [f"{key}: {value}" for key, value in info.items()]
    lines += ["```", "", "| step | status | seconds |", "|:--|:--|--:|"]
    lines += [f"| {o.step.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + ":--|" * 2 + "--:|" * 3 + ":--|:-:|:-:|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    notes = [(o.step.name, f) for o in outcomes for f in o.figures if f.note]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {name}, {f.name}: {f.note}" for name, f in notes]
    path.write_text("\n".join(lines) + "\n")


def advantage(figure: Figure, value: float) -> float:
    """A ratio turned so that above 1 means mltuner did better than its
    baseline, whichever way the figure's own ratio runs."""
    return value if figure.better == "higher" else 1.0 / value


def plot(path: Path, name: str, figures: list[Figure]) -> None:
    """One horizontal bar per figure, on a log scale: how much better (> 1)
    or worse (< 1) mltuner did than its baseline, with the goal as a tick
    and the range over seeds or sizes as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as Canvas

    shown = [f for f in figures if f.ratio is not None and f.ratio > 0]
    if not shown:
        return
    canvas = Canvas(figsize=(10, 1.0 + 0.36 * len(shown)), layout="constrained")
    FigureCanvasAgg(canvas)
    axes = canvas.add_subplot()
    positions = list(range(len(shown)))[::-1]
    colors = ["tab:gray" if f.met is None else "tab:green" if f.met else "tab:red" for f in shown]
    values = [advantage(f, f.ratio) for f in shown]  # type: ignore[arg-type]
    axes.barh(positions, [v - 1.0 for v in values], left=1.0, color=colors)  # from 1.0: left worse, right better
    for y, f in zip(positions, shown):
        if f.ratio_range:  # the spread over seeds or table sizes
            low, high = sorted(advantage(f, r) for r in f.ratio_range)
            axes.plot([low, high], [y, y], color="black", linewidth=1)
            values += [low, high]
    for y, f in zip(positions, shown):
        if f.goal is not None:
            goal = advantage(f, f.goal)
            axes.plot([goal, goal], [y - 0.4, y + 0.4], color="black", linewidth=2)
    axes.set_xscale("log")
    ends = values + [advantage(f, f.goal) for f in shown if f.goal is not None] + [1.0]
    axes.set_xlim(min(ends) / 1.5, max(ends) * 1.5)
    axes.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    axes.set_yticks(positions, [f.name[:80] for f in shown], fontsize=7)
    axes.set_xlabel("mltuner vs its baseline in the same run: > 1 better, < 1 worse "
                    "(log scale; black tick: goal; line: min-max)")
    axes.set_title(f"{name}: green = goal met, red = goal missed, grey = no goal", fontsize=9)
    canvas.savefig(path, format="png", dpi=110)


def write_results(out: Path, info: dict[str, object], outcomes: list[Outcome]) -> None:
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    write_csv(out / "summary.csv", outcomes)
    write_markdown(out / "summary.md", info, outcomes, summary_rows(outcomes))
    (out / "figures.json").write_text(json.dumps([f.to_json() for o in outcomes for f in o.figures], indent=1))
    plot(out / f"{outcomes[-1].step.name}.png", outcomes[-1].step.name, outcomes[-1].figures)


def parse_names(text: Optional[str], known: set[str]) -> set[str]:
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    unknown = names - known
    if unknown:
        raise SystemExit(f"mltuner bench: error: unknown benchmark(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}")
    return names


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mltuner bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about 5 minutes on 2 CPU cores")
    parser.add_argument("--gpu", action="store_true", help="the GPU benchmarks too (needs a CUDA GPU)")
    parser.add_argument("--long", action="store_true",
                        help="the long benchmarks too (demo over 10 seeds, tuning at the large size): for a "
                             "host with many cores")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated benchmarks to run")
    parser.add_argument("--skip", metavar="NAMES", help="comma-separated benchmarks to leave out")
    parser.add_argument("--out", metavar="DIR", help="results directory (default results/bench-DATE)")
    parser.add_argument("--list", action="store_true", help="print the steps of this run and exit")
    args = parser.parse_args(argv)
    known = {s.name for s in plan(args.quick, True, True)} | {s.name for s in plan(args.quick, False, True)}
    only, skip = parse_names(args.only, known), parse_names(args.skip, known)
    # A long benchmark named in --only runs without --long.
    long = args.long or bool(only & ({s.name for s in plan(args.quick, False, True)}
                                     - {s.name for s in plan(args.quick, False)}))
    steps = plan(args.quick, args.gpu, long)
    steps = [s for s in steps if (not only or s.name in only) and s.name not in skip]
    if args.list:
        for s in steps:
            print(f"{s.name:<12} {s.script} {' '.join(s.args)}  (limit {s.timeout_s:.0f} s)")
        return 0
    if args.gpu and not gpu_names():
        print("mltuner bench: error: --gpu needs an NVIDIA GPU (nvidia-smi found none)", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so that the running benchmark's group is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out or REPO / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    info = machine(args)
    print("\n".join(f"{key}: {value}" for key, value in info.items()), flush=True)
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    for step in steps:
        outcomes.append(run_step(step, out))
        info["total_seconds"] = round(time.perf_counter() - start)
        write_results(out, info, outcomes)  # after each step: a run cut short keeps what it measured
    print(f"\n== Summary ({info['total_seconds']} s; every ratio against a baseline run side by side) ==")
    print_table(summary_rows(outcomes))
    print(f"\nwrote {out}/ (summary.md, summary.csv, figures.json, machine.json, PNGs, logs)")
    failed = [o.step.name for o in outcomes if o.status not in ("ok",) and not o.status.startswith("skipped")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
