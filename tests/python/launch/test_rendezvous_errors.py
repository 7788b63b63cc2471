"""A rendezvous that cannot work fails with the reason, within its timeout:
rank 0's port held by another program, a foreign program at rank 0's
address, or nothing there at all; two processes claiming one rank, or a rank
of another world size, fail every rank at once. Nothing a peer with the
job's secret sends stops rank 0's coordinator. The ranks run on threads of
this process with real sockets on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import mltuner
from mltuner.launch import ProcessEnv
from mltuner.launch._env import free_port
from mltuner.launch._rendezvous import Coordinator, _decode
from mltuner.transport._security import derive_keys, secure_client

_SECRET = "rendezvous-test-secret"


def _env(rank: int, port: int, world_size: int = 2) -> ProcessEnv:
    return ProcessEnv(rank=rank, world_size=world_size, local_rank=rank, master_addr="127.0.0.1",
                      master_port=port, bind_host="127.0.0.1", secret=_SECRET, source="mltuner")


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


# -- what other ranks (or anything with the job's secret) send rank 0 --------------


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_decode_refuses_every_frame_that_is_no_control_message_without_raising() -> None:
    bad = [_deep(100_000), b'{"op":"x","a":' + _deep(100_000) + b"}", b"[" * 300_000,
           b'{"op":"x","n":' + b"9" * 5000 + b"}",
           b"\xff\xfe", b"null", b"[]", b'{"op":1}', b"NaN", b'"' + b'\\"' * 100_000, b"{" * (1 << 20)]
    for frame in bad:
        assert _decode(frame) is None, frame[:40]
    assert _decode(b'{"op":"x","a":' + _deep(100) + b"}") is not None
    text = json.dumps({"op": "x", "s": "[" * 5000 + "\\\"{" * 500}).encode()
    assert _decode(text) == json.loads(text)


def _dealer(context: zmq.Context[zmq.Socket[bytes]], port: int, secret: str | None) -> zmq.Socket[bytes]:
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.sndtimeo = dealer.rcvtimeo = 10_000
    if secret is not None:
        secure_client(dealer, derive_keys(secret))
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return dealer


def _ask(dealer: zmq.Socket[bytes], message: dict[str, Any] | bytes) -> dict[str, Any]:
    dealer.send(message if isinstance(message, bytes) else json.dumps(message).encode())
    answer: dict[str, Any] = json.loads(dealer.recv())
    return answer


def test_a_deeply_nested_frame_leaves_the_rendezvous_working() -> None:
    # It raised RecursionError in rank 0's coordinator thread, which died: the
    # ranks' rendezvous and every later barrier waited out their timeouts.
    port = free_port()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    leave = threading.Event()
    jobs: dict[int, mltuner.Job] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with mltuner.Job(env=_env(r, port), rendezvous_timeout_s=30.0) as job:
                jobs[r] = job
                job.barrier("joined")
                leave.wait(30)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(0,))]
    threads[0].start()
    dealer = _dealer(context, port, _SECRET)
    try:
        dealer.send(_deep(100_000))
        dealer.send(b'{"op":"join","rank":1,"world_size":2,"card":' + _deep(100_000) + b"}")
        dealer.send(b"[" * 500_000)
        # Answered in order after those: the coordinator is still there.
        answer = _ask(dealer, {"op": "barrier", "rank": 1, "name": "x"})
        assert answer["op"] == "error" and "before joining" in answer["message"]
        threads.append(threading.Thread(target=rank, args=(1,)))
        threads[1].start()
        deadline = time.monotonic() + 30
        while len(jobs) < 2 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not errors, errors
        assert len(jobs) == 2, "the rendezvous did not complete"
        assert jobs[0]._coordinator is not None and jobs[0]._coordinator.rejections.count >= 3
    finally:
        leave.set()
        for thread in threads:
            thread.join(30)
        dealer.close()
        context.term()
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert not errors, errors


def _every_rank(envs: list[ProcessEnv], timeout_s: float) -> list[tuple[BaseException | None, float]]:
    """Each env's Job on a thread of its own: what each raised, and when."""
    results: list[tuple[BaseException | None, float]] = [(None, 0.0)] * len(envs)
    start = time.monotonic()

    def rank(i: int) -> None:
        try:
            mltuner.Job(env=envs[i], rendezvous_timeout_s=timeout_s).close()
            results[i] = (None, time.monotonic() - start)
        except BaseException as error:  # reported by the main thread
            results[i] = (error, time.monotonic() - start)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(envs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def test_two_processes_claiming_a_rank_fail_every_rank_at_once() -> None:
    # Only the second claimant failed; rank 0 and the first waited out the
    # timeout and then named a rank that "never joined".
    port = free_port()
    results = _every_rank([_env(0, port, 3), _env(1, port, 3), _env(1, port, 3)], timeout_s=30.0)
    for error, took in results:
        assert isinstance(error, mltuner.InvalidArgumentError), error
        assert "two processes claim rank 1" in str(error)
        assert took < 15  # far below the rendezvous timeout


def test_a_rank_of_another_world_size_fails_every_rank_at_once() -> None:
    port = free_port()
    results = _every_rank([_env(0, port, 2), _env(1, port, 3)], timeout_s=30.0)
    for error, took in results:
        assert isinstance(error, mltuner.InvalidArgumentError), error
        assert "rank 1 was started with world size 3, rank 0 with 2" in str(error)
        assert took < 15


@pytest.fixture
def coordinator() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], Coordinator]]:
    """A coordinator of two ranks on its own (no secret: loopback)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=2)
    served = Coordinator(context, "127.0.0.1", 0, world_size=2, keys=None)
    yield context, served
    served.close()
    context.destroy(linger=0)


def _join_message(rank: Any, world_size: Any = 2, card: dict[str, str] | None = None) -> dict[str, Any]:
    return {"op": "join", "rank": rank, "world_size": world_size, "card": card or {"data": f"tcp://x:{rank}"},
            "fingerprint": "f"}


def test_json_true_is_no_rank_and_no_world_size(
        coordinator: tuple[zmq.Context[zmq.Socket[bytes]], Coordinator]) -> None:
    # `true` passed as rank 1 (and as a world size of 1): bool is an int to Python.
    context, served = coordinator
    dealer = _dealer(context, served.port, None)
    try:
        answer = _ask(dealer, _join_message(True))
        assert answer["op"] == "error" and "rank True is outside" in answer["message"]
        answer = _ask(dealer, _join_message(1, world_size=True))
        assert answer["op"] == "error" and "without a world size" in answer["message"]
        assert served.missing_ranks() == [0, 1]
        answer = _ask(dealer, _join_message(0, world_size=2.0))
        assert answer["op"] == "error"
        answer = _ask(dealer, {"op": "barrier", "rank": False, "name": "x"})
        assert answer["op"] == "error" and "rank False is outside" in answer["message"]
    finally:
        dealer.close()


def test_a_message_whose_handling_fails_is_answered_and_the_rest_served(
        coordinator: tuple[zmq.Context[zmq.Socket[bytes]], Coordinator], monkeypatch: pytest.MonkeyPatch) -> None:
    context, served = coordinator

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(served, "_barrier", broken)
    dealers = [_dealer(context, served.port, None) for _ in range(2)]
    try:
        answer = _ask(dealers[0], {"op": "barrier", "rank": 0, "name": "x"})
        assert answer["op"] == "error" and "RuntimeError: a bug" in answer["message"]
        dealers[0].send(json.dumps(_join_message(0)).encode())
        assert _ask(dealers[1], _join_message(1))["op"] == "welcome"
        assert json.loads(dealers[0].recv())["op"] == "welcome"
    finally:
        for dealer in dealers:
            dealer.close()


def test_a_failing_coordinator_fails_every_rank_instead_of_going_silent(
        coordinator: tuple[zmq.Context[zmq.Socket[bytes]], Coordinator], monkeypatch: pytest.MonkeyPatch) -> None:
    context, served = coordinator
    first = _dealer(context, served.port, None)
    dealers = [first]
    try:
        first.send(json.dumps(_join_message(0)).encode())
        while served.missing_ranks() != [1]:
            time.sleep(0.01)

        def broken() -> None:
            raise RuntimeError("the monitor broke")

        monkeypatch.setattr(served.guard, "handle_events", broken)
        dealers.append(_dealer(context, served.port, None))  # a connection: a monitor event
        answer = json.loads(first.recv())  # rank 0's wait ends with the reason
        assert answer["op"] == "error" and "RuntimeError: the monitor broke" in answer["message"]
        assert served.failure is not None and "the monitor broke" in served.failure
        answer = _ask(dealers[1], _join_message(1))
        assert answer["op"] == "error" and "coordinator failed" in answer["message"]
    finally:
        for dealer in dealers:
            dealer.close()


def test_a_master_address_that_does_not_resolve_is_named_at_once() -> None:
    # ZeroMQ retries a name it cannot resolve in silence: the join waited out its timeout.
    env = dataclasses.replace(_env(1, free_port()), master_addr="no-such-host.invalid")
    start = time.monotonic()
    with pytest.raises(mltuner.InvalidArgumentError, match="'no-such-host.invalid' does not resolve"):
        mltuner.Job(env=env, rendezvous_timeout_s=20)
    assert time.monotonic() - start < 10

