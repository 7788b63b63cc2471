"""Runs one job of local workers under `mltuner launch` for a benchmark and
returns the JSON result its rank 0 wrote (tuner_bench.py, straggler_bench.py,
throughput_bench.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from cores import pinned

WORKERS = 2
# How long the launcher may take to stop its workers after SIGTERM
# (mltuner.launch's KILL_AFTER_SECONDS plus the reaping) before it is killed.
STOP_SECONDS = 15.0


def run_job(command: list[str], result: Path, workers: int = WORKERS,
            timeout_s: Optional[float] = None, cores: Optional[list[int]] = None,
            env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Runs ``command`` on ``workers`` local workers and returns what rank 0
    wrote to ``result``. Raises RuntimeError (the job failed or wrote
    nothing) or TimeoutError (it ran past ``timeout_s``), each with the tail
    of the workers' output. ``cores``: pin the launcher and its workers to
    these cores (``taskset``). ``env``: variables set for the launcher and
    its workers, beside this process's.

    The launcher runs as a child process so that a timeout can stop it: on
    SIGTERM it stops and reaps its workers (which sit in their own process
    groups, out of reach of a signal to the launcher's). It shares this
    process's group, so Ctrl-C reaches it too."""
    result.unlink(missing_ok=True)  # callers reuse the path: never read an earlier job's result
    launcher = pinned([sys.executable, "-m", "mltuner.cli", "launch", "-n", str(workers), "--grace", "10", "--",
                       *command], cores)
    process = subprocess.Popen(launcher, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace",
                               env={**os.environ, **env} if env else None)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        raise TimeoutError(f"timed out after {timeout_s:g} s\n{tail(output)}") from None
    finally:
        if process.poll() is None:  # interrupted: give the launcher its time to stop the workers
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    if process.returncode != 0 or not result.exists():
        raise RuntimeError(f"{' '.join(command)} failed (exit code {process.returncode}):\n{tail(output)}")
    return dict(json.loads(result.read_text()))


def tail(output: str, lines: int = 30) -> str:
    return "\n".join(output.rstrip().splitlines()[-lines:])
