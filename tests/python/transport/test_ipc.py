"""Transports by distance: processes of one host talk through ipc:// in a
private directory (mode 0700, removed at exit), authenticated with CURVE as
TCP is; tcp:// between hosts; the choice is automatic and can be forced."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import mltuner
from mltuner.transport._address import Card, IpcDirectory, choose_address, host_identity
from pairs import close_pair, start_pair, train_adds  # type: ignore[import-not-found]

ROWS, WIDTH, CLOCKS = 8, 16, 6
EXPECTED = np.full((ROWS, WIDTH), 3.0 * CLOCKS, dtype=np.float32)  # ranks add 1 and 2 each clock


def test_one_host_talks_ipc_in_a_private_directory_removed_at_close() -> None:
    jobs = start_pair()
    directories = [job._ipc.path for job in jobs]  # noqa: SLF001 - the test looks at the files
    try:
        assert jobs[0].peer_endpoints[1] == f"ipc://{directories[1] / 'data'}"
        assert jobs[1].peer_endpoints[0] == f"ipc://{directories[0] / 'data'}"
        for directory in directories:
            info = directory.stat()
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
            assert sorted(p.name for p in directory.iterdir()) == ["control", "data"]
        for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
            np.testing.assert_array_equal(result, EXPECTED)
    finally:
        close_pair(jobs)
    assert not any(directory.exists() for directory in directories)


def test_tcp_can_be_forced_and_gives_the_same_values() -> None:
    jobs = start_pair(transport="tcp")
    try:
        assert all(endpoint.startswith("tcp://127.0.0.1:") for job in jobs for endpoint in job.peer_endpoints.values())
        assert all(job._ipc is None for job in jobs)  # noqa: SLF001
        for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
            np.testing.assert_array_equal(result, EXPECTED)
    finally:
        close_pair(jobs)


def test_the_environment_variable_chooses_and_a_bad_argument_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from mltuner.launch import detect_environment

    monkeypatch.setenv("MLTUNER_TRANSPORT", "tcp")
    assert detect_environment().transport == "tcp"
    with pytest.raises(mltuner.InvalidArgumentError, match="transport must be one of auto, tcp, ipc"):
        mltuner.Job(transport="udp")  # type: ignore[arg-type]


def test_ipc_sockets_refuse_a_process_without_the_keys() -> None:
    jobs = start_pair()
    try:
        target = jobs[1].peer_endpoints[0]  # rank 0's data socket, as rank 1 reaches it
        assert target.startswith("ipc://")
        context = zmq.Context()
        rogue = context.socket(zmq.PUSH)
        rogue.connect(target)
        rogue.send_multipart([b"\x00" * 64, b""], flags=zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        while jobs[0].refused_connections == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        rogue.close(linger=0)
        context.term()
        assert jobs[0].refused_connections >= 1
        assert jobs[0].rejected_messages == 0  # nothing got past the handshake
        for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
            np.testing.assert_array_equal(result, EXPECTED)
    finally:
        close_pair(jobs)


def _card(host: str, ipc: str | None) -> Card:
    return Card(host=host, tcp={"data": "tcp://10.0.0.2:5000"}, ipc={"data": ipc} if ipc else {})


def test_the_choice_follows_the_host_and_what_this_process_can_see(tmp_path: Path) -> None:
    here = host_identity()
    mine = _card(here, None)
    missing = f"ipc://{tmp_path / 'absent'}"
    # Another host, or a socket file this process cannot see (another mount
    # namespace on the same host): TCP.
    assert choose_address("auto", mine, _card("other/boot/0", missing), "data", 1) == "tcp://10.0.0.2:5000"
    assert choose_address("auto", mine, _card(here, missing), "data", 1) == "tcp://10.0.0.2:5000"
    assert choose_address("tcp", mine, _card(here, missing), "data", 1) == "tcp://10.0.0.2:5000"
    with pytest.raises(mltuner.InvalidArgumentError, match="rank 1 runs on another host"):
        choose_address("ipc", mine, _card("other/boot/0", missing), "data", 1)
    with pytest.raises(mltuner.InvalidArgumentError, match="malformed rendezvous card"):
        Card.from_json({"host": "h", "tcp": {"data": 5}, "ipc": {}}, 1)


def test_a_killed_process_directory_is_removed_by_the_next_job(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    if len(str(base)) + 40 >= 100:
        monkeypatch.setenv("XDG_RUNTIME_DIR", "")  # too long for socket paths: the system's temp dir is used
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    first = IpcDirectory()
    stale = first.path.parent / f"mltuner-{dead_pid}-leftover"
    stale.mkdir(mode=0o700)
    (stale / "data").write_text("")
    try:
        second = IpcDirectory()
        try:
            assert not stale.exists()
            assert first.path.exists()  # its process (this one) is alive
        finally:
            second.close()
    finally:
        first.close()
    assert not first.path.exists()
