"""Runs one 2-worker job under `mltuner launch` for a benchmark and returns
the JSON result its rank 0 wrote (tuner_bench.py, straggler_bench.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from mltuner.dist import launch

WORKERS = 2


def run_job(command: list[str], result: Path) -> dict[str, Any]:
    """Runs ``command`` on WORKERS local workers; raises with the tail of
    their output if any fails."""
    out = io.StringIO()
    code = launch(command, WORKERS, stdout=out, grace_seconds=10)
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({code}):\n{out.getvalue()[-3000:]}")
    return dict(json.loads(result.read_text()))
