"""The `mltuner` command. It parses arguments and calls the library."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mltuner


def _info(_: argparse.Namespace) -> int:
    print(f"mltuner {mltuner.__version__} (Python {platform.python_version()}, {platform.machine()})")
    built = mltuner.cuda_built()
    print(f"CUDA backend: {'built' if built else 'not built (no nvcc at install time)'}; "
          f"visible GPUs: {mltuner.cuda_device_count()}")
    return 0


def _after_separator(command: Sequence[str]) -> list[str]:
    # argparse keeps the `--` separator in front of a REMAINDER argument.
    return list(command[1:] if command[:1] == ["--"] else command)


def _launch(args: argparse.Namespace) -> int:
    # Imported here so that other commands never pay for it.
    from mltuner.dist import launch

    command = _after_separator(args.command)
    try:
        return launch(command, args.nproc, master_port=args.port, grace_seconds=args.grace)
    except ValueError as error:
        print(f"mltuner launch: error: {error}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib is slow to import and only this command needs it.
    from mltuner.tune._report import write_report

    try:
        png = write_report(args.log, args.output)
    except (OSError, ValueError) as error:
        print(f"mltuner report: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    return 0


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    directory = Path(args.out) if args.out else Path("mltuner-out") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _watched(args: argparse.Namespace, kind: str, command: list[str], env_log: bool) -> int:
    from mltuner.tune._watch import log_env, run_watched

    out = _out_dir(args, kind)
    log = out / "decisions.jsonl"
    command = _after_separator(command)
    if kind in ("tune", "demo"):
        command = [sys.executable, "-m", "mltuner.apps.mnist1d", "--log", str(log), "--result",
                   str(out / "result.json"), *command]
    elif not command:
        print("mltuner run: error: give the training command after --", file=sys.stderr)
        return 2
    print(f"mltuner {kind}: {args.nproc} workers; writing to {out}/", flush=True)
    return run_watched(command, args.nproc, log=log, workers_log=out / "workers.log", report=out / "report.png",
                       terminal=False if args.plain else None, env=log_env(log) if env_log else None)


def _tune(args: argparse.Namespace) -> int:
    return _watched(args, "tune", list(args.app_args), env_log=False)


# The main job: the MNIST-1D CNN with every tunable of the paper searched.
# 20,000 generated samples (the authors' generator, 4x their default set) give
# epochs long enough for one-epoch trials and a validation set of 1,600. Above
# lr 0.3 the CNN can lose all its ReLUs a few epochs after a fast start, which
# a trial of under one epoch cannot see (it happened once at lr 0.78).
DEMO_ARGS = ["--model", "cnn", "--samples", "20000", "--search", "lr,momentum,batch_size,staleness",
             "--lr-min", "1e-3", "--lr-max", "0.3", "--max-epochs", "60"]


def _demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401 - the CNN needs it
    except ImportError:
        print("mltuner demo: error: the demo trains a PyTorch CNN; install PyTorch first: "
              "python3 -m pip install \"mltuner[torch]\" torch==2.13.0", file=sys.stderr)
        return 2
    return _watched(args, "demo", DEMO_ARGS + list(args.app_args), env_log=False)


def _run(args: argparse.Namespace) -> int:
    return _watched(args, "run", list(args.command), env_log=True)


def _find_suite(source: str | None) -> Path | None:
    """benchmarks/run.py of the source checkout: under --source, else under
    the current directory or one of its parents."""
    roots = [Path(source)] if source else [Path.cwd(), *Path.cwd().parents]
    for root in roots:
        suite = root / "benchmarks" / "run.py"
        if suite.is_file():
            return suite
    return None


def _bench(args: argparse.Namespace) -> int:
    suite = _find_suite(args.source)
    if suite is None:
        where = args.source or "the current directory or its parents"
        print(f"mltuner bench: error: no benchmarks/run.py in {where}. The benchmarks live in the source "
              "checkout (they build C++ benchmarks and compare with PyTorch DDP); run this command from it, "
              "or pass --source DIR.", file=sys.stderr)
        return 2
    # Its own process: the suite imports its sibling scripts by path.
    return subprocess.call([sys.executable, str(suite), *_after_separator(args.suite_args)],
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _add_watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of local workers (default: 2)")
    parser.add_argument("--out", default=None,
                        help="directory for the decision log, report and output (default: mltuner-out/KIND-TIME)")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of a live table")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mltuner` console script."""
    parser = argparse.ArgumentParser(prog="mltuner", description=mltuner.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="version, build and the devices this installation can use")
    info.set_defaults(handler=_info)
    launch = commands.add_parser(
        "launch", help="run N workers of a training command on this machine",
        usage="mltuner launch -n N [--port P] [--grace S] -- COMMAND [ARGS...]",
        description="Runs N copies of COMMAND, each with MLTUNER_RANK and the other variables "
                    "mltuner.dist.detect_environment reads, and prints their output prefixed "
                    "with [rank k]. When a worker fails, the others get --grace seconds to exit, "
                    "then SIGTERM, then SIGKILL; the exit code is the failed worker's.")
    launch.add_argument("-n", "--nproc", type=int, required=True, help="number of workers")
    launch.add_argument("--port", type=int, default=0,
                        help="rank 0's port (default: a free port)")
    launch.add_argument("--grace", type=float, default=15.0,
                        help="seconds the other workers get to exit after one fails (default: 15)")
    launch.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command to run, after `--`")
    launch.set_defaults(handler=_launch)
    report = commands.add_parser(
        "report", help="draw a tuning run's decision log as a PNG",
        description="Draws the last run in a tuner's decision log (JSON lines): training loss "
                    "and validation accuracy over wall time, with each search shaded and the "
                    "setting it chose.")
    report.add_argument("log", help="the decision log (decisions.jsonl)")
    report.add_argument("-o", "--output", default=None, metavar="PNG",
                        help="the PNG to write (default: LOG with a .png suffix)")
    report.set_defaults(handler=_report)
    tune = commands.add_parser(
        "tune", help="tune and train the MNIST-1D MLP on local workers, with live progress",
        usage="mltuner tune [-n N] [--out DIR] [--plain] [PROGRAM OPTIONS...]",
        description="Runs python -m mltuner.apps.mnist1d on N local workers (mltuner launch) with the "
                    "tuner choosing learning rate, momentum and batch size; shows its decisions live, and "
                    "writes the decision log, a PNG report and the result to DIR. Options it does not know "
                    "go to the program (see python -m mltuner.apps.mnist1d --help): for example "
                    "--mode hyperband, --search lr,staleness, --max-epochs 10, --target-accuracy 0.6.")
    _add_watch_options(tune)
    tune.set_defaults(handler=_tune)
    demo = commands.add_parser(
        "demo", help="the main job: tune and train the MNIST-1D CNN on 2 local workers",
        usage="mltuner demo [-n N] [--out DIR] [--plain] [PROGRAM OPTIONS...]",
        description="mltuner tune with the MNIST-1D CNN (PyTorch, through mltuner.torch; on the GPU when "
                    "there is one) and the tuner choosing learning rate, momentum, batch size and "
                    f"staleness: {' '.join(DEMO_ARGS)}. Ends with the test accuracy and where the decision "
                    "log and the report are.")
    _add_watch_options(demo)
    demo.set_defaults(handler=_demo)
    run = commands.add_parser(
        "run", help="run your training script (using mltuner.tune.TuningSession) with live progress",
        usage="mltuner run [-n N] [--out DIR] [--plain] -- COMMAND [ARGS...]",
        description="Like mltuner launch, and the TuningSession of rank 0 logs to DIR/decisions.jsonl "
                    "(MLTUNER_TUNING_LOG), which is shown live and drawn as DIR/report.png at the end; "
                    "the workers' output goes to DIR/workers.log.")
    _add_watch_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after `--`")
    run.set_defaults(handler=_run)
    bench = commands.add_parser(
        "bench", help="run the benchmark suite of a source checkout (summary table, CSV, PNGs)",
        usage="mltuner bench [--source DIR] [--quick] [--gpu] [--only NAMES] [--skip NAMES] [--out DIR] [--list]",
        description="Runs benchmarks/run.py of the source checkout: every benchmark, each figure a ratio to a "
                    "baseline measured in the same run (numpy copies, raw pyzmq, plain PyTorch, PyTorch DDP, "
                    "the GPU's copy bandwidth), one summary table, CSV and PNGs in a results directory. "
                    "--quick takes about 5 minutes on 2 cores; --gpu adds the GPU benchmarks. "
                    "See python benchmarks/run.py --help.")
    bench.add_argument("--source", default=None, help="the source checkout (default: the current directory "
                       "or a parent holding benchmarks/run.py)")
    bench.set_defaults(handler=_bench)
    args, extra = parser.parse_known_args(argv)
    if args.handler in (_tune, _demo):
        args.app_args = extra
    elif args.handler is _bench:
        args.suite_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
