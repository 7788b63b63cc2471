"""What reaches a worker from the network: malformed, misaddressed and
foreign messages are refused and counted without disturbing training, and,
CURVE being on for every job (loopback included), a socket without the job's
keys gets nothing through: no data, no forged goodbye.

Both ranks of a 2-process job run here on threads (each Job has its own
ZeroMQ context and sockets, so the traffic between them is real TCP on
127.0.0.1); the rogue is a plain pyzmq PUSH socket."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port
from mltuner.transport._security import derive_keys, secure_client

CLOCKS = 5


def start_pair(secure: bool | None = None, secret: str | None = "pair-secret",
               wait_timeout_s: float = 20, branches: bool = False,
               rule: mltuner.UpdateRule | None = None) -> list[mltuner.Job]:
    port = free_port()
    jobs: list[mltuner.Job | None] = [None, None]
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        env = ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                         bind_host="127.0.0.1", secret=secret, source="mltuner")
        config = mltuner.Config(update_rule=rule or mltuner.UpdateRule("add"), wait_timeout_s=wait_timeout_s,
                                branches=branches)
        try:
            jobs[rank] = mltuner.Job(config, env=env, secure=secure, rendezvous_timeout_s=20)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return [job for job in jobs if job is not None]


def train(jobs: list[mltuner.Job]) -> list[np.ndarray]:
    """Each rank adds (rank + 1) to every row each clock; returns the fetched table."""
    results: list[np.ndarray] = [np.empty(0)] * 2

    def run(job: mltuner.Job) -> None:
        worker = job.worker
        table = worker.create_table("t", 6, 4)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        for _ in range(CLOCKS):
            worker.pre_update(update)[:] = job.rank + 1
            worker.update(update)
            worker.clock()
        worker.sync()
        results[job.rank] = worker.fetch(table)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    return results


def close(jobs: list[mltuner.Job]) -> None:
    threads = [threading.Thread(target=job.close) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def header(*, magic: int = 0x4E544C4D, version: int = 1, kind: int = 1, sender: int = 1, receiver: int = 0,
           table: int = 0, clock: int = 0, row_width: int = 4, spans: int = 0) -> bytes:
    head = struct.pack("<IHHiiiiqqqIIQ", magic, version, kind, sender, receiver, table, 0, clock, 0, row_width,
                       spans, 0, 0)
    assert len(head) == 64
    return head


MALFORMED = {
    "one garbage frame": [b"hello"],
    "three frames": [b"a", b"b", b"c"],
    "short header": [b"\x00" * 10, b""],
    "foreign magic": [header(magic=0x12345678), b""],
    "future version": [header(version=9), b""],
    "unknown type": [header(kind=77), b""],
    "for another rank": [header(receiver=5), b""],
    "from itself": [header(sender=0), b""],
    "spans missing": [header(spans=3), b""],
    "payload of the wrong size": [header(spans=1) + struct.pack("<qq", 0, 2), b"\x00" * 12],
}


def rogue(endpoint: str, frames_list: list[list[bytes]], keys: object = None) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.linger = 500
    if keys is not None:
        secure_client(socket, keys)  # type: ignore[arg-type]
    socket.connect(endpoint)
    for frames in frames_list:
        socket.send_multipart(frames)
    time.sleep(1.0)
    socket.close()
    context.term()


def test_malformed_messages_are_refused_and_training_is_unharmed() -> None:
    """An insider (a socket with the job's keys) sending garbage: each
    message is validated and refused, none reaches the engine."""
    jobs = start_pair()
    try:
        rogue(jobs[0].endpoint, list(MALFORMED.values()), derive_keys("pair-secret"))
        deadline = time.monotonic() + 10
        while jobs[0].rejected_messages < len(MALFORMED) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jobs[0].rejected_messages == len(MALFORMED)
        results = train(jobs)
        for result in results:
            np.testing.assert_array_equal(result, np.full((6, 4), 3.0 * CLOCKS, dtype=np.float32))
    finally:
        close(jobs)


@pytest.mark.parametrize("who", ["no keys", "keys of another secret"])
def test_curve_keeps_unauthenticated_peers_out(who: str) -> None:
    jobs = start_pair()
    try:
        keys = None if who == "no keys" else derive_keys("another-secret")
        # A well-formed clock update from "rank 1" that would corrupt the table if it got in.
        forged = [header(kind=1, sender=1, receiver=0, clock=0, spans=1) + struct.pack("<qq", 0, 3),
                  np.full(12, 1000.0, dtype=np.float32).tobytes()]
        rogue(jobs[0].endpoint, [forged, [b"hello"]], keys)
        results = train(jobs)
        for result in results:
            np.testing.assert_array_equal(result, np.full((6, 4), 3.0 * CLOCKS, dtype=np.float32))
        assert jobs[0].rejected_messages == 0  # nothing even reached the validator
        assert jobs[0].refused_connections >= 1
    finally:
        close(jobs)


def test_secure_false_is_refused_off_the_loopback() -> None:
    env = ProcessEnv(rank=0, world_size=2, local_rank=0, master_addr="10.0.0.1", master_port=free_port(),
                     bind_host="0.0.0.0", secret="s" * 32, source="mltuner")
    with pytest.raises(mltuner.InvalidArgumentError, match="secure=False"):
        mltuner.Job(env=env, secure=False)


@pytest.mark.parametrize("setting", ["lr", "branches", "check_finite"])
def test_workers_with_different_settings_are_refused(setting: str) -> None:
    def config(rank: int) -> mltuner.Config:
        lr = 0.1 * (rank + 1) if setting == "lr" else 0.1
        return mltuner.Config(update_rule=mltuner.UpdateRule("sgd", lr), **({} if setting == "lr" else
                                                                            {setting: rank == 1}))

    jobs, errors = join_pair(config)
    assert not jobs and len(errors) == 2
    for error in errors:
        assert isinstance(error, mltuner.InvalidArgumentError)
        assert "different settings" in str(error)


def join_pair(config: Callable[[int], mltuner.Config]) -> tuple[list[mltuner.Job], list[BaseException]]:
    """Two ranks joining on threads, each with ``config(rank)``: the jobs
    that started and the errors of those that did not."""
    port = free_port()
    jobs: list[mltuner.Job] = []
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        env = ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                         bind_host="127.0.0.1", secret=None, source="mltuner")
        try:
            jobs.append(mltuner.Job(config(rank), env=env, rendezvous_timeout_s=20))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return jobs, errors


def test_settings_equal_as_numbers_are_the_same_settings() -> None:
    """An int where another rank has the float default (wait_timeout_s=60
    against 60.0, a rate of 1 against 1.0) is the same setting: it was
    refused as "started with different settings"."""
    jobs, errors = join_pair(lambda rank: mltuner.Config(update_rule=mltuner.UpdateRule("sgd", 1), wait_timeout_s=60)
                             if rank == 0 else mltuner.Config(update_rule=mltuner.UpdateRule("sgd", 1.0)))
    try:
        assert not errors, errors
        assert len(jobs) == 2
    finally:
        for job in jobs:
            job.close(graceful=False)


def test_workers_with_different_secrets_cannot_meet() -> None:
    """Rank 1 learns at once that rank 0 refused its key; rank 0, which
    never hears from it, names it when its rendezvous times out."""
    port = free_port()
    errors: dict[int, BaseException] = {}

    def join(rank: int) -> None:
        env = ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                         bind_host="127.0.0.1", secret=f"secret-of-rank-{rank}", source="mltuner")
        try:
            mltuner.Job(env=env, rendezvous_timeout_s=2)
        except BaseException as error:  # noqa: BLE001
            errors[rank] = error

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert isinstance(errors[0], mltuner.WaitTimeoutError) and "ranks [1] never joined" in str(errors[0])
    assert isinstance(errors[1], mltuner.InvalidArgumentError) and "a different secret" in str(errors[1])
