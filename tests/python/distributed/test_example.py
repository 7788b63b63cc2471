"""The README's first command: the softmax-regression example as a real
2-process job under `mltuner launch`."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from mltuner.dist import launch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "softmax_regression.py"


def test_readme_example_trains_on_two_processes() -> None:
    out = io.StringIO()
    code = launch([sys.executable, str(EXAMPLE), "--clocks", "150"], 2, stdout=out, grace_seconds=10)
    text = out.getvalue()
    assert code == 0, text
    assert "[rank 0] workers=2 slack=0 clocks=150" in text
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", text).group(1))  # type: ignore[union-attr]
    assert accuracy > 80.0, text
