"""Control apart from data: heartbeats have their own sockets and thread, so
a receiver whose data path stalls longer than the heartbeat timeout is not
declared lost, and what waits for it is bounded (back-pressure, then a clear
error after the wait timeout); a truly silent peer (SIGSTOP) is still named
within the heartbeat timeout. The back-pressure tests keep every payload on
the sockets (``cuda_ipc=False``: by default CPU processes of one host move
payloads through shared memory, and only notices take the socket); one test
stalls a receiver of shared-memory notices."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import mltuner
from mltuner.launch._env import free_port
from pairs import close_pair, run_both, start_pair, train_adds  # type: ignore[import-not-found]

PEER_WORKER = Path(__file__).resolve().parent.parent / "distributed" / "peer_worker.py"
sys.path.insert(0, str(PEER_WORKER.parent))
from peer_worker import add_clock, add_loop_tables  # type: ignore[import-not-found]  # noqa: E402

ROWS, WIDTH = 64, 4096  # a 1 MiB table: each clock's update for the other shard is 512 KiB
SLICE_BYTES = ROWS // 2 * WIDTH * 4
LIMIT = 1 << 20


def stall_receiver(job: mltuner.Job, seconds: float, min_bytes: int = SLICE_BYTES) -> Callable[[], bool]:
    """Makes the job's data receive thread sleep once, at the first message
    with a payload of min_bytes or more (by default the first update of the
    training; 0: the next message), as a receiver far slower than its sender
    would; returns a check that the stall was done in full."""
    transport = job._transport  # noqa: SLF001 - the test reaches into the receive path
    assert transport is not None
    loops = transport._loops  # noqa: SLF001
    if transport.native:
        pump = loops.pump
        pump.stall_next_delivery(min_bytes, int(seconds * 1000))
        return lambda: bool(pump.stats["stalls"] == 1)
    deliver = loops._on_data  # noqa: SLF001
    times: list[float] = []

    def slow(header: Any, payload: Any) -> None:
        if not times and len(payload) >= min_bytes:
            times.append(time.monotonic())
            time.sleep(seconds)
            times.append(time.monotonic())
        deliver(header, payload)

    loops._on_data = slow  # noqa: SLF001
    return lambda: len(times) == 2 and times[1] - times[0] >= seconds


def test_a_receiver_stalled_longer_than_the_heartbeat_timeout_is_not_lost(socket_threads: str) -> None:
    jobs = start_pair(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, max_queued_bytes=LIMIT, cuda_ipc=False)
    assert all(job._transport.native == (socket_threads == "c++") for job in jobs)  # noqa: SLF001
    try:
        stalled = stall_receiver(jobs[1], 2.5)
        # An unread table: nothing holds rank 0 back but the transport, so its
        # updates pile up behind the stalled receiver.
        results = train_adds(jobs, ROWS, WIDTH, clocks=120, read=False)
        for result in results:
            np.testing.assert_array_equal(result, np.full((ROWS, WIDTH), 3.0 * 120, dtype=np.float32))
        assert stalled()  # the stall happened, 2.5x the timeout
        sender = jobs[0]._transport  # noqa: SLF001
        # Back-pressure: what waited for rank 1 reached the bound and never
        # passed it in ZeroMQ; in the node's outbox behind it the engine's
        # updates stopped at the bound, and the shard's replies (which never
        # wait) of the clocks rank 0 ran ahead, at most what the bounds on the
        # way let through (outbox, ZeroMQ, rank 1's inbox), may pass it.
        assert SLICE_BYTES <= sender.peak_queued[1] <= LIMIT
        assert jobs[0]._node.peak_outbox_bytes <= 4 * LIMIT  # noqa: SLF001
        # The receiver's inboxes are bounded by the same plan (inbox_test in
        # C++ tests the waiting): deliveries stop at it, and its own shard's
        # replies to its own engine, which never wait, may pass it as above.
        assert 0 < jobs[1]._node.peak_inbox_bytes <= 4 * LIMIT  # noqa: SLF001
        assert all(job._lost_peer() is None for job in jobs)  # noqa: SLF001
    finally:
        close_pair(jobs)


def clock_until_rank_0_fails(jobs: list[mltuner.Job], stall_from_bytes: int) -> dict[str, Any]:
    """Both ranks clock an unread table for up to 10 s while rank 1's data
    receive thread stalls for 10 s at its first message of stall_from_bytes
    or more; returns each rank's error ("error R") and when it came ("after R")."""
    outcome: dict[str, Any] = {}

    def run(rank: int) -> None:
        worker = jobs[rank].worker
        table = worker.create_table("t", ROWS, WIDTH)
        update = worker.virtual_pre_update(table)
        worker.virtual_update(update)
        worker.virtual_clock()
        worker.finish_virtual_iteration()
        worker.start_iterations()
        if rank == 1:
            # Armed now, so the stall takes a training update, not the
            # initial values (whose wait has the same short timeout). Long
            # beside the 2 s waits: on a loaded machine rank 0's engine
            # thread may start its wait seconds after the stall began, and
            # that wait must still run out before rank 1 takes data again.
            stall_receiver(jobs[1], 10.0, stall_from_bytes)
        started = time.monotonic()
        try:
            # An unread table: rank 0 clocks on, two clocks ahead of rank
            # 1 at most, while its updates for rank 1 wait, until the
            # transport or that bound gives up on rank 1.
            while time.monotonic() - started < 10.0 and "error 0" not in outcome:
                worker.pre_update(update)[:] = 1.0
                worker.update(update)
                worker.clock()
                time.sleep(0.01)
        except mltuner.MltunerError as error:
            outcome[f"error {rank}"] = error
            outcome[f"after {rank}"] = time.monotonic() - started

    run_both(run, timeout_s=30)
    return outcome


