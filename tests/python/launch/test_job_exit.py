"""A script that ends without closing its Job exits cleanly: the job is
closed at interpreter exit, while its threads can still be joined (left to
teardown, the engine's joinable threads ended the process with
std::terminate, exit code 134)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from mltuner.launch import launch

SCRIPT = """
import mltuner
job = mltuner.Job(heartbeat_timeout_s=10.0, rendezvous_timeout_s=30)
worker = job.worker
table = worker.create_table("t", 4, 2)
update = worker.virtual_pre_update(table)
worker.virtual_update(update)
worker.virtual_clock()
worker.finish_virtual_iteration()
worker.start_iterations()
worker.pre_update(update)[:] = 1.0
worker.update(update)
worker.clock()
print("leaving without close", flush=True)
"""


def test_a_job_left_open_is_closed_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "open_job.py"
    script.write_text(SCRIPT)
    out = io.StringIO()
    code = launch([sys.executable, str(script)], 2, stdout=out, grace_seconds=10)
    text = out.getvalue()
    assert code == 0, text
    assert text.count("leaving without close") == 2 and "terminate" not in text, text


STUCK = """
import os, time
import mltuner
job = mltuner.Job(mltuner.Config(wait_timeout_s=2), heartbeat_timeout_s=30.0, rendezvous_timeout_s=30)
if job.rank == 0:
    time.sleep(8)  # alive (its heartbeats go on) but never reaching close in time
print(f"rank {job.rank} leaving without close", flush=True)
"""


def test_a_job_left_open_whose_peer_is_stuck_exits_with_an_error(tmp_path: Path) -> None:
    """Closed at exit, a close that a stuck (not lost) peer never answers
    ends the process with status 1 and the wait's message (it exited 0, and
    the launcher reported success)."""
    script = tmp_path / "stuck_peer.py"
    script.write_text(STUCK)
    out = io.StringIO()
    code = launch([sys.executable, str(script)], 2, stdout=out, grace_seconds=20)
    text = out.getvalue()
    assert code != 0, text
    assert "rank 1 leaving without close" in text and "closing the job at exit" in text, text
    assert "rank 0 did not reach it" in text, text
