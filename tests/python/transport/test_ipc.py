"""Transports by distance: processes of one host talk through ipc:// in a
private directory (mode 0700, removed at exit), which authenticates the
peers (no CURVE there unless Job(secure=True)); tcp:// between hosts, and
on loopback when forced, always with CURVE; the choice is automatic and can
be forced."""

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
from mltuner.transport._address import Card, IpcDirectory, choose_address, host_identity, private_directory_problem
from mltuner.transport._security import SocketSecurity, derive_keys
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


def _mechanisms(job: mltuner.Job) -> dict[str, int]:
    """The ZeroMQ security mechanism of each of a job's data and control
    sockets, by kind (listeners by their address, PUSH sockets by peer)."""
    found: dict[str, int] = {}
    for channel in (job._transport, job._liveness):  # noqa: SLF001 - the test looks at the sockets
        assert channel is not None
        name = "data" if channel is job._transport else "control"  # noqa: SLF001
        for listener in channel.listeners:
            kind = listener.socket.last_endpoint.decode().split(":", 1)[0]
            found[f"{name} {kind} listener"] = listener.socket.mechanism
        for peer, socket in channel._peers.items():  # noqa: SLF001
            found[f"{name} push to {peer}"] = socket.mechanism
    return found


def test_ipc_sockets_are_plain_in_a_private_directory_and_tcp_keeps_curve() -> None:
    jobs = start_pair()
    try:
        for job in jobs:
            assert job._ipc is not None  # noqa: SLF001
            assert private_directory_problem(job._ipc.path) == ""  # noqa: SLF001 - 0700, this user's
            mechanisms = _mechanisms(job)
            assert mechanisms["data tcp listener"] == zmq.CURVE
            assert mechanisms["control tcp listener"] == zmq.CURVE
            assert mechanisms["data ipc listener"] == zmq.NULL
            assert mechanisms["control ipc listener"] == zmq.NULL
            peer = 1 - job.rank
            assert mechanisms[f"data push to {peer}"] == zmq.NULL  # through ipc://
            assert mechanisms[f"control push to {peer}"] == zmq.NULL
        # The TCP port still refuses a process without the keys (even on
        # loopback, where any local user could connect).
        rogue_refused(jobs[0], jobs[0].endpoint)
        for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
            np.testing.assert_array_equal(result, EXPECTED)
    finally:
        close_pair(jobs)


def test_a_plain_ipc_peer_of_this_user_is_validated_like_any_message() -> None:
    # What the private directory lets in is this user's processes only; what
    # they send is still validated before the engine sees it.
    jobs = start_pair()
    try:
        context = zmq.Context()
        rogue = context.socket(zmq.PUSH)
        rogue.connect(jobs[1].peer_endpoints[0])
        rogue.send_multipart([b"\x00" * 64, b""])
        deadline = time.monotonic() + 10
        while jobs[0].rejected_messages == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        rogue.close(linger=0)
        context.term()
        assert jobs[0].rejected_messages == 1
        for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
            np.testing.assert_array_equal(result, EXPECTED)
    finally:
        close_pair(jobs)


def test_secure_true_keeps_curve_on_ipc_and_forced_tcp_on_loopback_uses_curve() -> None:
    for kwargs in ({"secure": True}, {"transport": "tcp"}):
        jobs = start_pair(**kwargs)
        try:
            for job in jobs:
                assert set(_mechanisms(job).values()) == {zmq.CURVE}, kwargs
            endpoint = jobs[1].peer_endpoints[0]
            assert endpoint.startswith("ipc://" if "secure" in kwargs else "tcp://127.0.0.1:")
            rogue_refused(jobs[0], endpoint)
            for result in train_adds(jobs, ROWS, WIDTH, CLOCKS):
                np.testing.assert_array_equal(result, EXPECTED)
        finally:
            close_pair(jobs)


def rogue_refused(job: mltuner.Job, endpoint: str) -> None:
    """A socket without the job's keys connects to ``endpoint`` of ``job``:
    its handshake fails (counted) and nothing reaches the validator."""
    before = job.refused_connections
    context = zmq.Context()
    rogue = context.socket(zmq.PUSH)
    rogue.connect(endpoint)
    rogue.send_multipart([b"\x00" * 64, b""], flags=zmq.NOBLOCK)
    deadline = time.monotonic() + 10
    while job.refused_connections == before and time.monotonic() < deadline:
        time.sleep(0.05)
    rogue.close(linger=0)
    context.term()
    assert job.refused_connections > before
    assert job.rejected_messages == 0


