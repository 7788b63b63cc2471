"""The `mltuner` command. It parses arguments and calls the library."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import mltuner
from mltuner.launch._launcher import MAX_LOCAL_WORKERS
from mltuner.apps._mnist1d_options import DEFAULT_SEED, DefaultsHelpFormatter, add_program_options

class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    from mltuner.launch import launch

    command = _after_separator(args.command)
    try:
        return launch(command, args.nproc, master_port=args.port, grace_seconds=args.grace)
    except ValueError as error:
        print(f"mltuner launch: error: {error}", file=sys.stderr)
        return 2


class _UsageError(Exception):
    """A bad option value found before any worker started: one line, exit code 2."""


# The names a job writes in its output folder.
LOG_NAME, REPORT_NAME, RESULT_NAME, WORKERS_LOG_NAME = "decisions.jsonl", "report.png", "result.json", "workers.log"


def _report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib is slow to import and only this command needs it.
    from mltuner.tune import dashboard_command, write_report

    # Beside the log, under the name the job itself gives it.
    output = args.output if args.output is not None else Path(args.log).with_name(REPORT_NAME)
    try:
        png = write_report(args.log, output)
    except (OSError, ValueError) as error:
        print(f"mltuner report: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    dashboard = dashboard_command(args.log)
    if dashboard is not None:
        print(f"studies: {dashboard}")
    return 0


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    """The output folder, checked but not made yet: a call that fails before
    its job starts leaves nothing behind."""
    directory = Path(args.out) if args.out else Path("mltuner-out") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    if directory.exists() and not directory.is_dir():
        raise _UsageError(f"--out {directory}: exists and is not a directory")
    return directory


def _watched(args: argparse.Namespace, kind: str, command: list[str], env_log: bool) -> int:
    from mltuner.tune import log_env, run_watched

    out = _out_dir(args, kind)
    log, report = out / LOG_NAME, out / REPORT_NAME
    if kind in ("tune", "demo"):
        command = [sys.executable, "-m", "mltuner.apps.mnist1d", "--log", str(log), "--result",
                   str(out / RESULT_NAME), *command]
    out.mkdir(parents=True, exist_ok=True)
    print(f"mltuner {kind}: {args.nproc} workers; writing to {out}/", flush=True)
    return run_watched(command, args.nproc, log=log, workers_log=out / WORKERS_LOG_NAME, report=report,
                       terminal=False if args.plain else None, env=log_env(log) if env_log else None)


def _program_args(args: argparse.Namespace, tokens: Sequence[str]) -> list[str]:
    """The program's options among ``tokens`` (those after the command name),
    after checking them all together as every worker will."""
    from mltuner.apps.mnist1d import check_args  # imports the tuner: only for these commands
    from mltuner.exceptions import InvalidArgumentError

    try:
        check_args(args, world_size=args.nproc)
    except InvalidArgumentError as error:
        raise _UsageError(str(error)) from None
    watch = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_watch_options(watch)
    _, program = watch.parse_known_args(tokens)  # the full parse already accepted every token
    return program


def _tune(args: argparse.Namespace) -> int:
    return _watched(args, "tune", _program_args(args, args.tokens), env_log=False)


# The main job: the MNIST-1D CNN with every tunable of the paper searched.
# 20,000 generated samples (the authors' generator, 4x their default set) give
# epochs long enough for one-epoch trials and a validation set of 1,600. The
# full learning-rate range is searched: a setting that kills the CNN's ReLUs
# a few epochs after a fast start is caught by the tuner's rollback guard.
# Per-worker batches of 32-128: a clock of this small CNN costs about the
# same at any batch size (its time is per-step overhead, on a CPU and on a
# GPU alike), so smaller batches win the short trials on progress per second
# and then take 4-8x longer per epoch. Each search gets 10% of the job's
# budget, raised by the floor (what the trial-time rule needs from an
# untrained CNN) up to 20% for the searches together. 50 epochs leave room
# for a large batch's fewer steps and for a rollback; the job stops earlier
# when validation accuracy converges.
DEMO_ARGS = ["--model", "cnn", "--samples", "20000", "--search", "lr,momentum,batch_size,staleness",
             "--batch-sizes", "32,64,128", "--max-epochs", "50", "--retune-every", "10"]


def _demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401 - the CNN needs it
    except ImportError:
        raise _UsageError("the demo trains a PyTorch CNN; install PyTorch first: "
                          "python3 -m pip install \"mltuner[torch]\" torch==2.13.0") from None
    return _watched(args, "demo", DEMO_ARGS + _program_args(args, args.tokens), env_log=False)


def _run(args: argparse.Namespace) -> int:
    command = _after_separator(args.command)
    if not command:
        raise _UsageError("give the training command after --")
    if shutil.which(command[0]) is None:
        raise _UsageError(f"{command[0]}: command not found (or not executable)")
    return _watched(args, "run", command, env_log=True)


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


def _workers(text: str) -> int:
    """An argparse type: a number of workers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of workers (an integer >= 1), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of workers (an integer >= 1), got {text!r}")
    if value > MAX_LOCAL_WORKERS:
        raise argparse.ArgumentTypeError(f"at most {MAX_LOCAL_WORKERS} workers run on one machine, got {value}")
    return value


def _add_watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=_workers, default=2, metavar="N", help="number of local workers")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="directory for the decision log, report and output (default: mltuner-out/KIND-TIME)")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of a live table")


