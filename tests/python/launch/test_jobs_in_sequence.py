"""A script may open jobs one after another on the same master port. A rank
that leaves a job first may reach the last job's coordinator, which rank 0
has not closed yet; it must wait for the next one, not fail as a second
process claiming its rank. Both ranks run on threads of this process with
real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port
from mltuner.launch._rendezvous import Coordinator
from mltuner.launch._torch_store import job_key

ROWS, WIDTH = 4, 3


def _env(rank: int, port: int) -> ProcessEnv:
    return ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                      bind_host="127.0.0.1", secret="jobs-in-sequence-secret", source="mltuner")


def test_the_next_job_waits_for_rank_0_to_close_the_last(monkeypatch: pytest.MonkeyPatch,
                                                         record_read_update: Callable[..., tuple[int, int]]) -> None:
    port = free_port()
    close = Coordinator.close

    def slow_close(self: Coordinator) -> None:
        time.sleep(1.0)  # rank 1 has left the job and joins the next meanwhile
        close(self)

    monkeypatch.setattr(Coordinator, "close", slow_close)
    results: dict[int, list[np.ndarray]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for job_number in range(2):
                with mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add")), env=_env(r, port),
                                 rendezvous_timeout_s=20.0) as job:
                    # Each rank adds job_number + 1 to every row for two clocks; the third reads both ranks' sums.
                    read, update = record_read_update(job.worker, job.worker.create_table("t", ROWS, WIDTH))
                    for _ in range(3):
                        rows = np.array(job.worker.read(read), copy=True)
                        job.worker.post_read(read)
                        job.worker.pre_update(update)[:] = 1.0 + job_number
                        job.worker.update(update)
                        job.worker.clock()
                    results[r].append(rows)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert not errors, errors
    # Two clocks of two workers adding 1 (the first job), then 2 (the second, fresh tables).
    for r in (0, 1):
        np.testing.assert_array_equal(results[r][0], np.full((ROWS, WIDTH), 4.0, np.float32))
        np.testing.assert_array_equal(results[r][1], np.full((ROWS, WIDTH), 8.0, np.float32))


def test_a_second_process_claiming_a_rank_during_the_job_fails_at_once() -> None:
    port = free_port()
    leave = threading.Event()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with mltuner.Job(env=_env(r, port), rendezvous_timeout_s=20.0):
                leave.wait(30)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # both have joined
        start = time.monotonic()
        with pytest.raises(mltuner.InvalidArgumentError, match="two processes claim rank 1"):
            mltuner.Job(env=_env(1, port), rendezvous_timeout_s=20.0)
        assert time.monotonic() - start < 5
    finally:
        leave.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors


def test_each_job_of_a_torchrun_process_has_its_own_store_key() -> None:
    assert [job_key("mltuner/run/0/rendezvous") for _ in range(2)] == [
        "mltuner/run/0/rendezvous/job-0", "mltuner/run/0/rendezvous/job-1"]


def test_a_rank_that_joins_again_on_a_new_connection_is_answered_there() -> None:
    """A join sent again by the same process (its card is the same), say
    after a reconnect, gets the welcome on its new connection; another
    process's join for that rank is an error."""
    context = zmq.Context(io_threads=2)  # the coordinator uses the control channel's I/O thread
    coordinator = Coordinator(context, "127.0.0.1", 0, world_size=1, keys=None)
    sockets = []

    def join(card: dict[str, str]) -> dict[str, object]:
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        socket.rcvtimeo = 5000
        socket.connect(f"tcp://127.0.0.1:{coordinator.port}")
        sockets.append(socket)
        socket.send(json.dumps({"op": "join", "rank": 0, "world_size": 1, "card": card, "fingerprint": "f"}).encode())
        return json.loads(socket.recv())

    try:
        mine = {"data": "tcp://127.0.0.1:1"}
        assert join(mine) == {"op": "welcome", "cards": [mine]}
        assert join(mine) == {"op": "welcome", "cards": [mine]}
        other = join({"data": "tcp://127.0.0.1:2"})
        assert other["op"] == "error" and "two processes claim rank 0" in str(other["message"])
    finally:
        for socket in sockets:
            socket.close()
        coordinator.close()
        context.term()