def test_security_rule_per_address() -> None:
    keys = derive_keys("a secret of enough characters")
    default = SocketSecurity(keys)
    assert default.keys_for("tcp://127.0.0.1:5000") is keys  # loopback TCP: any local user could connect
    assert default.keys_for("tcp://10.0.0.2:5000") is keys
    assert default.keys_for("tcp://[::1]:5000") is keys
    assert default.keys_for("ipc:///run/user/1/mltuner-1-x/data") is None  # the directory authenticates
    assert SocketSecurity(keys, curve_on_ipc=True).keys_for("ipc:///tmp/x/data") is keys
    assert SocketSecurity(None).keys_for("tcp://127.0.0.1:5000") is None  # secure=False (loopback only)
    with pytest.raises(mltuner.InvalidArgumentError, match="no security rule"):
        default.keys_for("inproc://x")


def test_an_ipc_directory_that_others_may_open_is_refused(tmp_path: Path) -> None:
    directory = IpcDirectory()
    try:
        directory.check_private()
        os.chmod(directory.path, 0o755)
        with pytest.raises(mltuner.InvalidArgumentError, match="not private.*mode 755"):
            directory.check_private()
        # A peer's socket in such a directory is not used: TCP, or an error when ipc:// is forced.
        listener = zmq.Context.instance().socket(zmq.PULL)
        listener.bind(directory.endpoint("data"))
        try:
            here = host_identity()
            theirs = _card(here, directory.endpoint("data"))
            assert choose_address("auto", _card(here, None), theirs, "data", 1) == "tcp://10.0.0.2:5000"
            with pytest.raises(mltuner.InvalidArgumentError, match="may be opened by other users"):
                choose_address("ipc", _card(here, None), theirs, "data", 1)
            os.chmod(directory.path, 0o700)
            assert choose_address("auto", _card(here, None), theirs, "data", 1) == directory.endpoint("data")
        finally:
            listener.close(linger=0)
    finally:
        directory.close()


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


def test_received_payloads_are_used_in_place_and_all_handed_back(socket_threads: str) -> None:
    # On the CPU backend the node reads each received payload where ZeroMQ
    # put it; the transport keeps the frame until the node hands it back.
    # Payloads under 256 KiB (ProcessNode::kBatchBelowBytes) join batches and
    # are copied at both ends: these are 320 KiB, half a table each. Shared
    # memory is off: with it the payloads would not take the socket.
    rows, width = 320, 512
    jobs = start_pair(cuda_ipc=False)
    try:
        for result in train_adds(jobs, rows, width, CLOCKS):
            np.testing.assert_array_equal(result, np.full((rows, width), 3.0 * CLOCKS, dtype=np.float32))
        for job in jobs:
            node, transport = job._node, job._transport  # noqa: SLF001 - the test looks at the counters
            assert transport is not None
            # Each clock brings the peer's update of this shard and its shard's rows.
            assert node.payloads_used_in_place >= 2 * CLOCKS
            deadline = time.monotonic() + 10
            while (node.borrowed_payloads or transport.lent_payloads) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert node.borrowed_payloads == 0 and transport.lent_payloads == 0
    finally:
        close_pair(jobs)


def test_cpu_engines_of_one_host_move_payloads_through_shared_memory() -> None:
    # The same training with shared memory on (the default): every payload
    # is copied into the peer's landing region and only its notice takes the
    # socket; every range comes back by a release, so nothing stays held.
    rows, width = 320, 512
    jobs = start_pair()
    try:
        assert [job.data_paths for job in jobs] == [{1: "shared-memory"}, {0: "shared-memory"}]
        for result in train_adds(jobs, rows, width, CLOCKS):
            np.testing.assert_array_equal(result, np.full((rows, width), 3.0 * CLOCKS, dtype=np.float32))
        for job in jobs:
            stats = job.transport_stats
            # Each clock sends the peer's shard its update and the peer's worker this shard's rows.
            assert stats["cuda_ipc_sent_messages"] >= 2 * CLOCKS
            assert stats["cuda_ipc_received_bytes"] >= 2 * CLOCKS * rows // 2 * width * 4
            assert stats["cuda_ipc_fallbacks"] == 0
            assert stats["socket_payload_bytes"] < rows * width * 4  # the initial values at most, no clock's
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                job.transport_stats["cuda_ipc_releases_received"] < job.transport_stats["cuda_ipc_sent_messages"]
                for job in jobs):
            time.sleep(0.02)
        for job in jobs:
            stats = job.transport_stats
            assert stats["cuda_ipc_releases_received"] == stats["cuda_ipc_sent_messages"]
    finally:
        close_pair(jobs)
