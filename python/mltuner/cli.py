"""The `mltuner` command. It parses arguments and calls the library; the
tune, run and demo commands arrive with their features."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import mltuner


def _info(_: argparse.Namespace) -> int:
    print(f"mltuner {mltuner.__version__} (Python {platform.python_version()}, {platform.machine()})")
    built = mltuner.cuda_built()
    print(f"CUDA backend: {'built' if built else 'not built (no nvcc at install time)'}; "
          f"visible GPUs: {mltuner.cuda_device_count()}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    # Imported here so that other commands never pay for it.
    from mltuner.dist import launch

    command = list(args.command)
    if command[:1] == ["--"]:  # argparse keeps the separator in front of REMAINDER
        command = command[1:]
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
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
