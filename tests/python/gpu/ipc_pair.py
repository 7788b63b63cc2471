"""Launches the two ranks of cuda_ipc_worker.py on 127.0.0.1, both on GPU 0
or rank r on GPU r, for the CUDA IPC test and benchmarks/ipc_bench.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mltuner.launch._env import free_port

WORKER = Path(__file__).with_name("cuda_ipc_worker.py")


def launch_pair(out: Path, cuda_ipc: bool, args: list[str], *, timeout_s: float,
                env: dict[str, str] | None = None, gpus: int = 1) -> tuple[list[int], list[str]]:
    """Runs both ranks writing to ``out``, CUDA IPC on or off, rank r on GPU
    r mod ``gpus`` (every GPU stays visible to both: a process opens only
    memory of a GPU it sees); their exit codes and outputs. A rank still
    running at ``timeout_s`` is killed."""
    port = free_port()
    procs = []
    for rank in range(2):
        rank_env = dict(os.environ, MLTUNER_RANK=str(rank), MLTUNER_WORLD_SIZE="2",
                        MLTUNER_LOCAL_RANK=str(rank % gpus), MLTUNER_MASTER_ADDR="127.0.0.1",
                        MLTUNER_MASTER_PORT=str(port),
                        MLTUNER_SECRET="cuda-ipc-pair", MLTUNER_CUDA_IPC="1" if cuda_ipc else "0",
                        PYTHONUNBUFFERED="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "--out", str(out), *args], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [proc.returncode for proc in procs], outputs