def _add_tune_parser(commands: argparse._SubParsersAction[_Parser],
                     name: str, *, summary: str, description: str) -> argparse.ArgumentParser:
    """tune or demo: the launcher's options and the program's, every one
    with its default in --help and checked before a worker starts."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=description, formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    _add_watch_options(parser)
    add_program_options(parser.add_argument_group(
        "program options", "passed to python -m mltuner.apps.mnist1d on every worker"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mltuner` console script."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="mltuner", description=mltuner.__doc__)
    parser.add_argument("--version", action="version", version=f"mltuner {mltuner.__version__}")
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    info = commands.add_parser("info", help="version, build and the devices this installation can use")
    info.set_defaults(handler=_info)
    launch = commands.add_parser(
        "launch", help="run N workers of a training command on this machine",
        usage="mltuner launch -n N [--port P] [--grace S] -- COMMAND [ARGS...]",
        description="Runs N copies of COMMAND, each with MLTUNER_RANK and the other variables "
                    "mltuner.launch.detect_environment reads, and prints their output prefixed "
                    "with [rank k]. When a worker fails, the others get --grace seconds to exit, "
                    "then SIGTERM, then SIGKILL; the exit code is the failed worker's.")
    launch.add_argument("-n", "--nproc", type=_workers, required=True, help="number of workers")
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
                        help=f"the PNG to write (default: {REPORT_NAME} beside LOG, as the job names it)")
    report.set_defaults(handler=_report)
    tune = _add_tune_parser(
        commands, "tune", summary="tune and train the MNIST-1D MLP on local workers, with live progress",
        description="Runs python -m mltuner.apps.mnist1d on N local workers (mltuner launch) with the "
                    "tuner choosing learning rate, momentum and batch size; shows its decisions live, and "
                    f"writes the decision log ({LOG_NAME}), a PNG report ({REPORT_NAME}) and the result "
                    f"({RESULT_NAME}) to DIR. Every option is checked before a worker starts. --seed "
                    f"(default {DEFAULT_SEED}) makes the run's proposals reproducible: two runs with one seed "
                    "propose the same first trials in the same order; which trials win depends on measured "
                    "times, so later decisions may differ. Ctrl-C stops the job and draws the report of "
                    "what ran.")
    tune.set_defaults(handler=_tune)
    demo = _add_tune_parser(
        commands, "demo", summary="the main job: tune and train the MNIST-1D CNN on 2 local workers",
        description="mltuner tune with the MNIST-1D CNN (PyTorch, through mltuner.torch; on the GPU when "
                    "there is one) and the tuner choosing learning rate, momentum, batch size and "
                    f"staleness: {' '.join(DEMO_ARGS)} (the defaults below). Ends with the test accuracy and "
                    "where the decision log and the report are.")
    demo.set_defaults(handler=_demo, **_demo_defaults())
    run = commands.add_parser(
        "run", help="run your training script (using mltuner.tune.TuningSession) with live progress",
        usage="mltuner run [-n N] [--out DIR] [--plain] -- COMMAND [ARGS...]", formatter_class=DefaultsHelpFormatter,
        description="Like mltuner launch, and the TuningSession of rank 0 logs to DIR/decisions.jsonl "
                    "(MLTUNER_TUNING_LOG), which is shown live and drawn as DIR/report.png at the end; "
                    "the workers' output goes to DIR/workers.log.")
    _add_watch_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after `--`")
    run.set_defaults(handler=_run)
    bench = commands.add_parser(
        "bench", help="run the benchmark suite of a source checkout (summary table, CSV, PNGs)",
        usage="mltuner bench [--source DIR] [--quick] [--gpu] [--long] [--only NAMES] [--skip NAMES] [--out DIR] "
              "[--list]",
        description="Runs benchmarks/run.py of the source checkout: every benchmark, each figure a ratio to a "
                    "baseline measured in the same run (numpy copies, raw pyzmq, plain PyTorch, PyTorch DDP, "
                    "the GPU's copy bandwidth), one summary table, CSV and PNGs in a results directory. "
                    "--quick takes about 5 minutes on 2 cores; --gpu adds the GPU benchmarks; --long the demo over "
                    "10 seeds and the tuning benchmark on a job of minutes, for a host with many cores. "
                    "See python benchmarks/run.py --help.")
    bench.add_argument("--source", default=None, help="the source checkout (default: the current directory "
                       "or a parent holding benchmarks/run.py)")
    bench.set_defaults(handler=_bench)
    args, extra = parser.parse_known_args(tokens)
    if args.handler is _bench:
        args.suite_args = extra
    elif extra:
        commands.choices[args.subcommand].error(f"unrecognized arguments: {' '.join(extra)}")
    # The options after the command's name (global options before it exit early).
    args.tokens = tokens[tokens.index(args.subcommand) + 1:]
    try:
        return int(args.handler(args))
    except _UsageError as error:
        print(f"mltuner {args.subcommand}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the job (which handles its own)
        print(f"mltuner {args.subcommand}: interrupted", file=sys.stderr)
        return 130


def _demo_defaults() -> dict[str, object]:
    """The program's options as DEMO_ARGS sets them, for demo's --help."""
    program = argparse.ArgumentParser(add_help=False)
    add_program_options(program)
    return vars(program.parse_args(DEMO_ARGS))


if __name__ == "__main__":
    sys.exit(main())
