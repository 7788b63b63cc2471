"""The attacks of issue 17 against a default loopback job (no secret given:
the job uses this user's key), with rank 1 a real process and rank 0 driven
here: a forged rows message (type 3, clock 10^9, values -12345) and a forged
goodbye from rank 1 reach rank 0's data port from a socket without the job's
keys. Both are refused before the engine (counted, logged once), rank 0's
reads stay exact, and a later kill -9 of rank 1 is still named within the
heartbeat timeout."""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port
from mltuner.transport._security import derive_keys, secure_client

PEER = Path(__file__).with_name("peer_worker.py")
sys.path.insert(0, str(PEER.parent))
from peer_worker import add_loop_tables  # type: ignore[import-not-found]  # noqa: E402

HEARTBEAT_TIMEOUT_S = 3.0


def forged_rows() -> list[bytes]:
    head = struct.pack("<IHHiiiiqqqIIQ", 0x4E544C4D, 1, 3, 1, 0, 0, 0, 10**9, 0, 4, 1, 0, 0)
    return [head + struct.pack("<qq", 0, 6), np.full(24, -12345.0, dtype=np.float32).tobytes()]


def forged_goodbye() -> list[bytes]:
    return [b"MLTN-BYE" + struct.pack("<i", 1)]


def send_as_rogue(endpoint: str, keys: object, seconds: float) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.linger = 0
    if keys is not None:
        secure_client(socket, keys)  # type: ignore[arg-type]
    socket.connect(endpoint)
    for frames in (forged_rows(), forged_goodbye()):
        socket.send_multipart(frames)
    time.sleep(seconds)  # the rogue keeps retrying its handshake meanwhile
    socket.close()
    context.term()


@pytest.mark.timeout(90)
def test_forged_rows_and_goodbye_are_refused_and_a_later_kill_is_named(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    env = dict(os.environ, MLTUNER_RANK="1", MLTUNER_WORLD_SIZE="2", MLTUNER_LOCAL_RANK="1",
               MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    env.pop("MLTUNER_SECRET", None)
    env.pop("MLTUNER_SECRET_FILE", None)
    peer = subprocess.Popen([sys.executable, str(PEER), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    caplog.set_level(logging.WARNING, logger="mltuner")
    try:
        me = ProcessEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port,
                        bind_host="127.0.0.1", secret=None, source="mltuner")
        config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=30)
        job = mltuner.Job(config, env=me, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, rendezvous_timeout_s=30)
        try:
            worker = job.worker
            _, read, update = add_loop_tables(worker)
            worker.start_iterations()

            def one_clock(clock: int) -> None:
                seen = np.array(worker.read(read))
                worker.post_read(read)
                # Slack 0: every worker's updates through clock - 1, 3 per clock.
                np.testing.assert_array_equal(seen, np.full((6, 4), 3.0 * clock, dtype=np.float32))
                worker.pre_update(update)[:] = 1.0
                worker.update(update)
                worker.clock()

            for clock in range(5):
                one_clock(clock)
            for keys in (None, derive_keys("another secret")):
                send_as_rogue(job.endpoint, keys, 0.5)
            for clock in range(5, 10):
                one_clock(clock)
            assert job.rejected_messages == 0  # nothing reached the validator, let alone the engine
            assert job.refused_connections >= 2
            refusals = [r for r in caplog.records if "refused" in r.getMessage()]
            assert 1 <= len(refusals) <= 2, [r.getMessage() for r in refusals]

            peer.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(mltuner.PeerLostError, match="worker rank 1 stopped answering"):
                for clock in range(10, 10_000):
                    one_clock(clock)
            assert time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 2.0
        finally:
            job.close(graceful=False)
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.communicate(timeout=10)
