"""Helpers of the distributed tests: start real worker processes on
127.0.0.1, bounded in time, and never leave one behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mltuner.launch._env import free_port

WORKER = Path(__file__).with_name("train_worker.py")
# The tests import the worker program's model and data (pytest runs with
# --import-mode=importlib, which does not put test folders on sys.path).
sys.path.insert(0, str(WORKER.parent))


class Workers:
    """N worker processes of one job, started with the MLTUNER_* variables."""

    def __init__(self, n: int, args: list[str], out: Path, program: Path = WORKER,
                 extra_env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.out = out
        self.procs = []
        for rank in range(n):
            env = dict(os.environ, **(extra_env or {}))
            env.update(MLTUNER_RANK=str(rank), MLTUNER_WORLD_SIZE=str(n), MLTUNER_LOCAL_RANK=str(rank),
                       MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port),
                       MLTUNER_SECRET="test-secret", PYTHONUNBUFFERED="1")
            self.procs.append(subprocess.Popen([sys.executable, str(program), "--out", str(out), *args], env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def wait(self, timeout_s: float = 90.0) -> list[tuple[int, str]]:
        """(exit code, output) of every rank; kills them all on a timeout."""
        results = []
        try:
            for proc in self.procs:
                output, _ = proc.communicate(timeout=timeout_s)
                results.append((proc.returncode, output))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return results

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()

    def result(self, rank: int, name: str = "") -> dict[str, np.ndarray]:
        """What rank wrote at the end (or, with name="saved", at its checkpoint)."""
        suffix = f"-{name}" if name else ""
        with np.load(self.out / f"rank-{rank}{suffix}.npz", allow_pickle=False) as data:
            return dict(data)


@pytest.fixture
def start_workers(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Workers] = []

    def start(n: int, *args: str, out: Path | None = None, program: Path = WORKER,
              env: dict[str, str] | None = None) -> Workers:
        directory = out or tmp_path / f"job-{len(started)}"
        directory.mkdir(exist_ok=True)
        workers = Workers(n, list(args), directory, program, env)
        started.append(workers)
        return workers

    yield start
    for workers in started:
        workers.kill()
