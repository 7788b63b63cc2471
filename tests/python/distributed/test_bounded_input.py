"""Bounded input on a job's sockets: a frame announced larger than the limit
is refused before its bytes are read (ZeroMQ drops the connection), a flood
of malformed messages writes a bounded number of log lines, connections
beyond the cap are cut, and a table whose messages would not fit the limit
is refused at create_table, naming the setting."""

from __future__ import annotations

import logging
import socket
import struct
import time

import pytest
import zmq

import mltuner
from mltuner.transport._security import derive_keys, secure_client

from test_wire_security import close, start_pair, train  # type: ignore[import-not-found]


def zmtp_greeting(mechanism: bytes) -> bytes:
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def test_an_oversized_announced_frame_is_dropped_unread() -> None:
    jobs = start_pair()
    try:
        with socket.create_connection(host_port(jobs[0].endpoint), timeout=5) as raw:
            raw.sendall(zmtp_greeting(b"CURVE"))
            time.sleep(0.2)
            # A command frame announced as 1 GiB (long-size flag), then its bytes.
            raw.sendall(b"\x06" + struct.pack(">Q", 1 << 30))
            chunk = b"\x00" * (1 << 20)
            sent = 0
            with pytest.raises((ConnectionResetError, BrokenPipeError)):  # the peer hung up
                for _ in range(256):
                    raw.sendall(chunk)
                    sent += len(chunk)
                raw.recv(1)  # still open after 256 MiB? then this times out: a failure
            # What went through is what the kernel buffered before the reset.
            assert sent < 64 << 20
        for result in train(jobs):  # the job did not notice
            assert float(result[0, 0]) == 15.0
    finally:
        close(jobs)


def test_a_flood_of_malformed_messages_logs_a_bounded_number_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mltuner")
    jobs = start_pair()
    flood = 3000
    try:
        context = zmq.Context()
        rogue = context.socket(zmq.PUSH)
        secure_client(rogue, derive_keys("pair-secret"))  # an insider: the frames reach the validator
        rogue.connect(jobs[0].endpoint)
        for index in range(flood):
            rogue.send(b"junk %d" % index)
        deadline = time.monotonic() + 20
        while jobs[0].rejected_messages < flood and time.monotonic() < deadline:
            time.sleep(0.05)
        rogue.close(linger=0)
        context.term()
        assert jobs[0].rejected_messages == flood
        lines = [r for r in caplog.records if "refused" in r.getMessage()]
        assert 1 <= len(lines) <= 3, len(lines)
    finally:
        close(jobs)


def test_connections_beyond_the_cap_are_cut() -> None:
    jobs = start_pair()
    opened: list[socket.socket] = []
    try:
        for _ in range(40):  # the cap is 1 peer + 16 spare
            opened.append(socket.create_connection(host_port(jobs[0].endpoint), timeout=5))
        # Sooner than the 5-s handshake timeout would drop them.
        deadline = time.monotonic() + 3
        while jobs[0].refused_connections < 40 - 17 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jobs[0].refused_connections >= 40 - 17
        for result in train(jobs):
            assert float(result[0, 0]) == 15.0
    finally:
        for connection in opened:
            connection.close()
        close(jobs)


def test_a_table_too_large_for_the_message_limit_is_refused() -> None:
    jobs = start_pair()
    try:
        with pytest.raises(mltuner.InvalidArgumentError, match=r"max_message_bytes"):
            # 2 shards of 2**25 rows of 8 floats: 1 GiB frames, over the default 256 MiB.
            jobs[0].worker.create_table("huge", 2 << 25, 8)
    finally:
        close(jobs)


@pytest.mark.parametrize("bad", [0, 1000, 2**63, 1.5, True, "1"])
def test_max_message_bytes_is_checked(bad: object) -> None:
    with pytest.raises(mltuner.InvalidArgumentError, match="max_message_bytes"):
        mltuner.Job(max_message_bytes=bad)  # type: ignore[arg-type]