def test_a_receiver_that_takes_nothing_fails_the_sender_within_the_wait_timeout(socket_threads: str) -> None:
    config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=2.0)
    jobs = start_pair(config, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, max_queued_bytes=LIMIT,
                      cuda_ipc=False)
    try:
        outcome = clock_until_rank_0_fails(jobs, SLICE_BYTES)
        # Whichever bound ran out first says so and names rank 1: the bytes
        # in ZeroMQ (the send thread) or the outbox behind them (the engine).
        error = outcome["error 0"]
        if isinstance(error, mltuner.PeerLostError):
            assert "worker rank 1 stopped taking data" in str(error) and "heartbeats still arrive" in str(error)
        else:
            assert isinstance(error, mltuner.WaitTimeoutError), error
            if "the rows of shard 1): a worker is slow" in str(error):
                pass  # the bound on an unread table's lead (memory/allocator.cc): rank 1's shard is behind
            elif "for the buffer of pre_update" in str(error):
                # The application's own wait for a buffer ran out first, while
                # an engine thread still waited behind rank 1 (on the outbox,
                # whose wait then fails the node too, or between the allocator's
                # waits: on a loaded machine either interleaving happens; the
                # node's abort is not this test's point, the sender's error is).
                assert "the allocator thread is waiting for" in str(error), error
            else:
                assert "the outbox to other processes" in str(error) and "worker rank 1 is not taking" in str(error)
        assert outcome["after 0"] < 8.0  # the wait timeout (2 s) ended it, not the end of the stall (10 s)
        assert jobs[0]._transport.peak_queued[1] <= LIMIT  # noqa: SLF001
        # The engine waited instead: its updates stopped at the bound; the
        # shard's replies of the clocks in flight may pass it (see above).
        assert jobs[0]._node.peak_outbox_bytes <= 4 * LIMIT  # noqa: SLF001
    finally:
        run_both(lambda rank: jobs[rank].close(graceful=False))


