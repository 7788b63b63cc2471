"""The examples, run as a user would: the softmax-regression example as a
real 2-process job under `mltuner launch`, the CNN under `mltuner run`, and
the model larger than its budget."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mltuner.cli import main
from mltuner.launch import launch

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
EXAMPLE = EXAMPLES / "softmax_regression.py"


def test_readme_example_trains_on_two_processes() -> None:
    out = io.StringIO()
    code = launch([sys.executable, str(EXAMPLE), "--clocks", "150"], 2, stdout=out, grace_seconds=10)
    text = out.getvalue()
    assert code == 0, text
    assert "[rank 0] workers=2 slack=0 clocks=150" in text
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", text).group(1))  # type: ignore[union-attr]
    assert accuracy > 80.0, text


def test_larger_than_budget_example_matches_the_unconstrained_run() -> None:
    pytest.importorskip("torch")
    # A small model, so the least pool weighs more: 40% of its need (a
    # quarter is below the least pool of reading each layer twice).
    done = subprocess.run([sys.executable, str(EXAMPLES / "larger_than_budget.py"), "--width", "64", "--depth", "4",
                           "--batch", "32", "--clocks", "5", "--budget-fraction", "0.4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical to the run without a budget" in done.stdout


def test_mnist1d_cnn_example_tunes_under_mltuner_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    # Two workers with batch stealing: its loop must also take steps of no samples.
    code = main(["run", "--plain", "-n", "2", "--out", str(tmp_path), "--", sys.executable,
                 str(EXAMPLES / "mnist1d_cnn.py"), "--max-epochs", "1", "--samples", "5000", "--trials", "4",
                 "--steal-batches"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert re.search(r"test accuracy [\d.]+%", text) and (tmp_path / "report.png").exists()
