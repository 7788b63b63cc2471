"""The `mltuner` command. It parses arguments and calls the library; the
launch, tune, run, report and demo commands arrive with their features."""

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mltuner` console script."""
    parser = argparse.ArgumentParser(prog="mltuner", description=mltuner.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="version, build and the devices this installation can use")
    info.set_defaults(handler=_info)
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
