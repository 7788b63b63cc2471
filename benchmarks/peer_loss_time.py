"""How long a job takes to notice a worker killed with SIGKILL.

Rank 1 runs tests/python/distributed/peer_worker.py in its own process; rank 0
runs here, clocking every 20 ms. Rank 1 is killed at clock 20; printed: the
seconds from the kill to rank 0's PeerLostError, and to the end of rank 0's
Job.close(graceful=False). docs/distributed.md quotes these numbers.

    PYTHONPATH=python python benchmarks/peer_loss_time.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "python" / "distributed" / "peer_worker.py"
sys.path.insert(0, str(PEER.parent))

import mltuner  # noqa: E402
from mltuner.launch import ProcessEnv  # noqa: E402
from mltuner.launch._env import free_port  # noqa: E402
from peer_worker import add_loop_tables  # type: ignore[import-not-found]  # noqa: E402

SECRET = "peer-loss-benchmark-secret"


def one_run(heartbeat_timeout_s: float) -> tuple[float, float]:
    port = free_port()
    env = dict(os.environ, MLTUNER_RANK="1", MLTUNER_WORLD_SIZE="2", MLTUNER_LOCAL_RANK="1",
               MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port), MLTUNER_SECRET=SECRET)
    peer = subprocess.Popen([sys.executable, str(PEER), "--heartbeat-timeout", str(heartbeat_timeout_s)], env=env,
                            stdout=subprocess.DEVNULL)
    try:
        me = ProcessEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port,
                        bind_host="127.0.0.1", secret=SECRET, source="mltuner")
        config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=30)
        job = mltuner.Job(config, env=me, heartbeat_timeout_s=heartbeat_timeout_s, rendezvous_timeout_s=30)
        worker = job.worker
        _, read, update = add_loop_tables(worker)
        worker.start_iterations()
        killed = 0.0
        noticed = float("nan")
        try:
            for clock in range(1_000_000):
                if clock == 20:
                    peer.send_signal(signal.SIGKILL)
                    killed = time.monotonic()
                worker.read(read)
                worker.post_read(read)
                worker.pre_update(update)[:] = 1.0
                worker.update(update)
                worker.clock()
                time.sleep(0.02)
        except mltuner.PeerLostError:
            noticed = time.monotonic() - killed
        job.close(graceful=False)
        return noticed, time.monotonic() - killed
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    args = parser.parse_args()
    for _ in range(args.runs):
        noticed, closed = one_run(args.heartbeat_timeout)
        print(f"PeerLostError {noticed:.2f} s after the kill, close() done {closed:.2f} s after it", flush=True)


if __name__ == "__main__":
    main()
