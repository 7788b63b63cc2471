"""The watcher of `mltuner tune/demo/run`: a job stopped with Ctrl-C still
leaves its report."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from mltuner.tune.display._watch import run_watched


def watch(tmp_path: Path, script: str, workers: int, **options: Any) -> tuple[int, str]:
    """Runs ``script`` (LOG in it: the decision log's path) on ``workers``
    under run_watched; its exit code and what it printed."""
    log = tmp_path / "decisions.jsonl"
    job = tmp_path / "job.py"
    job.write_text(script.replace("LOG", repr(str(log))))
    out = io.StringIO()
    code = run_watched([sys.executable, str(job)], workers, log=log, workers_log=tmp_path / "w.log",
                       terminal=False, out=out, **options)
    return code, out.getvalue()


@pytest.mark.timeout(60)
def test_ctrl_c_still_writes_the_report(tmp_path: Path) -> None:
    # Rank 0 logs a decision, then sends SIGINT to the launcher, as Ctrl-C in
    # its terminal would.
    code, text = watch(tmp_path,
                       "import json, os, signal, time\n"
                       "if os.environ['MLTUNER_RANK'] == '0':\n"
                       "    with open(LOG, 'a') as f:\n"
                       "        f.write(json.dumps({'time': time.time(), 'event': 'start', 'phase': 'init'}) + '\\n')\n"
                       "    os.kill(os.getppid(), signal.SIGINT)\n"
                       "time.sleep(30)\n", 2, report=tmp_path / "report.png")
    assert code == 130
    assert "the job was stopped (exit code 130)" in text
    assert f"report: {tmp_path / 'report.png'}" in text
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(60)
def test_a_job_of_two_sessions_shows_both(tmp_path: Path) -> None:
    # The display ended at the first session's end: the second, in the same
    # log, was never shown.
    code, text = watch(tmp_path,
                       "import json, os, time\n"
                       "if os.environ['MLTUNER_RANK'] == '0':\n"
                       "    with open(LOG, 'a') as f:\n"
                       "        for outcome in ('max_epochs', 'converged'):\n"
                       "            for record in ({'event': 'start', 'phase': 'init'},\n"
                       "                           {'event': 'end', 'phase': 'end', 'outcome': outcome, 'epochs': 2}):\n"
                       "                f.write(json.dumps({'time': time.time(), **record}) + '\\n')\n"
                       "                f.flush()\n"
                       "                time.sleep(0.3)\n", 1)
    assert code == 0
    assert "done: max_epochs" in text and "done: converged" in text, text
