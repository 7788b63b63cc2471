"""The `mltuner` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mltuner
from mltuner.cli import main


def test_info_reports_version_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"mltuner {mltuner.__version__}" in out
    assert f"visible GPUs: {mltuner.cuda_device_count()}" in out


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2


def test_the_module_runs_as_a_program() -> None:
    done = subprocess.run([sys.executable, "-m", "mltuner.cli", "info"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "CUDA backend" in done.stdout