def test_a_receiver_of_shared_memory_that_takes_nothing_fails_the_sender_within_the_wait_timeout(
        socket_threads: str) -> None:
    # With shared memory only notices take the socket. Rank 1 stops taking
    # them: its shard never gets rank 0's updates, so rank 0, whose table is
    # unread, may run at most a bounded lead ahead before its wait for rank
    # 1's rows runs out; meanwhile what it sent is bounded by its landing
    # slice in rank 1's region.
    config = mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=2.0)
    jobs = start_pair(config, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0)
    assert [job.data_paths for job in jobs] == [{1: "shared-memory"}, {0: "shared-memory"}]
    try:
        outcome = clock_until_rank_0_fails(jobs, 0)  # notices have no payload: stall at the next message
        error = outcome["error 0"]
        assert isinstance(error, mltuner.WaitTimeoutError), error
        # Rank 1's shard is behind (its own may be too: rank 1 waits as well).
        behind = re.search(r"behind: the rows of shard ([0-9, ]+)\)", str(error))
        assert behind is not None and "1" in behind.group(1).split(", "), error
        assert outcome["after 0"] < 8.0  # the wait timeout (2 s) ended it, not the end of the stall (10 s)
        stats = jobs[0].transport_stats
        assert stats["cuda_ipc_sent_bytes"] > 0 and stats["cuda_ipc_fallbacks"] == 0
    finally:
        run_both(lambda rank: jobs[rank].close(graceful=False))


PEER = textwrap.dedent(f"""
    import sys
    import signal
    import mltuner
    sys.path.insert(0, {str(PEER_WORKER.parent)!r})
    from peer_worker import add_clock, add_loop_tables

    def fail(*_):  # SIGUSR1: the training loop raises, uncaught (no `with Job`: closed at exit)
        raise RuntimeError("the training loop failed")

    signal.signal(signal.SIGUSR1, fail)
    job = mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=60),
                      heartbeat_interval_s=0.1, heartbeat_timeout_s=float(sys.argv[1]), rendezvous_timeout_s=30)
    worker = job.worker
    _, read, update = add_loop_tables(worker)
    worker.start_iterations()
    print("ready", flush=True)
    while True:
        add_clock(worker, read, update, 1.0)
""")


def start_peer(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """Rank 1 of a 2-process job: ``script`` run in a process of its own,
    with the port rank 0 (:func:`rank_0`) takes."""
    path = tmp_path / "peer.py"
    path.write_text(script)
    port = free_port()
    env = dict(os.environ, MLTUNER_RANK="1", MLTUNER_WORLD_SIZE="2", MLTUNER_LOCAL_RANK="1",
               MLTUNER_MASTER_ADDR="127.0.0.1", MLTUNER_MASTER_PORT=str(port), MLTUNER_SECRET="liveness-secret")
    return subprocess.Popen([sys.executable, str(path), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), port


def rank_0(port: int, *, heartbeat_interval_s: float, heartbeat_timeout_s: float) -> mltuner.Job:
    """This process as rank 0 of :func:`start_peer`'s job."""
    return mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=60),
                       env=mltuner.launch.ProcessEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1",
                                                     master_port=port, bind_host="127.0.0.1",
                                                     secret="liveness-secret", source="mltuner"),
                       heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=heartbeat_timeout_s,
                       rendezvous_timeout_s=30)


@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL, signal.SIGUSR1],
                         ids=["SIGSTOP", "SIGKILL", "uncaught exception"])
def test_a_silent_peer_is_named_within_the_heartbeat_timeout(tmp_path: Path, how: signal.Signals) -> None:
    timeout_s = 1.5
    peer, port = start_peer(tmp_path, PEER, str(timeout_s))
    try:
        job = rank_0(port, heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout_s)
        try:
            worker = job.worker
            _, read, update = add_loop_tables(worker)
            worker.start_iterations()

            def clock() -> None:
                add_clock(worker, read, update, 1.0)

            for _ in range(5):
                clock()
            peer.send_signal(how)
            silenced = time.monotonic()
            with pytest.raises(mltuner.PeerLostError, match="worker rank 1 stopped answering"):
                for _ in range(100_000):
                    clock()
            assert time.monotonic() - silenced < timeout_s + 1.0
        finally:
            job.close(graceful=False)
    finally:
        peer.kill()
        peer.communicate(timeout=10)


