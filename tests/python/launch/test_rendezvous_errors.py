"""A rendezvous that cannot work fails with the reason, within its timeout:
rank 0's port held by another program, a foreign program at rank 0's
address, or nothing there at all. Both ranks run on threads of this process
with real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port


def _env(rank: int, port: int) -> ProcessEnv:
    return ProcessEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", master_port=port,
                      bind_host="127.0.0.1", secret="rendezvous-test-secret", source="mltuner")


def _join(rank: int, port: int, timeout_s: float = 20.0) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(mltuner.MltunerError) as caught:
        mltuner.Job(env=_env(rank, port), rendezvous_timeout_s=timeout_s)
    return caught.value, time.monotonic() - start


def _serve(answer: bytes | None) -> Iterator[int]:
    """Another program on a port: it accepts connections and hangs up at
    once (``answer`` None), or writes ``answer`` and keeps the connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:
                continue
            if answer is None:
                connection.close()
            else:
                kept.append(connection)
                connection.sendall(answer)

    kept: list[socket.socket] = []
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for connection in kept:
        connection.close()
    server.close()


@pytest.fixture
def foreign_server() -> Iterator[int]:
    yield from _serve(None)


@pytest.fixture
def talking_server() -> Iterator[int]:
    """A program that speaks another protocol (here HTTP) on its port."""
    yield from _serve(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello" * 4)


def test_rank_0_names_a_port_another_program_holds(foreign_server: int) -> None:
    error, took = _join(0, foreign_server)
    assert isinstance(error, mltuner.InvalidArgumentError)
    assert f"cannot listen on 127.0.0.1:{foreign_server}" in str(error) and "another program" in str(error)
    assert took < 5


def test_a_rank_meeting_a_foreign_program_says_so(foreign_server: int) -> None:
    error, took = _join(1, foreign_server)
    assert isinstance(error, mltuner.InvalidArgumentError)
    assert "not this job's rank 0" in str(error) and "refused this process's handshake 3 times" in str(error)
    assert took < 5  # far below the rendezvous timeout


def test_a_rank_meeting_a_program_of_another_protocol_says_so(talking_server: int) -> None:
    # ZeroMQ drops such a connection without a handshake-failure event and
    # never tries again: without a check the join waited out its timeout.
    error, took = _join(1, talking_server)
    assert isinstance(error, mltuner.InvalidArgumentError)
    assert "closed it without ZeroMQ's handshake" in str(error) and "not this job's rank 0" in str(error)
    assert took < 8


def test_nothing_at_the_address_times_out_saying_so() -> None:
    error, took = _join(1, free_port(), timeout_s=2.0)
    assert isinstance(error, mltuner.WaitTimeoutError)
    assert "nothing accepted a connection" in str(error)
    assert 1.9 < took < 6
