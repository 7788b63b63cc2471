"""Moves a ProcessNode's data messages between processes over ZeroMQ.

Each process binds its data sockets (PULL: one on ``tcp://`` with CURVE,
one on ``ipc://`` in its private directory) that every peer sends to, and
connects one PUSH to each peer's, through ``ipc://`` on one host and
``tcp://`` between hosts (:mod:`mltuner.transport._address`). Python creates,
secures and connects the sockets; two threads then move the bytes, each
owning its sockets:

- the send thread takes encoded messages from the node and sends the header
  frame and the payload with no copy (ZeroMQ holds the payload until the
  bytes are out; a pinned, recycled host frame then returns to its pool);
- the receive thread hands data frames to the node, which validates them
  and, on the CPU backend, uses the payload where ZeroMQ received it (no
  copy): the thread keeps each payload frame, by token, until the node
  hands the token back (the shard applied it, or the rows are installed).

Both threads are C++ (``_core.SocketPump``, ``cpp/include/mltuner/socket_pump.h``):
they call the libzmq that pyzmq loaded, through the sockets' handles, and
never take the GIL, so a clock of many small messages (every table's
update, rows, CUDA IPC notices and releases) does not queue behind the
training thread's Python, nor it behind them. Where that library cannot be
found (a pyzmq built with a static libzmq) or ``MLTUNER_SOCKET_THREADS=python``
asks for it, Python threads do the same (:mod:`mltuner.transport._python_loops`).
With the C++ threads, a Python thread here watches the sockets' connection
guards (failed handshakes, the cap on connections), logs refused input and
passes on the plan's queue bound.

Batches: each wake-up of the send thread takes every message waiting in the
node's outbox, which joins the small ones for one peer into one batch
(``cpp/src/wire/batch.h``; the receiving node opens it): a clock's updates
of all its tables, or a shard's pushes of one clock, leave as one socket
message per peer. Only payloads under 256 KiB join batches; larger ones go
alone, to be used in place.

Liveness is not judged here: heartbeats travel on the control channel
(:mod:`mltuner.transport._control`), so a backlog of data never makes a
healthy peer look dead.

Bounded queues: the payload bytes handed to ZeroMQ for one peer and not yet
written out are bounded (``queue_limit``, from the plan: a few clocks of
this process's traffic to that peer). A send that would pass the bound waits
until the peer has taken enough (back-pressure: the node's outbox then fills
and the engine waits on it), for at most ``wait_timeout_s``; a peer that
takes nothing for that long while its heartbeats still arrive is stuck, and
the job fails naming it. ZeroMQ's own queues are bounded in messages too.
On the receiving side the node's inboxes are bounded the same way: a
delivery waits (up to ``wait_timeout_s``) while the shard or the installer
is behind, the receive thread then reads nothing, and ZeroMQ's and the
kernel's flow control carry the back-pressure to the sender.

Messages between this process's own engine and shard never come here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import zmq

from mltuner import _core
from mltuner.exceptions import MltunerError
from mltuner.transport._control import DATA_IO_THREAD, push_sockets
from mltuner.transport._guard import Listener, RejectionLog
from mltuner.transport._python_loops import PythonLoops
from mltuner.transport._security import SocketSecurity

__all__ = ["SocketTransport", "SEND_QUEUE_MESSAGES", "RECEIVE_QUEUE_MESSAGES", "find_zmq_library"]

_log = logging.getLogger("mltuner.transport")
_WATCH_S = 0.05
# ZeroMQ's queues in messages (bytes are bounded by queue_limit on the send
# side; small messages are copied into ZeroMQ's, so they are bounded too).
# The receive thread hands each message on at once; when it falls behind, a
# peer's connection holds at most RECEIVE_QUEUE_MESSAGES before the kernel's
# flow control makes the sender's queue grow (and its bound apply).
SEND_QUEUE_MESSAGES = 1000
RECEIVE_QUEUE_MESSAGES = 64
# MLTUNER_SOCKET_THREADS=python: the Python threads, even where C++ could run.
_THREADS_VARIABLE = "MLTUNER_SOCKET_THREADS"


def find_zmq_library() -> str | None:
    """The path of the shared libzmq loaded in this process (pyzmq's), or
    None where there is not exactly one (a static libzmq, or no /proc)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libzmq" in line}
    except OSError:
        return None
    paths = {path for path in paths if os.path.basename(path).startswith("libzmq")}
    return paths.pop() if len(paths) == 1 else None


class NativeLoops:
    """The C++ send and receive threads (``_core.SocketPump``) and the Python
    thread beside them that watches the guards, logs refused input and
    passes on the plan's queue bound (which changes as tables are made)."""

    def __init__(self, pump: _core.SocketPump, listeners: list[Listener], rejections: RejectionLog,
                 queue_limit: Callable[[], int]) -> None:
        self.pump = pump
        self._listeners = listeners
        self._rejections = rejections
        self._queue_limit = queue_limit
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="mltuner-guards", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Joins every thread (the sockets stay open)."""
        self._stopping.set()
        self._watcher.join(10.0)
        self.pump.stop()

    @property
    def rejected(self) -> int:
        return int(self.pump.stats["refused_messages"])

    @property
    def stuck(self) -> str | None:
        return self.pump.stuck or None

    @property
    def peak_queued(self) -> dict[int, int]:
        return dict(self.pump.stats["peak_queued_bytes"])

    def queued_bytes(self, rank: int) -> int:
        return int(self.pump.stats["queued_bytes"][rank])

    @property
    def lent_payloads(self) -> int:
        return int(self.pump.stats["lent_payloads"])

    def _watch(self) -> None:
        poller = zmq.Poller()
        for listener in self._listeners:
            poller.register(listener.guard.monitor, zmq.POLLIN)
        limit = -1
        while not self._stopping.is_set():
            ready = dict(poller.poll(int(_WATCH_S * 1000)))
            for listener in self._listeners:
                if listener.guard.monitor in ready:
                    listener.guard.handle_events()
            for why in self.pump.take_refusals():
                self._rejections.record(why)
            latest = int(self._queue_limit())
            if latest != limit:
                self.pump.set_queue_limit(latest)
                limit = latest


class SocketTransport:
    """The data send and receive threads of one process (see the module doc).

    Args:
        node: this process's engine and shard.
        listeners: the bound data sockets (one per address kind) with their
            guards; the transport owns them from here on.
        peers: each peer's data endpoint, by rank.
        security: which endpoints use CURVE.
        queue_limit: the payload bytes that may wait in ZeroMQ for one peer
            (a single larger message is let through alone); asked again as
            the plan changes.
        wait_timeout_s: how long a send may wait for room before the job
            fails.
    """

    def __init__(self, node: _core.ProcessNode, context: zmq.Context[zmq.Socket[bytes]], listeners: list[Listener],
                 peers: dict[int, str], security: SocketSecurity, *,
                 queue_limit: Callable[[], int], wait_timeout_s: float) -> None:
        self._node = node
        self.listeners = listeners
        self.endpoints = dict(peers)
        self._queue_limit = queue_limit
        self._peers = push_sockets(context, peers, security, io_thread=DATA_IO_THREAD,
                                   send_queue=SEND_QUEUE_MESSAGES)
        self.rejections = RejectionLog(_log, f"rank {int(node.rank)}'s data socket")
        # ZeroMQ mallocs every received payload; keep what a clock frees for the next.
        changed, why = _core.keep_freed_memory_for_frames()
        _log.debug("mltuner: malloc for received frames: %s%s", why, "" if changed else " (left as it is)")
        pump = self._start_pump(wait_timeout_s)
        self._loops: NativeLoops | PythonLoops = (
            NativeLoops(pump, listeners, self.rejections, queue_limit) if pump is not None
            else PythonLoops(node, listeners, self._peers, self.rejections, queue_limit=queue_limit,
                             wait_timeout_s=wait_timeout_s))

    @property
    def native(self) -> bool:
        """Whether the C++ threads move the data (else Python threads do)."""
        return isinstance(self._loops, NativeLoops)

    def _start_pump(self, wait_timeout_s: float) -> _core.SocketPump | None:
        if os.environ.get(_THREADS_VARIABLE, "").strip().lower() == "python":
            return None
        library = find_zmq_library()
        if library is None:
            _log.info("mltuner: no shared libzmq found in this process; the data plane runs on Python threads")
            return None
        try:
            return _core.SocketPump(
                self._node, library, {rank: socket.underlying for rank, socket in self._peers.items()},
                [listener.socket.underlying for listener in self.listeners],
                max(1, int(wait_timeout_s * 1000)), int(self._queue_limit()))
        except MltunerError as error:
            _log.info("mltuner: the data plane runs on Python threads: %s", error)
            return None

    def stop(self, *, graceful: bool = True) -> None:
        """Joins the threads and closes the sockets. Call after the node is
        shut down (its outbox is then closed and drains). Graceful, queued
        bytes get a second to leave."""
        self._loops.stop()
        linger_ms = 1000 if graceful and not self._node.aborted else 0
        for socket in self._peers.values():
            socket.close(linger=linger_ms)
        for listener in self.listeners:
            listener.close()

    @property
    def rejected(self) -> int:
        """Messages refused here for their frame count (the node counts
        the messages it refuses)."""
        return self._loops.rejected

    @property
    def stuck(self) -> str | None:
        """Why a peer was declared stuck, once it is."""
        return self._loops.stuck

    @property
    def peak_queued(self) -> dict[int, int]:
        """The most payload bytes that waited in ZeroMQ for each peer."""
        return dict(self._loops.peak_queued)

    def queued_bytes(self, rank: int) -> int:
        """Payload bytes waiting in ZeroMQ for peer ``rank``."""
        return self._loops.queued_bytes(rank)

    @property
    def lent_payloads(self) -> int:
        """Received payload frames kept for the node (used in place)."""
        return self._loops.lent_payloads