def test_ranks_that_close_at_different_clocks_are_warned_about(
        record_read_update: Callable[..., tuple[int, int]]) -> None:
    """One rank runs a clock more than the other (an off-by-one in its loop):
    nothing fails, but the close says so, on every rank."""
    jobs = start_pair()

    def train(rank: int) -> None:
        worker = jobs[rank].worker
        read, update = record_read_update(worker, worker.create_table("t", 4, 2))
        for _ in range(3 + rank):  # rank 1 runs one clock more
            worker.read(read)
            worker.post_read(read)
            worker.pre_update(update)[:] = 1.0
            worker.update(update)
            worker.clock()

    try:
        run_both(train)
        with pytest.warns(UserWarning, match=r"different clocks \(rank 0 at clock 3, rank 1 at clock 4\)"):
            run_both(lambda rank: jobs[rank].close())
    finally:
        run_both(lambda rank: jobs[rank].close(graceful=False))



STALLING_PEER = textwrap.dedent("""
    import logging
    import re
    import sys
    import time
    import mltuner

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    timeout_s = float(sys.argv[1])
    job = mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=60),
                      heartbeat_interval_s=0.05, heartbeat_timeout_s=timeout_s, rendezvous_timeout_s=30)
    size = 16  # one C call that keeps the interpreter lock (re never releases it), as a long json.loads would
    while True:
        started = time.monotonic()
        re.match(r"(a+)+$", "a" * size + "b")
        if time.monotonic() - started >= 2 * timeout_s:
            break
        size += 1 if time.monotonic() - started > timeout_s / 2 else 2
    time.sleep(0.3)  # the control thread runs again
    print("lost:", job._lost_peer(), flush=True)
    job.close(graceful=False)
""")


def test_a_process_that_held_the_interpreter_lock_does_not_blame_its_peer(tmp_path: Path) -> None:
    """A rank whose main thread holds the interpreter lock longer than the
    heartbeat timeout is silent, and its peer rightly takes it for lost; but
    once it runs again it reads the heartbeats its peer sent meanwhile before
    judging that peer, and says it was the silent one (a probe's stalled rank
    declared its healthy peer lost: the poll's answer from before the stall
    said nothing had come)."""
    timeout_s = 0.5
    peer, port = start_peer(tmp_path, STALLING_PEER, str(timeout_s))
    try:
        job = rank_0(port, heartbeat_interval_s=0.05, heartbeat_timeout_s=timeout_s)
        try:
            output, _ = peer.communicate(timeout=120)
            assert "lost: None" in output, output
            assert "rank 1's control thread did not run for" in output, output
            assert job._lost_peer() is not None and "worker rank 1 stopped answering" in job._lost_peer()  # noqa: SLF001
        finally:
            job.close(graceful=False)
    finally:
        peer.kill()
        peer.communicate(timeout=10)


DIES_AFTER_JOINING = textwrap.dedent("""
    import os
    import mltuner
    from mltuner.transport import _cuda_ipc

    def die(*args, **kwargs):  # joined, then gone before the exchanges after the join
        os._exit(9)

    _cuda_ipc.connect = die
    mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add")), heartbeat_interval_s=0.1,
                heartbeat_timeout_s=1.0, rendezvous_timeout_s=60)
""")


