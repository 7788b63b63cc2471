"""A script that ends without closing its Job exits cleanly: the job is
closed at interpreter exit, while its threads can still be joined (left to
teardown, the engine's joinable threads ended the process with
std::terminate, exit code 134)."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from mltuner.launch import launch

PEER_WORKER_DIR = Path(__file__).resolve().parent.parent / "distributed"  # peer_worker.py


def run_on_two(tmp_path: Path, script: str, grace_seconds: float) -> tuple[int, str]:
    """``script`` under mltuner's launcher on 2 processes: its exit code and output."""
    path = tmp_path / "script.py"
    path.write_text(script)
    out = io.StringIO()
    return launch([sys.executable, str(path)], 2, stdout=out, grace_seconds=grace_seconds), out.getvalue()


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
    code, text = run_on_two(tmp_path, SCRIPT, grace_seconds=10)
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
    code, text = run_on_two(tmp_path, STUCK, grace_seconds=20)
    assert code != 0, text
    assert "rank 1 leaving without close" in text and "closing the job at exit" in text, text
    assert "rank 0 did not reach it" in text, text


FAILED_RANK = f"""
import os, sys, time
import mltuner
sys.path.insert(0, {str(PEER_WORKER_DIR)!r})
from peer_worker import add_clock, add_loop_tables

def job() -> mltuner.Job:
    return mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=60),
                       heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, rendezvous_timeout_s=30)

def clocks(job: mltuner.Job):
    worker = job.worker
    _, read, update = add_loop_tables(worker)
    worker.start_iterations()
    return lambda: add_clock(worker, read, update, 1.0)
""" + """
def train_until_lost(clock) -> None:
    started = time.monotonic()
    try:
        for _ in range(1_000_000):
            clock()
    except mltuner.PeerLostError as error:
        print(f"rank 0 lost its peer after {time.monotonic() - started:.1f} s: {error}", flush=True)
        os._exit(3)
    print("rank 0 trained on without its peer", flush=True)
"""

SHUT_DOWN = FAILED_RANK + """
with job() as j:  # rank 1 shuts its worker down, then leaves the block as if it had finished
    clock = clocks(j)
    if j.rank == 1:
        for _ in range(3):
            clock()
        j.worker.shutdown()
    else:
        train_until_lost(clock)
"""

DIED_DURING_CLOSE = FAILED_RANK + """
j = job()
clock = clocks(j)
for _ in range(3):
    clock()
if j.rank == 1:
    time.sleep(1.0)  # still training when it dies
    os._exit(9)
try:
    j.close()
    print("rank 0 closed as if the job had finished", flush=True)
except mltuner.PeerLostError as error:
    print(f"rank 0 lost its peer in close(): {error}", flush=True)
"""


def test_a_rank_whose_close_failed_is_reported_lost_not_waited_for(tmp_path: Path) -> None:
    """A rank whose close fails (its worker shut down: a probe's peer waited
    60 s and got a message naming no rank) says no goodbye: its peer reports
    it lost within the heartbeat timeout."""
    code, text = run_on_two(tmp_path, SHUT_DOWN, grace_seconds=20)
    assert code != 0, text
    assert re.search(r"rank 0 lost its peer after (\d+\.\d) s: worker rank 1 stopped answering", text), text


def test_a_peer_lost_while_this_rank_waits_in_close_is_raised(tmp_path: Path) -> None:
    """A rank waiting in close() for a peer still training, which dies, does
    not end as if the job had finished (probe: close returned, exit 0)."""
    code, text = run_on_two(tmp_path, DIED_DURING_CLOSE, grace_seconds=20)
    assert code != 0, text
    assert "rank 0 lost its peer in close(): worker rank 1 stopped answering" in text, text