def test_a_rank_that_dies_right_after_joining_is_named_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """Heartbeats start at the join: a rank gone before the exchanges that
    follow it (the CUDA IPC allgather, on CPU jobs too) is named within the
    heartbeat timeout (a probe's survivors waited the rendezvous timeout,
    120 s by default, and then blamed the allgather)."""
    peer, port = start_peer(tmp_path, DIES_AFTER_JOINING)
    try:
        started = time.monotonic()
        with pytest.raises(mltuner.PeerLostError, match="worker rank 1 stopped answering"):
            rank_0(port, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
        assert time.monotonic() - started < 20
    finally:
        peer.kill()
        peer.communicate(timeout=10)


WATCHING_PEER = textwrap.dedent("""
    import logging
    import sys
    import time
    import mltuner

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    job = mltuner.Job(mltuner.Config(update_rule=mltuner.UpdateRule("add"), wait_timeout_s=60),
                      heartbeat_interval_s=0.05, heartbeat_timeout_s=float(sys.argv[1]), rendezvous_timeout_s=30)
    print("ready", flush=True)
    until = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < until:  # stopped and continued meanwhile
        if job._lost_peer() is not None:
            print("lost:", job._lost_peer(), flush=True)
            break
        time.sleep(0.05)
    job.close(graceful=False)
""")


def test_a_process_stopped_and_continued_does_not_blame_its_peer(tmp_path: Path) -> None:
    """SIGSTOP for twice the heartbeat timeout, then SIGCONT: the stopped
    rank's own pause does not count as its peer's silence (a re-probe: it
    named its healthy peer at once, the heartbeats still in ZeroMQ's queues,
    whose thread had been stopped too). The peer here has a longer timeout,
    so it waits the pause out."""
    peer, port = start_peer(tmp_path, WATCHING_PEER, "0.5", "4.0")
    try:
        job = rank_0(port, heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0)
        try:
            assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
            time.sleep(0.3)
            peer.send_signal(signal.SIGSTOP)
            time.sleep(1.0)
            peer.send_signal(signal.SIGCONT)
            output, _ = peer.communicate(timeout=60)
            assert "lost:" not in output, output
            assert "rank 1's control thread did not run for" in output, output
            assert job._lost_peer() is None  # noqa: SLF001
        finally:
            job.close(graceful=False)
    finally:
        peer.kill()
        peer.communicate(timeout=10)


@pytest.mark.parametrize("interval_s, timeout_s, hold_s", [(0.05, 0.1, 0.0), (0.1, 1.0, 0.7)],
                         ids=["a timeout of two polls", "holds of the lock under the timeout"])
def test_a_silent_peer_is_still_named_after_pauses_of_this_process(interval_s: float, timeout_s: float,
                                                                   hold_s: float) -> None:
    """Catching up after its own pause must not hide a peer that really went
    silent (a review: a first version added each pause to every peer's last
    heartbeat, so with a 0.1-s timeout every turn of the control thread, and
    with the main thread holding the lock 0.7 s of each 1-s timeout, the
    silent peer was never named)."""
    jobs = start_pair(heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s)
    try:
        time.sleep(0.3)
        assert jobs[0]._lost_peer() is None  # noqa: SLF001
        silent = jobs[1]._liveness  # noqa: SLF001 - its control thread ends: no goodbye, no heartbeats
        assert silent is not None
        silent._stopping.set()  # noqa: SLF001
        silent._thread.join()  # noqa: SLF001
        started = time.monotonic()
        while jobs[0]._lost_peer() is None and time.monotonic() - started < 10:  # noqa: SLF001
            if hold_s:
                _hold_the_interpreter_lock(hold_s)
            else:
                time.sleep(0.01)
        assert "worker rank 1 stopped answering" in (jobs[0]._lost_peer() or "")  # noqa: SLF001
        assert time.monotonic() - started < 8  # a judgement a hold or two after the timeout
    finally:
        for job in jobs:
            job.close(graceful=False)


def _hold_the_interpreter_lock(seconds: float) -> None:
    """One C call that keeps the interpreter lock about ``seconds`` (``re``
    never releases it while it backtracks)."""
    import re as regex

    size = 16
    while True:
        started = time.monotonic()
        regex.match(r"(a+)+$", "a" * size + "b")
        took = time.monotonic() - started
        if took >= seconds:
            return
        size += 1 if took > seconds / 4 else 2
